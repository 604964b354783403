"""Keeping one state report current at solar-control: coalesced, rate-bounded and echoed.

`instances_update` and `host_health` are snapshots: control replaces its copy with each one,
so only the newest matters. A `Reporter` therefore never queues: a change only marks the report
dirty, and one loop sends a freshly built snapshot when it is due. That bounds the traffic by
the rate (one send in flight, then at most one per `min_interval_s`) instead of by the number
of changes: a burst of 2,000 changes costs a few dozen lists, not 2,000. Building and encoding
a big list is CPU on the event loop, so the pause after a send is also at least `cost_factor`
times what that send took: reporting never takes more than about a fifth of the loop.

Echoes: after a change the report is sent again at each of `echo_s` (seconds after the last
change), rebuilt at that moment. Control acts on its copy only when an event wakes it, and it
deliberately ignores some wakes (its reconciler skips an intent for a few seconds after it
creates a replica). A report that lands in such a quiet window is followed by another one
within the spacing of `echo_s` after the window ends, whatever its length up to the last echo;
nothing here knows control's constants.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger(__name__)


class Reporter:
    """Sends the report built by `send` when marked, coalescing marks and bounding the rate.

    `send()` returns False when the report could not go out for a reason that will pass (the
    socket's queue is backed up): it is then retried after `min_interval_s`. It returns True
    when it was sent, or when sending is moot (not connected: the next connect syncs anyway).
    """

    def __init__(
        self,
        send: Callable[[], Awaitable[bool]],
        *,
        min_interval_s: float,
        echo_s: Sequence[float] = (),
        debounce_s: float = 0.0,
        period_s: float | None = None,
        cost_factor: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self.min_interval_s = min_interval_s
        self.echo_s = tuple(sorted(d for d in echo_s if d > 0))
        self.debounce_s = debounce_s
        self.period_s = period_s
        self.cost_factor = cost_factor
        self._clock = clock
        self._dirty_at: float | None = None
        self._echo_due: list[float] = []
        self._last_sent = -math.inf
        self._next_allowed = -math.inf
        self._period_from = clock()
        self._wake = asyncio.Event()
        # Counters (metrics and tests).
        self.sends = 0
        self.echoes = 0
        self.coalesced = 0
        self.deferred = 0

    def mark(self, *, echo: bool = True) -> None:
        """Something in the report changed: send soon, and echo after it if asked."""
        now = self._clock()
        if self._dirty_at is None:
            self._dirty_at = now
        else:
            self.coalesced += 1
        if echo and self.echo_s:
            # Counted from the last change: a stream of changes is covered by the regular
            # sends, and the echoes follow its end.
            self._echo_due = [now + d for d in self.echo_s]
        self._wake.set()

    def sent_elsewhere(self) -> None:
        """The same report just went out another way (the connect sync): restart the period."""
        self._period_from = self._clock()

    @property
    def pending(self) -> bool:
        return self._dirty_at is not None or bool(self._echo_due)

    def _next_due(self) -> float | None:
        floor = max(self._last_sent + self.min_interval_s, self._next_allowed)
        due: list[float] = []
        if self._dirty_at is not None:
            due.append(max(self._dirty_at + self.debounce_s, floor))
        if self._echo_due:
            due.append(max(self._echo_due[0], floor))
        if self.period_s is not None:
            due.append(max(max(self._period_from, self._last_sent) + self.period_s, floor))
        return min(due) if due else None

    async def run(self) -> None:
        while True:
            now = self._clock()
            due = self._next_due()
            if due is None or due > now:
                self._wake.clear()
                timeout = None if due is None else due - now
                try:
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                continue
            echo = self._dirty_at is None and bool(self._echo_due) and self._echo_due[0] <= now
            self._dirty_at = None
            while self._echo_due and self._echo_due[0] <= now:
                self._echo_due.pop(0)
            # Stamped before the send, so a send that fails fast cannot spin the loop.
            self._last_sent = now
            try:
                sent = await self._send()
            except Exception:  # a bug in one send must not end the reports for good
                log.exception("sending a report failed")
                sent = True
            end = self._clock()
            self._next_allowed = end + self.cost_factor * (end - now)
            if sent:
                self.sends += 1
                self.echoes += echo
            else:
                self.deferred += 1
                if self._dirty_at is None:
                    self._dirty_at = now

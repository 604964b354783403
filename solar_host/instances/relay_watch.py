"""A serving backend's log relay, kept running.

The relay (log_relay.py) is the one writer of the backend's log file. Should it end while the
backend lives (an operator's kill, the OOM killer), the backend's writes fail with EPIPE, which
it survives, and its output is lost: its log stops, and with it what the host reads there
(readiness of a restart, telemetry, the flight record's last lines). The backend itself is
never touched for that: a model that serves is worth more than its log. Instead another relay
is started on the same pipe (relays.restart), and the host's log says what happened.

Bounded: a relay that keeps ending (a log directory it cannot write) is replaced at most
RESTARTS_PER_HOUR times an hour, then left, said once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from solar_host.instances import process as procs
from solar_host.instances import relays

log = logging.getLogger(__name__)

RESTARTS_PER_HOUR = 5
_HOUR_S = 3600.0


async def keep(
    proc: procs.BackendProcess,
    log_path: Callable[[], Path | None],
    bound: int,
    instance_id: str,
) -> None:
    """While `proc` lives: when its relay ends, start another on its pipe writing to
    `log_path()` within `bound` bytes. Ends with the backend, or when its output is no pipe
    any more (it closed it), or after RESTARTS_PER_HOUR replacements within an hour."""
    restarts: deque[float] = deque()
    while (relay := proc.relay) is not None:
        await relays.exited(relay)
        if not proc.alive():
            return  # it ended with its backend, at end of file: nothing lost
        now = time.monotonic()
        while restarts and now - restarts[0] > _HOUR_S:
            restarts.popleft()
        path = log_path()
        if len(restarts) >= RESTARTS_PER_HOUR or path is None:
            why = (
                "it has no log file any more"
                if path is None
                else f"ended {len(restarts)} times in the last hour"
            )
            log.error(
                "the log relay of instance %s (pid %d) ended: not replaced (%s); the backend "
                "serves on, its output is lost until it restarts",
                instance_id,
                relay.identity.pid,
                why,
            )
            proc.relay = None
            return
        new = await asyncio.to_thread(relays.restart, proc.identity, path, bound)
        if new is None:
            # Gone meanwhile, or its output is no pipe any more: nothing left to relay.
            log.info(
                "the log relay of instance %s (pid %d) ended: its backend no longer writes to it",
                instance_id,
                relay.identity.pid,
            )
            proc.relay = None
            return
        restarts.append(now)
        proc.relay = new
        log.warning(
            "the log relay of instance %s (pid %d) ended while its backend (pid %d) runs: "
            "replaced by pid %d; what the backend wrote meanwhile was lost",
            instance_id,
            relay.identity.pid,
            proc.pid,
            new.identity.pid,
        )

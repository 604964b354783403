"""What the host tells solar-control: the state reports and the outbox (contract 8.10).

* `instances_update` at once after an instance change, and `host_health` every
  HEALTH_REPORT_INTERVAL_S and early (debounced) after a reservation or instance change. Both
  are full snapshots kept current by a `Reporter`: coalesced (one send in flight, the newest
  state built when it goes), at most one per CONTROL_REPORT_MIN_INTERVAL_S, and echoed after a
  change (CONTROL_REPORT_ECHO_S) so a report control ignored in a quiet window is repeated
  after it;
* logs, runtime states, step logs, pull progress and job events through the bounded outbox,
  flushed every OUTBOX_FLUSH_INTERVAL_S.

Backpressure: while the socket's send queue is backed up (control, or the network, not reading)
reports wait, coalesced, and the outbox keeps dropping by its caps, so memory stays bounded.
Bus handlers only touch memory, so a host with control unreachable never waits for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from solar_host import events as ev
from solar_host.control.connection import NAMESPACE, Session, worth_logging
from solar_host.control.outbox import Outbox
from solar_host.control.payloads import PayloadBuilder
from solar_host.control.reporter import Reporter

log = logging.getLogger(__name__)

HEALTH_DEBOUNCE_S = 0.2
# Socket.IO servers refuse messages past max_http_buffer_size, 1,000,000 bytes by default
# (python-engineio): a report above it is dropped, and so is the link.
CONTROL_MESSAGE_LIMIT = 1_000_000


class Telemetry:
    """Sends the host's reports on whichever session the link holds now (`current`)."""

    def __init__(
        self,
        host: Any,
        *,
        current: Callable[[], Session | None],
        host_id: Callable[[], str | None],
    ) -> None:
        self.settings = host.settings
        self._current = current
        self._host_id = host_id
        self.payloads = PayloadBuilder(host)
        self.outbox = Outbox(self.settings.outbox_max_entries)
        # Counters for the metrics endpoint.
        self.sent: Counter[str] = Counter()
        self.emit_failures = 0
        self.oversized_reports = 0  # reports past CONTROL_MESSAGE_LIMIT
        min_interval = self.settings.control_report_min_interval_s
        echoes = self.settings.control_echo_delays
        self.instances_reporter = Reporter(
            self._report_instances, min_interval_s=min_interval, echo_s=echoes
        )
        self.sync_reporter = Reporter(self._sync, min_interval_s=min_interval)
        self.health_reporter = Reporter(
            self._report_health,
            min_interval_s=min_interval,
            echo_s=echoes,
            debounce_s=HEALTH_DEBOUNCE_S,
            period_s=self.settings.health_report_interval_s,
        )
        self._emit_lock = asyncio.Lock()

    @property
    def _registered(self) -> bool:
        session = self._current()
        return session is not None and session.open and session.acked

    def subscribe(self, bus: Any) -> list[Callable[[], None]]:
        """Listen to the host's events; the unsubscribers come back."""
        return [
            bus.subscribe(self._on_instances_changed, ev.InstancesChanged),
            bus.subscribe(self._on_log_line, ev.LogLine),
            bus.subscribe(self._on_runtime_state, ev.RuntimeStateChanged),
            bus.subscribe(self._on_pull_progress, ev.PullProgress),
            bus.subscribe(self._on_step_log, ev.StepLog),
            bus.subscribe(self._on_job_lifecycle, ev.JobLifecycle),
            bus.subscribe(self._on_reservations_changed, ev.ReservationsChanged),
        ]

    def start_tasks(self, running: Callable[[], bool]) -> list[asyncio.Task[None]]:
        """The outbox flush and the three reporters, each its own task."""
        return [
            asyncio.create_task(self._flush_loop(running), name="control-outbox"),
            asyncio.create_task(self.instances_reporter.run(), name="control-instances"),
            asyncio.create_task(self.health_reporter.run(), name="control-health"),
            asyncio.create_task(self.sync_reporter.run(), name="control-sync"),
        ]

    def sync_soon(self) -> None:
        """Control acknowledged the host: the outbox fills again and everything is sent."""
        self.outbox.set_accepting(True)
        # Through a Reporter: a control that repeats registration_ack hundreds of times gets
        # a few coalesced syncs, not hundreds of full lists.
        self.sync_reporter.mark(echo=False)

    async def _sync(self) -> bool:
        session = self._current()
        if session is None or not session.acked or not session.ns_connected:
            return True  # moot: the next ack syncs
        if session.backed_up():
            return False
        await self.send("registration", session)
        await self.send("instances_update", session)
        await self.send("host_health", session)
        self.health_reporter.sent_elsewhere()
        return True

    # --- sending ------------------------------------------------------------------------------

    async def send(self, event: str, session: Session) -> bool:
        """Build one of the three state payloads now (the newest truth) and emit it. A service
        that fails while being read costs this one message, never the connection."""
        try:
            if event == "registration":
                payload = self.payloads.registration()
            elif event == "instances_update":
                payload = self.payloads.instances_update()
            else:
                payload = await self.payloads.host_health()
        except Exception:
            self.emit_failures += 1
            log.exception("building %s failed", event)
            return False
        if event != "host_health":
            self._warn_if_oversized(event, payload)
        return await self._emit(event, payload, session)

    def _warn_if_oversized(self, event: str, payload: Any) -> None:
        """Say so, loudly, when a report is past control's default message limit: control
        then drops it and the link, and nothing else would tell the operator why."""
        instances = payload.get("instances") if isinstance(payload, dict) else None
        if not isinstance(instances, list) or len(instances) < 1000:
            return  # an entry is well under 1 KB: far from the limit, skip the encoding
        size = len(json.dumps(payload, separators=(",", ":"), default=str))
        if size > CONTROL_MESSAGE_LIMIT:
            self.oversized_reports += 1
            if worth_logging(self.oversized_reports):
                log.error(
                    "the %s report is %d bytes (%d instances): solar-control's Socket.IO server "
                    "refuses messages over %d bytes unless its max_http_buffer_size is raised, "
                    "and drops the link with them",
                    event,
                    size,
                    len(instances),
                    CONTROL_MESSAGE_LIMIT,
                )

    async def _emit(self, event: str, payload: Any, session: Session) -> bool:
        if not session.open:
            return False
        try:
            async with self._emit_lock:
                await session.sio.emit(event, payload, namespace=NAMESPACE)
        except Exception as err:
            self.emit_failures += 1
            log.debug("emit %s failed: %s", event, err)
            return False
        self.sent[event] += 1
        return True

    async def _report(self, event: str) -> bool:
        """A Reporter's send: the newest snapshot now. False only to say "retry later"."""
        session = self._current()
        if session is None or not session.open:
            return True  # moot: the next connect sends everything
        if session.backed_up():
            return False
        # While pending only registration is read: keep the pending record current.
        await self.send(event if session.acked else "registration", session)
        return True

    async def _report_instances(self) -> bool:
        return await self._report("instances_update")

    async def _report_health(self) -> bool:
        return await self._report("host_health")

    async def _flush_loop(self, running: Callable[[], bool]) -> None:
        interval = self.settings.outbox_flush_interval_s
        while running():
            await asyncio.sleep(interval)
            if not len(self.outbox) or not self._registered:
                continue
            session = self._current()
            if session is None or session.backed_up():
                continue  # the outbox stays bounded by its caps meanwhile
            for event, payload in self.outbox.drain():
                await self._emit(event, payload, session)

    # --- bus handlers (memory only: they run inside the publisher) ----------------------------

    def _on_instances_changed(self, event: ev.Event) -> None:
        if self._current() is None:
            return  # the next connect sends the full list anyway
        # Every change is echoed, crash or not: the host cannot tell which of its
        # reports control chose to ignore, only that it acts on the ones after.
        self.instances_reporter.mark(echo=True)
        if self._registered:
            self.health_reporter.mark(echo=False)

    def _on_reservations_changed(self, event: ev.Event) -> None:
        if self._registered:
            self.health_reporter.mark(echo=True)

    def _on_log_line(self, event: ev.Event) -> None:
        assert isinstance(event, ev.LogLine)
        self.outbox.put_log(
            {
                "instance_id": event.instance_id,
                "seq": event.seq,
                "line": event.line,
                "timestamp": event.timestamp,
            }
        )

    def _on_runtime_state(self, event: ev.Event) -> None:
        assert isinstance(event, ev.RuntimeStateChanged)
        self.outbox.put_state(
            event.instance_id,
            {"instance_id": event.instance_id, "timestamp": event.timestamp, "data": event.state},
        )

    def _on_pull_progress(self, event: ev.Event) -> None:
        assert isinstance(event, ev.PullProgress)
        self.outbox.put_pull_progress(event.payload, timestamp=ev.iso_now())

    def _on_step_log(self, event: ev.Event) -> None:
        assert isinstance(event, ev.StepLog)
        self.outbox.put_step_log(event.entry)

    def _on_job_lifecycle(self, event: ev.Event) -> None:
        assert isinstance(event, ev.JobLifecycle)
        self.outbox.put_event(event.name, {**event.payload, "host_id": self._host_id()})

"""The link to solar-control over Socket.IO (control-contract 1, reference 8).

One `ControlLink` per host. It owns its reconnect loop (python-socketio's own reconnection is
off): connect to `/hosts` with `{api_key, host_name}`, register, and on every disconnect or
refused connect retry with a short capped backoff, trying each configured URL in turn
(fail-over between control replicas). One connection is a `Session` (connection.py); what
the host reports goes through `Telemetry` (telemetry.py); the commands are run by a
`CommandRunner` (commands.py). This module holds the loop, registration and the gate before
the commands.

Events from control are checked field by field: a value of the wrong type is ignored with a
warning, never stored. Commands are run only for a session control has acknowledged, and the
link never follows an HTTP redirect: the key goes to the configured address or nowhere.
The link stops reconnecting only when control's last word about registration was `rejected`
for the key in use; a later `registration_ack` or `pending` undoes a rejection.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import socketio

from solar_host.control.commands import COMMANDS, CommandRunner, failure
from solar_host.control.connection import (
    MAX_FIELD_CHARS,
    NAMESPACE,
    Session,
    close_session,
    connect_session,
    new_session,
    wait_event,
    watch_session,
    worth_logging,
)
from solar_host.control.packets import REFUSED
from solar_host.control.telemetry import Telemetry
from solar_host.settings import normalize_control_url as normalize_url

log = logging.getLogger(__name__)

# A session shorter than this counts as a failure for the reconnect delay.
SHORT_SESSION_S = 10.0


class ControlLinkUnavailable(RuntimeError):
    """The link is not running, so POST /reconnect cannot start a connection (503)."""


class ControlLink:
    """The host's Socket.IO client towards solar-control."""

    def __init__(self, host: Any, *, connect_timeout_s: float = 10.0) -> None:
        self.host = host
        self.settings = host.settings
        self.urls = [normalize_url(u) for u in self.settings.control_urls]
        if not self.urls:
            raise ValueError("ControlLink needs at least one SOLAR_CONTROL_URL")
        self.connect_timeout_s = connect_timeout_s
        self.telemetry = Telemetry(
            host, current=lambda: self._session, host_id=lambda: self.host_id
        )
        # The telemetry's parts that the metrics and the tests read on the link.
        self.outbox = self.telemetry.outbox
        self.sent = self.telemetry.sent
        self.instances_reporter = self.telemetry.instances_reporter
        self.health_reporter = self.telemetry.health_reporter
        # Counters for the metrics endpoint.
        self.reconnects = 0
        self.connect_failures = 0
        # Registration state.
        self.host_id: str | None = None
        self.pending_id: str | None = None
        self.rejected = False
        self.rejected_reason: str | None = None
        self._rejected_key: str | None = None
        self.ignored_fields = 0  # wrong-typed fields in control's events
        self.refused_packets = 0  # binary or undecodable packets from control (packets.py)
        self.refused_unregistered = 0  # commands before registration_ack
        self.refused_redirects = 0  # connects that control's address answered with a redirect
        self.commands = CommandRunner(
            lambda: self.host.instances,
            max_in_flight=self.settings.control_max_commands_in_flight,
            max_bytes=self.settings.control_max_command_bytes,
        )

        self._running = False
        self._session: Session | None = None
        self._url_index = 0
        self._run_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._unsubscribe: list[Callable[[], None]] = []
        self._wake = asyncio.Event()

    # --- state --------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """The /hosts namespace is connected (approved or pending)."""
        s = self._session
        return s is not None and s.open

    @property
    def registered(self) -> bool:
        """Connected and acknowledged by control: telemetry is used, not dropped."""
        s = self._session
        return self.connected and s is not None and s.acked

    @property
    def running(self) -> bool:
        return self._running

    @property
    def oversized_reports(self) -> int:
        return self.telemetry.oversized_reports

    def metrics(self) -> dict[str, Any]:
        return {
            "connected": self.connected,
            "registered": self.registered,
            "rejected": self.rejected,
            "host_id": self.host_id,
            "pending_id": self.pending_id,
            "url": self._session.url if self.connected and self._session else None,
            "reconnects": self.reconnects,
            "connect_failures": self.connect_failures,
            "emit_failures": self.telemetry.emit_failures,
            "sent": dict(self.sent),
            "dropped": dict(self.outbox.dropped),
            "outbox_size": len(self.outbox),
            "echoes": self.instances_reporter.echoes + self.health_reporter.echoes,
            "reports_deferred": self.instances_reporter.deferred + self.health_reporter.deferred,
            "commands_in_flight": self.commands.in_flight,
            "commands_refused": {
                "busy": self.commands.refused_busy,
                "payload_too_large": self.commands.refused_size,
                "not_registered": self.refused_unregistered,
                "unknown": self.commands.refused_unknown,
            },
            "ignored_fields": self.ignored_fields,
            "refused_packets": self.refused_packets,
            "refused_redirects": self.refused_redirects,
            "oversized_reports": self.oversized_reports,
        }

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._unsubscribe = self.telemetry.subscribe(self.host.bus)
        self._run_task = asyncio.create_task(self._run(), name="control-link")
        self._tasks = self.telemetry.start_tasks(lambda: self._running)

    async def stop(self) -> None:
        self._running = False
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        # Flags first: a cancellation can be swallowed inside the library's own wait_for
        # (Python 3.11), so the loops also check `_running` and the session's `closed`.
        if self._session is not None:
            self._session.closed.set()
        self._wake.set()
        tasks = [t for t in (self._run_task, *self._tasks) if t]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        self._tasks = []
        self._run_task = None
        session, self._session = self._session, None
        self.outbox.set_accepting(False)
        if session is not None:
            await close_session(session)

    async def reconnect(self) -> str:
        """POST /reconnect: "already_connected", or "reconnecting" with an immediate attempt.

        After a rejection this starts the link again (the admin may have changed their mind).
        """
        if not self._running:
            raise ControlLinkUnavailable("Failed to trigger reconnection")
        if self.connected:
            return "already_connected"
        self._clear_rejection()
        if self._run_task is None or self._run_task.done():
            self._run_task = asyncio.create_task(self._run(), name="control-link")
        else:
            self._wake.set()
        return "reconnecting"

    # --- the connection loop ------------------------------------------------------------------

    async def _run(self) -> None:
        base = self.settings.ws_reconnect_delay
        cap = max(self.settings.ws_reconnect_max_delay, base)
        delay = base
        failed_in_round = 0
        while self._running and not self._rejected_for_good():
            url = self.urls[self._url_index]
            session = await self._connect(url)
            if session is None:
                failed_in_round += 1
                self._url_index = (self._url_index + 1) % len(self.urls)
                if failed_in_round < len(self.urls):
                    continue  # fail over to the next replica at once
                failed_in_round = 0
                if await self._backoff(delay):
                    delay = base
                else:
                    delay = min(delay * 2, cap)
                continue
            failed_in_round = 0
            began = time.monotonic()
            if not self._running:
                await close_session(session)
                break
            await watch_session(session, lambda: self._running)
            await self._end_session(session)
            if session.silent or not session.acked:
                # A replica that fell silent, or never registered this host: the next one
                # is tried first (one that keeps accepting and then fails would hold it).
                self._url_index = (self._url_index + 1) % len(self.urls)
            if not self._running or self._rejected_for_good():
                break
            self.reconnects += 1
            # A link that keeps ending soon after it is made (a control dropping every report,
            # one over its message size say) backs off as failed connects do, instead of
            # reconnecting at the base delay for ever.
            lasted = time.monotonic() - began
            delay = base if lasted >= SHORT_SESSION_S else min(delay * 2, cap)
            if await self._backoff(delay):
                delay = base
        if self._rejected_for_good():
            log.warning(
                "solar-control rejected this host (%s); not reconnecting until POST /reconnect",
                self.rejected_reason or "no reason given",
            )

    def _rejected_for_good(self) -> bool:
        """Control's last word was a rejection of the key this host would connect with."""
        return self.rejected and self._rejected_key == self.host.api_key

    def _clear_rejection(self) -> None:
        self.rejected = False
        self.rejected_reason = None
        self._rejected_key = None

    async def _backoff(self, delay: float) -> bool:
        """Sleep about `delay` (jittered down, so the cap holds). True when woken early."""
        self._wake.clear()
        woken = await wait_event(self._wake, delay * random.uniform(0.75, 1.0))
        self._wake.clear()
        return woken

    async def _connect(self, url: str) -> Session | None:
        session = new_session(
            url,
            api_key=self.host.api_key,
            insecure=self.settings.insecure,
            timeout_s=self.connect_timeout_s,
            max_command_bytes=self.commands.max_bytes,
        )
        self._bind_handlers(session)
        self._session = session
        try:
            await connect_session(
                session,
                host_name=self.settings.effective_host_name,
                timeout_s=self.connect_timeout_s,
            )
        except (socketio.exceptions.ConnectionError, TimeoutError, OSError, ValueError) as err:
            self.connect_failures += 1
            if session.redirects:
                self.refused_redirects += 1
                if worth_logging(self.refused_redirects):  # it repeats at every retry
                    log.error(
                        "solar-control at %s answered a redirect to %s: not followed; set "
                        "SOLAR_CONTROL_URL to the final address",
                        url,
                        session.redirects[0],
                    )
            else:
                log.info(
                    "cannot connect to solar-control at %s: %s", url, err or type(err).__name__
                )
            if self._session is session:
                self._session = None
            await close_session(session)
            return None
        log.info("connected to solar-control at %s", url)
        return session

    async def _end_session(self, session: Session) -> None:
        if self._session is session:
            self._session = None
        self.outbox.set_accepting(False)
        self.pending_id = None
        await close_session(session)
        log.info("disconnected from solar-control at %s", session.url)

    # --- events from control ------------------------------------------------------------------

    def _bind_handlers(self, session: Session) -> None:
        sio = session.sio

        async def on_connect() -> None:
            session.ns_connected = True
            if session.acked:
                self._maybe_sync(session)
            else:
                # Control reads registration while pending, and stores it for the approval.
                await self.telemetry.send("registration", session)

        async def on_disconnect(reason: Any = None) -> None:
            log.info("solar-control link closed: %s", reason)
            session.ns_connected = False
            session.closed.set()
            if self._session is session:
                self.outbox.set_accepting(False)

        async def on_registration_ack(data: Any = None) -> None:
            fields = self._fields("registration_ack", data, host_id=str, host_name=str)
            known = self.host_id
            if fields.get("host_id"):
                self.host_id = fields["host_id"]
            self.pending_id = None
            self._clear_rejection()  # control's newest word: approved
            session.ack_seq += 1
            if session.ack_seq == 1 or self.host_id != known:  # not once per repeated ack
                log.info(
                    "registered with solar-control as %s (%s)",
                    fields.get("host_name"),
                    self.host_id,
                )
            # Often this arrives before the namespace counts as connected (contract 8.2): then
            # the connect handler runs the sync.
            self._maybe_sync(session)

        async def on_pending(data: Any = None) -> None:
            fields = self._fields("pending", data, pending_id=str)
            pending_id = fields.get("pending_id") or None
            # Once per id (a few ids per session): a repeating control cannot flood the log.
            if pending_id not in session.pending_logged and len(session.pending_logged) < 5:
                session.pending_logged.add(pending_id)
                log.warning("solar-control: waiting for admin approval (pending id %s)", pending_id)
            self.pending_id = pending_id
            self._clear_rejection()  # control's newest word: waiting, not refused
            self._unregister(session)

        async def on_rejected(data: Any = None) -> None:
            fields = self._fields("rejected", data, reason=str)
            self.rejected = True
            self.rejected_reason = fields.get("reason")
            self._rejected_key = session.api_key
            log.warning("solar-control rejected this host: %s", self.rejected_reason)
            self._unregister(session)

        sio.on("connect", on_connect, namespace=NAMESPACE)
        sio.on("disconnect", on_disconnect, namespace=NAMESPACE)
        sio.on("registration_ack", on_registration_ack, namespace=NAMESPACE)
        sio.on("pending", on_pending, namespace=NAMESPACE)
        sio.on("rejected", on_rejected, namespace=NAMESPACE)
        for name in COMMANDS:
            sio.on(name, self._command_handler(name, session), namespace=NAMESPACE)

        async def on_unknown(name: str, *_: Any) -> dict[str, Any]:
            # Without it an event of no known name was dropped: a call got an empty ack, as if
            # the command had been done.
            return await self.commands.run(name, None)

        sio.on("*", on_unknown, namespace=NAMESPACE)

        async def on_refused(what: Any = None, *_: Any) -> dict[str, Any]:
            self.refused_packets += 1
            if worth_logging(self.refused_packets):
                log.warning("solar-control sent %s; refused", what)
            return failure(400, f"refused: {what}", code="invalid_request")

        sio.on(REFUSED, on_refused, namespace=NAMESPACE)
        sio.on(REFUSED, on_refused, namespace="/")  # a bare binary frame names no namespace

    def _command_handler(
        self, name: str, session: Session
    ) -> Callable[..., Coroutine[Any, Any, dict[str, Any] | None]]:
        # python-socketio runs each incoming event as its own task, so a start that takes
        # minutes does not hold up other events; the return value is the ack.
        async def handler(data: Any = None, *extra: Any) -> dict[str, Any] | None:
            if session.close_if_unread():
                # Control sends commands and reads none of the acks: each one queued was kept
                # in memory. The link is closed (and made again); the command is not run.
                return None
            if session is not self._session or not session.acked:
                # Control acknowledges a host before it may drive it (it sends the ack in its
                # connect handler, before anything else); a peer that never did, one keeping
                # the host pending, or an old connection, gets an answer and no action.
                self.refused_unregistered += 1
                if worth_logging(self.refused_unregistered):
                    log.warning(
                        "solar-control sent %s before acknowledging this host; refused", name
                    )
                return failure(
                    403, "this host is not registered with solar-control", code="not_registered"
                )
            return await self.commands.run(name, data)

        return handler

    def _fields(self, event: str, data: Any, **types: type) -> dict[str, Any]:
        """The fields of a control event that have the expected type; others are ignored (and
        counted) with a warning, so a malformed event can neither break nor poison the link."""
        if data is None:
            return {}
        if not isinstance(data, dict):
            self.ignored_fields += 1
            if worth_logging(self.ignored_fields):
                log.warning(
                    "solar-control sent %s with a %s payload; ignored", event, type(data).__name__
                )
            return {}
        out: dict[str, Any] = {}
        for name, kind in types.items():
            if name not in data or data[name] is None:
                continue
            value = data[name]
            too_long = isinstance(value, str) and len(value) > MAX_FIELD_CHARS
            if isinstance(value, kind) and not isinstance(value, bool) and not too_long:
                out[name] = value
            else:
                self.ignored_fields += 1
                if not worth_logging(self.ignored_fields):
                    continue
                log.warning(
                    "solar-control sent %s.%s as %s%s, expected %s; ignored",
                    event,
                    name,
                    type(value).__name__,
                    f" of {len(value)} characters" if too_long else "",
                    kind.__name__,
                )
        return out

    def _unregister(self, session: Session) -> None:
        """Control took its approval back (pending, or rejected, after an ack): until the next
        ack only registration is sent, as before the first (contract: while pending, control
        reads nothing else); the next ack syncs everything again."""
        session.ack_seq = session.synced_seq = 0
        if session is self._session:
            self.outbox.set_accepting(False)

    def _maybe_sync(self, session: Session) -> None:
        """Run the post-approval sync once per ack, once the namespace is connected."""
        if session is not self._session or not session.ns_connected:
            return
        if session.ack_seq <= session.synced_seq:
            return
        session.synced_seq = session.ack_seq
        self.telemetry.sync_soon()

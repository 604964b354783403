"""The link to solar-control over Socket.IO (control-contract 1, reference 8).

One `ControlLink` per host. It owns its reconnect loop (python-socketio's own reconnection is
off): connect to `/hosts` with `{api_key, host_name}`, register, and on every disconnect or
refused connect retry with a short capped backoff, trying each configured URL in turn
(fail-over between control replicas). Telemetry goes out three ways:

* `instances_update` at once after an instance change, and `host_health` every
  HEALTH_REPORT_INTERVAL_S and early (debounced) after a reservation or instance change
  (contract 8.10). Both are full snapshots kept current by a `Reporter`: coalesced (one send in
  flight, the newest state built when it goes), at most one per CONTROL_REPORT_MIN_INTERVAL_S,
  and echoed after a change (CONTROL_REPORT_ECHO_S) so a report control ignored in a quiet
  window is repeated after it;
* logs, runtime states, step logs, pull progress and job events through the bounded outbox,
  flushed every OUTBOX_FLUSH_INTERVAL_S.

Backpressure: while the socket's send queue is backed up (control, or the network, not reading)
reports wait, coalesced, and the outbox keeps dropping by its caps, so memory stays bounded.
Bus handlers only touch memory, so a host with control unreachable never waits for it.

Events from control are checked field by field: a value of the wrong type is ignored with a
warning, never stored. Commands are run only for a session control has acknowledged, and the
link never follows an HTTP redirect: the key goes to the configured address or nowhere.
The link stops reconnecting only when control's last word about registration was `rejected`
for the key in use; a later `registration_ack` or `pending` undoes a rejection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import socketio
import yarl

from solar_host import events as ev
from solar_host.control.commands import COMMANDS, CommandRunner, failure
from solar_host.control.outbox import Outbox
from solar_host.control.packets import REFUSED, ControlPacket
from solar_host.control.payloads import PayloadBuilder
from solar_host.control.reporter import Reporter
from solar_host.settings import normalize_control_url as normalize_url

log = logging.getLogger(__name__)

NAMESPACE = "/hosts"
HEALTH_DEBOUNCE_S = 0.2
# Packets waiting in the Engine.IO send queue above which reports wait and the outbox holds.
MAX_QUEUED_PACKETS = 32
# Packets in the send queue at which control counts as not reading at all: a command then
# closes the link instead of queueing its answer behind the others.
MAX_UNREAD_PACKETS = 1024
# Largest WebSocket message accepted from control: a bigger one closes the link (aiohttp), so
# commands up to this size are read and answered (payload_too_large above the command limit).
# (Every byte of a message is decoded on the event loop before any limit is checked: a 13 MiB
# command cost 1.6 s of it.)
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Longest silence of control (not even a ping: control pings every 25 s by default) after
# which the host drops the link and connects again.
MAX_SILENCE_S = 90.0
# A session shorter than this counts as a failure for the reconnect delay.
SHORT_SESSION_S = 10.0
# Socket.IO servers refuse messages past max_http_buffer_size, 1,000,000 bytes by default
# (python-engineio): a report above it is dropped, and so is the link.
CONTROL_MESSAGE_LIMIT = 1_000_000
# Longest id or name accepted from control's events (uuids and names are far shorter).
MAX_FIELD_CHARS = 256


def _stamp_packets(session: _Session) -> None:
    """Note the time of every packet the session receives (Engine.IO's pings too)."""
    eio = session.sio.eio
    receive = getattr(eio, "_receive_packet", None)
    if receive is None:  # another python-engineio: the link keeps the server's own timeouts
        return

    async def stamped(pkt: Any) -> Any:
        session.last_heard = time.monotonic()
        return await receive(pkt)

    eio._receive_packet = stamped


def _worth_logging(count: int) -> bool:
    """The first 20 of a kind of warning, then every 1,000th: a hostile peer repeating a
    malformed event must not flood the host's log."""
    return count <= 20 or count % 1000 == 0


class ControlLinkUnavailable(RuntimeError):
    """The link is not running, so POST /reconnect cannot start a connection (503)."""


class RedirectRefused(aiohttp.ClientConnectionError):
    """Control's address answered the handshake with a redirect, which the link never follows.
    A connection error to Engine.IO, so either transport fails the connect as usual."""


def http_refusing_redirects(refused: list[str]) -> aiohttp.ClientSession:
    """The HTTP session Engine.IO connects through, one per connect and closed with it.

    aiohttp follows up to 10 redirects to any origin, https to plain http included, and the
    Socket.IO CONNECT that follows carries the host key: a control address answering 302 would
    hand the key (and the right to send commands) to whatever it named. So the first redirect
    ends the attempt; its target is noted in `refused` for the log line."""

    async def refuse(_: Any, __: Any, params: aiohttp.TraceRequestRedirectParams) -> None:
        location = params.response.headers.get("Location", "")
        params.response.close()
        try:  # the address the operator may mean, without Engine.IO's query
            target = str(params.url.join(yarl.URL(location)).with_query(None))
        except ValueError:
            target = location
        refused.append(target[:MAX_FIELD_CHARS] or "(no Location)")
        raise RedirectRefused(f"redirect to {refused[-1]} not followed")

    # A trace hook runs before aiohttp follows the redirect, in every aiohttp 3.x.
    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(refuse)
    return aiohttp.ClientSession(trace_configs=[trace])


async def wait_event(event: asyncio.Event, within_s: float) -> bool:
    """True if `event` is set within `within_s`. asyncio.timeout, unlike 3.11's wait_for, never
    swallows a cancellation that lands as the event fires."""
    try:
        async with asyncio.timeout(within_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


@dataclass(eq=False)
class _Session:
    """One Socket.IO connection. Handlers are bound to their session, so a late event of an old
    connection cannot disturb the state of the current one."""

    sio: socketio.AsyncClient
    url: str
    http: aiohttp.ClientSession | None = None  # ours: Engine.IO leaves a given session open
    api_key: str = ""
    ns_connected: bool = False
    ack_seq: int = 0
    synced_seq: int = 0
    pending_logged: set[str | None] = field(default_factory=set)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    last_heard: float = field(default_factory=time.monotonic)  # any packet, pings included
    silent: bool = False  # closed for hearing nothing past MAX_SILENCE_S

    @property
    def acked(self) -> bool:
        return self.ack_seq > 0


class ControlLink:
    """The host's Socket.IO client towards solar-control."""

    def __init__(self, host: Any, *, connect_timeout_s: float = 10.0) -> None:
        self.host = host
        self.settings = host.settings
        self.urls = [normalize_url(u) for u in self.settings.control_urls]
        if not self.urls:
            raise ValueError("ControlLink needs at least one SOLAR_CONTROL_URL")
        self.connect_timeout_s = connect_timeout_s
        self.payloads = PayloadBuilder(host)
        self.outbox = Outbox(self.settings.outbox_max_entries)
        # Counters for the metrics endpoint.
        self.sent: Counter[str] = Counter()
        self.reconnects = 0
        self.connect_failures = 0
        self.emit_failures = 0
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
        self.oversized_reports = 0  # reports past CONTROL_MESSAGE_LIMIT
        self.commands = CommandRunner(
            lambda: self.host.services.get("instances"),
            max_in_flight=self.settings.control_max_commands_in_flight,
            max_bytes=self.settings.control_max_command_bytes,
        )
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

        self._running = False
        self._session: _Session | None = None
        self._url_index = 0
        self._run_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._unsubscribe: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._emit_lock = asyncio.Lock()

    # --- state --------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """The /hosts namespace is connected (approved or pending)."""
        s = self._session
        return s is not None and s.ns_connected and not s.closed.is_set()

    @property
    def registered(self) -> bool:
        """Connected and acknowledged by control: telemetry is used, not dropped."""
        s = self._session
        return self.connected and s is not None and s.acked

    @property
    def running(self) -> bool:
        return self._running

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
            "emit_failures": self.emit_failures,
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
        bus = self.host.bus
        self._unsubscribe = [
            bus.subscribe(self._on_instances_changed, ev.InstancesChanged),
            bus.subscribe(self._on_log_line, ev.LogLine),
            bus.subscribe(self._on_runtime_state, ev.RuntimeStateChanged),
            bus.subscribe(self._on_pull_progress, ev.PullProgress),
            bus.subscribe(self._on_step_log, ev.StepLog),
            bus.subscribe(self._on_job_lifecycle, ev.JobLifecycle),
            bus.subscribe(self._on_reservations_changed, ev.ReservationsChanged),
        ]
        self._run_task = asyncio.create_task(self._run(), name="control-link")
        self._tasks = [
            asyncio.create_task(self._flush_loop(), name="control-outbox"),
            asyncio.create_task(self.instances_reporter.run(), name="control-instances"),
            asyncio.create_task(self.health_reporter.run(), name="control-health"),
            asyncio.create_task(self.sync_reporter.run(), name="control-sync"),
        ]

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
            await self._close(session)

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
                await self._close(session)
                break
            await self._wait_closed(session)
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

    async def _connect(self, url: str) -> _Session | None:
        redirects: list[str] = []
        http = http_refusing_redirects(redirects)
        sio = socketio.AsyncClient(
            reconnection=False,
            handle_sigint=False,
            ssl_verify=not self.settings.insecure,
            request_timeout=self.connect_timeout_s,
            # Room for a command at the limit to be read and refused with an answer.
            websocket_extra_options={
                "max_msg_size": max(MAX_MESSAGE_BYTES, 2 * self.commands.max_bytes)
            },
            serializer=ControlPacket,
            http_session=http,
        )
        session = _Session(sio=sio, url=url, http=http, api_key=self.host.api_key)
        _stamp_packets(session)
        self._bind_handlers(session)
        self._session = session
        auth = {"api_key": session.api_key, "host_name": self.settings.effective_host_name}
        try:
            # python-socketio waits wait_timeout for the namespace CONNECT; control sends none
            # when its connect handler fails, so a timeout is just another failed attempt.
            async with asyncio.timeout(self.connect_timeout_s + 5):
                await sio.connect(
                    url,
                    auth=auth,
                    namespaces=[NAMESPACE],
                    socketio_path="socket.io",
                    transports=["websocket"],
                    wait_timeout=self.connect_timeout_s,
                )
        except (socketio.exceptions.ConnectionError, TimeoutError, OSError, ValueError) as err:
            self.connect_failures += 1
            if redirects:
                self.refused_redirects += 1
                if _worth_logging(self.refused_redirects):  # it repeats at every retry
                    log.error(
                        "solar-control at %s answered a redirect to %s: not followed; set "
                        "SOLAR_CONTROL_URL to the final address",
                        url,
                        redirects[0],
                    )
            else:
                log.info(
                    "cannot connect to solar-control at %s: %s", url, err or type(err).__name__
                )
            if self._session is session:
                self._session = None
            await self._close(session)
            return None
        log.info("connected to solar-control at %s", url)
        return session

    async def _wait_closed(self, session: _Session) -> None:
        # The disconnect handler sets `closed`; the state check covers a transport that died
        # without the library calling it.
        while not session.closed.is_set() and self._running:
            await wait_event(session.closed, 1.0)
            if session.sio.eio.state != "connected":
                session.closed.set()
            elif time.monotonic() - session.last_heard > MAX_SILENCE_S:
                # Engine.IO takes its ping timeouts from the server: one that announced an
                # hour and fell silent held the host on a dead link for as long.
                log.warning(
                    "nothing from solar-control at %s for %.0f s; closing the link",
                    session.url,
                    MAX_SILENCE_S,
                )
                session.silent = True
                session.closed.set()

    async def _end_session(self, session: _Session) -> None:
        if self._session is session:
            self._session = None
        self.outbox.set_accepting(False)
        self.pending_id = None
        await self._close(session)
        log.info("disconnected from solar-control at %s", session.url)

    async def _close(self, session: _Session) -> None:
        session.closed.set()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await session.sio.disconnect()
        if session.http is not None:
            with contextlib.suppress(Exception):
                await session.http.close()

    # --- events from control ------------------------------------------------------------------

    def _bind_handlers(self, session: _Session) -> None:
        sio = session.sio

        async def on_connect() -> None:
            session.ns_connected = True
            if session.acked:
                self._maybe_sync(session)
            else:
                # Control reads registration while pending, and stores it for the approval.
                await self._send("registration", session)

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
            if _worth_logging(self.refused_packets):
                log.warning("solar-control sent %s; refused", what)
            return failure(400, f"refused: {what}", code="invalid_request")

        sio.on(REFUSED, on_refused, namespace=NAMESPACE)
        sio.on(REFUSED, on_refused, namespace="/")  # a bare binary frame names no namespace

    def _command_handler(
        self, name: str, session: _Session
    ) -> Callable[..., Coroutine[Any, Any, dict[str, Any] | None]]:
        # python-socketio runs each incoming event as its own task, so a start that takes
        # minutes does not hold up other events; the return value is the ack.
        async def handler(data: Any = None, *extra: Any) -> dict[str, Any] | None:
            if self._unread(session):
                # Control sends commands and reads none of the acks: each one queued was kept
                # in memory. The link is closed (and made again); the command is not run.
                if not session.closed.is_set():
                    log.warning(
                        "solar-control does not read what the host sends (%d packets "
                        "queued); closing the link",
                        MAX_UNREAD_PACKETS,
                    )
                    session.closed.set()
                return None
            if session is not self._session or not session.acked:
                # Control acknowledges a host before it may drive it (it sends the ack in its
                # connect handler, before anything else); a peer that never did, one keeping
                # the host pending, or an old connection, gets an answer and no action.
                self.refused_unregistered += 1
                if _worth_logging(self.refused_unregistered):
                    log.warning(
                        "solar-control sent %s before acknowledging this host; refused", name
                    )
                return failure(
                    403, "this host is not registered with solar-control", code="not_registered"
                )
            return await self.commands.run(name, data)

        return handler

    def _unread(self, session: _Session) -> bool:
        queue = getattr(session.sio.eio, "queue", None)
        return queue is not None and queue.qsize() >= MAX_UNREAD_PACKETS

    def _fields(self, event: str, data: Any, **types: type) -> dict[str, Any]:
        """The fields of a control event that have the expected type; others are ignored (and
        counted) with a warning, so a malformed event can neither break nor poison the link."""
        if data is None:
            return {}
        if not isinstance(data, dict):
            self.ignored_fields += 1
            if _worth_logging(self.ignored_fields):
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
                if not _worth_logging(self.ignored_fields):
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

    def _unregister(self, session: _Session) -> None:
        """Control took its approval back (pending, or rejected, after an ack): until the next
        ack only registration is sent, as before the first (contract: while pending, control
        reads nothing else); the next ack syncs everything again."""
        session.ack_seq = session.synced_seq = 0
        if session is self._session:
            self.outbox.set_accepting(False)

    def _maybe_sync(self, session: _Session) -> None:
        """Run the post-approval sync once per ack, once the namespace is connected."""
        if session is not self._session or not session.ns_connected:
            return
        if session.ack_seq <= session.synced_seq:
            return
        session.synced_seq = session.ack_seq
        self.outbox.set_accepting(True)
        # Through a Reporter: a control that repeats registration_ack hundreds of times gets
        # a few coalesced syncs, not hundreds of full lists.
        self.sync_reporter.mark(echo=False)

    async def _sync(self) -> bool:
        session = self._session
        if session is None or not session.acked or not session.ns_connected:
            return True  # moot: the next ack syncs
        if self._backed_up(session):
            return False
        await self._send("registration", session)
        await self._send("instances_update", session)
        await self._send("host_health", session)
        self.health_reporter.sent_elsewhere()
        return True

    # --- sending ------------------------------------------------------------------------------

    async def _send(self, event: str, session: _Session) -> bool:
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
            if _worth_logging(self.oversized_reports):
                log.error(
                    "the %s report is %d bytes (%d instances): solar-control's Socket.IO server "
                    "refuses messages over %d bytes unless its max_http_buffer_size is raised, "
                    "and drops the link with them",
                    event,
                    size,
                    len(instances),
                    CONTROL_MESSAGE_LIMIT,
                )

    async def _emit(self, event: str, payload: Any, session: _Session | None = None) -> bool:
        session = session or self._session
        if session is None or not session.ns_connected or session.closed.is_set():
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

    def _backed_up(self, session: _Session) -> bool:
        """The socket's send queue holds more than a few packets: control (or the network) is
        not keeping up, and piling more on would only grow memory."""
        queue = getattr(session.sio.eio, "queue", None)
        return queue is not None and queue.qsize() > MAX_QUEUED_PACKETS

    async def _report(self, event: str) -> bool:
        """A Reporter's send: the newest snapshot now. False only to say "retry later"."""
        session = self._session
        if session is None or not session.ns_connected or session.closed.is_set():
            return True  # moot: the next connect sends everything
        if self._backed_up(session):
            return False
        # While pending only registration is read: keep the pending record current.
        await self._send(event if session.acked else "registration", session)
        return True

    async def _report_instances(self) -> bool:
        return await self._report("instances_update")

    async def _report_health(self) -> bool:
        return await self._report("host_health")

    async def _flush_loop(self) -> None:
        interval = self.settings.outbox_flush_interval_s
        while self._running:
            await asyncio.sleep(interval)
            if not len(self.outbox) or not self.registered:
                continue
            session = self._session
            if session is None or self._backed_up(session):
                continue  # the outbox stays bounded by its caps meanwhile
            for event, payload in self.outbox.drain():
                await self._emit(event, payload, session)

    # --- bus handlers (memory only: they run inside the publisher) ----------------------------

    def _on_instances_changed(self, event: ev.Event) -> None:
        if self._session is None:
            return  # the next connect sends the full list anyway
        # Every change is echoed, crash or not: the host cannot tell which of its
        # reports control chose to ignore, only that it acts on the ones after.
        self.instances_reporter.mark(echo=True)
        if self.registered:
            self.health_reporter.mark(echo=False)

    def _on_reservations_changed(self, event: ev.Event) -> None:
        if self.registered:
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
        self.outbox.put_event(event.name, {**event.payload, "host_id": self.host_id})

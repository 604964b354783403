"""One Socket.IO connection to solar-control: how it is made, watched and closed.

The link (client.py) decides when to connect, to which replica, and what a session's end means;
this module holds what one connection is: a python-socketio client with reconnection off, an
HTTP session of ours that refuses redirects (the host key goes to the configured address or
nowhere), the time of the last packet heard (Engine.IO's pings too) so a silent peer is left,
and the send queue whose length tells whether control is reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import socketio
import yarl

from solar_host.control.packets import ControlPacket

log = logging.getLogger(__name__)

NAMESPACE = "/hosts"
# Packets waiting in the Engine.IO send queue above which reports wait and the outbox holds.
MAX_QUEUED_PACKETS = 32
# Packets in the send queue at which control may not be reading at all: held at every look for
# UNREAD_S, or past UNREAD_HARD_PACKETS at any, a command then closes the link instead of
# queueing its answer behind the others. A look alone says little: when control sends
# thousands of commands at once, the host may read all of them in one turn of its event loop
# and queue every answer before its writer next runs (1,900 of 4,000 seen on Python 3.13, 30
# on 3.11), and a control that reads drains them in a turn or two.
MAX_UNREAD_PACKETS = 1024
UNREAD_S = 3.0
UNREAD_HARD_PACKETS = 8 * MAX_UNREAD_PACKETS
# Largest WebSocket message accepted from control: a bigger one closes the link (aiohttp), so
# commands up to this size are read and answered (payload_too_large above the command limit).
# (Every byte of a message is decoded on the event loop before any limit is checked: a 13 MiB
# command cost 1.6 s of it.)
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Longest silence of control (not even a ping: control pings every 25 s by default) after
# which the host drops the link and connects again.
MAX_SILENCE_S = 90.0
# Longest id or name accepted from control's events (uuids and names are far shorter).
MAX_FIELD_CHARS = 256


def worth_logging(count: int) -> bool:
    """The first 20 of a kind of warning, then every 1,000th: a hostile peer repeating a
    malformed event must not flood the host's log."""
    return count <= 20 or count % 1000 == 0


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
class Session:
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
    unread_since: float | None = None  # since when every look found the queue unread
    redirects: list[str] = field(default_factory=list)  # refused by `http`, for the log

    @property
    def acked(self) -> bool:
        return self.ack_seq > 0

    @property
    def open(self) -> bool:
        """The namespace is connected and the session not yet closed."""
        return self.ns_connected and not self.closed.is_set()

    def backed_up(self) -> bool:
        """The socket's send queue holds more than a few packets: control (or the network) is
        not keeping up, and piling more on would only grow memory."""
        queue = getattr(self.sio.eio, "queue", None)
        return queue is not None and queue.qsize() > MAX_QUEUED_PACKETS

    def close_if_unread(self) -> bool:
        """Close the session if control reads nothing the host sends: MAX_UNREAD_PACKETS or
        more queued at every look for UNREAD_S, or UNREAD_HARD_PACKETS now. True if closed
        (now or before, for that reason)."""
        queue = getattr(self.sio.eio, "queue", None)
        queued = queue.qsize() if queue is not None else 0
        if queued < MAX_UNREAD_PACKETS:
            self.unread_since = None
            return False
        now = time.monotonic()
        if self.unread_since is None:
            self.unread_since = now
        if queued < UNREAD_HARD_PACKETS and now - self.unread_since < UNREAD_S:
            return False
        if not self.closed.is_set():
            log.warning(
                "solar-control does not read what the host sends (%d packets queued for "
                "%.1f s); closing the link",
                queued,
                now - self.unread_since,
            )
            self.closed.set()
        return True


def new_session(
    url: str, *, api_key: str, insecure: bool, timeout_s: float, max_command_bytes: int
) -> Session:
    """A session not yet connected, with a fresh client and HTTP session of its own."""
    redirects: list[str] = []
    http = http_refusing_redirects(redirects)
    sio = socketio.AsyncClient(
        reconnection=False,
        handle_sigint=False,
        ssl_verify=not insecure,
        request_timeout=timeout_s,
        # Room for a command at the limit to be read and refused with an answer.
        websocket_extra_options={"max_msg_size": max(MAX_MESSAGE_BYTES, 2 * max_command_bytes)},
        serializer=ControlPacket,
        http_session=http,
    )
    session = Session(sio=sio, url=url, http=http, api_key=api_key, redirects=redirects)
    _stamp_packets(session)
    return session


def _stamp_packets(session: Session) -> None:
    """Note the time of every packet the session receives (Engine.IO's pings too)."""
    eio = session.sio.eio
    receive = getattr(eio, "_receive_packet", None)
    if receive is None:  # another python-engineio: the link keeps the server's own timeouts
        return

    async def stamped(pkt: Any) -> Any:
        session.last_heard = time.monotonic()
        return await receive(pkt)

    eio._receive_packet = stamped


async def connect_session(session: Session, *, host_name: str, timeout_s: float) -> None:
    """Connect to `/hosts` with the host's key and name. Raises what python-socketio raises
    (ConnectionError, OSError, ValueError), or TimeoutError."""
    auth = {"api_key": session.api_key, "host_name": host_name}
    # python-socketio waits wait_timeout for the namespace CONNECT; control sends none when its
    # connect handler fails, so a timeout is just another failed attempt.
    async with asyncio.timeout(timeout_s + 5):
        await session.sio.connect(
            session.url,
            auth=auth,
            namespaces=[NAMESPACE],
            socketio_path="socket.io",
            transports=["websocket"],
            wait_timeout=timeout_s,
        )


async def watch_session(session: Session, running: Callable[[], bool]) -> None:
    """Return once the session is closed, its transport died, or control fell silent."""
    # The disconnect handler sets `closed`; the state check covers a transport that died
    # without the library calling it.
    while not session.closed.is_set() and running():
        await wait_event(session.closed, 1.0)
        if session.sio.eio.state != "connected":
            session.closed.set()
        elif session.close_if_unread():
            pass  # it said why
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


async def close_session(session: Session) -> None:
    session.closed.set()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await session.sio.disconnect()
    if session.http is not None:
        with contextlib.suppress(Exception):
            await session.http.close()

"""Everything the host does with uvicorn's private API, in one module: uvicorn (pinned below its
next minor in pyproject.toml) may change any of it in a release, and tests/test_uvicorn_adapter.py
fails naming the class and attribute if it does (PRIVATE_API lists them).

- `guarded_protocol`: uvicorn's httptools protocol with the bounds it leaves out (below), and an
  answer's head and body in one send (HeadWithBody), for the host's API and the HF server alike.
- `uvicorn_config_class`: uvicorn.Config without uvicorn's command line.
- `websockets_on_first_upgrade`: uvicorn's WebSocket protocol, imported when first needed.
- `notifying_server`: the host's uvicorn.Server: READY=1 once it serves, a bounded wait for
  requests in flight at a stop, and a stop by SIGINT or SIGTERM that returns instead of
  raising the signal again (uvicorn re-raises it after a clean shutdown: Ctrl-C ended in a
  KeyboardInterrupt traceback and a death by SIGINT).

The guard: a connection whose request headers do not arrive within a time limit, or
whose headers pass a size limit, is closed. uvicorn never times out a connection that has not
finished its headers (anyone who can connect held a descriptor for ever), and httptools keeps
headers of any size in memory (400 headers of 1 MiB took 400 MiB). Past the size limit the
request is answered 431 and never run, nor anything sent after it.

Three more bounds, each on a connection that held memory or a descriptor for as long as its
client liked (review repros, no key needed):

- Pipelining: httptools queues every request of a read (uvloop reads up to 256 KiB) before
  uvicorn pauses reading. 256 KiB of `GET /x` is 13,800 queued requests, about 31 MB, held while
  the client does not read the answers; 50 such connections took a host from 63 MB to 1.6 GB. A
  connection with more than MAX_PIPELINED requests waiting is dropped and the rest of what it
  sent is parsed without being kept.
- Answers nobody reads: a connection whose transport stays paused for writing (the client reads
  nothing) for WRITE_STALL_S is dropped.
- After an answer: the next request's headers must come within the header timeout of its end,
  whatever bytes come meanwhile. uvicorn's keep-alive timer is cancelled by any byte: the rest
  of a body the app answered without reading (a 401 to a POST), sent one byte at a time or not
  at all, held the connection for ever (10,000 such took 8,490 descriptors). A connection
  closed and still not gone (its answer unsent) one header timeout later is aborted."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("solar_host")

# What this module reads or overrides of uvicorn beyond its documented API (uvicorn.Config,
# uvicorn.Server(config).run/serve, should_exit, started), by class: instance attributes and
# methods alike. tests/test_uvicorn_adapter.py checks every name on the installed uvicorn.
PRIVATE_API: dict[str, tuple[str, ...]] = {
    "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol": (
        "loop",
        "transport",
        "cycle",
        "pipeline",
        "connection_made",
        "connection_lost",
        "data_received",
        "on_message_begin",
        "on_url",
        "on_header",
        "on_headers_complete",
        "on_body",
        "on_message_complete",
        "on_response_complete",
        "pause_writing",
        "resume_writing",
        "handle_websocket_upgrade",
        "parser",
        "headers",
        "flow",
        "server_state",
    ),
    "uvicorn.protocols.http.httptools_impl.RequestResponseCycle": (
        "transport",
        "response_complete",
    ),
    "uvicorn.server.Server": (
        "server_state",
        "startup",
        "_wait_tasks_to_complete",
        "capture_signals",
        "_captured_signals",
    ),
    "uvicorn.server.ServerState": ("connections", "tasks"),
}

# Far above what any client sends (nginx's default buffers hold 32 KiB).
MAX_HEADER_BYTES = 64 * 1024
# Requests waiting behind the one being answered. Browsers and HTTP clients do not pipeline;
# one that sends more than this at once is not a client the host serves.
MAX_PIPELINED = 16
# How long an answer may wait for a client that reads nothing before its connection is dropped.
WRITE_STALL_S = 30.0

Header = tuple[bytes, bytes]
# An answer given by the connection itself (ConnectionGuard._answer_at_once): called with a GET's
# raw target and headers, it returns a 200's own header lines (after uvicorn's default ones,
# with the blank line) and its body, or None to run the app as usual.
InstantAnswer = Callable[[bytes, list[Header]], tuple[bytes, bytes] | None]


def guarded_protocol(
    timeout_s: float,
    max_header_bytes: int = MAX_HEADER_BYTES,
    *,
    max_pipelined: int = MAX_PIPELINED,
    write_stall_s: float = WRITE_STALL_S,
    instant: InstantAnswer | None = None,
) -> Any:
    """The protocol class for uvicorn.Config(http=...): uvicorn's httptools protocol with the
    `ConnectionGuard` over it; "auto", without the bounds, where httptools is missing.
    `instant` answers the requests it knows without the app (ConnectionGuard._answer_at_once)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"
    bounds = {
        "_header_timeout_s": timeout_s,
        "_max_header_bytes": max_header_bytes,
        "_max_pipelined": max_pipelined,
        "_write_stall_s": write_stall_s,
        "_too_large": _headers_too_large(max_header_bytes),
        "_instant": staticmethod(instant) if instant is not None else None,
    }
    return type("GuardedProtocol", (ConnectionGuard, HttpToolsProtocol), bounds)


class ConnectionGuard:
    """The bounds (module docstring) over uvicorn's HttpToolsProtocol, which `guarded_protocol`
    puts after it in the class it makes: each `super()` here is uvicorn's method. A mixin, so
    that uvicorn is imported only when a server is made. The limits are class attributes of
    the made class."""

    _header_timeout_s: float
    _max_header_bytes: int
    _max_pipelined: int
    _write_stall_s: float
    _too_large: bytes
    # uvicorn's, read here (PRIVATE_API).
    loop: asyncio.AbstractEventLoop
    transport: Any
    cycle: Any
    pipeline: Any

    # When the awaited headers are due (None while none are awaited), and the one timer
    # of the connection that looks at it. Arming and disarming per request only set the
    # field: a timer set and cancelled per request was a tenth of the host's CPU under
    # load. The timer wakes at most once per timeout and re-arms itself if still needed.
    _deadline: float | None = None
    _timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    # Dropped: nothing more it sends is kept (the parser still runs over the rest of the
    # read it is in, with every callback a no-op).
    _dropped = False
    _instant: InstantAnswer | None = None
    # The request being parsed was answered by _answer_at_once: no cycle of uvicorn's has it.
    _answered = False
    # The request's target as it arrived (uvicorn keeps its own only once a request began).
    _target = b""
    # uvicorn's default headers (server, date: a new list each second) and their bytes.
    _defaults_of: list[Header] | None = None
    _defaults = b""
    # uvicorn's, read here (PRIVATE_API).
    parser: Any
    headers: list[Header]
    flow: Any
    server_state: Any

    def _arm(self) -> None:
        self._header_bytes = 0
        self._arm_deadline()

    def _arm_deadline(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.time() + self._header_timeout_s
            if self._timer is None:
                self._timer = self.loop.call_at(self._deadline, self._check_deadline)

    def _disarm(self) -> None:
        self._deadline = None

    def _check_deadline(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return
        if self.loop.time() < deadline:
            self._timer = self.loop.call_at(deadline, self._check_deadline)
            return
        self._deadline = None
        self._headers_late()

    def _headers_late(self) -> None:
        if self.transport.is_closing():
            # Closed a timeout ago and still not gone: its answer cannot be sent.
            self.transport.abort()
        else:
            self.transport.close()
            self._arm_deadline()  # the close must complete within one more timeout

    def _drop(self) -> None:
        """Close at once, unsent answers and queued requests with it."""
        self._dropped = True
        self.pipeline.clear()
        self._disarm()
        self.transport.abort()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self.pipeline.clear()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._dropped:
            super().data_received(data)

    def on_message_begin(self) -> None:
        if self._dropped:
            return
        self._answered = False
        self._target = b""
        self._arm()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._dropped:
            return
        self._count(len(url))
        self._target += url
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._dropped:
            return
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_body(self, body: bytes) -> None:
        if not (self._dropped or self._answered):
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not (self._dropped or self._answered):
            super().on_message_complete()

    def on_response_complete(self) -> None:
        idle = not self.pipeline
        super().on_response_complete()
        if idle:
            # Nothing else was asked: the next request's headers are due within the header
            # timeout, whatever else comes (uvicorn's keep-alive timer stops at any byte).
            self._arm_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self._write_stall_s, self._stalled)

    def resume_writing(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        super().resume_writing()

    def _stalled(self) -> None:
        self._stall_timer = None
        self._drop()

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self._max_header_bytes:
            self._refuse_headers()

    def _refuse_headers(self) -> None:
        """431 and close. Nothing more it sends is kept or run: closing alone left the
        rest of the read to the parser, which ran the refused request all the same."""
        self._dropped = True
        self.pipeline.clear()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # An earlier request's answer is being written: a 431 would land inside it.
            self._drop()
            return
        self.transport.write(self._too_large)
        self.transport.close()  # the header deadline aborts it if it does not complete

    def on_headers_complete(self) -> None:
        if self._dropped:
            return
        if len(self.pipeline) >= self._max_pipelined:
            self._drop()
            return
        self._disarm()
        if self._instant is not None and self._answer_at_once():
            return
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.transport is self.transport:
            cycle.transport = HeadWithBody(self.transport, self.loop)

    def _answer_at_once(self) -> bool:
        """Answer a GET that `_instant` knows here, in one write, without the app: no ASGI
        scope, task, cycle or middleware for the two routes control polls hardest, which then
        cost a third of the CPU they did. Only a plain keep-alive HTTP/1.1 GET, on a connection
        with nothing else in flight and not paused for writing; anything else (and whatever
        `_instant` declines) goes to the app as before. The answer then completes as uvicorn's
        own do (on_response_complete: its count, its keep-alive timer, the header deadline)."""
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.pipeline:
            return False
        if self.transport.is_closing():
            return False  # closing (a late header deadline): no write here
        parser = self.parser
        if (
            parser.get_method() != b"GET"
            or parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or parser.should_upgrade()
            or self.flow.write_paused
        ):
            return False
        assert self._instant is not None
        answer = self._instant(self._target, self.headers)
        if answer is None:
            return False
        defaults = self.server_state.default_headers
        if defaults is not self._defaults_of:
            self._defaults_of = defaults
            self._defaults = b"".join(b"%s: %s\r\n" % (name, value) for name, value in defaults)
        self._answered = True
        head, body = answer
        self.transport.writelines((b"HTTP/1.1 200 OK\r\n", self._defaults, head, body))
        self.on_response_complete()
        return True

    def handle_websocket_upgrade(self) -> None:
        self._disarm()
        super().handle_websocket_upgrade()


class HeadWithBody:
    """The transport as one answer's cycle sees it: the answer's first write (its head) is
    held until the next (the body's first bytes) and both go out in one send, or until the
    loop's next turn, whichever comes first. A head and a body sent apart were two sends, two
    loopback segments and two wake-ups of the client: over a third of the host's CPU for a
    small answer such as GET /health. Nothing waits longer than one turn of the loop (a 100
    Continue, a streamed answer's head before its first chunk)."""

    __slots__ = ("_first", "_held", "_loop", "_transport")

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._first = True
        self._loop = loop

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held = data
            self._loop.call_soon(self._flush)
        elif self._held is not None:
            head, self._held = self._held, None
            self._transport.writelines((head, data))
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        head, self._held = self._held, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return bool(self._transport.is_closing())


def _headers_too_large(limit: int) -> bytes:
    """The whole 431 answer, written straight to the transport (no request runs)."""
    body = json.dumps({"detail": f"request headers are larger than {limit} bytes"}).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def uvicorn_config_class() -> Any:
    """uvicorn.Config, imported without uvicorn's package __init__ where no one imported uvicorn
    yet. That __init__ imports uvicorn.main, the `uvicorn` command line (click, the reloaders,
    watchfiles, multiprocessing): about 14 ms of CPU in every host start, before the first
    /health, for code a host never runs. The package module is made from its spec instead,
    with the names uvicorn's own modules import from it (Config: uvicorn.lifespan) and the
    server's; `uvicorn.run` and `uvicorn.main` are not there in such a process (the host's:
    serve() is its only user of uvicorn; the HF server imports uvicorn as usual)."""
    if "uvicorn" not in sys.modules:
        spec = importlib.util.find_spec("uvicorn")
        if spec is not None and spec.submodule_search_locations is not None:
            package = importlib.util.module_from_spec(spec)
            sys.modules["uvicorn"] = package
            try:
                from uvicorn._version import __version__
                from uvicorn.config import Config
                from uvicorn.server import Server
            except BaseException:
                del sys.modules["uvicorn"]
                raise
            package.__version__ = __version__  # type: ignore[attr-defined]
            package.Config = Config  # type: ignore[attr-defined]
            package.Server = Server  # type: ignore[attr-defined]
    from uvicorn.config import Config

    return Config


def websockets_on_first_upgrade(**kwargs: Any) -> asyncio.Protocol:
    """uvicorn.Config(ws=...): the protocol uvicorn's "auto" picks, imported at the first
    WebSocket upgrade rather than by Config.load at start-up (the websockets package was 5-13
    ms of every start, before the first /health, for connections that come later if ever).
    uvicorn makes one per upgrade with its config, server state and app state as keywords."""
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    if AutoWebSocketsProtocol is None:
        raise RuntimeError("no WebSocket library (websockets or wsproto) is installed")
    return AutoWebSocketsProtocol(**kwargs)


def notifying_server(
    config: Any, on_started: Callable[[], None], *, shutdown_grace_s: float
) -> Any:
    """A uvicorn.Server that calls `on_started` (READY=1) once it serves, bounds the wait for
    requests in flight at a stop by `shutdown_grace_s`, and returns after a stop by signal
    (`stopped_by` names the signals) instead of raising it again."""
    from uvicorn.server import Server as UvicornServer

    class Server(UvicornServer):  # type: ignore[misc]
        cut_requests = False
        stopped_by: tuple[int, ...] = ()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            """uvicorn's, less the re-raise of the signals it caught once the server is
            down: the stop is complete, and the caller says how it ended."""
            with super().capture_signals():
                try:
                    yield
                finally:
                    self.stopped_by = tuple(self._captured_signals)
                    self._captured_signals.clear()

        async def _wait_tasks_to_complete(self) -> None:
            """uvicorn waits for every request in flight before the lifespan's shutdown, with
            no bound: a start waiting for a model to load (up to START_DEADLINE_S) or a pull
            held a hand-over or a stop for as long, the API closed meanwhile. After
            shutdown_grace_s, what is still in flight has its connection closed unanswered:
            control takes a dropped start as "outcome unknown" and looks again, where an
            answer (uvicorn's 500 for a cancelled request) would be a failed start, and it
            deletes an instance whose start failed. The work itself goes on as the stop
            decides (a start is shielded: handed over, the next host adopts its backend)."""
            try:
                async with asyncio.timeout(shutdown_grace_s):
                    await super()._wait_tasks_to_complete()
                    return
            except TimeoutError:
                pass
            state = self.server_state
            log.warning(
                "closing %d connection(s) with requests still in flight after %g s",
                len(state.connections),
                shutdown_grace_s,
            )
            for conn in list(state.connections):
                conn.transport.close()
            self.cut_requests = True  # their CancelledError is no error (serving._CutRequests)
            for task in list(state.tasks):
                task.cancel()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(shutdown_grace_s):
                    await super()._wait_tasks_to_complete()

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and not self.should_exit:
                for sock in sockets or ():  # uvicorn names only the sockets it binds itself
                    addr = sock.getsockname()
                    log.info("serving the REST API on http://%s:%d", *addr[:2])
                on_started()

    return Server(config)

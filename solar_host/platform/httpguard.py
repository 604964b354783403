"""uvicorn's httptools protocol with the bounds uvicorn leaves out, for the host's API and
the HF server alike: a connection whose request headers do not arrive within a time limit, or
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
import json
from typing import Any

# Far above what any client sends (nginx's default buffers hold 32 KiB).
MAX_HEADER_BYTES = 64 * 1024
# Requests waiting behind the one being answered. Browsers and HTTP clients do not pipeline;
# one that sends more than this at once is not a client the host serves.
MAX_PIPELINED = 16
# How long an answer may wait for a client that reads nothing before its connection is dropped.
WRITE_STALL_S = 30.0


def guarded_protocol(
    timeout_s: float,
    max_header_bytes: int = MAX_HEADER_BYTES,
    *,
    max_pipelined: int = MAX_PIPELINED,
    write_stall_s: float = WRITE_STALL_S,
) -> Any:
    """The protocol class for uvicorn.Config(http=...); "auto", without the bounds, where
    httptools is missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"
    too_large = _headers_too_large(max_header_bytes)

    class GuardedProtocol(HttpToolsProtocol):  # type: ignore[misc]
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

        def _arm(self) -> None:
            self._header_bytes = 0
            self._arm_deadline()

        def _arm_deadline(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.time() + timeout_s
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
            self._arm()
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            if self._dropped:
                return
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._dropped:
                return
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_body(self, body: bytes) -> None:
            if not self._dropped:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._dropped:
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
                self._stall_timer = self.loop.call_later(write_stall_s, self._stalled)

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
            if self._header_bytes > max_header_bytes:
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
            self.transport.write(too_large)
            self.transport.close()  # the header deadline aborts it if it does not complete

        def on_headers_complete(self) -> None:
            if self._dropped:
                return
            if len(self.pipeline) >= max_pipelined:
                self._drop()
                return
            self._disarm()
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.transport is self.transport:
                cycle.transport = HeadWithBody(self.transport, self.loop)

        def handle_websocket_upgrade(self) -> None:
            self._disarm()
            super().handle_websocket_upgrade()

    return GuardedProtocol


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

"""EventStream under a real uvicorn on a loopback socket (both of its HTTP implementations),
and its ASGI contract driven directly where the timing must be exact."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncGenerator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from solar_host.servers.sse import EventStream

WAIT_S = 10


class Trace:
    """What the event generators did, and a way to wait for it."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.changed = asyncio.Event()

    def add(self, what: str) -> None:
        self.events.append(what)
        self.changed.set()

    async def until(self, what: str) -> None:
        async with asyncio.timeout(WAIT_S):
            while what not in self.events:
                self.changed.clear()
                await self.changed.wait()


def make_app(trace: Trace) -> Starlette:
    async def finite() -> AsyncGenerator[bytes, None]:
        try:
            for i in range(3):
                yield f"data: {i}\n\n".encode()
            trace.add("finite: last event")
        finally:
            trace.add("finite: closed")

    async def endless() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: first\n\n"
            trace.add("endless: waiting")
            await asyncio.Event().wait()  # nothing more to send, ever: only a hang-up ends it
            yield b"data: never\n\n"
        except asyncio.CancelledError:
            trace.add("endless: cancelled")
            raise
        finally:
            trace.add("endless: closed")

    async def route(request: Request) -> Response:
        await request.body()  # as hf_server does before it answers
        gen = finite() if request.url.path == "/finite" else endless()
        return EventStream(gen, headers={"Cache-Control": "no-cache"})

    return Starlette(routes=[Route("/finite", route), Route("/endless", route)])


@pytest.fixture(params=["h11", "httptools"])
async def served(request):
    trace = Trace()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        make_app(trace), http=request.param, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(WAIT_S):
        while not server.started:
            await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield url, trace
    server.should_exit = True
    async with asyncio.timeout(WAIT_S):
        await task
    sock.close()


async def test_every_event_arrives_then_the_stream_ends(served) -> None:
    url, trace = served
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as c:
        r = await c.get("/finite")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert trace.events == ["finite: last event", "finite: closed"]


async def test_a_hang_up_while_nothing_is_sent_cancels_the_stream(served) -> None:
    url, trace = served
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    await trace.until("endless: waiting")
    head = await asyncio.wait_for(reader.readuntil(b"data: first\n\n"), WAIT_S)
    assert head.startswith(b"HTTP/1.1 200")
    writer.close()  # the stream sends nothing more: only the disconnect can tell it
    await writer.wait_closed()
    await trace.until("endless: closed")
    assert trace.events == ["endless: waiting", "endless: cancelled", "endless: closed"]
    # The server goes on serving: the cancellation did not escape into uvicorn.
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as c:
        assert (await c.get("/finite")).status_code == 200


# ---- the ASGI contract, driven directly ----------------------------------------------------


async def test_the_disconnect_that_follows_a_complete_response_cancels_nothing() -> None:
    """uvicorn answers receive() with http.disconnect as soon as the response is complete;
    that must not cancel the task that goes on to serve the connection's next request."""
    complete = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message["more_body"]:
            complete.set()

    async def two() -> AsyncGenerator[bytes, None]:
        yield b"data: a\n\n"
        yield b"data: b\n\n"

    async def serve() -> str:
        await EventStream(two())({"type": "http"}, receive, send)
        for _ in range(5):
            await asyncio.sleep(0)  # give a stray cancellation every chance to land
        return "still running"

    task = asyncio.create_task(serve())
    assert await asyncio.wait_for(task, WAIT_S) == "still running"
    assert [m.get("body") for m in sent[1:]] == [b"data: a\n\n", b"data: b\n\n", b""]


async def test_a_cancellation_from_outside_propagates_and_closes_the_events() -> None:
    closed = asyncio.Event()
    waiting = asyncio.Event()

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        pass

    async def endless() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: x\n\n"
            waiting.set()
            await asyncio.Event().wait()
            yield b"data: never\n\n"
        finally:
            closed.set()

    task = asyncio.create_task(EventStream(endless())({"type": "http"}, receive, send))
    await asyncio.wait_for(waiting.wait(), WAIT_S)
    task.cancel()  # e.g. the server shutting down
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT_S)
    assert closed.is_set()

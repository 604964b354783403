"""A server-sent-events response that writes each event straight to ASGI `send`.

Starlette's StreamingResponse, under a server that speaks ASGI spec 2.3 (uvicorn does), runs
every stream inside an anyio task group with a second task listening for the disconnect. When
eight chats start together that machinery was about 12% of the event loop's busy time, and the
event loop is what a burst's first tokens queue behind. This response keeps the one thing that
machinery is for, noticing a client that hangs up while nothing is being sent (uvicorn's `send`
to a closed connection returns silently), with one plain asyncio task, and stops the stream by
cancelling the task that runs it.

Whatever ends the stream (its last event, the client leaving, the server shutting down), the
event iterator is closed before `__call__` returns, so its `finally` clauses run in order with
the request and not at some later garbage collection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


async def hang_up(receive: Receive) -> None:
    """Return once the client has gone (ASGI `http.disconnect`). Only after the request body
    has been read: until then `receive` answers with the body's parts, which this skips."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str] | None = None
    ) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        live = True  # False once the stream is over: a late disconnect cancels nothing
        hung_up = False

        async def watch() -> None:
            nonlocal hung_up
            # Also answered once the response is complete: that echo `live` ignores.
            await hang_up(receive)
            if live:
                hung_up = True
                streaming.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # Ours was a signal, consumed here; one from outside (shutdown) goes on up.
            if not hung_up or streaming.uncancel() > 0:
                raise
        finally:
            live = False
            watcher.cancel()
            # Closing runs the generator's own clean-up (freeing a decode row, logging the
            # 499) now; an iterator that already finished closes at once.
            await self.events.aclose()

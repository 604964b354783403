"""hf_server's HTTP plumbing shared by its routes: JSON answers, error answers (OpenAI's
error body), and the request's client hanging up while its answer is being worked out."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from solar_host.servers.hf_protocol import APIError, dumps
from solar_host.servers.sse import hang_up

JSON = "application/json"

# The request being handled, for the handlers that watch for its client leaving.
CURRENT_REQUEST: contextvars.ContextVar[Request] = contextvars.ContextVar("hf_request")


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type=JSON)


def error_response(err: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return Response(dumps(err.body()), status_code=err.status, media_type=JSON, headers=headers)


class ClientGone(APIError):
    def __init__(self) -> None:
        super().__init__(499, "client disconnected", code="client_disconnected")


async def unless_disconnected(work: Awaitable[Any], request: Request | None) -> Any:
    """`work`'s result; ClientGone (and `work` cancelled) if the client hangs up first.

    A non-streamed generation sends nothing until it ends, so only the connection closing
    says that nobody waits for it any more (ASGI's http.disconnect, once the body is read).
    """
    task = asyncio.ensure_future(work)
    if request is None:
        return await task

    watch = asyncio.ensure_future(hang_up(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()

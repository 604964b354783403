"""X-Request-ID in and out, and the request id in every log line written while serving it.

A pure ASGI middleware (no task or body wrapping: it runs on every request). A caller's id is kept
when it is short and printable, so ids from solar-control's logs can be searched for here;
otherwise a fresh one is made. The id is set in `request_id_var` for the whole request, so
log records from routes and services (and tasks they spawn) carry it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from solar_host.platform.logging_setup import request_id_var

HEADER = b"x-request-id"
_VALID = re.compile(rb"^[A-Za-z0-9._:/+=@-]{1,128}$")

log = logging.getLogger("solar_host.access")


def new_request_id() -> str:
    return os.urandom(8).hex()  # 16 hex digits, as uuid4().hex[:16] gave, at a third of its cost


def incoming_id(scope: Scope) -> str:
    return id_in_headers(scope.get("headers") or ())


def id_in_headers(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The caller's X-Request-ID (the first) when usable, else a new id."""
    for name, value in headers:
        if name == HEADER:
            if _VALID.match(value):
                return value.decode("ascii")
            break
    return new_request_id()


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        rid = incoming_id(scope)
        token = request_id_var.set(rid)
        header = (HEADER, rid.encode("ascii"))
        status = 0
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] in ("http.response.start", "websocket.accept"):
                status = message.get("status", 101)
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            # Access lines only at DEBUG: GET /instances is polled hard by solar-control.
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "%s %s %s %.1f ms",
                    scope.get("method", "WS"),
                    scope.get("path", ""),
                    status,
                    (time.perf_counter() - started) * 1000,
                )
            request_id_var.reset(token)

"""A direct answer for the two routes solar-control polls hardest: GET /instances and GET /health.

Control polls `GET /instances` every 1-2 s for each host it cannot see over the socket, and
`GET /health` on every host refresh. Through FastAPI's router (path matching over every route,
dependency solving, response objects) one such request costs about 200 us of CPU; answered here
from the same cached bytes the routes return, it costs about 10 us. The FastAPI routes stay (they
document the API and serve HEAD and anything this does not match); this sits inside the API key
middleware, so auth is unchanged.

Under `solar-host serve` the connection answers them before any of that (InstantAnswers): no
ASGI scope, task or middleware, about half the CPU again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from solar_host import __version__
from solar_host.api.asgi_json import send_json
from solar_host.api.auth import PUBLIC_PATHS, key_in_headers, keys_match
from solar_host.api.request_id import id_in_headers
from solar_host.api.request_id import log as access_log


class HotPathMiddleware:
    def __init__(self, app: ASGIApp, routes: dict[str, Callable[[], bytes]]):
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and not scope.get("query_string"):
            body_of = self.routes.get(scope["path"])
            if body_of is not None:
                await send_json(send, 200, body_of())
                return
        await self.app(scope, receive, send)


def health_body(host: Any) -> bytes:
    """The /health answer (the route returns the same bytes)."""
    return _health_json(host.models_disk())


def _health_json(disk: dict[str, float] | None) -> bytes:
    return json.dumps(
        {"status": "healthy", "service": "solar-host", "version": __version__, "disk": disk},
        separators=(",", ":"),
    ).encode()


class HealthAnswer:
    """/health's bytes, made again only when the disk reading changed: it is the same object
    until its next refresh (at most every few seconds), however often /health is asked."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self._disk: Any = None
        self._body = b""

    def __call__(self) -> bytes:
        disk = self.host.models_disk()
        if disk is None or disk is not self._disk:
            self._disk, self._body = disk, _health_json(disk)
        return self._body


def hot_routes(host: Any) -> dict[str, Callable[[], bytes]]:
    return {
        "/instances": lambda: host.instances.list_json(),
        "/health": HealthAnswer(host),
    }


class InstantAnswers:
    """The hot routes as the connection itself answers them (serve(): uvicorn_adapter's
    ConnectionGuard._answer_at_once), with what the edge layers would have done to the answer:
    the caller's request id or a new one, the key checked as APIKeyMiddleware checks it. It
    answers only what those layers would pass untouched: a request without a body, with the
    right key where one is needed, and no access line to log (LOG_LEVEL debug); anything else
    returns None and goes through the edge layers as before (a 401 and its refusal line, a
    body limit, a router-less 503)."""

    def __init__(
        self,
        routes: dict[str, Callable[[], bytes]],
        get_key: Callable[[], str],
        unavailable: Callable[[], bool],
    ) -> None:
        self.routes = {
            path.encode(): (body_of, path in PUBLIC_PATHS) for path, body_of in routes.items()
        }
        self.get_key = get_key
        self.unavailable = unavailable

    def __call__(
        self, target: bytes, headers: Iterable[tuple[bytes, bytes]]
    ) -> tuple[bytes, bytes] | None:
        route = self.routes.get(target)
        if route is None or self.unavailable() or access_log.isEnabledFor(logging.DEBUG):
            return None
        body_of, public = route
        for name, _ in headers:
            if name == b"content-length" or name == b"transfer-encoding":
                return None  # a body: the body limit's
        if not public and not keys_match(key_in_headers(headers)[0], self.get_key()):
            return None
        body = body_of()
        return _HEAD % (len(body), id_in_headers(headers).encode("ascii")), body


# The headers send_json and RequestIdMiddleware give a 200, in their order.
_HEAD = b"content-type: application/json\r\ncontent-length: %d\r\nx-request-id: %s\r\n\r\n"

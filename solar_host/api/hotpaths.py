"""A direct answer for the two routes solar-control polls hardest: GET /instances and GET /health.

Control polls `GET /instances` every 1-2 s for each host it cannot see over the socket, and
`GET /health` on every host refresh. Through FastAPI's router (path matching over every route,
dependency solving, response objects) one such request costs about 200 us of CPU; answered here
from the same cached bytes the routes return, it costs about 10 us. The FastAPI routes stay (they
document the API and serve HEAD and anything this does not match); this sits inside the API key
middleware, so auth is unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from solar_host import __version__
from solar_host.api.asgi_json import send_json


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

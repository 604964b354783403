"""The edge of the REST API: the pure-ASGI layers every HTTP request and WebSocket passes before
the router, in one list so that `create_app` and the staged server put the same ones in front.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from solar_host.api.auth import APIKeyMiddleware
from solar_host.api.hotpaths import HotPathMiddleware, hot_routes
from solar_host.api.limits import BodyLimitMiddleware
from solar_host.api.request_id import RequestIdMiddleware

if TYPE_CHECKING:
    from collections.abc import Callable

    from starlette.types import ASGIApp

    from solar_host.host import Host


def public_paths(host: Host) -> Callable[[str], bool]:
    """Paths served without the key besides the always-public ones (auth.py). The peer routes
    check PEER_TOKEN themselves, and take no API key (api/peers.py)."""

    def is_public(path: str) -> bool:
        if path.startswith("/peer/"):
            return True
        return path == "/metrics" and host.settings.metrics_public

    return is_public


def edge_layers(host: Host) -> list[tuple[type, dict[str, Any]]]:
    """(middleware class, options), innermost first."""
    return [
        # Inside auth: GET /instances needs the key like any route.
        (HotPathMiddleware, {"routes": hot_routes(host)}),
        (APIKeyMiddleware, {"get_key": host.key, "is_public": public_paths(host)}),
        (
            BodyLimitMiddleware,
            {
                "max_bytes": host.settings.max_request_body_bytes,
                "timeout_s": host.settings.http_body_timeout_s,
            },
        ),
        # Outermost, so that refused (401/413) requests carry an id too.
        (RequestIdMiddleware, {}),
    ]


def wrap_in_edge(app: ASGIApp, host: Host) -> ASGIApp:
    for layer, options in edge_layers(host):
        app = layer(app, **options)
    return app

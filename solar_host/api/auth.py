"""API key authentication for every HTTP and WebSocket route but the public ones.

The key is taken as `X-API-Key: <key>` or `Authorization: Bearer <key>` (what OpenAI clients,
Prometheus and most tools send), and on WebSocket routes also as `?api_key=` (browsers cannot
set headers there). Each refusal is logged, rate-limited (refusals.py).

A pure ASGI middleware (no per-request task or body wrapping), because it runs on every request
and `GET /instances` is polled hard by solar-control.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from solar_host.api.asgi_json import detail, send_json
from solar_host.api.refusals import RefusalLog

PUBLIC_PATHS = frozenset(
    {"/", "/health", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"}
)
PUBLIC_PREFIXES = ("/docs/static/",)
NO_KEY = "no API key (X-API-Key or Authorization: Bearer)"
NOT_BEARER = "Authorization is not 'Bearer <key>'"
WRONG_KEY = "wrong API key"


def keys_match(given: str | None, expected: str) -> bool:
    """Constant-time comparison (the time does not depend on where the keys differ)."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def key_in_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str | None, str]:
    """(the key a request gives in its headers, or None; why none was taken). The first
    X-API-Key wins; else the last Authorization, if it says Bearer."""
    given = None
    bearer = None
    for name, value in headers:
        if name == b"x-api-key":
            given = value.decode("latin-1")
            break
        if name == b"authorization":
            bearer = value
    why = NO_KEY
    if given is None and bearer is not None:
        scheme, _, token = bearer.decode("latin-1").strip().partition(" ")
        if scheme.lower() == "bearer":
            given = token.strip()
        else:
            why = NOT_BEARER
    return given, why


class APIKeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        get_key: Callable[[], str],
        is_public: Callable[[str], bool] | None = None,
    ):
        self.app = app
        self.get_key = get_key
        self.extra_public = is_public
        self.refusals = RefusalLog()

    def public(self, path: str) -> bool:
        if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return True
        return bool(self.extra_public and self.extra_public(path))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if kind == "http" and (scope.get("method") == "OPTIONS" or self.public(path)):
            await self.app(scope, receive, send)
            return
        given, why = key_in_headers(scope.get("headers") or ())
        if given is None and kind == "websocket":
            qs = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
            if qs.get("api_key"):
                given = qs["api_key"][0]
        if keys_match(given, self.get_key()):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        route = f"{scope.get('method', 'GET')} {path}" if kind == "http" else f"WebSocket {path}"
        self.refusals.refuse(client[0] if client else "unknown", route, WRONG_KEY if given else why)
        if kind == "websocket":
            # Accept, then close with 1008 (policy violation): a refused handshake would only
            # show the client an HTTP 403 without a reason it can act on.
            message = await receive()
            if message["type"] == "websocket.connect":
                await send({"type": "websocket.accept"})
                await send(
                    {
                        "type": "websocket.close",
                        "code": 1008,
                        "reason": "Invalid or missing API key",
                    }
                )
            return
        await send_json(
            send,
            401,
            detail("Invalid or missing API key"),
            [(b"www-authenticate", b"APIKey"), (b"access-control-allow-origin", b"*")],
        )

"""The REST API on top of the host core: `create_api(host)` mounts the routers,
`create_app(settings)` is the whole ASGI app with its lifespan (tests, `solar_host.main`).

`solar-host serve` does not use `create_app`: it serves the core first and builds the API
beside it (see `serving.py`). Both put the same edge layers (api/edge.py) in front.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from solar_host import __version__
from solar_host.host import Host, build_host
from solar_host.settings import Settings

if TYPE_CHECKING:
    from collections.abc import Callable


def create_api(host: Host, *, lifespan: Callable[[FastAPI], Any] | None = None) -> FastAPI:
    """The routers of one host, without the edge layers. Builds in about 0.2 s (route models)."""
    app = FastAPI(
        title="solar-host",
        version=__version__,
        description="Host agent: launches and supervises model inference servers.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.host = host
    from solar_host.api import (
        docs,
        estimates,
        instances,
        jobs,
        metrics,
        models,
        peers,
        resources,
        streams,
        system,
    )

    for module in (
        system,
        estimates,
        instances,
        streams,
        docs,
        jobs,
        resources,
        models,
        peers,
        metrics,
    ):
        app.include_router(module.router)
    install_openapi_security(app)
    install_validation_handlers(app)
    return app


def install_validation_handlers(app: FastAPI) -> None:
    """FastAPI's own handlers, made safe for any input.

    HTTP: the 422 echoes each bad `input`; a lone surrogate in it (JSON "\\ud800") cannot be
    encoded, and the answer became a 500. WebSocket: a bad query parameter (`since_seq=abc`)
    closed the handshake, which a client only sees as a bare HTTP 403, like a refused key;
    now the socket is accepted and closed with 1008 and a reason naming the parameter.
    """
    from fastapi.encoders import jsonable_encoder
    from fastapi.exceptions import RequestValidationError, WebSocketRequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.requests import Request
    from starlette.websockets import WebSocket

    from solar_host.platform.textsafe import scrub

    async def http_invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return JSONResponse(
            status_code=422, content={"detail": scrub(jsonable_encoder(exc.errors()))}
        )

    async def ws_invalid(websocket: WebSocket, exc: Exception) -> None:
        assert isinstance(exc, WebSocketRequestValidationError)
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("query", "path"))
            parts.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg")))
        reason = scrub("; ".join(parts) or "invalid request")
        # A close reason is at most 123 bytes.
        reason = reason.encode()[:123].decode("utf-8", "ignore")
        await websocket.accept()
        await websocket.close(code=1008, reason=reason)

    app.add_exception_handler(RequestValidationError, http_invalid)
    app.add_exception_handler(WebSocketRequestValidationError, ws_invalid)


def create_app(settings: Settings, *, host: Host | None = None, **overrides: Any) -> FastAPI:
    """The ASGI app of one host, built at once. Touches no file until the lifespan starts."""
    host = host or build_host(settings, **overrides)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await host.start()
        try:
            yield
        finally:
            await host.stop()

    app = create_api(host, lifespan=lifespan)
    from solar_host.api.edge import edge_layers

    # add_middleware puts each layer outside the ones before it: innermost first.
    for layer, options in edge_layers(host):
        app.add_middleware(layer, **options)
    return app


PUBLIC_OPENAPI_PATHS = {"/", "/health"}


def install_openapi_security(app: FastAPI) -> None:
    """Declare the X-API-Key scheme so Swagger's Authorize button works."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["APIKeyHeader"] = {
            "type": "apiKey",
            "in": "header",
            "name": "X-API-Key",
        }
        for path, ops in schema.get("paths", {}).items():
            if path in PUBLIC_OPENAPI_PATHS:
                continue
            for op in ops.values():
                if isinstance(op, dict):
                    op["security"] = [{"APIKeyHeader": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

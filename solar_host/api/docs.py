"""Swagger UI and ReDoc served from the installed `swagger-ui-bundle` package (works offline)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse

router = APIRouter(include_in_schema=False)

_ALLOWED = {
    "swagger-ui-bundle.js",
    "swagger-ui.css",
    "favicon-32x32.png",
    "swagger-ui-standalone-preset.js",
}


def _assets_dir() -> Path:
    import swagger_ui_bundle

    return Path(swagger_ui_bundle.swagger_ui_path)


@router.get("/docs")
async def swagger_ui() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="solar-host API",
        swagger_js_url="/docs/static/swagger-ui-bundle.js",
        swagger_css_url="/docs/static/swagger-ui.css",
        swagger_favicon_url="/docs/static/favicon-32x32.png",
        oauth2_redirect_url="/docs/oauth2-redirect",
        swagger_ui_parameters={"persistAuthorization": True},
    )


@router.get("/docs/oauth2-redirect")
async def swagger_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/docs/static/{name}")
async def swagger_asset(name: str) -> FileResponse:
    if name not in _ALLOWED:
        raise HTTPException(404, "Not found")
    return FileResponse(_assets_dir() / name)


@router.get("/redoc")
async def redoc() -> HTMLResponse:
    # ReDoc's bundle is not shipped offline; point readers at the Swagger UI instead.
    return HTMLResponse(
        "<!doctype html><title>solar-host API</title>"
        "<p>The interactive API documentation is at <a href='/docs'>/docs</a>; "
        "the schema at <a href='/openapi.json'>/openapi.json</a>.</p>"
    )

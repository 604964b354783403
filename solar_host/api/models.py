"""Model store routes: GET /models, POST /models/pull, POST /models/{slug}/verify,
DELETE /models/{slug}.

Pull errors use the contract's flat body {error, detail, source_uri, status_code}; a malformed
pull request is a 422 in the same shape, naming the field.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from solar_host.model_store.pull import PullError, PullRequest
from solar_host.model_store.service import StoreError
from solar_host.platform.textsafe import refusal, scrub, unstorable

router = APIRouter(tags=["models"])


class PullResponse(BaseModel):
    path: str
    cached: bool
    source_uri: str


class DeleteBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    filters: list[str] | None = None


def _store(request: Request) -> Any:
    return request.app.state.host.models


def _validation_detail(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "body"
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if e["loc"] else msg)
    return "; ".join(parts)


@router.get("/models")
async def list_models(request: Request) -> list[dict[str, Any]]:
    import asyncio

    return await asyncio.to_thread(_store(request).list_models)


@router.post(
    "/models/pull",
    response_model=PullResponse,
    responses={
        400: {"description": "source and source_uri disagree"},
        401: {"description": "registry or hub refused the credentials"},
        404: {"description": "unknown repository, artifact, subpath or GGUF"},
        422: {"description": "invalid body, or model_id/harbor_ref name another artifact"},
        502: {"description": "source unreachable or integrity check failed"},
        507: {"description": "not enough disk space"},
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": PullRequest.model_json_schema()}},
        }
    },
)
async def pull_model(request: Request) -> Any:
    """Download a model into MODELS_DIR; blocks until it is on disk."""
    try:
        raw = await request.json()
    except (ValueError, RecursionError):  # deep nesting overflows the parser
        raw = None
    uri = raw.get("source_uri") if isinstance(raw, dict) else None
    uri = scrub(uri) if isinstance(uri, str) else ""
    if not isinstance(raw, dict):
        err = PullError(422, "invalid_request", "request body must be a JSON object")
        return JSONResponse(err.body(uri), status_code=422)
    bad = unstorable(raw)
    if bad is not None:
        # A lone surrogate (JSON "\\ud800") cannot be echoed, logged or written to a manifest.
        err = PullError(422, "invalid_request", refusal(bad))
        return JSONResponse(err.body(uri), status_code=422)
    try:
        req = PullRequest.model_validate(raw)
    except ValidationError as verr:
        err = PullError(422, "invalid_request", _validation_detail(verr))
        return JSONResponse(err.body(uri), status_code=422)
    try:
        return await _store(request).pull(req)
    except PullError as perr:
        return JSONResponse(perr.body(req.source_uri), status_code=perr.status_code)


@router.post(
    "/models/{slug}/verify",
    responses={
        400: {"description": "not a model name"},
        404: {"description": "no model of that name was pulled"},
        409: {"description": "the model is being pulled"},
    },
)
async def verify_model(slug: str, request: Request) -> Any:
    """Read a pulled model's files again and check each against the digest its source
    published (recorded at the pull: no network). 200 either way; `ok` says whether every
    file matched, and each file's `result` is ok, mismatch, missing, unrecorded or extra. A
    mismatched or missing file is noted, and the next pull of the model fetches it again."""
    try:
        return await _store(request).verify(slug)
    except StoreError as err:
        return JSONResponse({"detail": err.detail}, status_code=err.status_code)


@router.delete("/models/{slug}")
async def delete_model(slug: str, request: Request) -> Any:
    """Delete a model (or, with {"filters": [globs]}, only the matching files)."""
    body = await request.body()
    filters = None
    if body.strip():
        try:
            filters = DeleteBody.model_validate_json(body).filters
        except ValidationError as verr:
            return JSONResponse({"detail": _validation_detail(verr)}, status_code=422)
    try:
        return await _store(request).delete(slug, filters)
    except StoreError as err:
        return JSONResponse({"detail": err.detail}, status_code=err.status_code)

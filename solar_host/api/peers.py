"""Routes other solar-hosts pull model files from (MODEL_PEERS, PEER_TOKEN; ruling 26).

Read-only and GET only: `GET /peer/v1/models?source_uri=` tells what this host holds of a
source (files, sizes, the digests its pull checked), `GET /peer/v1/files/{digest}` serves one
checked file, with Range. They take `Authorization: Bearer <PEER_TOKEN>` and nothing else: the
API key is not accepted here (a peer must not be able to drive this host, nor this route
leak what only the API key should reach), and with PEER_TOKEN unset, or equal to API_KEY,
they serve nothing (404). Files are found by digest among the recorded models, inside
MODELS_DIR, while they are the size their pull recorded (model_store/peers.py).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

from solar_host.api.auth import keys_match
from solar_host.model_store import peers

router = APIRouter(tags=["peers"])
DIGEST_RE = re.compile(r"^(sha256:[0-9a-f]{64}|gitsha1:[0-9a-f]{40})$")


def _refusal(request: Request) -> JSONResponse | None:
    host = request.app.state.host
    token = host.settings.peer_token
    if not token or keys_match(token, host.key()):
        return JSONResponse(
            {"detail": "this host serves no peers (PEER_TOKEN is not set)"}, status_code=404
        )
    scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not keys_match(given.strip(), token):
        return JSONResponse(
            {"detail": "peer routes take Authorization: Bearer <PEER_TOKEN>"},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return None


@router.get(f"{peers.PREFIX}/models")
async def peer_snapshot(source_uri: str, request: Request) -> Any:
    """What this host holds of `source_uri`: its checked files with their digests."""
    refused = _refusal(request)
    if refused is not None:
        return refused
    store = request.app.state.host.models
    record = await asyncio.to_thread(peers.snapshot, store.manifest, source_uri)
    if record is None:
        return JSONResponse({"detail": f"{source_uri} is not on this host"}, status_code=404)
    return record


@router.get(f"{peers.PREFIX}/files/{{digest}}")
async def peer_file(digest: str, request: Request) -> Any:
    """One checked model file, by the digest its source published or its sha256 (Range)."""
    refused = _refusal(request)
    if refused is not None:
        return refused
    if not DIGEST_RE.match(digest):
        return JSONResponse(
            {"detail": "digest: expected sha256:<64 hex> or gitsha1:<40 hex>"}, status_code=422
        )
    store = request.app.state.host.models
    path = await asyncio.to_thread(peers.find_file, store.manifest, digest)
    if path is None:
        return JSONResponse({"detail": f"no checked file {digest} on this host"}, status_code=404)
    return FileResponse(path, media_type="application/octet-stream")

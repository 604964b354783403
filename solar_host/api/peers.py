"""Routes other solar-hosts pull model files from (MODEL_PEERS, PEER_TOKEN; ruling 26).

Read-only and GET only: `GET /peer/v1/models?source_uri=` tells what this host holds of a
source (files, sizes, the digests its pull checked), `GET /peer/v1/files/{digest}` serves one
checked file, with Range; `GET /peer/v1/pieces/{digest}` tells which pieces of a file this
host offers (of a pull fetching it now, or of the checked file) and `GET
/peer/v1/pieces/{digest}/{index}` serves one (model_store/pieces.py, swarm.py). They take
`Authorization: Bearer <PEER_TOKEN>` and nothing else: the
API key is not accepted here (a peer must not be able to drive this host, nor this route
leak what only the API key should reach), and with PEER_TOKEN unset, or equal to API_KEY,
they serve nothing (404). Files are found by digest among the recorded models, inside
MODELS_DIR, while they are the size their pull recorded (model_store/peers.py). Everything sent
stays within PEER_MAX_UPLOAD_BYTES_PER_S.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from solar_host.api.auth import keys_match
from solar_host.model_store import peers
from solar_host.model_store.pacing import RateCap

router = APIRouter(tags=["peers"])
DIGEST_RE = re.compile(r"^(sha256:[0-9a-f]{64}|gitsha1:[0-9a-f]{40})$")
CHUNK = 256 << 10  # a paced body is read and sent this much at a time (1 MiB when not paced)


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
    if store.upload_cap.bytes_per_s <= 0:
        return FileResponse(path, media_type="application/octet-stream")
    size = (await asyncio.to_thread(path.stat)).st_size
    start = _range_start(request.headers.get("range"), size)
    if start is None:
        return FileResponse(path, media_type="application/octet-stream")  # 416s and all
    headers = {"Accept-Ranges": "bytes", "Content-Length": str(size - start)}
    status = 200
    if start:
        status = 206
        headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
    return await _paced(request, path, start, size - start, status, headers)


@router.get(f"{peers.PREFIX}/pieces/{{digest}}")
async def peer_piece_map(digest: str, request: Request) -> Any:
    """Which pieces of `digest` this host offers (a pull fetching it, or the checked file)."""
    refused = _refusal(request) or _bad_digest(digest)
    if refused is not None:
        return refused
    store = request.app.state.host.models
    answer = await asyncio.to_thread(peers.piece_answer, store.board, store.manifest, digest)
    if answer is None:
        return JSONResponse({"detail": f"{digest} is not on this host"}, status_code=404)
    return answer


@router.get(f"{peers.PREFIX}/pieces/{{digest}}/{{index}}")
async def peer_piece(digest: str, index: int, request: Request) -> Any:
    """One piece of `digest` this host offers (PIECE_BYTES, the last one shorter)."""
    refused = _refusal(request) or _bad_digest(digest)
    if refused is not None:
        return refused
    store = request.app.state.host.models
    at = await asyncio.to_thread(peers.piece_location, store.board, store.manifest, digest, index)
    if at is None:
        return JSONResponse(
            {"detail": f"piece {index} of {digest} is not offered here"}, status_code=404
        )
    path, offset, length = at
    headers = {"Content-Length": str(length)}
    return await _paced(request, path, offset, length, 200, headers)


def _bad_digest(digest: str) -> JSONResponse | None:
    if DIGEST_RE.match(digest):
        return None
    return JSONResponse(
        {"detail": "digest: expected sha256:<64 hex> or gitsha1:<40 hex>"}, status_code=422
    )


def _range_start(header: str | None, size: int) -> int | None:
    """The first byte a `Range: bytes=N-` asks for (0 with no Range); None for any other
    Range (FileResponse answers those, uncapped: the pulls of solar-host never send them)."""
    if not header:
        return 0
    unit, _, spec = header.partition("=")
    first, dash, last = spec.strip().partition("-")
    if unit.strip() != "bytes" or not dash or last or not first.isdigit():
        return None
    start = int(first)
    return start if start < size else None


async def _paced(
    request: Request, path: Path, offset: int, length: int, status: int, headers: dict[str, str]
) -> Any:
    """`length` bytes of `path` from `offset`, sent within PEER_MAX_UPLOAD_BYTES_PER_S (one cap
    for everything this host sends its peers)."""
    cap: RateCap = request.app.state.host.models.upload_cap
    try:
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)
    except OSError:
        return JSONResponse({"detail": "the file is gone"}, status_code=404)

    async def body() -> AsyncIterator[bytes]:
        try:
            done = 0
            while done < length:
                chunk = CHUNK if cap.bytes_per_s > 0 else 4 * CHUNK
                data = await asyncio.to_thread(
                    os.pread, fd, min(chunk, length - done), offset + done
                )
                if not data:
                    return  # the file shrank: the peer sees a short body and fails the piece
                wait = cap.reserve(len(data))
                if wait > 0:
                    await asyncio.sleep(wait)
                yield data
                done += len(data)
        finally:
            os.close(fd)

    return StreamingResponse(
        body(), status_code=status, headers=headers, media_type="application/octet-stream"
    )

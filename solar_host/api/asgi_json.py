"""A JSON answer sent straight over ASGI, for the layers in front of the router (auth, body
limit, hot paths, the staged server) that answer without building a Response object."""

from __future__ import annotations

import json
from collections.abc import Iterable

from starlette.types import Send

Header = tuple[bytes, bytes]


def detail(message: str) -> bytes:
    """FastAPI's error body shape: {"detail": message}."""
    return json.dumps({"detail": message}).encode()


async def send_json(send: Send, status: int, body: bytes, headers: Iterable[Header] = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})

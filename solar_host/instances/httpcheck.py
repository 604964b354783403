"""A minimal HTTP GET for health checks and metrics scrapes of local backends.

Deliberately tiny: one connection per call, HTTP/1.0, no pooling, so a hung backend can never
wedge a shared client and the cost per probe is a few hundred microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


def probe_address(bind_host: str) -> str:
    """Where the host reaches a backend that binds `bind_host`."""
    if bind_host in ("0.0.0.0", "", "::", "[::]"):
        return "127.0.0.1"
    return bind_host


async def http_get(
    host: str,
    port: int,
    path: str,
    *,
    bearer: str | None = None,
    timeout: float = 1.0,
    max_bytes: int = 4 * 1024 * 1024,
) -> tuple[int, bytes]:
    """(status, body) of GET http://host:port/path; raises OSError/TimeoutError on failure."""
    auth = f"Authorization: Bearer {bearer}\r\n" if bearer else ""
    head = f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\n{auth}Connection: close\r\n\r\n"
    return await _exchange(host, port, head.encode("latin-1"), timeout, max_bytes)


async def http_post_json(
    host: str,
    port: int,
    path: str,
    payload: bytes,
    *,
    bearer: str | None = None,
    timeout: float = 1.0,
    max_bytes: int = 4 * 1024 * 1024,
) -> tuple[int, bytes]:
    """(status, body) of POST http://host:port/path with the JSON `payload` (the known-answer
    probes); raises OSError/TimeoutError on failure."""
    auth = f"Authorization: Bearer {bearer}\r\n" if bearer else ""
    head = (
        f"POST {path} HTTP/1.0\r\nHost: {host}:{port}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return await _exchange(host, port, head.encode("latin-1") + payload, timeout, max_bytes)


async def _exchange(
    host: str, port: int, request: bytes, timeout: float, max_bytes: int
) -> tuple[int, bytes]:
    """One request on its own connection, the answer read to its end."""

    async def run() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            await writer.drain()
            # A bytearray: `bytes += chunk` copied the whole body at every 64 KiB read (66 ms
            # of the loop for a 4 MiB metrics page, every 2 s per instance).
            data = bytearray(await reader.read(max_bytes))
            while len(data) < max_bytes:
                more = await reader.read(max_bytes - len(data))
                if not more:
                    break
                data += more
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        head, _, body = data.partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0].split()
        if len(status_line) < 2 or not status_line[1].isdigit():
            raise OSError("malformed HTTP response")
        return int(status_line[1]), bytes(body)

    async with asyncio.timeout(timeout):
        return await run()


async def answer_status(
    host: str, port: int, path: str, bearer: str | None, timeout: float = 1.0
) -> int | None:
    """The HTTP status GET `path` is answered with; None when nothing answers in time."""
    try:
        status, _ = await http_get(
            host, port, path, bearer=bearer, timeout=timeout, max_bytes=65536
        )
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return None
    return status


async def is_healthy(
    host: str, port: int, path: str, bearer: str | None, timeout: float = 1.0
) -> bool:
    return await answer_status(host, port, path, bearer, timeout) == 200


class ProbePacer:
    """Paces the readiness probes of every backend that is starting, host-wide.

    One backend loading is probed every FIRST_S at first, then less often the longer it loads
    (small models are ready in a second; a big one takes minutes). Many loading at once share
    a budget of MAX_PER_S probes a second: 200 backends started together are each probed about
    once a second instead of 40 times, and the event loop stays free for the API. A probe costs
    the host a connection and the backend a request, while it is busy loading.
    """

    FIRST_S = 0.025
    LONGEST_S = 0.25
    MAX_PER_S = 200.0

    def __init__(self) -> None:
        self.active = 0

    @contextlib.asynccontextmanager
    async def probing(self) -> AsyncIterator[None]:
        """Count one backend as probed for the duration."""
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    def interval(self, elapsed: float) -> float:
        """Seconds until the next probe of a backend loading for `elapsed` seconds."""
        own = min(self.LONGEST_S, self.FIRST_S * (1.0 + elapsed * 2))
        return max(own, self.active / self.MAX_PER_S)

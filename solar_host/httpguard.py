"""uvicorn's httptools protocol with the bounds uvicorn leaves out, for the host's API and
the HF server alike: a connection whose request headers do not arrive within a time limit, or
whose headers pass a size limit, is closed. uvicorn never times out a connection that has not
finished its headers (anyone who can connect held a descriptor for ever), and httptools keeps
headers of any size in memory (400 headers of 1 MiB took 400 MiB)."""

from __future__ import annotations

import asyncio
from typing import Any

# Far above what any client sends (nginx's default buffers hold 32 KiB).
MAX_HEADER_BYTES = 64 * 1024


def guarded_protocol(timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES) -> Any:
    """The protocol class for uvicorn.Config(http=...); "auto", without the bounds, where
    httptools is missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class GuardedProtocol(HttpToolsProtocol):  # type: ignore[misc]
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def _arm(self) -> None:
            self._header_bytes = 0
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            self._arm()
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes and not self.transport.is_closing():
                self.transport.close()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def handle_websocket_upgrade(self) -> None:
            self._disarm()
            super().handle_websocket_upgrade()

    return GuardedProtocol

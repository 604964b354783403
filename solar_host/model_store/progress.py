"""Progress of one pull as the contract's pull_progress payloads.

One `PullReporter` per caller of a pull: it stamps that caller's `source_uri` (with subpath) on
every event, throttles `downloading` events, and lets exactly one terminal event (`completed` or
`failed`) through, whatever happens. Download workers run in threads and only bump a
`ByteCounter`; events are emitted from the event loop (the bus must only be used there).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ProgressCallback = Callable[[dict[str, Any]], None]

PHASES = ("resolving", "downloading", "verifying", "finalizing", "completed", "failed")
TERMINAL = ("completed", "failed")


class ByteCounter:
    """Bytes written so far by download threads (read by the monitor on the event loop)."""

    def __init__(self, initial: int = 0) -> None:
        self._lock = threading.Lock()
        self.done = initial

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n

    def set(self, n: int) -> None:
        with self._lock:
            self.done = n


class PullReporter:
    def __init__(
        self,
        source_uri: str,
        emit: ProgressCallback,
        *,
        interval_s: float,
        bytes_total: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source_uri = source_uri
        self.bytes_total = bytes_total
        self.interval_s = interval_s
        self._emit = emit
        self._clock = clock
        self._last_download_at: float | None = None
        self.terminal_sent = False
        self.bytes_done: int | None = None
        self.speed_bps: float | None = None
        self.waiting: str | None = None  # why no bytes come now (a 429's Retry-After), if so
        self.origin: str | None = None  # where the bytes come from now: source, or a peer
        self.skipped: dict[str, str] = {}  # peers no longer asked, and why
        self.bytes_from: dict[str, int] = {}  # bytes fetched per origin (source, peer <url>)
        self._origins_told: set[str] = set()

    def _send(self, phase: str, error: str | None = None) -> None:
        if self.terminal_sent:
            return
        if phase in TERMINAL:
            self.terminal_sent = True
        payload: dict[str, Any] = {
            "source_uri": self.source_uri,
            "phase": phase,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "speed_bps": self.speed_bps,
        }
        if self.waiting is not None and phase not in TERMINAL:
            payload["waiting"] = self.waiting
        if self.origin is not None and phase == "downloading":
            payload["from"] = self.origin
        if self.bytes_from and phase == "downloading":
            payload["bytes_from"] = dict(self.bytes_from)
        if self.skipped:
            payload["skipped_peers"] = dict(self.skipped)
        if error is not None:
            payload["error"] = error
        try:
            self._emit(payload)
        except Exception:  # a broken listener never breaks a pull
            log.exception("pull progress listener failed")

    def phase(self, phase: str) -> None:
        self._send(phase)

    def resolving(self, waiting: str | None) -> None:
        """Say again that the pull is resolving, and whether it waits (a 429 of the source)."""
        if waiting != self.waiting:
            self.waiting = waiting
            self._send("resolving")

    def downloading(
        self,
        bytes_done: int,
        speed_bps: float | None,
        *,
        force: bool = False,
        waiting: str | None = None,
        origin: str | None = None,
        skipped: dict[str, str] | None = None,
        bytes_from: dict[str, int] | None = None,
    ) -> None:
        """Report download progress at most every `interval_s` (unless forced, or the pull
        starts or stops waiting: that is said at once)."""
        now = self._clock()
        self.bytes_done = bytes_done
        self.bytes_from = dict(bytes_from or {})  # goes with the next event, never forces one
        self.speed_bps = speed_bps
        skipped = skipped or {}
        # A wait starting or ending, a peer skipped, or bytes coming from an origin not told
        # before is said at once (files are fetched a few at a time, and pieces of one file from
        # several origins: a flip back to an origin already told waits for the next event).
        new_origin = origin is not None and origin not in self._origins_told
        force = force or new_origin or (waiting, skipped) != (self.waiting, self.skipped)
        self.waiting, self.origin, self.skipped = waiting, origin, dict(skipped)
        if origin is not None:
            self._origins_told.add(origin)
        if (
            not force
            and self._last_download_at is not None
            and now - self._last_download_at < self.interval_s
        ):
            return
        self._last_download_at = now
        self._send("downloading")

    def completed(self) -> None:
        self._send("completed")

    def failed(self, error: str) -> None:
        self._send("failed", error=error)

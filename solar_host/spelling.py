"""The nearest known name to a misspelt one (config fields, settings)."""

from __future__ import annotations

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
        prev2, prev = prev, cur
    return min(prev[-1], limit)


def nearest(name: str, candidates: Iterable[str], max_edits: int = 2) -> str | None:
    """The candidate at most `max_edits` edits from `name` (case-insensitive), closest first."""
    low = name.lower()
    best: tuple[int, str] | None = None
    for c in candidates:
        d = edit_distance(low, c.lower(), max_edits + 1)
        if d <= max_edits and (best is None or (d, c) < best):
            best = (d, c)
    return best[1] if best else None

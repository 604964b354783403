"""Text a request may carry that no file, log or JSON answer can hold.

JSON's `\\ud800` escape decodes (Python's json module) to a lone UTF-16 surrogate: a str that
cannot be encoded as UTF-8. Kept, it fails whatever writes it later (config.json, a response
body), far from the request that brought it. `unencodable()` finds one so the request can be
refused naming the field; `scrub()` makes a value safe to echo in an error body.
"""

from __future__ import annotations

from typing import Any


def _bad(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def unencodable(value: Any, loc: tuple[Any, ...] = (), depth: int = 0) -> tuple[Any, ...] | None:
    """The location of the first string (key or value) in `value` that is not valid Unicode."""
    if isinstance(value, str):
        return loc if _bad(value) else None
    if depth > 64:
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and _bad(k):
                return (*loc, k.encode("utf-8", "backslashreplace").decode())
            found = unencodable(v, (*loc, k), depth + 1)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = unencodable(v, (*loc, i), depth + 1)
            if found is not None:
                return found
    return None


def scrub(value: Any, depth: int = 0) -> Any:
    """`value` with every lone surrogate replaced by its `\\udXXX` escape (safe to encode)."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode() if _bad(value) else value
    if depth > 64:
        return value
    if isinstance(value, dict):
        return {scrub(k, depth + 1): scrub(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v, depth + 1) for v in value]
    return value


NOT_UNICODE = "must be valid Unicode text (a lone UTF-16 surrogate is not)"


def refusal(loc: tuple[Any, ...], prefix: str = "") -> str:
    """The error naming where unencodable text was found: `body.config.x: must be ...`."""
    where = ".".join(str(x) for x in (prefix, *loc) if x != "")
    return f"{where or 'body'}: {NOT_UNICODE}"

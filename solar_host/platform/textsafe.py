"""Text a request may carry that no file, log or JSON answer can hold.

JSON's `\\ud800` escape decodes (Python's json module) to a lone UTF-16 surrogate: a str that
cannot be encoded as UTF-8. Kept, it fails whatever writes it later (config.json, a response
body), far from the request that brought it. `unstorable()` finds one (or JSON nested too deep
to store) so the request can be refused naming the field; `scrub()` makes a value safe to echo
in an error body.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# C0 and C1 control characters (tab and newline included). Names people read (an alias, a job's
# name) are shown on terminals and in solar-control, where an escape sequence in them would be
# obeyed: refused where they are given.
CONTROL_CHARS_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _bad(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# Deeper JSON than this is refused where a request's JSON is kept: the encoders that write
# config.json and the job store refuse depth past about 255, so a deeper value was accepted and
# then failed every later save (pydantic's to_json, json.dumps' recursion). No configuration
# needs more than a few levels.
MAX_DEPTH = 64
TOO_DEEP = f"is nested deeper than {MAX_DEPTH} levels"


def unstorable(
    value: Any, loc: tuple[Any, ...] = (), depth: int = 0
) -> tuple[tuple[Any, ...], str] | None:
    """Where `value` holds what no file, log or answer can keep, and why: a string (key or
    value) that is not valid Unicode, a NaN or infinity (Python's json reads them; strict JSON
    has no spelling for them, so a kept one became null or an invalid file), or nesting past
    MAX_DEPTH."""
    if isinstance(value, str):
        return (loc, NOT_UNICODE) if _bad(value) else None
    if isinstance(value, float) and not math.isfinite(value):
        return loc, NOT_FINITE
    if isinstance(value, dict | list | tuple) and depth >= MAX_DEPTH:
        return loc, TOO_DEEP
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and _bad(k):
                return (*loc, k.encode("utf-8", "backslashreplace").decode()), NOT_UNICODE
            found = unstorable(v, (*loc, k), depth + 1)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = unstorable(v, (*loc, i), depth + 1)
            if found is not None:
                return found
    return None


def scrub(value: Any, depth: int = 0) -> Any:
    """`value` with every lone surrogate replaced by its `\\udXXX` escape, and every NaN or
    infinity by its JSON spelling as a string ("NaN", "Infinity"): safe to encode as strict
    JSON, which has neither (an echo of the bad input in a 422 was a 500)."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode() if _bad(value) else value
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    if depth > 64:
        return value
    if isinstance(value, dict):
        return {scrub(k, depth + 1): scrub(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v, depth + 1) for v in value]
    return value


NOT_UNICODE = "must be valid Unicode text (a lone UTF-16 surrogate is not)"
NOT_FINITE = "must be a finite number (NaN and Infinity are not JSON)"


def refusal(found: tuple[tuple[Any, ...], str], prefix: str = "") -> str:
    """The error naming where unstorable() found something, and what: `body.config.x: ...`."""
    loc, why = found
    where = ".".join(str(x) for x in (prefix, *loc) if x != "")
    return f"{where or 'body'}: {why}"

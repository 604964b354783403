"""Plain-text formatting shared by the command line's commands: tables, sizes, durations, JSON."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from typing import Any


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False, default=str), flush=True)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[("" if v is None else visible(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, v in enumerate(row):
            widths[i] = max(widths[i], len(v))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_duration(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `2 h 10 min`."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


# C0 and C1 control characters but tab: ESC starts the sequences that retitle a terminal (OSC 0),
# write its clipboard (OSC 52), move the cursor or clear the screen (CSI); a lone CR or a
# backspace overwrites what was shown; U+009B is an 8-bit CSI.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
# The most of one host-supplied error detail shown on a terminal (a proxy's 2 MB error page).
MAX_DETAIL_CHARS = 2000


def visible(value: Any) -> str:
    """`str(value)` with each control character but tab spelled `\\xNN`: text a host sent (an
    alias, a status, an error) is shown, never obeyed by the terminal. For human output only:
    --json keeps the data as it came."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))


def clip(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """`text` cut after `limit` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} [... {len(text) - limit} more characters not shown]"


# --- messages and instance records -------------------------------------------------------


def print_error(msg: str) -> None:
    print(f"solar-host: {msg}", file=sys.stderr)


def print_warnings(body: dict[str, Any]) -> None:
    warnings = body.get("warnings")
    if not warnings:
        return
    for w in warnings if isinstance(warnings, list) else (warnings,):
        print(f"solar-host: warning: {visible(w)}", file=sys.stderr)


def record(body: dict[str, Any], key: str, default: Any = None) -> dict[str, Any]:
    """body[key] when it is an object (an instance record in an answer), else `default`."""
    value = body.get(key)
    return value if isinstance(value, dict) else (default if default is not None else {})


def where(inst: dict[str, Any]) -> str:
    if not inst.get("pid"):
        return ""
    return f" (port {visible(inst.get('port'))}, pid {visible(inst.get('pid'))})"


def label(inst: dict[str, Any]) -> str:
    alias = record(inst, "config").get("alias")
    iid = visible(inst.get("id"))
    return f"{iid} ({visible(alias)})" if alias else iid


def state_line(inst: dict[str, Any]) -> str:
    """`ID: STATUS (port P, pid N)` of an instance record, for humans."""
    return f"{visible(inst.get('id'))}: {visible(inst.get('status'))}{where(inst)}"

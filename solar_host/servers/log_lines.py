"""The lines of hf_server's log that the host reads: how the server writes them and how the
host parses them, in one place so that the two cannot drift apart.

The server writes its log to stdout, which the host sends to a file it follows. Per request:

    [REQUEST] id=ab12cd-1 endpoint=/v1/chat/completions
    [COMPLETE] id=ab12cd-1 endpoint=/v1/chat/completions prompt_tokens=26 completion_tokens=50
        time_ms=2000.0 started_at=2026-01-01T00:00:00+00:00 finished_at=...   (one line)
    [ERROR] id=ab12cd-1 endpoint=/v1/completions status=400 message=...

(a generation's [COMPLETE] carries its own start and end; an embedding's or a classification's
does not), and once the socket listens, through uvicorn's logger, the ready line
`Uvicorn running on http://HOST:PORT (Press CTRL+C to quit)`. The host's HFLogParser turns the
markers into runtime state and last-generation metrics; a ready line (or uvicorn's
"Application startup complete") is a fresh server, with nothing in flight.

Standard library only: the host imports this module, and so does the server process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

# The endpoints whose [COMPLETE] line is a generation (with its start and end times).
GENERATION_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions"})
# An [ERROR] line's message: on one line, and at most this many characters.
MAX_MESSAGE_CHARS = 300
# The ready line, as a logging format (host, port): written by the server once it listens.
READY_FORMAT = "Uvicorn running on http://%s:%d (Press CTRL+C to quit)"

_MARK = re.compile(r"\[(REQUEST|COMPLETE|ERROR)\]\s+id=(\S+)(.*)$")
_KV = re.compile(r"(\w+)=(\S+)")
_READY = re.compile(r"Uvicorn running on https?://", re.IGNORECASE)
_STARTED = re.compile(r"Uvicorn running on|Application startup complete", re.IGNORECASE)


# ---- the server's side -------------------------------------------------------------------


def request_line(rid: str, endpoint: str) -> str:
    """A request has begun."""
    return f"[REQUEST] id={rid} endpoint={endpoint}"


def complete_line(
    rid: str,
    endpoint: str,
    prompt_tokens: int,
    completion_tokens: int,
    elapsed_s: float,
    now: datetime | None = None,
) -> str:
    """A request has ended well, `elapsed_s` after it began. A generation's line ends with its
    start and end (`now`, the present when not given): the host's record is then the request's
    own, not the moment it happened to read the line."""
    line = (
        f"[COMPLETE] id={rid} endpoint={endpoint} prompt_tokens={prompt_tokens} "
        f"completion_tokens={completion_tokens} time_ms={elapsed_s * 1000:.1f}"
    )
    if endpoint in GENERATION_ENDPOINTS:
        end = now or datetime.now(UTC)
        start = end - timedelta(seconds=elapsed_s)
        line += f" started_at={start.isoformat()} finished_at={end.isoformat()}"
    return line


def error_line(rid: str, endpoint: str, status: int, message: str) -> str:
    """A request has ended in an error (its message on one line, cut to MAX_MESSAGE_CHARS)."""
    msg = message.replace("\n", " ")[:MAX_MESSAGE_CHARS]
    return f"[ERROR] id={rid} endpoint={endpoint} status={status} message={msg}"


def ready_host(host: str) -> str:
    """The host as the ready line shows it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


# ---- the host's side ---------------------------------------------------------------------


@dataclass(frozen=True)
class Marker:
    """One [REQUEST], [COMPLETE] or [ERROR] line, parsed. `fields` holds each `key=value` of
    the line after its id (a value ends at the first space: an [ERROR]'s message is cut
    there)."""

    kind: str  # "REQUEST", "COMPLETE" or "ERROR"
    rid: str
    fields: dict[str, str]


def parse_marker(line: str) -> Marker | None:
    """The marker on `line`, or None when it carries none."""
    if "[" not in line:  # most lines: no search
        return None
    m = _MARK.search(line)
    if m is None:
        return None
    return Marker(m.group(1), m.group(2), dict(_KV.findall(m.group(3))))


def is_ready_line(line: str) -> bool:
    """Whether `line` says the server listens (it has loaded its model and may be used)."""
    return bool(_READY.search(line))


def is_started_line(line: str) -> bool:
    """Whether `line` says a server (re)started: nothing of an earlier one is in flight."""
    return bool(_STARTED.search(line))


def timestamp(value: str | None) -> datetime | None:
    """A time from a marker's started_at/finished_at (timezone-aware), or None."""
    if not value:
        return None
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        return None
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)

"""Backend log files on disk: their names (one per start attempt), finding an instance's files,
reading the end of one, counting its lines, and pruning old ones."""

from __future__ import annotations

import contextlib
import glob
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from solar_host.platform.log_limits import cut_marker


def log_file_name(alias_safe: str, instance_id: str, ts: float | None = None) -> str:
    return f"{alias_safe}_{instance_id}_{int(ts if ts is not None else time.time())}.log"


def append_line(path: Path, line: str) -> None:
    """One line the host writes into an instance's log file itself (a start that failed
    before its backend ran). Blocking."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        os.write(fd, (line + "\n").encode("utf-8", "replace"))
    finally:
        os.close(fd)


def new_log_path(log_dir: Path, alias_safe: str, instance_id: str) -> Path:
    """A log file of its own for one start attempt.

    Two attempts within the same second must not share a file: a new attempt would read the
    old process's output (its ready line included) as its own. The timestamp moves forward
    to the next free second instead.
    """
    ts = int(time.time())
    while True:
        path = log_dir / log_file_name(alias_safe, instance_id, ts)
        if not path.exists():
            return path
        ts += 1


def files_of(log_dir: Path, instance_id: str) -> list[Path]:
    """Log files of an instance id, newest first."""
    pattern = f"*_{glob.escape(instance_id)}_*.log"
    # The glob also matches another instance's file whose alias holds `_<id>_` (alias
    # "team_b_chat" for id "b"): only `<alias>_<id>_<seconds>.log` is this id's.
    suffix = f"_{instance_id}"
    found = []
    for p in log_dir.glob(pattern):
        head, _, ts = p.name[:-4].rpartition("_")
        if not ts.isdigit() or not head.endswith(suffix) or len(head) <= len(suffix):
            continue
        try:
            found.append((p.stat().st_mtime, p))
        except OSError:
            continue
    return [p for _, p in sorted(found, key=lambda t: (t[0], t[1].name), reverse=True)]


def tail_lines(path: Path, n: int, max_line_bytes: int | None = None) -> list[str]:
    """The last `n` lines of a file, reading backwards in 64 KiB blocks.

    With `max_line_bytes`, each line is cut there (with the marker) and no more than
    n * (max_line_bytes + 1) bytes are ever read, however long the file's lines are.
    """
    if n <= 0:
        return []
    budget = None if max_line_bytes is None else n * (max_line_bytes + 1) + 1
    try:
        f = open(path, "rb")
    except OSError:
        return []
    with f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        data = b""
        pos = end
        cut_short = False
        while pos > 0 and data.count(b"\n") <= n:
            if budget is not None and len(data) >= budget:
                cut_short = True  # the first piece is the end of a longer line: not shown
                break
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if cut_short and lines:
        lines.pop(0)
    out = lines[-n:]
    if max_line_bytes is None:
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in out]
    marker = cut_marker(max_line_bytes)
    return [
        ln[:max_line_bytes].decode("utf-8", "ignore").rstrip("\r") + marker
        if len(ln) > max_line_bytes
        else ln.decode("utf-8", "replace").rstrip("\r")
        for ln in out
    ]


def count_lines(path: Path) -> tuple[int, int]:
    """(complete lines, byte size) of a file, read in blocks."""
    count = 0
    size = 0
    try:
        with open(path, "rb") as f:
            while True:
                block = f.read(1 << 20)
                if not block:
                    break
                size += len(block)
                count += block.count(b"\n")
    except OSError:
        return 0, 0
    return count, size


def file_mtime_iso(path: Path) -> str:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat()
    except OSError:
        return datetime.fromtimestamp(0, UTC).isoformat()


def prune_log_files(log_dir: Path, retention_s: float, now: float | None = None) -> int:
    """Remove log files older than `retention_s`, keeping the newest per (alias, instance id)."""
    now = now or time.time()
    groups: dict[str, list[tuple[float, Path]]] = {}
    for p in _iter_logs(log_dir):
        stem = p.name[:-4]
        head, _, ts = stem.rpartition("_")
        if not head or not ts.isdigit():
            continue
        try:
            mtime = p.stat().st_mtime
        except OSError:
            continue
        groups.setdefault(head, []).append((mtime, p))
    removed = 0
    # Rotated generations (<file>.log.N) are older parts of a log: they go by age alone.
    with contextlib.suppress(OSError):
        for p in log_dir.iterdir():
            name = p.name
            if ".log." in name and name.rpartition(".")[2].isdigit():
                with contextlib.suppress(OSError):
                    if now - p.stat().st_mtime > retention_s:
                        p.unlink()
                        removed += 1
    for entries in groups.values():
        entries.sort(reverse=True)
        for mtime, p in entries[1:]:
            if now - mtime > retention_s:
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed += 1
    return removed


def _iter_logs(log_dir: Path) -> Iterator[Path]:
    try:
        yield from (p for p in log_dir.iterdir() if p.suffix == ".log" and p.is_file())
    except OSError:
        return

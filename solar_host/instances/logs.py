"""Backend log files, the follower that turns them into numbered lines, and the in-memory ring.

The backend writes straight into its log file; the host follows the file (inotify, with a slow
poll as a safety net) and never sits between the backend and its output. Each line gets a `seq`
that increases for the life of the instance id, across retries, restarts and re-adoption.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import glob
import itertools
import logging
import os
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 64 * 1024  # longer lines are cut, so one runaway line cannot eat memory
READ_CHUNK = 256 * 1024
HOT_POLL_S = 0.02  # read interval while a log is busy (no inotify watch then)


class LogEntry(NamedTuple):
    """One numbered log line (a tuple: cheap to build by the hundred thousand)."""

    seq: int
    timestamp: str
    line: str

    def as_dict(self) -> dict[str, object]:
        return {"seq": self.seq, "timestamp": self.timestamp, "line": self.line}


class LogRing:
    """The last N lines of an instance, with contiguous seqs, and a wake-up for streamers."""

    def __init__(self, size: int, next_seq: int = 0):
        self.entries: deque[LogEntry] = deque(maxlen=size)
        self.next_seq = next_seq
        self._changed: asyncio.Event | None = None

    def append_many(self, lines: list[str], timestamp: str) -> list[LogEntry]:
        seq = self.next_seq
        out = [LogEntry(seq + i, timestamp, line) for i, line in enumerate(lines)]
        self.entries.extend(out)
        self.next_seq = seq + len(lines)
        self.notify()
        return out

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def changed(self) -> asyncio.Event:
        """An event set at the next append (one per batch, not per line)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    @property
    def first_seq(self) -> int:
        return self.entries[0].seq if self.entries else self.next_seq

    def since(self, seq: int) -> tuple[int | None, list[LogEntry]]:
        """Entries with seq >= `seq`; the first value is the first missing seq if some left."""
        first = self.first_seq
        gap = None
        if seq < first:
            gap, seq = seq, first
        start = seq - first
        if start >= len(self.entries):
            return gap, []
        return gap, list(itertools.islice(self.entries, start, None))

    def tail(self, n: int) -> list[LogEntry]:
        if n <= 0:
            return []
        return list(itertools.islice(self.entries, max(0, len(self.entries) - n), None))


# --- inotify ---------------------------------------------------------------------------------

_IN_MODIFY = 0x00000002
_IN_CLOSE_WRITE = 0x00000008
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")


class InotifyHub:
    """One inotify descriptor for every followed file, dispatching by watch descriptor."""

    def __init__(self) -> None:
        self._fd = -1
        self._libc: ctypes.CDLL | None = None
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ensure(self) -> bool:
        if self._fd >= 0:
            return True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        except (OSError, AttributeError):
            return False
        if fd < 0:
            return False
        self._libc, self._fd = libc, fd
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._drain)
        return True

    def available(self) -> bool:
        return self._ensure()

    def watch(self, path: Path, callback: Callable[[], None]) -> int | None:
        if not self._ensure():
            return None
        assert self._libc is not None
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), _IN_MODIFY | _IN_CLOSE_WRITE)
        if wd < 0:
            return None
        self._callbacks[wd] = callback
        return wd

    def unwatch(self, wd: int | None) -> None:
        if wd is None or self._fd < 0 or self._libc is None:
            return
        self._callbacks.pop(wd, None)
        self._libc.inotify_rm_watch(self._fd, wd)

    def _drain(self) -> None:
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            return
        woken = set()
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, _mask, _cookie, length = _EVENT.unpack_from(data, offset)
            offset += _EVENT.size + length
            woken.add(wd)
        for wd in woken:
            cb = self._callbacks.get(wd)
            if cb is not None:
                cb()

    def close(self) -> None:
        if self._fd >= 0:
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
            self._callbacks.clear()


class LogFollower:
    """Reads new bytes of a log file as they are written and hands complete lines on."""

    def __init__(
        self,
        path: Path,
        on_lines: Callable[[list[str]], None],
        hub: InotifyHub | None,
        *,
        offset: int = 0,
        poll_interval: float = 0.25,
    ):
        self.path = path
        self.on_lines = on_lines
        self.hub = hub
        self.offset = offset
        self.poll_interval = poll_interval
        self._partial = b""
        self._fd = -1
        self._wd: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.lines_read = 0
        self.first_line_at: float | None = None
        self._stopped = False
        # Off while a backend starts (its ready line should be seen at once); the supervisor
        # turns it on once the backend runs.
        self.hot_polling = False

    def start(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self._arm()
        self._task = asyncio.create_task(self._run(), name=f"follow:{self.path.name}")

    def _arm(self) -> None:
        if self.hub is not None and self._wd is None:
            self._wd = self.hub.watch(self.path, self._wake.set)

    def _disarm(self) -> None:
        if self.hub is not None and self._wd is not None:
            self.hub.unwatch(self._wd)
            self._wd = None

    async def _run(self) -> None:
        """Wait on inotify while the file is quiet; poll while it is busy.

        A watch makes the kernel queue an event on every write(2) of the backend: a backend
        that writes line by line ran 2 to 2.5 times slower watched (measured with 200,000
        lines). So once data flows (and `hot_polling` allows it) the watch is dropped and the
        file is read every HOT_POLL_S until it goes quiet, then watched again.
        """
        while not self._stopped:
            self._wake.clear()
            got = 0
            # One chunk at a time, yielding between chunks, so a flood cannot hold the loop.
            while True:
                n = self.read_chunk()
                got += n
                if n < READ_CHUNK:
                    break
                await asyncio.sleep(0)
            if got and self.hot_polling and self.hub is not None:
                self._disarm()
                await asyncio.sleep(HOT_POLL_S)
                continue
            if self._wd is None and self.hub is not None and self.hub.available():
                self._arm()
                continue  # read once more: a write may have landed before the watch
            interval = self.poll_interval if self._wd is not None else HOT_POLL_S
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # races with the wake-up, and the follower would then never stop.
            try:
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def read_available(self) -> None:
        """Read everything written so far and deliver the complete lines."""
        while self.read_chunk() == READ_CHUNK:
            pass

    def read_chunk(self) -> int:
        """Deliver the lines of one chunk; returns the bytes read (READ_CHUNK: more may wait)."""
        if self._fd < 0:
            return 0
        try:
            chunk = os.pread(self._fd, READ_CHUNK, self.offset)
        except OSError as err:
            log.warning("cannot read %s: %s", self.path, err)
            return 0
        if not chunk:
            return 0
        self.offset += len(chunk)
        self._deliver(chunk)
        return len(chunk)

    def _deliver(self, chunk: bytes) -> None:
        data = self._partial + chunk
        parts = data.split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > MAX_LINE_BYTES:
            parts.append(self._partial[:MAX_LINE_BYTES])
            self._partial = b""
        if not parts:
            return
        lines = [
            (p[:MAX_LINE_BYTES] if len(p) > MAX_LINE_BYTES else p)
            .decode("utf-8", "replace")
            .rstrip("\r")
            for p in parts
        ]
        if self.first_line_at is None:
            self.first_line_at = time.monotonic()
        self.lines_read += len(lines)
        self.on_lines(lines)

    async def stop(self, flush: bool = True) -> None:
        """Stop following; with `flush`, first deliver what is left (incl. a last partial line)."""
        self._stopped = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if flush:
            self.read_available()
            if self._partial:
                rest, self._partial = self._partial, b""
                self.lines_read += 1
                self.on_lines([rest.decode("utf-8", "replace").rstrip("\r")])
        if self.hub is not None:
            self.hub.unwatch(self._wd)
        self._wd = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# --- files -------------------------------------------------------------------------------------


def log_file_name(alias_safe: str, instance_id: str, ts: float | None = None) -> str:
    return f"{alias_safe}_{instance_id}_{int(ts if ts is not None else time.time())}.log"


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
    found = []
    for p in log_dir.glob(pattern):
        try:
            found.append((p.stat().st_mtime, p))
        except OSError:
            continue
    return [p for _, p in sorted(found, key=lambda t: (t[0], t[1].name), reverse=True)]


def tail_lines(path: Path, n: int) -> list[str]:
    """The last `n` lines of a file, reading backwards in 64 KiB blocks (memory stays small)."""
    if n <= 0:
        return []
    try:
        f = open(path, "rb")
    except OSError:
        return []
    with f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        data = b""
        pos = end
        while pos > 0 and data.count(b"\n") <= n:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines[-n:]]


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

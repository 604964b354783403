"""Backend log files, the follower that turns them into numbered lines, and the in-memory ring.

The backend writes straight into its log file; the host follows the file (inotify, with a slow
poll as a safety net) and never sits between the backend and its output. Each line gets a `seq`
that increases for the life of the instance id, across retries, restarts and re-adoption.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import itertools
import logging
import os
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from solar_host.platform.libc import libc as c_library
from solar_host.platform.log_limits import Rotation, cut_marker, generation_path, rotate_appended

log = logging.getLogger(__name__)

# Default cut of one line (LOG_LINE_MAX_BYTES): a runaway line cannot eat memory.
MAX_LINE_BYTES = 16 * 1024
READ_CHUNK = 256 * 1024
HOT_POLL_S = 0.02  # read interval while a log is busy (no inotify watch then)
# Where a rotation has to copy-truncate (no COLLAPSE_RANGE), how far its copy chases a
# backend that keeps writing (4 x LOG_FILE_MAX_BYTES, at least this) before it truncates.
ROTATE_CHASE_MIN_BYTES = 16 * 1024 * 1024
# What a stop (or a failed start) still reads of a backlog the follower never caught up with,
# on the event loop: the newest part of it; the rest is skipped with a line saying so.
FLUSH_MAX_BYTES = 4 * 1024 * 1024
# The unread part of a log the follower tolerates before it skips (or LOG_FILE_MAX_BYTES,
# when larger): a short burst is read whole.
BACKLOG_MIN_BYTES = 64 * 1024 * 1024
SKIPPED_LINE = "[log: {n} bytes skipped: the backend wrote faster than the host can follow]"


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

    def rebase(self, next_seq: int) -> None:
        """Empty the ring and continue from `next_seq` (an adopted backend's log, re-read).
        The same ring, not a new one: a stream already waiting on it sees what comes next."""
        self.entries.clear()
        self.next_seq = next_seq

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


class IdleLogBuffers:
    """The RETAINED_LOG_BUFFERS most recently stopped instances keep their in-memory log
    buffer; an older one is emptied (its lines stay in its log file, which GET logs reads
    then). Without this, every instance ever stopped held LOG_BUFFER_SIZE lines for the life
    of the host."""

    def __init__(self, limit: int):
        self.limit = limit
        self._rings: OrderedDict[str, LogRing] = OrderedDict()

    def idle(self, instance_id: str, ring: LogRing) -> None:
        """`instance_id`'s backend is gone: its buffer joins the retained ones, newest last."""
        self._rings.pop(instance_id, None)
        self._rings[instance_id] = ring
        while len(self._rings) > self.limit:
            _, oldest = self._rings.popitem(last=False)
            oldest.rebase(oldest.next_seq)  # seqs go on from where they were

    def busy(self, instance_id: str) -> None:
        """Its buffer is in use again (a start), or the instance is gone (a delete)."""
        self._rings.pop(instance_id, None)

    def __len__(self) -> int:
        return len(self._rings)


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
            libc = c_library()
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
        max_line_bytes: int = MAX_LINE_BYTES,
        max_file_bytes: int = 0,
        generations: int = 3,
        on_rotate: Callable[[int], None] | None = None,
    ):
        self.path = path
        self.on_lines = on_lines
        self.hub = hub
        self.offset = offset
        self.poll_interval = poll_interval
        self.max_line_bytes = max_line_bytes
        self._marker = cut_marker(max_line_bytes)
        # Rotation (0: never): see log_limits. `on_rotate(n)` is told how many complete lines
        # left the file, so whoever counts lines in it (re-adoption's seq) can add them.
        self.max_file_bytes = max_file_bytes
        self.generations = generations
        self.on_rotate = on_rotate
        self.rotations = 0
        self._rotation: asyncio.Future[Rotation] | None = None
        self._drain: tuple[int, int, int] | None = None  # (fd, pos, end) of a rotated copy
        self._partial = b""
        self._skipping = False  # inside a cut line: drop bytes up to its newline
        self._fd = -1
        self._wd: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.lines_read = 0
        self.skipped_bytes = 0
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
                if self.max_file_bytes:
                    # Never more unread than a file's worth (BACKLOG_MIN_BYTES at least): the
                    # rest is skipped (and rotated away like what was read), so the file
                    # stays bounded however fast the backend writes.
                    self.skip_backlog(max(self.max_file_bytes, BACKLOG_MIN_BYTES))
                n = self.read_chunk()
                got += n
                if n < READ_CHUNK or (self.max_file_bytes and self.offset >= self.max_file_bytes):
                    break
                await asyncio.sleep(0)
            if self.max_file_bytes and self.offset >= self.max_file_bytes:
                await self._rotate()
                continue
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

    async def _rotate(self) -> None:
        """Copy the file out and truncate it (off the loop), then go on reading from 0."""
        fut = asyncio.ensure_future(
            asyncio.to_thread(
                rotate_appended,
                self.path,
                self.offset,
                self.generations,
                max(ROTATE_CHASE_MIN_BYTES, 4 * self.max_file_bytes),
                # All that was read, unless a skip made it more (then its newest part only).
                self.max_file_bytes + READ_CHUNK,
            )
        )
        self._rotation = fut
        await asyncio.wait([fut])  # never cancels the copy; stop() finishes it instead
        self._finish_rotation(fut)

    def _finish_rotation(self, fut: asyncio.Future[Rotation]) -> None:
        if self._rotation is not fut:
            return  # already applied (by stop())
        self._rotation = None
        err = fut.exception()
        if err is not None:
            log.warning("cannot rotate %s: %s", self.path.name, err)
            self.max_file_bytes = 0  # no retry loop: the file keeps growing, as before
            return
        done = fut.result()
        if done.drain_to > done.drain_from:
            # What was written after our last read is read from the rotated copy first.
            try:
                fd = os.open(generation_path(self.path, 1), os.O_RDONLY | os.O_CLOEXEC)
                self._drain = (fd, done.drain_from, done.drain_to)
            except OSError as e:
                log.warning("cannot read rotated %s: %s", self.path.name, e)
        self.offset -= done.removed
        self.rotations += 1
        if self.on_rotate is not None:
            self.on_rotate(done.newlines)

    async def read_available(self, max_bytes: int = FLUSH_MAX_BYTES) -> None:
        """Read what was written so far and deliver the complete lines: of a backlog over
        `max_bytes`, only its newest `max_bytes` (the rest is skipped, and a line says so).
        The loop goes on between chunks (4 MiB of short lines take ~0.1 s to deliver)."""
        self.skip_backlog(max_bytes)
        while self.read_chunk() == READ_CHUNK:
            await asyncio.sleep(0)

    def skip_backlog(self, keep: int) -> int:
        """Skip what is unread beyond the newest `keep` bytes of the file; deliver a line
        saying how much (the rest of the line the skip lands in is dropped). Returns the
        bytes skipped. A backend writing faster than the host reads would otherwise grow its
        file without bound (only what was read is rotated away) and hold every stop while
        the backlog is read."""
        if self._fd < 0 or self._rotation is not None or self._drain is not None:
            return 0
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return 0
        skip = size - self.offset - keep
        if skip <= 0:
            return 0
        self.offset += skip
        self._partial = b""
        self._skipping = True  # what is left of the line the skip lands in
        self.skipped_bytes += skip
        self.lines_read += 1
        self.on_lines([SKIPPED_LINE.format(n=skip)])
        return skip

    def read_chunk(self) -> int:
        """Deliver the lines of one chunk; returns the bytes read (READ_CHUNK: more may wait)."""
        if self._fd < 0 or self._rotation is not None:
            return 0
        if self._drain is not None:
            fd, pos, end = self._drain
            chunk = os.pread(fd, min(READ_CHUNK, end - pos), pos)
            pos += len(chunk)
            if not chunk or pos >= end:
                os.close(fd)
                self._drain = None
            else:
                self._drain = (fd, pos, end)
            if chunk:
                self._deliver(chunk)
                return READ_CHUNK  # more may wait (the rest of the copy, then the file)
            return READ_CHUNK
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
        limit = self.max_line_bytes
        if self._skipping:
            # The rest of a line already cut: dropped up to its newline.
            nl = chunk.find(b"\n")
            if nl < 0:
                return
            self._skipping = False
            chunk = chunk[nl + 1 :]
            if not chunk:
                return
        data = self._partial + chunk
        parts = data.split(b"\n")
        self._partial = parts.pop()
        cut_partial = len(self._partial) > limit
        if cut_partial:
            # Delivered now, cut; what follows of it until its newline is dropped.
            parts.append(self._partial)
            self._partial = b""
            self._skipping = True
        if not parts:
            return
        lines = [self._decode(p, limit) for p in parts]
        if self.first_line_at is None:
            self.first_line_at = time.monotonic()
        self.lines_read += len(lines)
        self.on_lines(lines)

    def _decode(self, raw: bytes, limit: int) -> str:
        if len(raw) > limit:
            # errors="ignore": a multi-byte character split by the cut is dropped, not mangled.
            return raw[:limit].decode("utf-8", "ignore").rstrip("\r") + self._marker
        return raw.decode("utf-8", "replace").rstrip("\r")

    async def stop(self, flush: bool = True) -> None:
        """Stop following; with `flush`, first deliver what is left (incl. a last partial line)."""
        self._stopped = True
        self._wake.set()
        rotation = self._rotation
        if rotation is not None:
            # A rotation in flight finishes first: its thread truncates the file.
            await asyncio.wait([rotation])
            self._finish_rotation(rotation)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if flush:
            await self.read_available()
            if self._partial:
                rest, self._partial = self._partial, b""
                self.lines_read += 1
                self.on_lines([self._decode(rest, self.max_line_bytes)])
        if self.hub is not None:
            self.hub.unwatch(self._wd)
        self._wd = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._drain is not None:
            os.close(self._drain[0])
            self._drain = None


# --- files -------------------------------------------------------------------------------------


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

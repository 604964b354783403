"""Backend log files, the follower that turns them into numbered lines, and the in-memory ring.

A backend's log relay (log_relay.py) writes its log file, never past the file's bound; the host
follows the file (inotify, with a slow poll as a safety net) and never sits between the backend
and its output. The flood cut (cut_flood) is for writers without a relay: backends spawned
by older hosts, which write their file themselves. Each line gets a `seq` that increases for
the life of the instance id, across retries, restarts and re-adoption.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

# Files and inotify have modules of their own; what callers import from here still works.
from solar_host.instances.inotify import InotifyHub as InotifyHub
from solar_host.instances.log_files import append_line as append_line
from solar_host.instances.log_files import count_lines as count_lines
from solar_host.instances.log_files import file_mtime_iso as file_mtime_iso
from solar_host.instances.log_files import files_of as files_of
from solar_host.instances.log_files import log_file_name as log_file_name
from solar_host.instances.log_files import new_log_path as new_log_path
from solar_host.instances.log_files import prune_log_files as prune_log_files
from solar_host.instances.log_files import tail_lines as tail_lines
from solar_host.platform.log_limits import (
    Rotation,
    collapse_range,
    copy_out,
    cut_marker,
    generation_path,
    read_tail_and_truncate,
    rotate_appended,
)

log = logging.getLogger(__name__)

_NO_COLLAPSE = (errno.EOPNOTSUPP, errno.ENOSYS)

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
# Where the follower cannot cut the file (it may not write to it), the unread part it
# tolerates before it skips (or LOG_FILE_MAX_BYTES, when larger); the file then grows.
BACKLOG_MIN_BYTES = 64 * 1024 * 1024
# The least a log file may hold before the follower cuts what it has not read, where
# LOG_FILE_MAX_BYTES is smaller: a writer the host keeps up with writes this much between two
# looks (20 ms of hot polling, a busy loop's pause) and must not lose it.
CUT_FLOOR_BYTES = 4 * 1024 * 1024
# After a cut, how long the follower looks at the file every FLOOD_POLL_S instead of
# pausing HOT_POLL_S (at 1 GiB/s a backend writes 20 MB in one such pause).
FLOOD_HOLD_S = 0.5
FLOOD_POLL_S = 0.001
SKIPPED_LINE = "[log: {n} bytes skipped: the backend wrote faster than the host can follow]"


def relay_bound(max_file_bytes: int) -> int:
    """What a backend's log relay may take its file to: the follower reads up to
    LOG_FILE_MAX_BYTES and then rotates, and one chunk past it is what a relay may write
    while that rotation is due."""
    return max_file_bytes + READ_CHUNK


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
        self._can_cut = False  # the file is open read-write: cut_flood can truncate it
        self._can_collapse = True  # until the filesystem says it cannot
        # A cut by collapse in flight (a thread), and the range [a, b) it removes.
        self._collapsing: asyncio.Future[None] | None = None
        self._collapse_span = (0, 0)
        self._flood_rotation: int | None = None  # the rotation in flight copies this much out
        self._flood_until = 0.0  # monotonic: looked at every FLOOD_POLL_S until then
        self._wd: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.lines_read = 0
        self.skipped_bytes = 0
        self.cuts = 0
        self.first_line_at: float | None = None
        self._stopped = False
        # Off while a backend starts (its ready line should be seen at once); the supervisor
        # turns it on once the backend runs.
        self.hot_polling = False

    def start(self) -> None:
        self._fd = self._open()
        self._arm()
        self._task = asyncio.create_task(self._run(), name=f"follow:{self.path.name}")

    def _open(self) -> int:
        """Read-write where the file has a bound, so that cut_flood can truncate it;
        read-only otherwise, or where the host may not write the file (then only what was
        read is rotated away: the file outgrows its bound under a flood)."""
        if self.max_file_bytes:
            with contextlib.suppress(OSError):
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                self._can_cut = True
                return fd
        return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

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
                self._keep_bound()  # before each chunk is parsed
                n = self.read_chunk()
                got += n
                if n < READ_CHUNK or (self.max_file_bytes and self.offset >= self.max_file_bytes):
                    break
                await asyncio.sleep(0)
            if self.max_file_bytes and self.offset >= self.max_file_bytes:
                await self._rotate()
                continue
            if self._flooding():
                # A flood is on: looked at again at once, where a pause of HOT_POLL_S would
                # let it write tens of MB past the bound (the watch stays off meanwhile).
                self._disarm()
                await asyncio.sleep(FLOOD_POLL_S)
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

    def _flooding(self) -> bool:
        return time.monotonic() < self._flood_until

    def _keep_bound(self) -> None:
        if not self.max_file_bytes:
            return
        if self._collapsing is not None:
            if self._collapsing.done():
                self._finish_collapse()
            return
        if self._can_cut:
            self.cut_flood()
        else:
            # Never more unread than a file's worth (BACKLOG_MIN_BYTES at least): the rest is
            # skipped (and rotated away like what was read).
            self.skip_backlog(max(self.max_file_bytes, BACKLOG_MIN_BYTES))

    async def _rotate(self) -> None:
        """Copy the file out and truncate it (off the loop), then go on reading from 0."""
        # A flood's unread part is cut first: a collapse writes back all that follows the
        # range it removes, the backend's writes waiting (rotations took 0.2-1 s at 1 GiB/s).
        self._keep_bound()
        await self._cut_done()
        # All that was read, unless a skip made it more (then its newest part only).
        max_copy = self.max_file_bytes + READ_CHUNK
        if self._can_cut and not self._can_collapse and self._flooding():
            # In a flood, where the file cannot collapse: no chase (its copy would be read
            # first, with no cut, while the file grows): what was read is copied out, then
            # the file is cut to nothing (_finish_rotation), its newest chunk delivered.
            self._flood_rotation = self._line_start()
            job = partial(copy_out, self.path, self._flood_rotation, self.generations, max_copy)
        else:
            self._flood_rotation = None
            chase = max(ROTATE_CHASE_MIN_BYTES, 4 * self.max_file_bytes)
            job = partial(
                rotate_appended, self.path, self.offset, self.generations, chase, max_copy
            )
        fut = asyncio.ensure_future(asyncio.to_thread(job))
        self._rotation = fut
        # Never cancels the copy; stop() finishes it instead. A flood is cut meanwhile (past
        # what is being copied): copying to a new file can wait on the kernel's writeback of
        # dirty pages, 0.3 s was seen, while the backend writes 1 GiB/s.
        while not fut.done():
            flood = self._flood_rotation is not None
            await asyncio.wait([fut], timeout=FLOOD_POLL_S if flood else None)
            if not fut.done():
                self.cut_flood()
        self._finish_rotation(fut)

    def _finish_rotation(self, fut: asyncio.Future[Rotation]) -> None:
        if self._rotation is not fut:
            return  # already applied (by stop())
        self._rotation = None
        flood_copy, self._flood_rotation = self._flood_rotation, None
        err = fut.exception()
        if err is not None:
            log.warning("cannot rotate %s: %s", self.path.name, err)
            self.max_file_bytes = 0  # no retry loop: the file keeps growing, as before
            return
        done = fut.result()
        if flood_copy is not None:
            self.rotations += 1
            self._cut(0, done.newlines)
            return
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
        if self._collapsing is not None:
            return 0
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return 0
        skip = size - self.offset - keep
        if skip <= 0:
            return 0
        self.offset += skip
        self.skipped_bytes += skip
        self._gap(skip)
        return skip

    def cut_flood(self) -> int:
        """Keep the file within its bound by where the backend writes, not by what was read.

        Rotation removes only what was read, and a backend can write faster than the host
        parses (a stderr flood: over 1 GiB/s): the file grew by all it wrote between two
        rotations, 0.15-1.3 GB with a 4 MiB bound. So at each look, before a chunk is parsed,
        a file over max(LOG_FILE_MAX_BYTES, CUT_FLOOR_BYTES) plus one chunk, with more than a
        chunk unread, loses what is unread but for its newest chunk (the last lines of a
        flood are often what matters), unparsed, and one line says how many bytes went.

        Where the filesystem can (ext4, xfs), that middle is collapsed out, in a thread: the
        kernel does it under the lock the backend's appends take, so the count is exact and
        nothing written meanwhile is lost (and the backend waits, 10-30 ms, while it runs).
        Elsewhere (tmpfs) the file is truncated back to the start of the line being read,
        the newest chunk read just before: what the backend appends between that read and
        the truncate (up to the ~4 ms a truncate may wait for the lock) is lost unsaid.

        So the file is within that bound whenever the follower looks, which it does between
        chunks while data flows; in between it grows by what the backend writes meanwhile.
        Returns the bytes dropped (to be dropped, for a collapse in flight)."""
        if not self._can_cut or self._drain is not None or self._collapsing is not None:
            return 0
        if self._rotation is not None and self._flood_rotation is None:
            return 0  # a collapse or a copy-truncate counts on the file as it found it
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return 0
        if size <= max(self.max_file_bytes, CUT_FLOOR_BYTES) + READ_CHUNK:
            return 0
        if size - self.offset <= READ_CHUNK:
            return 0  # read up to its bound: the rotation is due, and removes what was read
        if self._can_collapse and self._rotation is None:
            block = os.fstat(self._fd).st_blksize or 4096
            start = -(-self.offset // block) * block
            end = (size - READ_CHUNK) // block * block
            if end > start:
                self._collapse_span = (start, end)
                self._collapsing = asyncio.ensure_future(
                    asyncio.to_thread(collapse_range, self._fd, start, end - start)
                )
                self._flood_until = time.monotonic() + FLOOD_HOLD_S
                return end - start
        cut_to = self._line_start()
        if self._flood_rotation is not None:
            cut_to = max(cut_to, self._flood_rotation)  # being copied out: kept till then
        return self._cut(cut_to)

    async def _cut_done(self) -> None:
        fut = self._collapsing
        if fut is not None:
            await asyncio.wait([fut])
            if self._collapsing is fut:  # not already applied (by stop())
                self._finish_collapse()

    def _finish_collapse(self) -> None:
        """A collapse removed [a, b) unread: what was unread before `a` is delivered, the
        line it ends in is dropped, and one line says how many bytes went. Exact: the kernel
        moved what the backend wrote meanwhile down, under the lock its writes take."""
        fut, self._collapsing = self._collapsing, None
        if fut is None:
            return
        start, end = self._collapse_span
        err = fut.exception()
        if err is not None:
            # EOPNOTSUPP (tmpfs, or not an extent-mapped file), or any other refusal: the
            # next look cuts by truncating, and so does every later one.
            self._can_collapse = False
            if not isinstance(err, OSError) or err.errno not in _NO_COLLAPSE:
                log.warning("cannot collapse %s: %s", self.path.name, err)
            return
        try:
            before_gap = os.pread(self._fd, start - self.offset, self.offset)
        except OSError:
            before_gap = b""
        self._deliver(before_gap)
        self.offset = start
        dropped = end - start + len(self._partial)
        self.cuts += 1
        self.skipped_bytes += dropped
        self._gap(dropped)

    def _line_start(self) -> int:
        """Where in the file the line being read begins: all before it was delivered. (It may
        have begun before a rotation moved the file's start out.)"""
        return max(0, self.offset - len(self._partial))

    def _cut(self, cut_to: int, moved: int = 0) -> int:
        """Truncate the file at `cut_to` (the line being read begins there or after). Of what
        is unread, the newest chunk is delivered; the rest, with the line being read, is
        dropped and a line says how many bytes. on_rotate is told of the lines delivered that
        the file no longer holds, and of `moved` lines copied out. Returns the bytes dropped."""
        try:
            size, newest = read_tail_and_truncate(self._fd, self.offset, READ_CHUNK, cut_to)
        except OSError as err:
            log.warning("cannot cut %s: %s", self.path.name, err)
            self._can_cut = False
            return 0
        dropped = size - len(newest) - self.offset
        self.offset = min(cut_to, size)
        before = self.lines_read
        if dropped > 0:
            dropped += len(self._partial)
            self.cuts += 1
            self.skipped_bytes += dropped
            self._flood_until = time.monotonic() + FLOOD_HOLD_S
            self._gap(dropped)
        self._deliver(newest)  # after a gap, from inside a line: dropped up to its newline
        # What follows its last newline may be the front of a write the truncate cut short
        # (a read does not wait for a write): dropped. The backend's next write lands at the
        # new end and starts a line of its own.
        self._partial = b""
        gone = moved + self.lines_read - before
        if gone and self.on_rotate is not None:
            # Re-adoption numbers lines by counting those in the file: it adds these.
            self.on_rotate(gone)
        return dropped

    def _gap(self, skipped: int) -> None:
        """`skipped` bytes were not delivered: the line being read is dropped, and what follows
        the gap up to its first newline (it may start inside a line); one line says so."""
        self._partial = b""
        self._skipping = True
        self.lines_read += 1
        self.on_lines([SKIPPED_LINE.format(n=skipped)])

    def read_chunk(self) -> int:
        """Deliver the lines of one chunk; returns the bytes read (READ_CHUNK: more may wait)."""
        if self._fd < 0 or self._rotation is not None or self._collapsing is not None:
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
        await self._cut_done()  # a collapse in flight too
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

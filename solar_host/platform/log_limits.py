"""Bounds on what a log may cost: one line's length, one file's size, how many files.

Whatever a backend or a job prints, the host keeps at most LOG_LINE_MAX_BYTES of a line (the
rest is dropped, the line ends with CUT_MARKER), and a log file grows to about
LOG_FILE_MAX_BYTES before it is rotated: its content moves to `<name>.1` (older generations
shift to `.2`, ..., the oldest beyond LOG_FILE_GENERATIONS is removed).

Backends write their log file themselves (an O_APPEND descriptor the host never sees again),
so a rotation cannot rename the file: the backend would keep writing into the renamed one.
Where the filesystem can (ext4, xfs), the part already read is copied to `<name>.1` and then
cut from the front of the file with FALLOC_FL_COLLAPSE_RANGE: the kernel does that under the
inode lock that appends take too, so not a byte the backend writes is lost. Elsewhere (tmpfs,
overlay) the file is copied out and truncated in place: with O_APPEND every later write lands
at the new end, but what the backend writes after the copy's last read and before the
truncate is lost; the copy chases a writer that keeps writing (up to a bound) to keep that
small.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
from pathlib import Path
from typing import Any, NamedTuple

from solar_host.platform.libc import libc, libc_holding_gil

_FALLOC_FL_COLLAPSE_RANGE = 0x08

CUT_MARKER = " [line cut: longer than {limit} bytes]"


def cut_marker(limit: int) -> str:
    return CUT_MARKER.format(limit=limit)


def generation_path(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def shift_generations(path: Path, keep: int) -> Path | None:
    """Make room for a new `.1`: `.k` -> `.k+1`, the oldest dropped. None when keep is 0."""
    with contextlib.suppress(OSError):
        generation_path(path, keep).unlink()
    if keep <= 0:
        return None
    for n in range(keep - 1, 0, -1):
        with contextlib.suppress(OSError):
            os.replace(generation_path(path, n), generation_path(path, n + 1))
    return generation_path(path, 1)


class Rotation(NamedTuple):
    """What a rotation did: newlines moved out; how many bytes left the front of the file
    (the reader's offset drops by that); bytes after the reader's offset that are only in
    `<name>.1` now (copy-truncate), to be read from there: [drain_from, drain_to)."""

    newlines: int
    removed: int
    drain_from: int = 0
    drain_to: int = 0


def _collapse(fd: int, length: int) -> None:
    collapse_range(fd, 0, length)


def collapse_range(fd: int, start: int, length: int) -> None:
    """Remove [start, start + length) from the file, what follows moving down (whole blocks,
    and not up to its end). Raises OSError: EOPNOTSUPP where the filesystem cannot."""
    rc = libc().fallocate(
        fd, _FALLOC_FL_COLLAPSE_RANGE, ctypes.c_longlong(start), ctypes.c_longlong(length)
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _copy_count(src: int, dst: int, start: int, end: int | None) -> tuple[int, int]:
    """Copy [start, end) (end None: until EOF); returns (end reached, newlines)."""
    pos, newlines = start, 0
    while end is None or pos < end:
        want = 1 << 20 if end is None else min(1 << 20, end - pos)
        block = os.pread(src, want, pos)
        if not block:
            break
        os.write(dst, block)
        newlines += block.count(b"\n")
        pos += len(block)
    return pos, newlines


def rotate_appended(
    path: Path, read_upto: int, keep: int, chase: int, max_copy: int = 0
) -> Rotation:
    """Rotate a file another process appends to into `<path>.1` (see the module doc).
    `max_copy` (0: no bound): `.1` gets at most the last `max_copy` bytes of what was read
    (the part before them was skipped by the reader: LogFollower.skip_backlog), so no
    generation is ever larger than a file's bound. `newlines` counts what `.1` got."""
    target = shift_generations(path, max(1, keep))
    assert target is not None
    src = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
        try:
            size = os.fstat(src).st_size
            block = os.fstat(src).st_blksize or 4096
            # Collapse needs whole blocks and must leave at least one byte.
            length = min(read_upto, size - 1) // block * block
            if length > 0:
                start = max(0, length - max_copy) if max_copy else 0
                _, newlines = _copy_count(src, dst, start, length)
                try:
                    _collapse(src, length)
                    return Rotation(newlines, length)
                except OSError as err:
                    if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                os.lseek(dst, 0, os.SEEK_SET)
                os.ftruncate(dst, 0)
            # Copy until the file stops growing (or `chase` past what was read), then
            # truncate at once: writes in between are the only ones that can be lost.
            start = max(0, read_upto - max_copy) if max_copy else 0
            end, newlines = _copy_count(src, dst, start, read_upto + chase)
            os.ftruncate(src, 0)
        finally:
            os.close(dst)
        return (
            Rotation(newlines, read_upto, read_upto - start, end - start)
            if end > read_upto
            else Rotation(newlines, read_upto)
        )
    finally:
        os.close(src)


def copy_out(path: Path, upto: int, keep: int, max_copy: int = 0) -> Rotation:
    """Copy the first `upto` bytes of `path` (the last `max_copy` of them at most) into a new
    `<path>.1`, older generations shifted; the file itself is left as it is, for the caller to
    truncate (LogFollower, in a flood: no collapse, no chase). `newlines` counts what `.1`
    got; `removed` is 0."""
    target = shift_generations(path, max(1, keep))
    assert target is not None
    src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
        try:
            start = max(0, upto - max_copy) if max_copy else 0
            _, newlines = _copy_count(src, dst, start, upto)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return Rotation(newlines, 0)


def read_tail_and_truncate(
    fd: int, read_from: int, max_read: int, cut_to: int
) -> tuple[int, bytes]:
    """The file's size, then its newest `max_read` bytes (none before `read_from`), then the
    file truncated at `cut_to` (its size at most): one run of calls no other thread of this
    process comes between, so that what another process appends meanwhile, which the
    truncate drops unread, is only what lands within those microseconds. Raises OSError."""
    lseek, pread, ftruncate = _gil_held_calls()
    size = lseek(fd, 0, os.SEEK_END)
    if size < 0:
        _raise_errno()
    start = max(read_from, size - max_read)
    data = b""
    if size > start:
        buf = ctypes.create_string_buffer(size - start)
        got = pread(fd, buf, size - start, start)
        if got < 0:
            _raise_errno()
        data = buf.raw[:got]
    if ftruncate(fd, min(cut_to, size)) != 0:
        _raise_errno()
    return size, data


@functools.cache
def _gil_held_calls() -> tuple[Any, Any, Any]:
    lib = libc_holding_gil()
    off_t, fd_t = ctypes.c_longlong, ctypes.c_int
    lseek = ctypes.PYFUNCTYPE(off_t, fd_t, off_t, ctypes.c_int)(("lseek", lib))
    pread = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, fd_t, ctypes.c_char_p, ctypes.c_size_t, off_t)(
        ("pread", lib)
    )
    ftruncate = ctypes.PYFUNCTYPE(ctypes.c_int, fd_t, off_t)(("ftruncate", lib))
    return lseek, pread, ftruncate


def _raise_errno() -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err))


class RotatingWriter:
    """A log file the host writes itself (job step logs), rotated by size."""

    def __init__(self, path: Path, max_bytes: int, keep: int):
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._f = open(path, "ab")
        self._size = self._f.tell()

    def write(self, data: bytes) -> None:
        if self._size and self._size + len(data) > self.max_bytes:
            self._f.close()
            target = shift_generations(self.path, self.keep)
            if target is not None:
                os.replace(self.path, target)
            else:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            self._f = open(self.path, "ab")
            self._size = 0
        self._f.write(data)
        self._f.flush()
        self._size += len(data)

    def close(self) -> None:
        self._f.close()

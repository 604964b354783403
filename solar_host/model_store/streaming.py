"""Streaming one HTTP body to a file while hashing it, and the cancel token that can stop it.

A body is received into a ring of preallocated buffers, hashed and written by two helper
threads (see the comment at BUF_SIZE), so a file is checked against its digest without being
read twice or held in memory. Every byte received is written before the stream returns,
whatever ends it, so a resume continues exactly where it stopped.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from solar_host.model_store.progress import ByteCounter
from solar_host.model_store.pull import Interrupted, LowSpeedGuard, PullError

# A body that keeps arriving at under MIN_RATE_BPS over RATE_WINDOW_S fails the pull (a read
# timeout alone lets a peer trickle a byte a minute for ever); what came stays for a resume.
MIN_RATE_BPS = 1024.0
RATE_WINDOW_S = 60.0


class CancelToken:
    """A cancel flag that can also close what a blocked thread is reading from."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._closers: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self.event.is_set()

    def cancel(self) -> None:
        self.event.set()
        with self._lock:
            closers, self._closers = self._closers, []
        for close in closers:
            try:
                close()
            except Exception:
                pass

    def child(self) -> CancelToken:
        """A token cancelled with this one, which can also be cancelled alone (the files of one
        pull stop together when one of them fails)."""
        token = CancelToken()
        self.on_cancel(token.cancel)
        if self.is_set():
            token.cancel()
        return token

    def on_cancel(self, close: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._closers.append(close)

        def forget() -> None:
            with self._lock:
                if close in self._closers:
                    self._closers.remove(close)

        return forget


class Cancelled(Exception):
    pass


# Streaming is a pipeline of three threads over a ring of preallocated buffers: the receiver
# fills a buffer from the socket, the hasher hashes it, the writer os.writes it and hands it back.
# recv, sha256 (~0.4 CPU-s per 500 MB that curl does not spend) and the copy into the page cache
# run in parallel (hashlib and os.write release the GIL), a write stalled by the disk does not
# stop the socket, and no bytes object is allocated per chunk. The ring bounds memory
# (BUFFERS * BUF_SIZE per blob in flight) and makes the receiver wait when a stage falls behind.
# Sizes measured on a loaded 2-core machine: a deep ring (16 MiB) absorbs the stalls of the disk
# and the scheduler; 256 KiB buffers cost less CPU than 1-4 MiB ones (likelier still in cache
# when hashed and written).
BUF_SIZE = 256 << 10
BUFFERS = 64
# Start the disk writes of what was written every this many bytes, so the fsync that makes the
# blob durable finds little left to flush instead of the whole file.
WRITEBACK_EVERY = 32 << 20


def make_durable(fd: int) -> None:
    """fsync one finished blob (a module function so bench/pull_throughput.py can time it)."""
    os.fsync(fd)


def durable_rename(part: Path, final: Path) -> None:
    fd = os.open(part, os.O_RDONLY)
    try:
        make_durable(fd)
    finally:
        os.close(fd)
    os.replace(part, final)


class _Pipeline:
    """Hash, then write to `fd` at `offset`, each buffer given in order; `take()` a free one."""

    def __init__(self, hasher: Any, fd: int, offset: int, counter: ByteCounter) -> None:
        self.hasher = hasher
        self.fd = fd
        self.counter = counter
        self.start = self.flushed = self.end = offset
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._to_hash: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self._to_write: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self._allocated = 0  # buffers are made on demand: a small blob needs only a few
        self.error: BaseException | None = None  # the first failure of a stage (ENOSPC, ...)
        self._threads = [
            threading.Thread(target=self._hash, name="blob-hash", daemon=True),
            threading.Thread(target=self._write, name="blob-write", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _hash(self) -> None:
        while (item := self._to_hash.get()) is not None:
            if self.error is None:
                try:
                    self.hasher.update(memoryview(item[0])[: item[1]])
                except BaseException as err:
                    self.error = err
            self._to_write.put(item)
        self._to_write.put(None)

    def _write(self) -> None:
        while (item := self._to_write.get()) is not None:
            buf, n = item
            if self.error is None:
                try:
                    write_all(self.fd, memoryview(buf)[:n])
                    self.end += n
                    self.counter.add(n)
                    if self.end - self.flushed >= WRITEBACK_EVERY:
                        start_writeback(self.fd, self.flushed, self.end - self.flushed)
                        self.flushed = self.end
                except BaseException as err:
                    self.error = err
            self._free.put(buf)  # also after a failure: the receiver must never wait forever

    def take(self) -> bytearray:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            if self._allocated < BUFFERS:
                self._allocated += 1
                return bytearray(BUF_SIZE)
            return self._free.get()

    def give(self, buf: bytearray, n: int) -> None:
        self._to_hash.put((buf, n))

    def close(self) -> int:
        """Wait until every buffer given is hashed and written; return the bytes written."""
        self._to_hash.put(None)
        for t in self._threads:
            t.join()
        if self.error is not None:
            raise self.error
        return self.end - self.start


def body_reader(resp: Any, length: int) -> Callable[[memoryview], int]:
    """readinto() for the raw body: straight from the socket when the length is known.

    urllib3 would return each chunk as a new bytes object (an allocation and a copy per MiB);
    with a Content-Length body the socket file under http.client is read into our buffer
    instead. Anything else (chunked, unknown length) falls back to urllib3.
    """
    fp = getattr(resp.raw, "_fp", None)  # http.client.HTTPResponse
    sock_file = getattr(fp, "fp", None)
    declared = getattr(fp, "length", None)
    if (
        getattr(fp, "chunked", True) is False
        and isinstance(declared, int)
        and declared == length
        and hasattr(sock_file, "readinto1")
    ):
        left = declared

        def read_socket(view: memoryview) -> int:
            nonlocal left
            if not left:
                return 0
            n = sock_file.readinto1(view[:left] if len(view) > left else view)
            left -= n
            return n

        return read_socket

    raw = resp.raw

    def read_urllib3(view: memoryview) -> int:
        data = raw.read1(len(view), decode_content=False)
        view[: len(data)] = data
        return len(data)

    return read_urllib3


def write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def stream_body(
    resp: Any,
    fd: int,
    offset: int,
    expected: int,
    hasher: Any,
    counter: ByteCounter,
    cancel: CancelToken,
    guard: LowSpeedGuard | None = None,
    pace: Callable[[int], None] | None = None,
) -> int:
    """Write the body (`expected` bytes) to `fd` from `offset`, hashing it on the way.

    Every byte received is written before this returns, whatever ends the stream (a cancel
    closes the socket under a blocked read), so a resume continues exactly where it stopped.
    `pace(n)` is told of every `n` bytes read and may wait (a rate cap). A body that goes on
    past `expected` bytes is refused: its size was announced, and the rest is never stored.
    """
    os.ftruncate(fd, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    read = body_reader(resp, expected)
    if guard is None:
        guard = LowSpeedGuard("The download", MIN_RATE_BPS, RATE_WINDOW_S)
    pipe = _Pipeline(hasher, fd, offset, counter)
    received = 0
    failure: BaseException | None = None
    try:
        while not cancel.is_set() and pipe.error is None:
            buf = pipe.take()
            view = memoryview(buf)[: min(BUF_SIZE, expected - received)]
            n = 0
            try:
                # Fill the buffer (a read returns what has arrived): one hash and one write per
                # buffer, however the network splits the stream.
                while n < len(view):
                    got = read(view[n:])
                    if not got:
                        break
                    n += got
                    guard.feed(got)
                    if pace is not None:
                        pace(got)
            except Exception as err:
                failure = err
            if n:
                pipe.give(buf, n)
                received += n
            if failure is not None or not n or received >= expected:
                break
    finally:
        written = pipe.close()  # a write error (ENOSPC) is raised from here as is
    if cancel.is_set():
        return written
    if isinstance(failure, PullError):
        raise failure
    if failure is not None:
        raise Interrupted(f"Download interrupted: {failure}") from failure
    if written < expected:
        raise Interrupted(
            f"Download interrupted: the server closed the connection after "
            f"{offset + written} of {offset + expected} bytes"
        )
    if _more(read):
        raise PullError(
            502,
            "model_pull_failed",
            f"{guard.what} sent more than the {offset + expected} bytes announced; refusing to "
            "store the rest",
        )
    return written


def _more(read: Callable[[memoryview], int]) -> bool:
    """Whether the body goes on past what was read (a body that ended reads nothing)."""
    try:
        return read(memoryview(bytearray(1))) > 0
    except Exception:
        return False  # the connection closed: nothing more came


_sync_file_range: Any = None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Queue the disk writes of a written range without waiting (Linux sync_file_range)."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            from solar_host.platform.libc import libc

            fn = libc().sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError):
            pass
    if _sync_file_range:
        _sync_file_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; a failure is harmless


def abort_response(resp: Any) -> None:
    """Wake a thread blocked reading `resp` (close() alone does not interrupt a recv)."""
    import socket

    conn = getattr(resp.raw, "_connection", None)
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    resp.close()

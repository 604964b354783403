"""One inotify descriptor for every followed log file, dispatching by watch descriptor."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import struct
from collections.abc import Callable
from pathlib import Path

from solar_host.platform.libc import libc as c_library

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

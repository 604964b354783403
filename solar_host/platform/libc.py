"""The C library, for the few Linux calls the standard library lacks (inotify, fallocate's
collapse, sync_file_range, Landlock's syscalls).

Opened as the program's own symbols (dlopen(NULL)), which include libc: never through
ctypes.util.find_library, which runs `/sbin/ldconfig -p` in a child process. Called on the
event loop, that blocked the loop for the child's run, and the child, between its fork and
its exec, carried the host's whole environment, so a scan for backends by environment found
a stranger beside them.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library with errno kept (ctypes.get_errno after a failed call). Raises OSError
    where the program cannot be opened as a library."""
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def libc_holding_gil() -> ctypes.PyDLL:
    """The same library, called without letting go of the GIL: for a few short calls in a row
    that no other Python thread may come between (each call through libc(), like each os.*
    call, lets go of it, and taking it back can wait a switch interval, 5 ms, or more)."""
    return ctypes.PyDLL(None, use_errno=True)

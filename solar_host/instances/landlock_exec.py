"""Start a backend under a Landlock ruleset, from a thread that restricts itself first.

Landlock, no_new_privs and the capability sets belong to a thread, not to the process, and a
child inherits those of the thread that cloned it. So the host starts a short-lived thread,
restricts that thread alone (no_new_privs, landlock_restrict_self, and for root the
capabilities that step around the ruleset), spawns the backend from it and lets it end. The
restriction holds across exec, for the backend and everything it starts; the host's other
threads never had it.

Before, the backend was started through this file run as a program (`python -I -S`, which
restricted itself and exec'd the backend): a second interpreter's start-up, 19 ms of every
start. A preexec_fn would do it in the child without one, but forces subprocess from vfork onto
fork(), which copies the page tables of the whole host while it holds the GIL (94 ms a spawn
for a 1.5 GB process, against 0.26 ms), so 200 starts at once stalled the event loop. The
thread keeps vfork, and the backend gets exactly the environment it was given (the launcher's
interpreter had to put back the LC_CTYPE that PEP 538 changed).

A start does its spawning work (the policy, the ruleset, the spawn) in a thread of its own that
ends with it (`in_disposable_thread`); a spawn there restricts that thread itself, instead of
handing the spawn from a worker thread to yet another thread and back. Each hand-over between
threads waits for the kernel to run the thread woken, about 0.1 ms on an idle machine and
1-3 ms on a busy one.
"""

from __future__ import annotations

import _thread
import ctypes
import os
import subprocess
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from solar_host.platform.libc import libc as c_library

_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_SYS_LANDLOCK_RESTRICT_SELF = 446
# Capabilities that would let a backend of a host run as root step around the ruleset: read
# another process's memory and environment (SYS_PTRACE: Landlock lets it trace the host), open
# files by handle (DAC_READ_SEARCH), make device nodes or do raw I/O (MKNOD, SYS_RAWIO), mount,
# load modules or BPF programs, bypass the LSMs (SYS_ADMIN, SYS_MODULE, BPF, PERFMON,
# MAC_*), reboot. Dropped from the bounding set before exec, so root's backend never has them.
_DROP_CAPS = (2, 16, 17, 19, 21, 22, 27, 32, 33, 38, 39)
_CAP_VERSION_3 = 0x20080522
T = TypeVar("T")


class _ThisThread(threading.local):
    # True in the threads in_disposable_thread starts: they end with their work, so a spawn
    # there may restrict the thread itself.
    disposable = False


_this_thread = _ThisThread()


class NotConfined(OSError):
    """The thread could not be restricted: nothing was spawned."""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _clear_inheritable(libc: ctypes.CDLL) -> None:
    """Empty this thread's inheritable set (and with it the ambient one), which exec would
    otherwise carry past the bounding set. Usually empty already; some container runtimes
    fill it."""
    header = _CapHeader(_CAP_VERSION_3, 0)  # pid 0: the calling thread
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return
    if not (data[0].inheritable or data[1].inheritable):
        return
    data[0].inheritable = data[1].inheritable = 0
    libc.capset(ctypes.byref(header), data)


def _restrict_this_thread(ruleset_fd: int) -> None:
    libc = c_library()
    if (
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        or libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset_fd, 0) != 0
    ):
        err = ctypes.get_errno()
        raise NotConfined(err, f"cannot confine the backend: {os.strerror(err)}")
    if os.geteuid() == 0:
        for cap in _DROP_CAPS:  # EINVAL for one this kernel does not know: nothing to drop
            libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
        _clear_inheritable(libc)


def in_disposable_thread(fn: Callable[[], T], done: Callable[[T | BaseException], None]) -> None:
    """Run `fn()` in a new thread that ends with it, then `done(its result or exception)` in
    that thread. Returns at once: the thread is not waited for to start (threading.Thread.start
    would block the caller, an event loop, until the kernel runs it)."""

    def main() -> None:
        _this_thread.disposable = True
        try:
            outcome: Any = fn()
        except BaseException as err:  # handed to `done`
            outcome = err
        done(outcome)

    _thread.start_new_thread(main, ())


def spawn_confined(
    ruleset_fd: int, popen: Callable[[], subprocess.Popen[Any]]
) -> subprocess.Popen[Any]:
    """`popen()` (a subprocess.Popen without preexec_fn) called from a thread restricted by
    the ruleset: the child it spawns is confined from its first instruction. That thread is
    the calling one where it is disposable (in_disposable_thread), else a new one. Blocking (the
    spawn; a thread's start and join). Raises NotConfined, or what `popen` raised."""
    if _this_thread.disposable:
        # Its restriction cannot be lifted, and it ends with the start it serves.
        _restrict_this_thread(ruleset_fd)
        return popen()
    outcome: list[Any] = []

    def run() -> None:
        try:
            _restrict_this_thread(ruleset_fd)
            outcome.append(popen())
        except BaseException as err:  # handed to the caller's thread
            outcome.append(err)

    # Never reused: its restriction cannot be lifted, and it ends with the spawn.
    thread = threading.Thread(target=run, name="confined-spawn", daemon=True)
    thread.start()
    thread.join()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result

"""The host's side of log relays (log_relay.py): start one per backend, find the one of an
adopted backend, wait for one to have written all its backend said.

A relay is the host's child while the host that spawned it lives, and nobody's afterwards:
it runs in a session of its own with an empty environment, so ownership.py never counts it
among a backend's processes, and a stop never signals it; it exits by itself once every
writer of its pipe is gone. Its children are reaped here (`reap`), at each start and wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from solar_host.instances import ownership, procfs, signals
from solar_host.instances.ownership import Identity

PROGRAM = str(Path(__file__).with_name("log_relay.py"))
# The pipe's buffer: what a backend writes without waiting while its relay is descheduled.
# Not more: past pipe-user-pages-soft (64 MiB of pipes per user) the kernel gives every new
# pipe of the user one page, other programs' too; 256 KiB is 256 backends' worth.
PIPE_BYTES = 256 * 1024
# How long a backend that exited gets for its relay to write what is left in the pipe
# (it exits at end of file) before its log is read a last time.
DRAIN_S = 2.0
NO_BOUND = 1 << 62  # a log file without a bound (a spawn outside a start: benches, tests)

_children: list[subprocess.Popen[bytes]] = []


@dataclass(frozen=True, slots=True)
class Relay:
    identity: Identity


def pipe() -> tuple[int, int]:
    """A pipe for a backend's output: (read end, write end), both close-on-exec."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # a pipe of the default size is slower, not wrong
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return read_end, write_end


def start(read_end: int, log_path: Path, bound: int) -> Relay:
    """A relay that appends what it reads from `read_end` (a pipe: the caller closes its own
    end afterwards) to `log_path`, within `bound` bytes. Blocking (fork/exec)."""
    reap()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-I", "-S", PROGRAM, str(bound)],
            stdin=read_end,
            stdout=log_fd,
            stderr=log_fd,  # its own traceback, should it ever have one
            env={},
            cwd="/",
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(log_fd)
    _children.append(popen)
    st = procfs.stat(popen.pid)
    ident = Identity(procfs.boot_id(), popen.pid, st.start_ticks if st is not None else -1)
    return Relay(ident)


def reap() -> None:
    """Collect the relays of this host that have exited (no zombies left behind)."""
    _children[:] = [p for p in _children if p.poll() is None]


def _pipe_readers() -> dict[str, list[int]]:
    """Processes by the pipe their standard input is (`pipe:[inode]`): one pass over procfs."""
    found: dict[str, list[int]] = {}
    for pid in procfs.pids():
        target = procfs.fd_target(pid, 0)
        if target is not None and target.startswith("pipe:"):
            found.setdefault(target, []).append(pid)
    return found


pipe_readers = ownership.SharedScan(_pipe_readers)


def relay_of(backend_pid: int) -> Relay | None:
    """The relay reading the live backend's standard output, or None (a backend spawned by an
    older host writes its file itself). Blocking (a scan of procfs)."""
    target = procfs.fd_target(backend_pid, 1)
    if target is None or not target.startswith("pipe:"):
        return None
    for pid in pipe_readers().get(target, ()):
        with contextlib.suppress(OSError):
            if "log_relay.py" in ownership.programs_of(ownership.cmdline_of(pid)):
                ident = ownership.identity_of(pid)
                if ident is not None:
                    return Relay(ident)
    return None


def log_file_of(backend_pid: int) -> Path | None:
    """The file the live backend's output ends up in: its relay's, or its own stdout's."""
    relay = relay_of(backend_pid)
    return ownership.stdout_path(relay.identity.pid if relay is not None else backend_pid)


def restart(backend: Identity, log_path: Path, bound: int) -> Relay | None:
    """A new relay for a live backend whose relay ended (killed, OOM-killed) while it writes
    on: started on the backend's own pipe, reopened through /proc/<pid>/fd/1 (for a pipe that
    opens the same pipe, read end). None when the backend is gone, its output is no pipe any
    more (it closed it), or another reader already relays it (that one is returned).
    Blocking (procfs, fork/exec)."""
    pid = backend.pid
    target = procfs.fd_target(pid, 1)
    if target is None or not target.startswith("pipe:") or not ownership.is_same(backend):
        return None
    existing = relay_of(pid)
    if existing is not None:
        return existing
    try:
        # O_NONBLOCK: a pipe opened through /proc waits for a writer like a FIFO; it has one.
        read_end = os.open(f"/proc/{pid}/fd/1", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None  # it ended meanwhile, or it is not ours to read
    try:
        os.set_blocking(read_end, True)
        if procfs.fd_target(pid, 1) != target:  # its fd 1 changed between the looks
            return None
        return start(read_end, log_path, bound)
    finally:
        os.close(read_end)


async def exited(relay: Relay, timeout: float | None = None) -> bool:
    """Wait until the relay exited, at most `timeout` seconds (None: for as long as it runs).
    True if it did."""
    try:
        fd = os.pidfd_open(relay.identity.pid)
    except OSError:
        return True  # gone (reaped already)
    try:
        return not ownership.is_same(relay.identity) or await signals.ended(fd, timeout)
    finally:
        os.close(fd)
        reap()


async def drained(relay: Relay, timeout: float = DRAIN_S) -> bool:
    """Wait until the relay exited (it wrote all its pipe held: every writer is gone), at most
    `timeout` (a process the backend left holding the pipe keeps it open). True if it did."""
    return await exited(relay, timeout)

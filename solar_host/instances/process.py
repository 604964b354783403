"""Backend processes: spawn detached from the host, recognise them again, signal their group.

A backend runs in its own session and process group with its output appended to its log file,
so it never waits on the host and keeps serving when the host dies. Identity is (pid, start time,
command line): a recorded pid alone could belong to another process by now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22).

    Unlike psutil's create_time, which adds the boot time as the wall clock sees it *now*,
    this never moves when the clock is adjusted, so it identifies a process exactly across
    host restarts.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
    except (ValueError, IndexError):
        return None


@dataclass(slots=True)
class BackendProcess:
    """A backend process the host owns, spawned now (`popen` set) or re-adopted."""

    pid: int
    create_time: float
    cmdline: list[str]
    popen: subprocess.Popen[bytes] | None = None
    start_ticks: int | None = None

    @property
    def is_child(self) -> bool:
        return self.popen is not None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return identity_matches(self.pid, self.create_time, self.cmdline, self.start_ticks)

    def exit_code(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        return None


def spawn(argv: list[str], env: Mapping[str, str], log_path: Path) -> BackendProcess:
    """Start `argv` in a new session with stdout+stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(fd)
    # Popen returns after exec, so this is the backend's own identity (for a script with a
    # shebang the kernel shows the interpreter first: record what the kernel shows).
    create_time, cmdline = 0.0, list(argv)
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(popen.pid)
        create_time, cmdline = p.create_time(), p.cmdline() or cmdline
    return BackendProcess(
        pid=popen.pid,
        create_time=create_time,
        cmdline=cmdline,
        popen=popen,
        start_ticks=start_ticks(popen.pid),
    )


def identity_matches(
    pid: int, create_time: float, cmdline: list[str], ticks: int | None = None
) -> bool:
    """True when `pid` is still the very process recorded (not a recycled pid)."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        if ticks is not None:
            if start_ticks(pid) != ticks:
                return False
        elif abs(p.create_time() - create_time) > 1.0:
            return False  # no tick count recorded: the wall-clock start time, loosely
        return p.cmdline() == cmdline
    except (psutil.Error, OSError):
        return False


def adopt(
    pid: int, create_time: float, cmdline: list[str], ticks: int | None = None
) -> BackendProcess | None:
    if identity_matches(pid, create_time, cmdline, ticks):
        return BackendProcess(pid=pid, create_time=create_time, cmdline=cmdline, start_ticks=ticks)
    return None


def adopt_any(pid: int) -> BackendProcess | None:
    """Wrap a live process by pid alone (its identity is taken from it now)."""
    try:
        p = psutil.Process(pid)
        return BackendProcess(
            pid=pid, create_time=p.create_time(), cmdline=p.cmdline(), start_ticks=start_ticks(pid)
        )
    except (psutil.Error, OSError):
        return None


def log_writers(log_dir: Path) -> dict[int, Path]:
    """Process-group leaders whose stdout is a file in `log_dir` (backends we spawned)."""
    try:
        root = log_dir.resolve()
    except OSError:
        return {}
    found: dict[int, Path] = {}
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == me:
            continue
        try:
            target = Path(os.readlink(f"/proc/{pid}/fd/1"))
            if target.parent != root or target.suffix != ".log":
                continue
            if os.getpgid(pid) != pid:
                continue  # a worker of a backend: its group leader is what we stop
        except OSError:
            continue
        found[pid] = target
    return found


def signal_group(proc: BackendProcess, sig: int) -> None:
    """Signal the backend's whole process group (its workers too), never another process."""
    if not proc.alive():
        return
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    try:
        if pgid == proc.pid:
            os.killpg(pgid, sig)
        else:  # not a group leader (should not happen): signal the process alone
            os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as err:
        log.warning("cannot signal backend pid %s: %s", proc.pid, err)


def kill_group_leftovers(pgid: int) -> None:
    """SIGKILL whatever is left of a process group (workers that outlived their leader)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def wait_exit(proc: BackendProcess, timeout: float | None = None) -> bool:
    """Wait until the process exits (reaping our own children). True if it exited."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    fd = -1
    try:
        fd = os.pidfd_open(proc.pid)
    except (ProcessLookupError, OSError):
        fd = -1
    if fd >= 0:
        loop.add_reader(fd, lambda: exited.done() or exited.set_result(True))
    try:
        if fd < 0:
            # No pidfd (gone already, or an old kernel): poll.
            async def poll() -> None:
                while proc.alive():
                    await asyncio.sleep(0.05)

            try:
                async with asyncio.timeout(timeout):
                    await poll()
            except TimeoutError:
                return False
        else:
            if proc.popen is not None and proc.popen.poll() is not None:
                return True
            try:
                async with asyncio.timeout(timeout):
                    await exited
            except TimeoutError:
                return False
    finally:
        if fd >= 0:
            loop.remove_reader(fd)
            os.close(fd)
    if proc.popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=1)
    return True


async def terminate(proc: BackendProcess, grace_s: float) -> int | None:
    """SIGTERM the group, wait `grace_s`, then SIGKILL. Returns the exit code when known."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    signal_group(proc, signal.SIGTERM)
    if not await wait_exit(proc, grace_s):
        log.warning("backend pid %s ignored SIGTERM for %.1fs; killing it", proc.pid, grace_s)
        signal_group(proc, signal.SIGKILL)
        await wait_exit(proc, 10.0)
    if pgid is not None:
        kill_group_leftovers(pgid)
    return proc.exit_code()

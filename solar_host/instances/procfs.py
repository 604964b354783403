"""Linux /proc, read in one place: the kernel's facts about processes, and nothing decided.

Whether a process is ours is ownership.py's question, what to do about it process.py's; this
module only reads: a process's stat fields (one at a time, or the whole process table in one
pass), its exec'd environment and command line, its descriptors, its name, the TCP listening
table (where sock_diag is not allowed), the boot's id, uptime and start time.

Every read is a snapshot: a process may exit (or its pid be reused) right after. What proves
a process is still the one meant is an Identity compared afterwards (ownership.is_same).
Everything here blocks: callers on the event loop use asyncio.to_thread.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
_GONE = (b"Z", b"X")  # zombie, dead: exited, not (yet) reaped


@dataclass(frozen=True, slots=True)
class Stat:
    """The fields of /proc/<pid>/stat the host uses."""

    state: bytes  # R, S, D, Z, ...
    ppid: int
    pgid: int
    sid: int
    start_ticks: int  # since boot, in clock ticks: never moves when the clock is set
    cpu_ticks: int  # user + system time of every thread, in clock ticks

    @property
    def exited(self) -> bool:
        """A zombie (or dead) process: ended, only its entry is left until it is reaped."""
        return self.state in _GONE


@functools.cache
def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


@functools.cache
def boot_id() -> str:
    """This boot's id (/proc/sys/kernel/random/boot_id); constant until the machine reboots."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def uptime_s() -> float:
    """Seconds since boot, on the boot clock (raises OSError or ValueError when unreadable)."""
    with open("/proc/uptime", "rb") as f:
        return float(f.read().split()[0])


def boot_time() -> int:
    """When the machine booted, in seconds since the epoch (/proc/stat's btime)."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return int(line.split()[1])
    raise OSError("/proc/stat has no btime")


def stat(pid: int) -> Stat | None:
    """/proc/<pid>/stat, or None when the process is gone or the file unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return _parse_stat(data)


def _parse_stat(data: bytes) -> Stat | None:
    # The name (field 2) may hold spaces and parentheses: fields are counted from its end.
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return Stat(
            state=fields[0],
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            sid=int(fields[3]),
            start_ticks=int(fields[19]),
            cpu_ticks=int(fields[11]) + int(fields[12]),
        )
    except (ValueError, IndexError):
        return None


def pids(*, include_self: bool = False) -> list[int]:
    """Every pid /proc lists now (this process's own left out unless asked for)."""
    me = -1 if include_self else os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(n) for n in names if n.isdigit() and int(n) != me]


def table(*, include_self: bool = False) -> dict[int, Stat]:
    """The process table: pid -> its stat fields, for every process readable now, in one pass
    (zombies included: callers that want the living skip `exited` ones)."""
    found: dict[int, Stat] = {}
    for pid in pids(include_self=include_self):
        st = stat(pid)
        if st is not None:
            found[pid] = st
    return found


def _read_small(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


def children(pid: int) -> list[int] | None:
    """The children of `pid`, from /proc/<pid>/task/<tid>/children (each thread lists those it
    forked): reads only this process's entries, where a scan of the table costs milliseconds
    on a busy machine. [] when it is gone; None where the kernel has no such file
    (CONFIG_PROC_CHILDREN off: scan `table()` instead)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        data = _read_small(f"/proc/{pid}/task/{tid}/children")
        if data is None:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended meanwhile
            return None
        out.extend(int(x) for x in data.split())
    return out


@functools.cache
def page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int:
    """Resident bytes of one process (/proc/<pid>/statm); 0 when it is gone."""
    data = _read_small(f"/proc/{pid}/statm")
    try:
        return int(data.split()[1]) * page_size() if data else 0
    except (IndexError, ValueError):
        return 0


def entry_time(pid: int) -> float | None:
    """When /proc/<pid> appeared (its directory's mtime): about when the process started, on
    the wall clock."""
    try:
        return os.stat(f"/proc/{pid}").st_mtime
    except OSError:
        return None


def environ(pid: int) -> list[bytes] | None:
    """The NAME=value items `pid` was exec'd with (None when unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def cmdline(pid: int) -> list[str]:
    """The process's command line (raises OSError once it is gone)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    return [a.decode("utf-8", "replace") for a in argv]


def comm(pid: int) -> str | None:
    """The process's name (its executable's, at most 15 bytes), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def fd_target(pid: int, fd: int) -> str | None:
    """What descriptor `fd` of the process points at (a path, `socket:[inode]`, ...)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None


def holds_socket(pid: int, inodes: set[int]) -> bool:
    """Whether one of the process's descriptors is one of these sockets (False where its
    descriptors cannot be read)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    wanted = {f"socket:[{i}]" for i in inodes}
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
    return False


def tcp_listeners() -> dict[int, set[int]]:
    """Listening TCP sockets (IPv4 and IPv6) as port -> socket inodes, from /proc/net/tcp and
    tcp6: where the kernel's sock_diag is not allowed (sockdiag.tcp_listeners is faster)."""
    found: dict[int, set[int]] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) < 10 or cols[3] != _LISTEN:
                        continue
                    with contextlib.suppress(ValueError):
                        port = int(cols[1].rsplit(":", 1)[1], 16)
                        found.setdefault(port, set()).add(int(cols[9]))
        except OSError:
            continue
    return found


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags (/proc/cpuinfo); None where the kernel does not say."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        return None
    return None


def own_cgroup() -> str | None:
    """This process's /proc/self/cgroup, or None when unreadable."""
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return None

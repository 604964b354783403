"""procfs: the one reader of /proc reads what the kernel says about real processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from solar_host.instances import procfs


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_stat_of_this_process_is_what_the_kernel_says() -> None:
    me = procfs.stat(os.getpid())
    assert me is not None and not me.exited
    assert (me.ppid, me.pgid, me.sid) == (os.getppid(), os.getpgid(0), os.getsid(0))
    assert 0 < me.start_ticks / procfs.clock_ticks() <= procfs.uptime_s()
    assert me.cpu_ticks >= 0
    assert procfs.stat(-1) is None


def test_the_table_holds_children_the_living_and_the_exited(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    with log.open("wb") as out:
        child = subprocess.Popen(
            ["sleep", "30"], stdout=out, env={"PROCFS_TEST": "yes"}, start_new_session=True
        )
    done = subprocess.Popen(["true"])
    try:
        _wait_for(lambda: (s := procfs.stat(done.pid)) is not None and s.exited, 10, "a zombie")
        table = procfs.table()
        assert os.getpid() not in table
        assert os.getpid() in procfs.table(include_self=True)
        entry = table[child.pid]
        assert entry.ppid == os.getpid() and entry.sid == child.pid == entry.pgid
        assert not entry.exited and table[done.pid].exited  # exited, not yet reaped
        assert child.pid in procfs.pids() and os.getpid() not in procfs.pids()

        assert b"PROCFS_TEST=yes" in (procfs.environ(child.pid) or [])
        _wait_for(lambda: procfs.cmdline(child.pid) == ["sleep", "30"], 10, "the exec")
        assert procfs.comm(child.pid) == "sleep"
        assert procfs.fd_target(child.pid, 1) == str(log)
        entered = procfs.entry_time(child.pid)
        assert entered is not None and abs(entered - time.time()) < 60
        started = procfs.boot_time() + entry.start_ticks / procfs.clock_ticks()
        assert abs(started - time.time()) < 60
    finally:
        child.kill()
        child.wait(10)
        done.wait(10)


def test_sockets_held_and_listening() -> None:
    listening = socket.socket()
    bound = socket.socket()
    try:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        bound.bind(("127.0.0.1", 0))
        inode = os.fstat(listening.fileno()).st_ino
        port = listening.getsockname()[1]
        assert procfs.holds_socket(os.getpid(), {inode})
        assert not procfs.holds_socket(os.getpid(), {0})
        table = procfs.tcp_listeners()
        assert inode in table[port]
        assert bound.getsockname()[1] not in table
    finally:
        listening.close()
        bound.close()


def test_this_boot_has_an_id() -> None:
    assert len(procfs.boot_id()) == 36
    assert procfs.uptime_s() > 0 and procfs.boot_time() < time.time()


def test_a_name_with_spaces_and_parentheses_does_not_shift_the_fields(tmp_path: Path) -> None:
    odd = tmp_path / "a) b (c"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        _wait_for(lambda: procfs.comm(child.pid) == "a) b (c", 10, "the exec")
        entry = procfs.stat(child.pid)
        assert entry is not None and entry.ppid == os.getpid() and entry.state in b"RSD"
    finally:
        child.kill()
        child.wait(10)

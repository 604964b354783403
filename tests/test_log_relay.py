"""The log relay (instances/log_relay.py, relays.py): the one writer of a backend's log file.

Real processes, real pipes and files: the relay never writes past its bound however fast its
pipe fills, says what it dropped, writes the last lines once there is room, exits at end of
file; a backend survives its relay's death; ownership never takes a relay for a backend of
ours; and a backend left running by a SIGKILLed host keeps its log written through its relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from solar_host.instances import confinement, landlock_exec, ownership, relays
from solar_host.instances import process as procs
from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import started
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

FLOOD = (
    "import os, sys\n"
    "block = (b'E' * 200 + b'\\n') * 256\n"
    "for _ in range(int(sys.argv[1])):\n"
    "    os.write(1, block)\n"
    "os.write(1, b'the last line\\n')\n"
)
TICKER = (
    "import os, time\n"
    "side = os.open(os.environ['SIDE'], os.O_WRONLY | os.O_APPEND)\n"
    "for i in range(600):\n"
    "    try:\n"
    "        os.write(1, b'tick %d\\n' % i)\n"
    "    except OSError as err:\n"
    "        os.write(side, b'write failed: %d\\n' % err.errno)\n"
    "    os.write(side, b'alive %d\\n' % i)\n"
    "    time.sleep(0.02)\n"
)


def gone(ident: ownership.Identity) -> bool:
    return not ownership.is_same(ident)


def test_the_relay_never_writes_past_its_bound_and_says_what_it_dropped(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    bound = 256 * 1024
    read_end, write_end = relays.pipe()
    try:
        relay = relays.start(read_end, log, bound)
    finally:
        os.close(read_end)
    # ~200 MB as fast as a process can write them, against a "host" that rotates the file only
    # now and then (a host descheduled for tens of ms at a time). Each rotation reads and
    # empties the file with the relay stopped (SIGSTOP), so that no write falls between the
    # read and the truncate: before, a rotation could erase the relay's last write unread, or
    # come before the relay had written its pipe backlog, which filled the room again and left
    # the last line waiting for a rotation that never came (the relay then exits without it).
    pid = relay.identity.pid
    seen: list[bytes] = []  # what each rotation found in the file

    def rotate() -> bytes:
        os.kill(pid, signal.SIGSTOP)
        try:
            data = log.read_bytes()
            os.truncate(log, 0)
        finally:
            os.kill(pid, signal.SIGCONT)
        seen.append(data)
        return data

    writer = subprocess.Popen([sys.executable, "-c", FLOOD, "4000"], stdout=write_end)
    os.close(write_end)
    biggest = 0
    deadline = time.monotonic() + 60
    while writer.poll() is None and time.monotonic() < deadline:
        size = log.stat().st_size
        biggest = max(biggest, size)
        if size > bound // 2:
            rotate()
        time.sleep(0.01)
    assert writer.wait(timeout=60) == 0
    # The flood is over: rotations go on (as the host's do) until the last line has arrived.
    last = b""
    deadline = time.monotonic() + 20
    while not last.endswith(b"the last line\n") and time.monotonic() < deadline:
        last = rotate()
        biggest = max(biggest, len(last))
        time.sleep(0.05)
    wait_for(lambda: gone(relay.identity), 20, "the relay to exit at end of file")
    relays.reap()
    print(f"relay under a flood: peak {biggest} bytes (bound {bound}), {len(seen)} rotations")
    assert biggest <= bound
    assert last.endswith(b"the last line\n"), last[-300:]
    told = [d for d in seen if b"bytes dropped: the backend wrote faster" in d]
    assert told, "no rotation found a line saying what was dropped"
    # The line saying so starts a line of its own.
    for data in told:
        i = data.index(b"solar-host: ")
        assert i == 0 or data[i - 1 : i] == b"\n"


def test_a_quiet_backend_loses_nothing_and_its_relay_exits_with_it(tmp_path: Path) -> None:
    log = tmp_path / "q.log"
    argv = [sys.executable, "-c", "import sys\nfor i in range(1000): print('line', i)\n"]
    proc = procs.spawn(argv, {"PATH": os.defpath}, log, tmp_path, log_bound=1 << 20)
    assert proc.relay is not None
    assert proc.popen is not None and proc.popen.wait(timeout=30) == 0
    assert asyncio.run(relays.drained(proc.relay, 20.0))
    lines = log.read_text().splitlines()
    assert lines == [f"line {i}" for i in range(1000)]
    relays.reap()
    assert not os.path.exists(f"/proc/{proc.relay.identity.pid}"), "its relay was not reaped"


def test_a_backend_survives_the_death_of_its_relay(tmp_path: Path) -> None:
    """SIGPIPE stays ignored in the backend: with no reader left, a write to its pipe fails
    (EPIPE), and it goes on serving."""
    log, side = tmp_path / "t.log", tmp_path / "side"
    side.touch()
    env = {"PATH": os.defpath, "SIDE": str(side)}
    proc = procs.spawn([sys.executable, "-c", TICKER], env, log, tmp_path, log_bound=1 << 20)
    assert proc.relay is not None and proc.popen is not None
    try:
        wait_for(lambda: b"tick 5\n" in log.read_bytes(), 20, "the backend's first lines")
        os.kill(proc.relay.identity.pid, signal.SIGKILL)
        wait_for(lambda: b"write failed: 32\n" in side.read_bytes(), 20, "a write to fail: EPIPE")
        before = side.read_bytes().count(b"alive")
        wait_for(lambda: side.read_bytes().count(b"alive") > before + 5, 20, "it to go on")
        assert proc.popen.poll() is None, "the backend died with its relay"
    finally:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)
        relays.reap()


def test_a_relay_is_never_taken_for_a_backend_of_ours(tmp_path: Path) -> None:
    log = tmp_path / "o.log"
    marker = ownership.marker("f" * 32, "relay-test")
    env = {"PATH": os.defpath, ownership.MARKER_VAR: marker}
    argv = [sys.executable, "-c", "import time\nprint('up', flush=True)\ntime.sleep(60)\n"]
    proc = procs.spawn(argv, env, log, tmp_path, log_bound=1 << 20)
    assert proc.relay is not None and proc.popen is not None
    relay = proc.relay.identity
    try:
        wait_for(lambda: b"up\n" in log.read_bytes(), 20, "its first line")
        assert ownership.marker_of(relay.pid) is None
        assert relay.pid not in [i.pid for i in ownership.carriers(marker)]
        assert relay.pid not in [
            i.pid for i in ownership.backend_processes(proc.identity, marker, None, frozenset())
        ]
        assert os.getsid(relay.pid) == relay.pid != os.getsid(proc.pid)
        # Found again from the backend alone (what a host that adopts it has), with its file.
        assert relays.relay_of(proc.pid) == proc.relay
        assert relays.log_file_of(proc.pid) == log
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)
    assert asyncio.run(relays.drained(proc.relay, 20.0))


def start_kept(h: HostProc) -> tuple[str, int, int]:
    """Start a host and one scripted backend under it, alias `kept`: (id, port, pid)."""
    h.start()
    inst = started(h, alias="kept")
    return inst["id"], inst["port"], inst["pid"]


def test_a_backend_left_by_a_killed_host_keeps_its_log_written(tmp_path: Path) -> None:
    with HostProc(tmp_path / "h") as h:
        iid, port, pid = start_kept(h)
        relay = relays.relay_of(pid)
        assert relay is not None
        [log] = (h.tmp / "logs").glob("kept_*.log")
        h.kill()
        # No host runs: the backend writes to its standard output (the fake appends a line
        # to what it is told), and the line reaches the file through the relay.
        url = f"http://127.0.0.1:{port}/write?path=/proc/self/fd/1"
        assert httpx.get(url, timeout=10).json() == {"wrote": "ok"}
        wait_for(lambda: b"written by the backend" in log.read_bytes(), 20, "the line in the file")
        assert ownership.is_same(relay.identity)
        h.start()
        with h.client() as c:
            wait_for(
                lambda: c.get(f"/instances/{iid}").json()["status"] == "running", 30, "adoption"
            )
            assert c.get(f"/instances/{iid}").json()["pid"] == pid
            # The new host follows the same file: what was written meanwhile, and after.
            assert httpx.get(url, timeout=10).json() == {"wrote": "ok"}

            def lines() -> str:
                return str(c.get(f"/instances/{iid}/logs").json())

            wait_for(lambda: lines().count("written by the backend") == 2, 20, "both lines")
            r = c.post(f"/instances/{iid}/stop")
            assert r.status_code == 200, r.text
        # Its relay went with it (end of file), nothing of it left behind.
        wait_for(lambda: gone(relay.identity), 20, "the relay to exit after the stop")


def test_relays_started_at_once_each_write_their_own_file(tmp_path: Path) -> None:
    """Spawns from several threads (the host spawns off its event loop): no pipe end leaks
    into another backend or relay, or a relay would never see end of file."""
    procs_: list[procs.BackendProcess] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        argv = [sys.executable, "-c", f"print('backend {i}')"]
        p = procs.spawn(argv, {"PATH": os.defpath}, tmp_path / f"{i}.log", tmp_path)
        with lock:
            procs_.append(p)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(procs_) == 8
    for p in procs_:
        assert p.popen is not None and p.popen.wait(timeout=30) == 0
        assert p.relay is not None
        assert asyncio.run(relays.drained(p.relay, 20.0)), "a relay never saw end of file"
    for i in range(8):
        assert (tmp_path / f"{i}.log").read_text() == f"backend {i}\n"
    relays.reap()


@pytest.mark.skipif(confinement.abi_version() < 2, reason="needs Landlock ABI 2 or later")
def test_a_confined_spawn_that_restricts_its_own_thread_leaves_the_relay_free(
    tmp_path: Path,
) -> None:
    """A start spawns in a thread that ends with it, and a confined spawn there restricts that
    thread itself (landlock_exec): what that thread made afterwards would be confined like the
    backend, kept out of LOG_DIR and from the host's interpreter. The relay comes from a thread
    made before."""
    logs = tmp_path / "logs"
    state = confinement.HostState(tmp_path / "config.json", logs, tmp_path / "jobs")
    # Not the host's interpreter (which the relay runs): the backend's policy names its own.
    argv = ["/bin/sh", "-c", "echo confined and logged"]
    # Its TMPDIR elsewhere: /tmp, where the logs are, is not a tree it may write.
    env = {"PATH": os.defpath, "TMPDIR": str(tmp_path / "scratch")}
    policy = confinement.access_policy(
        roots=[tmp_path / "models"], argv=argv, env=env, host_state=state
    )
    done: list[object] = []
    landlock_exec.in_disposable_thread(
        lambda: procs.spawn(argv, env, logs / "c.log", tmp_path, policy, "required"), done.append
    )
    wait_for(lambda: done, 30, "the spawn")
    [proc] = done
    assert isinstance(proc, procs.BackendProcess), proc
    assert proc.popen is not None and proc.popen.wait(timeout=30) == 0
    assert proc.relay is not None
    assert asyncio.run(relays.drained(proc.relay, 20.0))
    assert (logs / "c.log").read_text() == "confined and logged\n"

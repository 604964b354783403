"""Hostile backends against the lifecycle (tests/fixtures/hostile_backend.py), with real processes
and real sockets: backends that crash in a loop, ignore every polite signal, wedge their HTTP,
wipe their environment, or die while no host runs and have their pid taken by a stranger.

Every process a hostile backend starts is recorded in its pids file and killed by pid at the
end (test_hostile_backend.hostile_host); strangers a test starts itself are killed by it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from solar_host.instances import ownership
from tests import test_hostile_backend as hb
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def spawns(pids: Path) -> int:
    return len(hb.pids_in(pids).get("leader", []))


def leader(pids: Path) -> int:
    return wait_for(lambda: hb.pids_in(pids).get("leader", [None])[0], 10, "the leader")


def test_a_recorded_backend_whose_environment_was_wiped_is_re_adopted_not_killed(
    tmp_path: Path,
) -> None:
    """Its marker is gone from /proc/<pid>/environ (setproctitle, or an exec with an emptied
    environment), but the boot id, pid and start time recorded at spawn are its own: the next
    host takes it back. It was SIGKILLed without a word and loaded a second time."""
    with hb.hostile_host(tmp_path) as h:
        h.start()
        with h.client() as c:
            iid, pids = hb.create(c, h, "wiped", "--wipe-env", "leader")
            first = hb.start(c, iid)
            wait_for(lambda: ownership.marker_of(first["pid"]) is None, 10, "the wipe")
        h.kill()
        h.start()
        with h.client() as c:
            again = hb.running(c, iid, "the re-adoption")
            assert (again["pid"], again["port"]) == (first["pid"], first["port"])
            assert hb.alive(first["pid"]) and spawns(pids) == 1
            r = c.post(f"/instances/{iid}/stop")
            assert r.status_code == 200 and r.json()["instance"]["status"] == "stopped"
            wait_for(lambda: not hb.alive(first["pid"]), 10, "the stop to end it")


def test_a_running_backend_that_stopped_serving_while_no_host_ran_is_a_crash(
    tmp_path: Path,
) -> None:
    """It exec'd another program (same pid, start time and marker) that listens nowhere. The
    next host adopts it as its own, but it was ready already, so it is not loading: it was
    shown "starting" for up to START_DEADLINE_S (850 s), then failed with no restart. Now it
    has a moment to show its socket, and is then a crash like any other: ended, said so, and
    restarted under the restart policy."""
    with hb.hostile_host(tmp_path) as h:
        iid, pids, first = hb.exec_while_no_host_ran(h)
        with h.client() as c:
            seen: list[dict] = []

            def restarted() -> bool:
                inst = c.get(f"/instances/{iid}").json()
                seen.append(inst)
                return inst["status"] == "running" and inst["pid"] != first["pid"]

            wait_for(restarted, 60, "the crash restart")
            crashed = [i for i in seen if i["status"] == "failed"]
            assert not crashed or "stopped serving port" in crashed[0]["error_message"]
            assert "stopped serving port" in h.log()
            assert not hb.alive(first["pid"])
            assert spawns(pids) == 2
            r = c.post(f"/instances/{iid}/stop")
            assert r.status_code == 200 and r.json()["instance"]["status"] == "stopped"


def test_a_backend_deaf_to_term_int_and_hup_is_killed_after_the_grace(tmp_path: Path) -> None:
    with hb.hostile_host(tmp_path, STOP_GRACE_S="1") as h:
        h.start()
        with h.client() as c:
            iid, pids = hb.create(
                c, h, "deaf", "--ignore-term", "--ignore-hup", "--worker", "setsid"
            )
            inst = hb.start(c, iid)
            worker = hb.worker_of(pids)
            t0 = time.monotonic()
            r = c.post(f"/instances/{iid}/stop")
            took = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["instance"]["status"] == "stopped"
            assert took >= 0.9  # it was given its grace
            assert not hb.alive(inst["pid"]) and not hb.alive(worker)
            wait_for(lambda: "ignored SIGTERM" in h.log(), 10, "the log to say it was killed")


def test_a_host_shutdown_does_not_wait_on_backends_deaf_to_sigterm(tmp_path: Path) -> None:
    with hb.hostile_host(tmp_path, STOP_GRACE_S="1") as h:
        h.start()
        with h.client() as c:
            ids = [hb.create(c, h, f"deaf{n}", "--ignore-term", "--ignore-hup") for n in range(2)]
            pids = [hb.start(c, iid)["pid"] for iid, _ in ids]
        assert h.proc is not None
        t0 = time.monotonic()
        h.proc.send_signal(signal.SIGTERM)
        h.proc.wait(timeout=60)  # bounded: 2 s for requests, then one grace for all
        assert time.monotonic() - t0 < 45
        assert not any(hb.alive(p) for p in pids)


def test_a_crash_loop_backs_off_and_gives_up(tmp_path: Path) -> None:
    """Ready, then exit at once, every time: restarts come after doubling delays and stop at
    RESTART_MAX_IN_WINDOW, saying so; never a storm of spawns."""
    env = {"RESTART_BACKOFF_S": "0.2", "RESTART_MAX_IN_WINDOW": "3", "MAX_RETRIES": "2"}
    with hb.hostile_host(tmp_path, **env) as h:
        h.start()
        with h.client() as c:
            iid, pids = hb.create(c, h, "loop", "--exit-after", "0.2")
            hb.start(c, iid)
            final = wait_for(
                lambda: (
                    (i := c.get(f"/instances/{iid}").json())["status"] == "failed"
                    and "not restarting" in (i["error_message"] or "")
                    and i
                ),
                60,
                "the crash loop to be given up",
            )
            assert "crashed 3 times" in final["error_message"]
            assert final["pid"] is None
            # Every spawn ended once, and said so. One that exits before the host has seen it
            # ready (its 0.2 s can pass before the host reads the ready line, under load) is a
            # failed start attempt, retried within its start (MAX_RETRIES), not a crash: the
            # pids file counts it, the crash loop does not. The loop counted 3 ends: crashes
            # of a ready backend, and restarts that ran out of attempts.
            records = c.get(f"/instances/{iid}/flight-records").json()["records"]
            n = spawns(pids)
            assert n == len(records), records
            loop = [r for r in records if r["phase"] == "running" or r["attempt"] == 1 + 2]
            assert len(loop) == 3, records
            crashed = records[-1]["phase"] == "running"
            said = "exited unexpectedly" if crashed else "exited with code 3"
            assert said in final["error_message"]
            time.sleep(2)  # more than the next delay would have been
            assert spawns(pids) == n
            assert c.get(f"/instances/{iid}").json()["status"] == "failed"


def test_restarts_that_fail_before_ready_are_bounded(tmp_path: Path) -> None:
    """Ready once, then every spawn exits before it is ready: each crash restart makes its
    1 + MAX_RETRIES attempts, and the loop ends after RESTART_MAX_IN_WINDOW."""
    env = {"RESTART_BACKOFF_S": "0.1", "RESTART_MAX_IN_WINDOW": "2", "MAX_RETRIES": "1"}
    with hb.hostile_host(tmp_path, **env) as h:
        h.start()
        with h.client() as c:
            iid, pids = hb.create(c, h, "later", "--later-spawns-fail")
            # It crashes once the host has seen it ready (one timed from its spawn could end
            # first on a loaded machine: a failed start attempt, retried into a later spawn).
            os.kill(hb.start(c, iid)["pid"], signal.SIGKILL)
            wait_for(
                lambda: (
                    "not restarting" in (c.get(f"/instances/{iid}").json()["error_message"] or "")
                ),
                60,
                "the loop to be given up",
            )
            n = spawns(pids)
            assert n <= 1 + 2 * 2, n  # the first, then one restart of two attempts
            time.sleep(2)
            assert spawns(pids) == n


def test_a_stop_in_the_restart_backoff_stops_it_for_good(tmp_path: Path) -> None:
    with hb.hostile_host(tmp_path, RESTART_BACKOFF_S="4") as h:
        h.start()
        with h.client() as c:
            iid, pids = hb.create(c, h, "backoff", "--exit-after", "0.2")
            hb.start(c, iid)
            wait_for(
                lambda: c.get(f"/instances/{iid}").json()["status"] == "failed", 20, "the crash"
            )
            r = c.post(f"/instances/{iid}/stop")
            assert r.status_code == 200 and r.json()["instance"]["status"] == "stopped"
            assert r.json()["instance"]["error_message"] is None
            # One spawn, or more: one that exits before the host has seen it ready (its 0.2 s
            # can pass first, under load) is a failed start attempt, retried within the start.
            # Each ended once and said so; the last was the crash.
            records = c.get(f"/instances/{iid}/flight-records").json()["records"]
            n = spawns(pids)
            assert n == len(records) and records[-1]["phase"] == "running", records
            time.sleep(6)  # past the delay the restart would have come after
            assert spawns(pids) == n
            assert c.get(f"/instances/{iid}").json()["status"] == "stopped"
        h.kill()
        h.start()
        with h.client() as c:
            time.sleep(2)
            assert c.get(f"/instances/{iid}").json()["status"] == "stopped"
            assert spawns(pids) == n


def test_a_backend_whose_http_hangs_still_stops_promptly(tmp_path: Path) -> None:
    """/health answers, everything else is accepted and never answered: the host calls it
    running (it promises no liveness check), and a stop ends it without waiting on it."""
    with hb.hostile_host(tmp_path) as h:
        h.start()
        with h.client() as c:
            iid, _ = hb.create(c, h, "wedged", "--health-only")
            inst = hb.start(c, iid)
            with pytest.raises(httpx.TimeoutException):
                httpx.get(f"http://127.0.0.1:{inst['port']}/v1/models", timeout=1.0)
            assert c.get(f"/instances/{iid}").json()["status"] == "running"
            r = c.post(f"/instances/{iid}/stop")
            assert r.status_code == 200 and r.json()["instance"]["status"] == "stopped"
            assert not hb.alive(inst["pid"])


_STRANGER = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(8)
while True:
    c, _ = s.accept()
    c.recv(4096)
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
    c.close()
"""
_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def _spawn_with_pid(pid: int, argv: list[str], tries: int = 50) -> subprocess.Popen[bytes] | None:
    """A process given `pid` (ns_last_pid: needs root in this pid namespace); None when
    another process took it first every time."""
    for _ in range(tries):
        _LAST_PID.write_text(str(pid - 1))
        p = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL)
        if p.pid == pid:
            return p
        p.kill()
        p.wait(timeout=10)
    return None


@pytest.mark.skipif(not os.access(_LAST_PID, os.W_OK), reason="needs a writable ns_last_pid")
def test_a_stranger_that_took_a_dead_backends_pid_and_port_is_neither_adopted_nor_signalled(
    tmp_path: Path,
) -> None:
    """The backend dies while no host runs; a stranger gets its pid (in a session of its own,
    so its session id is the backend's too) and listens on its port, answering /health."""
    stranger = None
    try:
        with hb.hostile_host(tmp_path) as h:
            h.start()
            with h.client() as c:
                iid, _ = hb.create(c, h, "reused")
                first = hb.start(c, iid)
            h.kill()
            os.kill(first["pid"], signal.SIGKILL)
            # Reaped by init (it was the dead host's child): only then is the pid free.
            deadline = time.monotonic() + 20
            while os.path.exists(f"/proc/{first['pid']}") and time.monotonic() < deadline:
                time.sleep(0.05)
            if os.path.exists(f"/proc/{first['pid']}"):
                pytest.skip("the dead backend was not reaped: its pid cannot be reused")
            argv = [sys.executable, "-c", _STRANGER, str(first["port"])]
            stranger = _spawn_with_pid(first["pid"], argv)
            if stranger is None:
                pytest.skip("another process kept taking the pid")
            wait_for(lambda: ownership.port_holders(first["port"]), 10, "the stranger to listen")
            h.start()
            with h.client() as c:
                again = hb.running(c, iid, "the start at boot")
                assert again["pid"] != stranger.pid and again["port"] != first["port"]
                wait_for(lambda: f"still listened on by {stranger.pid}" in h.log(), 10, "its name")
                c.post(f"/instances/{iid}/stop")
            assert stranger.poll() is None  # never signalled
    finally:
        if stranger is not None:
            with contextlib.suppress(OSError):
                stranger.kill()
            stranger.wait(timeout=10)

"""The host process's own lifecycle: one host per state directory, the hand-over restart that
leaves backends serving, and systemd's notification protocol (READY/STOPPING/WATCHDOG).

Every test runs real host processes (tests/fixtures/hostproc.py) with real backends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from solar_host.platform.handover import HandOverError, hand_over, running_host_pid
from solar_host.platform.sdnotify import Notifier
from solar_host.platform.statelock import StateLock, StateLocked, is_locked
from tests.fixtures.host import free_port
from tests.fixtures.hostproc import HostProc
from tests.fixtures.pinger import Pinger
from tests.fixtures.script_backend import script_config, started
from tests.fixtures.waiting import wait_for


def start_instance(h: HostProc, alias: str = "keep") -> tuple[str, int, int]:
    """Create and start a scripted backend; (instance id, pid, port)."""
    inst = started(h, alias=alias)
    assert inst["status"] == "running", inst
    return inst["id"], inst["pid"], inst["port"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def settled_bytes(path: Path, quiet_s: float = 0.5, timeout: float = 30.0) -> bytes:
    """The file's bytes once no write has changed them for `quiet_s` (the host saves the
    record of a start just after answering it)."""
    deadline = time.monotonic() + timeout
    data = path.read_bytes()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = path.read_bytes()
        if now == data:
            return data
        data = now
    raise AssertionError(f"{path} kept changing")


def run_second_host(env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.fixtures.hostproc"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


# --- one host per state directory -------------------------------------------------------------


def test_lock_is_exclusive_and_names_its_holder(tmp_path: Path) -> None:
    first = StateLock.for_dirs(tmp_path / "state", tmp_path / "state")
    assert len(first.directories) == 1  # the same directory twice is one lock
    first.acquire()
    try:
        assert is_locked(tmp_path / "state")
        with pytest.raises(StateLocked) as err:
            StateLock.for_dirs(tmp_path / "state").acquire()
        assert err.value.holder == os.getpid()
        assert str(tmp_path / "state") in str(err.value) and str(os.getpid()) in str(err.value)
    finally:
        first.release()
    assert not is_locked(tmp_path / "state")
    again = StateLock.for_dirs(tmp_path / "state")
    again.acquire()
    again.release()


def test_all_or_none_of_the_locks(tmp_path: Path) -> None:
    held = StateLock.for_dirs(tmp_path / "logs")
    held.acquire()
    try:
        both = StateLock.for_dirs(tmp_path / "state", tmp_path / "logs")
        with pytest.raises(StateLocked):
            both.acquire()
        assert not both.held and not is_locked(tmp_path / "state")
    finally:
        held.release()


@pytest.mark.parametrize("shared", ["state", "logs", "jobs", "linked config"])
def test_second_host_on_a_shared_directory_exits_1_and_touches_nothing(
    tmp_path: Path, shared: str
) -> None:
    with HostProc(tmp_path / "a") as h:
        h.start()
        iid, pid, _port = start_instance(h)
        config_before = settled_bytes(h.tmp / "config.json")
        env = h.env()
        env["PORT"] = str(free_port())  # a free port: only the lock can stop it
        if shared == "logs":
            other = tmp_path / "b"
            other.mkdir()
            env["CONFIG_FILE"] = str(other / "config.json")
            env["MODELS_DIR"] = str(other / "models")
            env["JOBS_DIR"] = str(other / "jobs")
            directory = h.tmp / "logs"
        elif shared in ("jobs", "linked config"):
            # A host of its own directories but one: the jobs store and workspaces, or a
            # config.json that is a link to the first host's.
            other = tmp_path / "b"
            other.mkdir()
            env["CONFIG_FILE"] = str(other / "config.json")
            env["MODELS_DIR"] = str(other / "models")
            env["LOG_DIR"] = str(other / "logs")
            env["JOBS_DIR"] = str(other / "jobs")
            if shared == "jobs":
                env["JOBS_DIR"] = str(h.tmp / "jobs")
                directory = h.tmp / "jobs"
            else:
                (other / "config.json").symlink_to(h.tmp / "config.json")
                directory = h.tmp
        else:
            directory = h.tmp
        p = run_second_host(env)
        assert p.returncode == 1, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1, p.stderr
        assert str(directory.resolve()) in lines[0] and f"pid {h.pid}" in lines[0], lines[0]
        # Nothing touched: the first host's records, its backend and its service.
        assert (h.tmp / "config.json").read_bytes() == config_before
        assert alive(pid)
        with h.client() as c:
            inst = c.get(f"/instances/{iid}").json()
        assert inst["status"] == "running" and inst["pid"] == pid
        if shared in ("logs", "jobs"):
            assert not (tmp_path / "b" / "config.json").exists()
        if shared == "linked config":
            assert (tmp_path / "b" / "config.json").is_symlink()


def test_lock_of_a_killed_host_is_free_for_the_next(tmp_path: Path) -> None:
    with HostProc(tmp_path) as h:
        h.start()
        _iid, pid, _port = start_instance(h)
        h.kill(signal.SIGKILL)
        assert not is_locked(h.tmp)
        h.start()
        with h.client() as c:
            [inst] = c.get("/instances").json()
        assert inst["status"] == "running" and inst["pid"] == pid  # re-adopted


# --- which stop keeps backends ------------------------------------------------------------------


def test_sigterm_stops_backends_by_default(tmp_path: Path) -> None:
    with HostProc(tmp_path) as h:
        h.start()
        _iid, pid, _port = start_instance(h)
        assert h.stop() == 0 or h.proc is not None
        wait_for(lambda: not alive(pid), 30, "the backend to stop")
        assert h.backends() == []


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGHUP], ids=["SIGUSR2", "SIGHUP"])
def test_hand_over_signal_leaves_backends_serving_for_the_next_host(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """SIGHUP as well: its default action ended the host on the spot (a closed terminal, a
    `kill -HUP` meant as a reload)."""
    with HostProc(tmp_path) as h:
        h.start()
        iid, pid, port = start_instance(h)
        with Pinger(port, path="/health") as probe:
            h.proc.send_signal(sig)  # type: ignore[union-attr]
            assert h.proc.wait(timeout=60) == 0  # type: ignore[union-attr]
            assert alive(pid)
            h.start()
            with h.client() as c:
                inst = c.get(f"/instances/{iid}").json()
            assert inst["status"] == "running" and inst["pid"] == pid, inst
            time.sleep(0.3)  # a few more probes against the re-adopted backend
        assert probe.failures == [] and probe.ok > 5, (probe.failures, probe.ok)
        assert [p.pid for p in h.backends()] == [pid]  # no second backend
        assert "hand-over restart requested" in h.log()


def _start_in_background(h: HostProc, iid: str) -> tuple[threading.Thread, dict[str, Any]]:
    """POST start in a thread of its own (it waits for readiness); what it got lands in the
    dict: the status code, or the exception's class name."""
    got: dict[str, Any] = {}

    def run() -> None:
        try:
            with h.client(timeout=120) as c:
                got["answer"] = c.post(f"/instances/{iid}/start").status_code
        except httpx.HTTPError as err:
            got["answer"] = type(err).__name__

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def _pid_of(h: HostProc, iid: str, timeout: float = 20.0) -> int:
    with h.client() as c:
        deadline = time.monotonic() + timeout
        while not (pid := c.get(f"/instances/{iid}").json()["pid"]):
            assert time.monotonic() < deadline, "the backend was never spawned"
            time.sleep(0.05)
    return int(pid)


def test_a_hand_over_does_not_wait_for_a_start_in_flight(tmp_path: Path) -> None:
    """uvicorn waited for every request in flight before exiting, without a bound: a start
    waiting for a model to load held the hand-over (and the API, closed meanwhile) as long as
    the load, so `solar-host handover` timed out. Now the start's connection is closed
    unanswered after a short grace (control reads that as "outcome unknown" and looks again;
    a 500 would make it delete the instance), and the next host adopts the loading backend."""
    with HostProc(tmp_path, env={"INSTANCE_READY_TIMEOUT_S": "300"}) as h:
        h.start()
        with h.client() as c:
            cfg = script_config(h.tmp, "--ready-after", "8", alias="slow")
            iid = c.post("/instances", json={"config": cfg}).json()["instance"]["id"]
        thread, got = _start_in_background(h, iid)
        pid = _pid_of(h, iid)
        t0 = time.monotonic()
        h.proc.send_signal(signal.SIGUSR2)  # type: ignore[union-attr]
        assert h.proc.wait(timeout=30) == 0  # type: ignore[union-attr]
        took = time.monotonic() - t0
        thread.join(10)
        assert took < 6, f"the hand-over took {took:.1f} s"
        assert got.get("answer") in ("RemoteProtocolError", "ReadError"), got
        assert alive(pid)
        # Said in one line, as intended; the cut request is no error of the application's.
        said = h.log_path.read_text("utf-8", "replace")
        assert "closing 1 connection(s) with requests still in flight" in said, said
        assert "Traceback" not in said and "CancelledError" not in said, said
        h.start()
        with h.client() as c:
            deadline = time.monotonic() + 60
            while (inst := c.get(f"/instances/{iid}").json())["status"] != "running":
                assert inst["status"] == "starting", inst
                assert time.monotonic() < deadline, inst
                time.sleep(0.1)
        assert inst["pid"] == pid, inst


def test_an_adopted_start_that_fails_keeps_its_retries(tmp_path: Path) -> None:
    """A backend still loading when the host restarted, whose load then failed once, was left
    failed for good (wanted running, nothing to bring it back); the same failure without the
    restart is retried. The adoption now has the retries of the start it took over."""
    flag = tmp_path / "failed-once"
    once = f'if [ -e {flag} ]; then exec "$@"; fi; touch {flag}; sleep 3; echo failed; exit 1'
    with HostProc(tmp_path) as h:
        h.start()
        with h.client() as c:
            cfg = script_config(
                h.tmp, "--ready-after", "1", alias="t", fake_wrapper=["sh", "-c", once, "sh"]
            )
            iid = c.post("/instances", json={"config": cfg}).json()["instance"]["id"]
        _start_in_background(h, iid)
        first = _pid_of(h, iid)
        h.kill()
        h.start()
        with h.client() as c:
            deadline = time.monotonic() + 60
            while (inst := c.get(f"/instances/{iid}").json())["status"] != "running":
                assert time.monotonic() < deadline, inst
                time.sleep(0.1)
        assert inst["pid"] != first and alive(inst["pid"]), inst
        assert [p.pid for p in h.backends()] == [inst["pid"]]


def test_handover_command_finds_the_host_by_its_state_directory(tmp_path: Path) -> None:
    with pytest.raises(HandOverError, match="no solar-host is running"):
        running_host_pid(tmp_path)
    with HostProc(tmp_path) as h:
        h.start()
        _iid, pid, _port = start_instance(h)
        assert running_host_pid(h.tmp) == h.pid
        assert hand_over(h.tmp, timeout=60) == h.pid
        assert h.proc is not None and h.proc.wait(timeout=10) == 0
        assert alive(pid)
        with pytest.raises(HandOverError):
            running_host_pid(h.tmp)
        # The command line: finds the host from its settings, exits 0 once it is gone.
        h.start()
        env = {**h.env(), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        p = subprocess.run(
            [sys.executable, "-m", "solar_host", "handover", "--env-file", os.devnull],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            cwd=h.tmp,
        )
        assert p.returncode == 0, p.stderr
        assert "exited" in p.stdout
        assert h.proc is not None and h.proc.wait(timeout=10) == 0
        assert alive(pid)
        p = subprocess.run(
            [sys.executable, "-m", "solar_host", "handover", "--env-file", os.devnull],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            cwd=h.tmp,
        )
        assert p.returncode == 1 and "no solar-host is running" in p.stderr, p.stderr


def test_a_host_that_exits_between_the_lock_probe_and_the_signal_counts_as_handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import solar_host.platform.handover as handover

    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    monkeypatch.setattr(handover, "running_host_pid", lambda _d: gone.pid)
    assert hand_over(tmp_path, timeout=5) == gone.pid


# --- systemd notifications ------------------------------------------------------------------------


class NotifySocket:
    """A datagram socket playing systemd's notification socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[dict[str, str]] = []

    def drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, BlockingIOError):
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
            self.messages.append(fields)

    def wait(self, key: str, timeout: float = 30.0, count: int = 1) -> list[dict[str, str]]:
        deadline = time.monotonic() + timeout
        while True:
            self.drain()
            found = [m for m in self.messages if key in m]
            if len(found) >= count:
                return found
            assert time.monotonic() < deadline, f"no {key} (got {self.messages})"

    def close(self) -> None:
        self.sock.close()


def test_notifier_reads_and_removes_systemds_variables(tmp_path: Path) -> None:
    env = {"NOTIFY_SOCKET": "@solar-test", "WATCHDOG_USEC": "2000000", "OTHER": "x"}
    n = Notifier.from_environment(env)
    assert n.address == "@solar-test" and n.watchdog_s == 2.0
    assert env == {"OTHER": "x"}
    # A watchdog meant for another process is not ours to feed.
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}
    assert Notifier.from_environment(env).watchdog_s == 0.0
    assert not Notifier().send("READY=1")  # no socket: a no-op


def test_notifier_speaks_to_an_abstract_socket() -> None:
    name = f"solar-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        assert Notifier(address="@" + name).ready("ok")
        fields = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
        assert fields == {"READY": "1", "MAINPID": str(os.getpid()), "STATUS": "ok"}
    finally:
        sock.close()


def test_host_tells_systemd_ready_watchdog_and_stopping(tmp_path: Path) -> None:
    notify = NotifySocket(tmp_path / "notify.sock")
    try:
        env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"}
        with HostProc(tmp_path / "host", env=env) as h:
            h.start()
            [ready] = notify.wait("READY")
            assert ready["MAINPID"] == str(h.pid)
            notify.wait("WATCHDOG", count=3, timeout=30)
            _iid, pid, _port = start_instance(h)
            # The backend cannot speak for the host: systemd's variables are not inherited.
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert not [v for v in environ if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_"))]
            h.stop()
            notify.wait("STOPPING")
    finally:
        notify.close()

"""Upgrading from the previous release while its backends still serve.

Its config.json is a bare list of instances, a running one with `pid` and `port`; it did not
stop backends on shutdown, and at boot it SIGTERMed the recorded pid before starting again
(reference-behavior 6.9). This host does the same to a process that is plausibly that backend
(alive, listening on the recorded port, running the kind's program) and never signals one that
is not; one it cannot judge is left alone and its instance is not started beside it.

The "previous release's backends" are started by the test (loopback only) and reaped by it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from solar_host.instances import adopt_legacy, ownership
from tests.fixtures.hostproc import TAG_VAR, HostProc
from tests.fixtures.ports import free_port
from tests.fixtures.script_backend import FAKE, script_config


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


def _llama_server(tmp: Path) -> Path:
    """The scripted backend behind an executable named llama-server, as the previous release's
    llama.cpp backends ran (the interpreter runs a script of that name)."""
    path = tmp / "bin" / "llama-server"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(FAKE)!r}\n"
        f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n"
    )
    path.chmod(0o755)
    return path


@contextlib.contextmanager
def previous_release_backends(h: HostProc) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for p in started:  # only what this test started
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        for proc in h.backends():  # workers of those, if any survived
            with contextlib.suppress(psutil.Error):
                if proc.ppid() in (1, *(p.pid for p in started)):
                    proc.kill()


def _spawn(h: HostProc, started: list[subprocess.Popen[bytes]], argv: list[str]) -> int:
    env = {**os.environ, "FAKE_API_KEYS": h.api_key, TAG_VAR: h.tag}
    p = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    started.append(p)
    return p.pid


def _legacy_entry(tmp: Path, alias: str, pid: int, port: int) -> dict[str, object]:
    now = datetime.now(UTC).isoformat()
    return {
        "id": str(uuid.uuid4()),
        "config": script_config(tmp, alias=alias),
        "status": "running",
        "pid": pid,
        "port": port,
        "created_at": now,
        "started_at": now,
        "retry_count": 0,
    }


def test_a_backend_the_previous_release_left_serving_is_ended_then_started_again(
    tmp_path: Path,
) -> None:
    h = HostProc(tmp_path)
    with h, previous_release_backends(h) as started:
        port = free_port()
        argv = [str(_llama_server(tmp_path)), "--port", str(port), "--workers"]
        old = _spawn(h, started, argv)
        _wait(lambda: _listening(port), 20, "the old backend never listened")
        old_tree = {p.pid for p in h.backends()}  # it and its two workers
        assert old in old_tree and len(old_tree) == 3
        entry = _legacy_entry(tmp_path, "legacy", old, port)
        (tmp_path / "config.json").write_text(json.dumps([entry], indent=2))

        h.start(timeout=60)
        iid = entry["id"]

        def running() -> bool:
            with h.client(timeout=5) as c:
                return c.get(f"/instances/{iid}").json()["status"] == "running"

        _wait(running, 30, "the instance never ran again")
        with h.client() as c:
            inst = c.get(f"/instances/{iid}").json()
        assert inst["pid"] != old
        # The old backend and its workers are gone: one backend serves this instance.
        _wait(lambda: not (old_tree & {p.pid for p in h.backends()}), 10, "old tree survived")
        assert [p.pid for p in h.backends()] == [inst["pid"]]
        warnings = [ln for ln in h.log().splitlines() if "WARNING" in ln and f"pid {old}" in ln]
        assert warnings and "previous release" in warnings[0], h.log()


def test_a_recorded_pid_that_is_not_that_backend_is_never_signalled(tmp_path: Path) -> None:
    """Two entries: one whose pid is a server on the recorded port that is not a llama.cpp
    backend (cannot be judged: left alone, the instance not started beside it), one whose pid
    now runs something else entirely (never signalled; the instance starts as usual)."""
    h = HostProc(tmp_path)
    with h, previous_release_backends(h) as started:
        port = free_port()
        unsure = _spawn(h, started, [sys.executable, "-u", str(FAKE), "--port", str(port)])
        _wait(lambda: _listening(port), 20, "the server never listened")
        other = _spawn(h, started, ["sleep", "120"])
        doubtful = _legacy_entry(tmp_path, "doubtful", unsure, port)
        recycled = _legacy_entry(tmp_path, "recycled", other, free_port())
        (tmp_path / "config.json").write_text(json.dumps([doubtful, recycled], indent=2))

        h.start(timeout=60)

        def status(iid: object) -> dict[str, object]:
            with h.client(timeout=5) as c:
                return c.get(f"/instances/{iid}").json()

        _wait(lambda: status(recycled["id"])["status"] == "running", 30, "never started")
        inst = status(doubtful["id"])
        assert inst["status"] == "stopped", inst
        assert f"pid {unsure}" in str(inst["error_message"]), inst
        assert _alive(unsure) and _alive(other)  # neither was signalled
        # No duplicate: the doubtful instance has no backend of this host beside the old one.
        ours = {p.pid for p in h.backends()} - {unsure, other}
        assert ours == {status(recycled["id"])["pid"]}
        assert any("ERROR" in ln and f"pid {unsure}" in ln for ln in h.log().splitlines())
        # The decision is written: the next start does not start it either.
        h.kill()
        h.start(timeout=60)
        time.sleep(1.0)
        assert status(doubtful["id"])["status"] == "stopped"
        assert {p.pid for p in h.backends()} - {unsure, other} == ours


def test_a_backend_that_ignores_sigterm_is_killed_and_so_are_its_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adopt_legacy, "TERM_GRACE_S", 0.3)
    monkeypatch.setattr(adopt_legacy, "WORKER_GRACE_S", 0.2)
    port = free_port()
    argv = [sys.executable, "-u", str(FAKE), "--port", str(port), "--ignore-sigterm", "--workers"]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
    workers: list[psutil.Process] = []
    try:
        _wait(lambda: _listening(port), 20, "never listened")
        _wait(lambda: len(psutil.Process(p.pid).children()) == 2, 10, "no workers")
        workers = psutil.Process(p.pid).children()
        ident = ownership.identity_of(p.pid)
        assert ident is not None
        assert adopt_legacy.end_backends([ident]) == []
        assert p.wait(5) == -signal.SIGKILL
        psutil.wait_procs(workers, timeout=5)
        assert not any(_alive(w.pid) for w in workers)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
        for w in workers:
            with contextlib.suppress(psutil.Error):
                w.kill()


def test_what_a_command_line_runs() -> None:
    assert adopt_legacy.runs_kind(["/opt/llama.cpp/bin/llama-server", "--port", "1"], "llamacpp")
    assert adopt_legacy.runs_kind(["/usr/bin/python3", "-u", "/x/llama-server"], "llamacpp")
    assert adopt_legacy.runs_kind(
        ["/venv/bin/python", "-m", "sglang.launch_server", "--port", "1"], "sglang"
    )
    assert adopt_legacy.runs_kind(["/venv/bin/sglang", "serve"], "sglang")
    assert adopt_legacy.runs_kind(
        ["python", "-m", "solar_host.servers.hf_server"], "huggingface_causal"
    )
    assert not adopt_legacy.runs_kind(["python", "-m", "http.server"], "llamacpp")
    assert not adopt_legacy.runs_kind(["sleep", "120"], "llamacpp")
    assert not adopt_legacy.runs_kind([], "llamacpp")

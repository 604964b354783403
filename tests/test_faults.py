"""Faults: a SIGKILLed backend, a SIGKILLed host (mid-start, mid-stop, mid-write of config.json)
restarted on the same directory, and an unreachable solar-control.

After every host restart: config.json and the model manifest parse, a backend that kept serving
is re-adopted (same pid), every live backend belongs to exactly one running instance (none
unmanaged, none twice), and what was meant to run runs. 2 rounds per fault by default, 20 with
SOLAR_LONG_TESTS=1.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from solar_host.instances import relays
from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config

ROUNDS = 20 if os.environ.get("SOLAR_LONG_TESTS") else 2
SETTLED = {"running", "stopped", "failed"}


def owner(p: psutil.Process) -> str:
    """Instance id of a backend, from its log file, the one its log relay writes
    (alias_<id>_<ts>.log)."""
    path = relays.log_file_of(p.pid)
    try:
        return path.name.split("_")[1] if path is not None else "?"
    except IndexError:
        return "?"


def _describe(pid: int) -> str:
    """What a process is, for a failure message: its command line, state and stdout."""
    try:
        p = psutil.Process(pid)
        out = relays.log_file_of(pid)
        return f"{p.status()} ppid {p.ppid()} {p.cmdline()[:6]} log {out}"
    except (psutil.Error, OSError) as err:
        return f"gone or unreadable: {err!r}"


def cfg(h: HostProc, alias: str, *fake: str) -> dict[str, Any]:
    return script_config(h.tmp, *fake, alias=alias)


def settled(c: httpx.Client, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        insts = c.get("/instances").json()
        if all(i["status"] in SETTLED for i in insts):
            return {i["id"]: i for i in insts}
        assert time.monotonic() < deadline, [(i["id"], i["status"]) for i in insts]
        time.sleep(0.05)


def check_consistent(h: HostProc, insts: dict[str, dict[str, Any]]) -> list[str]:
    """Problems: files that do not parse, strays, duplicates, running without a process."""
    problems = []
    json.loads((h.tmp / "config.json").read_text())
    manifest = h.tmp / "models" / "manifest.json"
    if manifest.exists():
        json.loads(manifest.read_text())

    def unmanaged() -> list[psutil.Process]:
        return [
            p for p in h.backends() if insts.get(owner(p), {}).get("status") not in ("running",)
        ]

    # The boot sweep of strays runs after the host serves (it may wait out a SIGTERM grace).
    deadline = time.monotonic() + 15
    while unmanaged() and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = h.backends()
    by_owner: dict[str, list[int]] = {}
    for p in procs:
        by_owner.setdefault(owner(p), []).append(p.pid)
    for iid, pids in by_owner.items():
        inst = insts.get(iid)
        if inst is None or inst["status"] != "running":
            problems.append(
                f"unmanaged backend(s) {pids} of {iid} ({inst and inst['status']}): "
                f"{[_describe(pid) for pid in pids]}"
            )
            for pid in pids:
                psutil.Process(pid).kill()
        elif len(pids) > 1:
            problems.append(f"{iid} runs twice: {pids}")
        elif pids[0] != inst["pid"]:
            problems.append(f"{iid}: recorded pid {inst['pid']}, process {pids[0]}")
    for iid, inst in insts.items():
        if inst["status"] == "running" and iid not in by_owner:
            problems.append(f"{iid} is running without a process")
    return problems


def background(fn: Any) -> threading.Thread:
    def run() -> None:
        try:
            fn()
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError):
            pass  # the host dies under it (or the client closes): that is the point

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_backend_sigkill_is_recovered_without_leak(tmp_path: Path) -> None:
    with HostProc(tmp_path) as h:
        h.start()
        with h.client() as c:
            iid = c.post("/instances", json={"config": cfg(h, "k")}).json()["instance"]["id"]
            pid = c.post(f"/instances/{iid}/start").json()["instance"]["pid"]
            for _ in range(3):
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    inst = c.get(f"/instances/{iid}").json()
                    if inst["status"] == "running" and inst["pid"] != pid:
                        break
                    time.sleep(0.05)
                assert inst["status"] == "running" and inst["pid"] != pid, inst
                pid = inst["pid"]
                assert [p.pid for p in h.backends()] == [pid]
            logs = c.get(f"/instances/{iid}/logs").json()
            assert sum("listening" in e["line"] for e in logs) >= 4  # each restart logged
            assert c.post(f"/instances/{iid}/stop").status_code == 200
        assert h.backends() == []


@pytest.mark.parametrize("mode", ["start", "stop", "write"])
def test_host_sigkill_mid_operation(tmp_path: Path, mode: str) -> None:
    rng = random.Random(7)
    problems: list[str] = []
    with HostProc(tmp_path, env={"STOP_GRACE_S": "1.5"}) as h:
        h.start()
        with h.client() as c:
            keep = c.post("/instances", json={"config": cfg(h, "keep")}).json()["instance"]["id"]
            keep_pid = c.post(f"/instances/{keep}/start").json()["instance"]["pid"]
            slow = cfg(h, "slow", "--ready-after", "0.3", "--ignore-sigterm")
            target = c.post("/instances", json={"config": slow}).json()["instance"]["id"]
        for _ in range(ROUNDS):
            with h.client(timeout=10) as c:
                if mode == "stop":
                    c.post(f"/instances/{target}/start")
                    t = background(lambda c=c: c.post(f"/instances/{target}/stop"))
                    time.sleep(rng.uniform(0.0, 1.2))
                elif mode == "start":
                    c.post(f"/instances/{target}/stop")
                    t = background(lambda c=c: c.post(f"/instances/{target}/start"))
                    time.sleep(rng.uniform(0.0, 0.5))
                else:

                    def churn(c: httpx.Client = c) -> None:
                        for i in range(50):
                            r = c.post("/instances", json={"config": cfg(h, f"w{i}")})
                            c.delete(f"/instances/{r.json()['instance']['id']}")

                    t = background(churn)
                    time.sleep(rng.uniform(0.05, 0.4))
            h.kill()
            t.join(10)
            h.start()
            with h.client() as c:
                insts = settled(c)
                problems += [f"after kill mid-{mode}: {p}" for p in check_consistent(h, insts)]
                k = insts[keep]
                if k["status"] != "running" or k["pid"] != keep_pid:
                    problems.append(
                        f"mid-{mode}: kept backend not re-adopted: {k['status']} "
                        f"pid {k['pid']} (was {keep_pid})"
                    )
                    keep_pid = k["pid"]
        with h.client() as c:
            for iid in settled(c):
                c.post(f"/instances/{iid}/stop")
        assert h.backends() == [] or problems
    assert not problems, "\n".join(problems)


def test_unreachable_control_does_not_affect_host_operations(tmp_path: Path) -> None:
    """solar-control down (nothing listens) or refusing: the host serves REST as usual."""
    with HostProc(
        tmp_path,
        env={
            "SOLAR_CONTROL_URL": "http://127.0.0.1:9",
            "WS_RECONNECT_DELAY": "0.1",
            "WS_RECONNECT_MAX_DELAY": "0.2",
        },
    ) as h:
        t0 = time.monotonic()
        h.start()
        assert time.monotonic() - t0 < 20
        with h.client(timeout=10) as c:
            iid = c.post("/instances", json={"config": cfg(h, "x")}).json()["instance"]["id"]
            t0 = time.monotonic()
            r = c.post(f"/instances/{iid}/start")
            assert r.status_code == 200 and time.monotonic() - t0 < 10
            for _ in range(20):
                assert c.get("/instances").status_code == 200
            assert c.post(f"/instances/{iid}/stop").status_code == 200
            r = c.post("/reconnect")
            assert r.status_code in (200, 503), r.text
        assert h.proc is not None and h.proc.poll() is None
        assert "Traceback" not in h.log()


def test_a_restart_that_cannot_listen_leaves_the_backends_serving(tmp_path: Path) -> None:
    """The host's port held by another process when the host restarts: uvicorn bound it after
    the lifespan had re-adopted the backends, and its failure ran the lifespan's shutdown,
    which stopped every one (config.json then said stopped while they were wanted running).
    Now the host listens before it adopts anything, and exits 1 saying why."""
    import socket

    with HostProc(tmp_path) as h:
        h.start()
        with h.client() as c:
            iid = c.post("/instances", json={"config": cfg(h, "a")}).json()["instance"]["id"]
            pid = c.post(f"/instances/{iid}/start").json()["instance"]["pid"]
        h.kill()
        blocker = socket.socket()
        try:
            blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            blocker.bind(("127.0.0.1", h.port))
            blocker.listen(1)
            h.start(wait=False)
            assert h.proc is not None
            assert h.proc.wait(timeout=60) == 1
        finally:
            blocker.close()
        assert "cannot listen on" in h.log() and "no backend was adopted or stopped" in h.log()
        assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        [entry] = json.loads((h.tmp / "config.json").read_text())["instances"]
        assert entry["instance"]["status"] == "running" and entry["process"]["pid"] == pid
        h.start()  # the port is free again: the same backend is adopted
        with h.client() as c:
            inst = c.get(f"/instances/{iid}").json()
        assert inst["status"] == "running" and inst["pid"] == pid, inst

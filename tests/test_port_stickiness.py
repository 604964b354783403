"""An instance keeps its port (ruling 24): across host restarts in every stop mode, across
re-adoption and crash restarts, whenever that port is free; and it never takes a port another
instance last served on while that instance exists.

Before, a host stopped by SIGTERM started its instances again on the lowest free ports in boot
order: two instances swapped ports, so a saved backend URL reached the other model.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config

BOUND_S = 30.0


def _wait_running(c: httpx.Client, iids: list[str]) -> dict[str, dict]:
    deadline = time.monotonic() + BOUND_S
    seen: dict[str, dict] = {}
    while time.monotonic() < deadline:
        seen = {i: c.get(f"/instances/{i}").json() for i in iids}
        if all(inst["status"] == "running" for inst in seen.values()):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"not all running within {BOUND_S}s: {seen}")


def _ports(c: httpx.Client, iids: list[str]) -> dict[str, int]:
    return {i: inst["port"] for i, inst in _wait_running(c, iids).items()}


def _three_started_out_of_order(h: HostProc, c: httpx.Client) -> list[str]:
    """Three instances started last to first, so each holds a port that boot order (first to
    last, lowest port first) would give to another one."""
    iids = [
        c.post("/instances", json={"config": script_config(h.tmp, alias=f"m{n}")}).json()[
            "instance"
        ]["id"]
        for n in range(3)
    ]
    for iid in reversed(iids):
        r = c.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
    return iids


STOP_MODES = {
    "sigterm": ({}, signal.SIGTERM),
    "sigint": ({}, signal.SIGINT),
    "sigkill": ({}, signal.SIGKILL),
    "handover": ({}, signal.SIGUSR2),
    "keep_backends": ({"KEEP_BACKENDS_ON_SHUTDOWN": "true"}, signal.SIGTERM),
}


@pytest.mark.parametrize("mode", list(STOP_MODES))
def test_each_instance_keeps_its_port_across_a_host_restart(tmp_path: Path, mode: str) -> None:
    env, sig = STOP_MODES[mode]
    with HostProc(tmp_path, env=env) as h:
        h.start()
        with h.client() as c:
            iids = _three_started_out_of_order(h, c)
            before = _ports(c, iids)
        assert len(set(before.values())) == 3
        h.kill(sig)
        h.start()
        with h.client() as c:
            after = _ports(c, iids)
        assert after == before, f"{mode}: ports moved: {before} -> {after}"


def test_a_crash_restart_takes_the_same_port_and_a_stopped_instance_keeps_its_own(
    tmp_path: Path,
) -> None:
    with HostProc(tmp_path) as h:
        h.start()
        with h.client() as c:
            iids = _three_started_out_of_order(h, c)
            before = _ports(c, iids)
            # A crash: the backend is killed; the restart policy brings it back on its port.
            crashed = iids[1]
            pid = c.get(f"/instances/{crashed}").json()["pid"]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + BOUND_S
            while time.monotonic() < deadline:
                inst = c.get(f"/instances/{crashed}").json()
                if inst["status"] == "running" and inst["pid"] != pid:
                    break
                time.sleep(0.05)
            assert inst["status"] == "running" and inst["pid"] != pid, inst
            assert inst["port"] == before[crashed]
            # A stopped instance's port is not handed to a new one while it exists.
            stopped = iids[0]
            assert c.post(f"/instances/{stopped}/stop").status_code == 200
            new = c.post("/instances", json={"config": script_config(h.tmp, alias="new")})
            new_id = new.json()["instance"]["id"]
            got = c.post(f"/instances/{new_id}/start").json()["instance"]["port"]
            assert got not in before.values(), (got, before)
            # Started again, the stopped one is back on its own port.
            again = c.post(f"/instances/{stopped}/start").json()["instance"]["port"]
            assert again == before[stopped]

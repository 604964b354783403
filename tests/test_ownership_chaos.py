"""Chaos: the host SIGKILLed at random points of start, stop, restart, create and delete, while
a client sends a request every 50 ms to a backend that should stay up.

Must hold after every restart: 0 failed requests to the kept backend, same pid, no second
backend of any instance, a stop never undone, a restart ending running, nothing of ours left
behind at the end. 5 rounds by default (each operation once), 30 with SOLAR_LONG_TESTS=1.
"""

from __future__ import annotations

import functools
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.hostproc import HostProc
from tests.fixtures.pinger import Pinger
from tests.test_ownership import create, get, in_background, ours, start, wait_for

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="Linux /proc")

OPS = ["start", "stop", "restart", "create", "delete"]
ROUNDS = 30 if os.environ.get("SOLAR_LONG_TESTS") else len(OPS)
SETTLED = {"running", "stopped", "failed"}


def settled(c: httpx.Client, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    def check() -> dict[str, dict[str, Any]] | None:
        insts = c.get("/instances").json()
        if all(i["status"] in SETTLED for i in insts):
            return {i["id"]: i for i in insts}
        return None

    return wait_for(check, timeout, "every instance to settle")


def consistent(h: HostProc, c: httpx.Client) -> list[str]:
    """Problems once the background sweep had its time: each running instance has exactly its
    one process, nothing else of ours runs."""

    def problems() -> list[str]:
        insts = settled(c)
        found = ours(h)
        out = []
        for iid, pids in found.items():
            inst = insts.get(iid)
            if inst is None or inst["status"] != "running":
                out.append(f"unmanaged {pids} of {iid} ({inst and inst['status']})")
            elif pids != [inst["pid"]]:
                out.append(f"{iid}: processes {pids}, recorded pid {inst['pid']}")
        for iid, inst in insts.items():
            if inst["status"] == "running" and iid not in found:
                out.append(f"{iid} is running without a process")
        return out

    deadline = time.monotonic() + 20
    while (found := problems()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def operate(c: httpx.Client, h: HostProc, op: str, target: str, victim: str | None) -> None:
    if op == "create":
        create(c, h, f"c-{time.monotonic_ns()}")
    elif op == "delete":
        c.delete(f"/instances/{victim}")
    else:
        c.post(f"/instances/{target}/{op}")


def test_host_sigkill_at_random_points_never_disturbs_backends(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("SOLAR_CHAOS_SEED", "15")))
    problems: list[str] = []
    with HostProc(tmp_path / "h", env={"STOP_GRACE_S": "1"}) as h:
        h.start()
        with h.client() as c:
            keep = create(c, h, "keep")
            keep_inst = start(c, keep)
            target = create(c, h, "target", "--ready-after", "0.3")
        with Pinger(keep_inst["port"], h.api_key) as pinger:
            for n in range(ROUNDS):
                op = OPS[n] if n < len(OPS) else rng.choice(OPS)
                with h.client(timeout=15) as c:
                    before = get(c, target)
                    if op in ("stop", "restart") and before["status"] != "running":
                        before = start(c, target)
                    elif op == "start" and before["status"] != "stopped":
                        c.post(f"/instances/{target}/stop")
                        before = get(c, target)
                    victim = create(c, h, f"d{n}") if op == "delete" else None
                    client = h.client(timeout=15)
                    t = in_background(functools.partial(operate, client, h, op, target, victim))
                    time.sleep(rng.uniform(0.0, 0.6))
                h.kill()
                t.join(10)
                client.close()
                h.start()
                with h.client() as c:
                    if op == "restart":
                        wait_for(lambda: get(c, target)["status"] == "running", 30, "restart")
                    problems += [f"round {n} ({op}): {p}" for p in consistent(h, c)]
                    k = get(c, keep)
                    if k["status"] != "running" or k["pid"] != keep_inst["pid"]:
                        problems.append(f"round {n} ({op}): kept backend {k['status']} {k['pid']}")
                    after = get(c, target)
                    if op == "stop" and after["status"] == "running":
                        # The stop may not have reached the host; if it did, it was not undone.
                        if after["pid"] != before["pid"]:
                            problems.append(f"round {n}: a stop restarted the backend")
        with h.client() as c:
            for iid in list(settled(c)):
                c.post(f"/instances/{iid}/stop")
                c.delete(f"/instances/{iid}")
        wait_for(lambda: ours(h) == {}, 15, "nothing of ours left behind")
    assert not problems, "\n".join(problems)
    assert not pinger.failures, pinger.failures[:10]
    assert pinger.ok > ROUNDS * 10, pinger.ok

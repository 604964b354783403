"""Random concurrent create/start/stop/restart/delete calls on 10 instance slots.

Checks: no 500, no port given to two instances at once, no leaked or duplicated backend process
(psutil, by a tag on each backend's command line), and once the storm is over every instance
is in a settled state that matches its process, and follows the last call made on it.
1,000 calls with SOLAR_LONG_TESTS=1, 200 by default.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from solar_host.backends.registry import BackendRegistry
from solar_host.instances import relays
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend

CALLS = 1000 if os.environ.get("SOLAR_LONG_TESTS") else 200
SLOTS = 10
SETTLED = {"running", "stopped", "failed"}


def owner(p: psutil.Process) -> str:
    """A backend's log file (the one its log relay writes) names its instance
    (alias_<id>_<ts>.log)."""
    path = relays.log_file_of(p.pid)
    return path.name if path is not None else "?"


def tagged(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if tag in (p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


async def wait_settled(client: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        insts = (await client.get("/instances")).json()
        if all(i["status"] in SETTLED for i in insts):
            return insts
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not settled: {[(i['id'], i['status']) for i in insts]}")
        await asyncio.sleep(0.1)


async def test_random_concurrent_calls(tmp_path: Path) -> None:
    tag = f"conc-{uuid.uuid4().hex}"
    model = tmp_path / "models" / "m.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF")
    rng = random.Random(1234)
    s = host_settings(tmp_path, stop_grace_s=1.0, max_retries=0, boot_start_concurrency=4)
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    port_clash: list[str] = []
    slots: list[str | None] = [None] * SLOTS

    async with running_host(s, backends=BackendRegistry([ScriptBackend()])) as h:
        # Every call may wait on the calls before it on the same instance (starts block until
        # ready): give each its own connection and time, so the client is never the limit.
        c = httpx.AsyncClient(
            base_url=h.url,
            headers={"X-API-Key": s.api_key},
            timeout=600,
            limits=httpx.Limits(max_connections=CALLS + 10, max_keepalive_connections=64),
        )

        def cfg(i: int) -> dict[str, Any]:
            return {
                "backend_type": "llamacpp",
                "alias": f"c{i}",
                "model": str(model),
                "fake_args": ["--tag", tag, "--ready-after", str(rng.choice([0, 0.05, 0.2]))],
            }

        async def call(n: int) -> None:
            await asyncio.sleep(rng.random() * 2.0)  # spread the calls over ~2 s
            i = n % SLOTS
            iid = slots[i]
            op = rng.choice(["create", "start", "start", "stop", "restart", "delete"])
            if iid is None or op == "create":
                r = await c.post("/instances", json={"config": cfg(i)})
                if r.status_code == 200 and slots[i] is None:
                    slots[i] = r.json()["instance"]["id"]
                elif r.status_code == 200:  # the slot was filled meanwhile: keep it tidy
                    await c.delete(f"/instances/{r.json()['instance']['id']}")
            elif op == "delete":
                r = await c.delete(f"/instances/{iid}")
                if r.status_code == 200 and slots[i] == iid:
                    slots[i] = None
            else:
                r = await c.post(f"/instances/{iid}/{op}")
            statuses[r.status_code] += 1
            if r.status_code >= 500 or r.status_code not in (200, 404, 409):
                errors.append(f"{op} {iid}: {r.status_code} {r.text[:200]}")

        async def watch_ports(done: asyncio.Event) -> None:
            while not done.is_set():
                insts = (await c.get("/instances")).json()
                ports = Counter(
                    i["port"] for i in insts if i["port"] and i["status"] in ("running", "starting")
                )
                port_clash.extend(f"port {p} x{n}" for p, n in ports.items() if n > 1)
                await asyncio.sleep(0.05)

        done = asyncio.Event()
        watcher = asyncio.create_task(watch_ports(done))
        await asyncio.wait_for(asyncio.gather(*(call(n) for n in range(CALLS))), 900)
        done.set()
        await watcher

        insts = await wait_settled(c)
        procs = tagged(tag)
        running = {i["id"]: i for i in insts if i["status"] == "running"}
        # Every running instance has exactly its one live process; nothing else runs.
        known = {i["id"]: i["status"] for i in insts}
        own = {i["pid"] for i in running.values()}
        strays = [
            (p.pid, owner(p), known.get(owner(p).split("_")[1], "deleted"))
            for p in procs
            if p.pid not in own
        ]
        problems: list[str] = [f"stray backend {s}" for s in strays]
        for p in strays:
            psutil.Process(p[0]).kill()
        missing = own - {p.pid for p in procs}
        problems += [f"running instance without its process: pid {pid}" for pid in missing]
        ports = [i["port"] for i in running.values()]
        assert len(ports) == len(set(ports)), ports
        # The last call decides: a final start or stop on each instance, then check.
        finals = {i["id"]: rng.choice(["start", "stop"]) for i in insts}
        results = await asyncio.gather(
            *(c.post(f"/instances/{iid}/{op}") for iid, op in finals.items())
        )
        assert all(r.status_code == 200 for r in results), [r.text for r in results]
        insts = {i["id"]: i for i in await wait_settled(c)}
        for iid, op in finals.items():
            want = "running" if op == "start" else "stopped"
            assert insts[iid]["status"] == want, (iid, op, insts[iid])
        live = {p.pid for p in tagged(tag)}
        assert live == {i["pid"] for i in insts.values() if i["status"] == "running"}, live
        for iid in list(insts):
            await c.post(f"/instances/{iid}/stop")
            assert (await c.delete(f"/instances/{iid}")).status_code == 200
        assert (await c.get("/instances")).json() == []
        await c.aclose()
    await asyncio.sleep(0.2)
    leaked = tagged(tag)
    for p in leaked:
        p.kill()
    assert not leaked, f"leaked backends: {[p.pid for p in leaked]}"
    assert not problems, problems
    assert not port_clash, port_clash[:10]
    assert not errors, f"{statuses}: " + "\n".join(errors[:20])
    assert statuses[200] > CALLS // 3, statuses

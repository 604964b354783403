"""Readiness probes share a host-wide budget: one loading backend is probed often (it is
seen ready within a few tens of milliseconds), many loading at once are each probed less,
so 200 concurrent starts cannot fill the event loop with probe connections (issue 18)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.instances.httpcheck import ProbePacer
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config

HEALTH_DELAY_S = 1.5


def test_interval_grows_with_load_time_and_with_backends_loading() -> None:
    pacer = ProbePacer()
    pacer.active = 1
    assert pacer.interval(0.0) == pytest.approx(ProbePacer.FIRST_S)
    assert pacer.interval(600.0) == pytest.approx(ProbePacer.LONGEST_S)
    pacer.active = 400
    assert pacer.interval(0.0) == pytest.approx(400 / ProbePacer.MAX_PER_S)


def probes(log: Path) -> list[tuple[float, bool]]:
    out = []
    for line in log.read_text().splitlines():
        at, ok = line.split()
        out.append((float(at), ok == "1"))
    return out


async def start_loading(tmp_path: Path, count: int, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Start `count` backends whose /health answers 503 for HEALTH_DELAY_S (the ready line is
    off, so only the probes can tell), all at once; their probe logs."""
    monkeypatch.setattr(ProbePacer, "MAX_PER_S", 40.0)
    s = host_settings(tmp_path, instance_ready_timeout_s=60)
    logs = [tmp_path / f"health-{i}.log" for i in range(count)]
    async with running_host(s, backends=BackendRegistry([ScriptBackend()])) as h:
        async with httpx.AsyncClient(
            base_url=h.url, headers={"X-API-Key": s.api_key}, timeout=60
        ) as c:
            ids = []
            for i, log in enumerate(logs):
                args = ["--no-ready-line", "--health-delay", str(HEALTH_DELAY_S)]
                cfg = script_config(tmp_path, *args, "--health-log", str(log), alias=f"p{i}")
                r = await c.post("/instances", json={"config": cfg})
                assert r.status_code == 200, r.text
                ids.append(r.json()["instance"]["id"])
            answers = await asyncio.gather(*(c.post(f"/instances/{i}/start") for i in ids))
            assert [a.status_code for a in answers] == [200] * count, [a.text for a in answers]
            await asyncio.gather(*(c.post(f"/instances/{i}/stop") for i in ids))
    return logs


async def test_one_loading_backend_is_probed_often(tmp_path, monkeypatch) -> None:
    [log] = await start_loading(tmp_path, 1, monkeypatch)
    seen = probes(log)
    loading = [at for at, ok in seen if not ok]
    # 1.5 s at 25 ms growing to about 100 ms: some 25 probes on an idle machine, and ready
    # seen within one interval. Paced like 200 backends, it would be 2 probes, 1 s apart.
    assert len(loading) >= 8, len(loading)
    first_ok = next(at for at, ok in seen if ok)
    assert first_ok - loading[-1] < 0.5


async def test_many_loading_backends_share_the_probe_budget(tmp_path, monkeypatch) -> None:
    count = 20
    logs = await start_loading(tmp_path, count, monkeypatch)
    every = [probe for log in logs for probe in probes(log)]
    loading = sorted(at for at, ok in every if not ok)
    # Budget 40 a second for 20 loading backends: each about every 0.5 s. Unpaced, each would
    # be probed ~30 times in 1.5 s (600 in all).
    span = loading[-1] - loading[0]
    assert len(loading) <= 40 * (span + 0.5) + count, (len(loading), span)
    for log in logs:
        assert any(ok for _, ok in probes(log)), f"{log.name}: never probed ready"

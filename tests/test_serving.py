"""`solar-host serve`'s staged start (serving.py): the core, the edge layers and the hot paths
answer at once; other routes wait for the router being built beside them; a router that cannot
be built is a clear 503, never a hang. (A host that cannot start: test_foundation.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from solar_host.app import create_api
from solar_host.host import build_host
from solar_host.serving import StagedApp, _settle_startup_garbage
from tests.fixtures.host import API_KEY, free_port, host_settings

ROOT = Path(__file__).resolve().parents[1]


@contextlib.asynccontextmanager
async def staged_server(app: StagedApp) -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "staged server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


def gated_builder(host: Any, gate: threading.Event) -> Callable[[], Any]:
    def build() -> Any:
        assert gate.wait(20), "test never opened the gate"
        return create_api(host)

    return build


async def test_hot_paths_answer_while_the_router_builds_and_other_routes_wait(
    tmp_path: Path,
) -> None:
    host = build_host(host_settings(tmp_path))
    gate = threading.Event()
    settled: list[bool] = []
    app = StagedApp(host, gated_builder(host, gate), on_api_settled=lambda: settled.append(True))
    async with staged_server(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        # The core is up (lifespan ran) and the edge layers work before any route exists.
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/instances")).status_code == 401
        listed = await c.get("/instances", headers={"X-API-Key": API_KEY})
        assert listed.status_code == 200 and listed.json() == []
        assert app.api is None
        # A routed call waits for the router instead of failing...
        pending = asyncio.create_task(c.get("/resources", headers={"X-API-Key": API_KEY}))
        refused = asyncio.create_task(c.get("/resources"))
        await asyncio.sleep(0.3)
        assert not pending.done()
        # ...except one the edge refuses anyway: no key, no waiting.
        assert refused.done() and refused.result().status_code == 401
        gate.set()
        answered = await asyncio.wait_for(pending, 20)
        assert answered.status_code == 200 and "ram" in answered.json()
        assert settled == [True] and app.api is not None
        # With a query string /health skips the hot path: the router's route answers it.
        routed = await c.get("/health", params={"via": "router"})
        assert routed.status_code == 200 and routed.json()["status"] == "healthy"


async def test_a_router_that_cannot_be_built_is_a_503_and_the_hot_paths_keep_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = build_host(host_settings(tmp_path))

    def broken() -> Any:
        raise RuntimeError("route table exploded")

    app = StagedApp(host, broken)
    async with (
        staged_server(app) as url,
        httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=30) as c,
    ):
        r = await c.get("/resources")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert "route table exploded" in r.json()["detail"]
        # Not healthy without its REST API (a 200 here hid a host serving only 503s).
        health = await c.get("/health")
        assert health.status_code == 503 and "route table exploded" in health.json()["detail"]
        assert (await c.get("/instances")).status_code == 200
    assert any("could not be built" in rec.getMessage() for rec in caplog.records)


async def test_without_a_lifespan_the_first_routed_request_builds_the_router(
    tmp_path: Path,
) -> None:
    host = build_host(host_settings(tmp_path))
    app = StagedApp(host, lambda: create_api(host))
    transport = httpx.ASGITransport(app=app)  # sends no lifespan events
    async with httpx.AsyncClient(
        transport=transport, base_url="http://t", headers={"X-API-Key": API_KEY}
    ) as c:
        r = await c.get("/openapi.json")
    assert r.status_code == 200 and "/instances" in r.json()["paths"]


def test_settling_start_up_garbage_turns_the_collector_back_on() -> None:
    gc.disable()
    try:
        _settle_startup_garbage()
        assert gc.isenabled()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()


def test_uvicorn_main_app_serves_the_same_staged_host(tmp_path: Path) -> None:
    """`uvicorn solar_host.main:app` (the product README's development command)."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "API_KEY": API_KEY,
        "CONFIG_FILE": str(tmp_path / "config.json"),
        "LOG_DIR": str(tmp_path / "logs"),
        "MODELS_DIR": str(tmp_path / "models"),
    }
    cmd = [sys.executable, "-m", "uvicorn", "solar_host.main:app", "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=10) as c:
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                with contextlib.suppress(httpx.HTTPError):
                    if c.get("/health").status_code == 200:
                        break
                assert time.monotonic() < deadline, "no /health within 30 s"
                time.sleep(0.02)
            assert c.get("/resources").status_code == 200  # waits for the router if need be
            assert (tmp_path / "config.json").parent.is_dir()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0

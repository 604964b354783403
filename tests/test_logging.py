"""The host's own log: readable lines or JSON lines, with request ids and instance ids."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.platform.logging_setup import configure_logging
from tests.fixtures.host import API_KEY, free_port, host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def failing_config(tmp_path: Path) -> dict:
    return script_config(tmp_path, "--exit-after", "0", "--exit-code", "3", alias="broken:1b")


async def test_text_lines_carry_request_and_instance_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    settings = host_settings(tmp_path, max_retries=0, log_level="debug")
    configure_logging(settings)  # its handler writes to sys.stderr, which capsys holds now
    reg = BackendRegistry([ScriptBackend()])
    async with running_host(settings, backends=reg) as h:
        r = await h.client.post("/instances", json={"config": failing_config(tmp_path)})
        iid = r.json()["instance"]["id"]
        r = await h.client.post(f"/instances/{iid}/start", headers={"X-Request-ID": "req-text-1"})
        assert r.status_code == 500
        assert r.headers["x-request-id"] == "req-text-1"
    err = capsys.readouterr().err
    lines = err.splitlines()
    failed = [ln for ln in lines if "start attempt 1 of" in ln]
    assert failed, err
    # 2026-01-01T00:00:00.000Z WARNING solar_host...: instance=<id> request=<id>: message
    ts, level, rest = failed[0].split(" ", 2)
    assert ts.endswith("Z") and level == "WARNING"
    assert f" instance={iid} request=req-text-1: " in rest
    # debug level adds one access line per request, with its id
    assert any(
        f"POST /instances/{iid}/start 500" in ln and "request=req-text-1" in ln for ln in lines
    ), err


async def test_request_id_is_made_when_missing_or_unusable(tmp_path: Path) -> None:
    async with running_host(host_settings(tmp_path)) as h:
        made = (await h.client.get("/health")).headers["x-request-id"]
        assert len(made) == 16 and made.isalnum()
        again = (await h.client.get("/health")).headers["x-request-id"]
        assert again != made
        for bad in ("x" * 200, "has space", 'a"b'):
            got = (await h.client.get("/health", headers={"X-Request-ID": bad})).headers
            assert got["x-request-id"] != bad and len(got["x-request-id"]) == 16
        # refused requests carry one too
        r = await httpx.AsyncClient(base_url=h.url).get(
            "/instances", headers={"X-Request-ID": "ctl-42"}
        )
        assert r.status_code == 401 and r.headers["x-request-id"] == "ctl-42"


async def test_json_lines_from_the_real_command(tmp_path: Path) -> None:
    """`python -m solar_host` with LOG_FORMAT=json: every line of its log is a JSON object."""
    port = free_port()
    model = tmp_path / "models" / "m.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF")
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "PORT", "HOST")}
    env.update(
        PYTHONPATH=str(REPO),
        API_KEY=API_KEY,
        LOG_FORMAT="json",
        CONFIG_FILE=str(tmp_path / "config.json"),
        LOG_DIR=str(tmp_path / "logs"),
        MODELS_DIR=str(tmp_path / "models"),
        JOBS_DIR=str(tmp_path / "jobs"),
        LLAMA_SERVER_BIN="/bin/false",  # resolves, and every start of it fails at once
        MAX_RETRIES="0",
        START_PORT=str(free_port()),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "solar_host",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--env-file",
        os.devnull,
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=30) as c:
            t0 = time.monotonic()
            while True:
                assert proc.returncode is None, (await proc.stderr.read()).decode()  # type: ignore[union-attr]
                try:
                    if (await c.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() - t0 < 30, "host did not come up"
                await asyncio.sleep(0.1)
            r = await c.post(
                "/resources/reservations",
                json={"job_id": "job-1", "vram_gb": 0.0, "ram_gb": 0.001},
                headers={"X-Request-ID": "req-json-1"},
            )
            assert r.status_code == 201, r.text
            r = await c.post(
                "/instances",
                json={"config": {"backend_type": "llamacpp", "alias": "m", "model": str(model)}},
            )
            assert r.status_code == 200, r.text
            iid = r.json()["instance"]["id"]
            r = await c.post(f"/instances/{iid}/start", headers={"X-Request-ID": "req-json-2"})
            assert r.status_code == 500, r.text
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, err_bytes = await asyncio.wait_for(proc.communicate(), 30)
    records = [json.loads(line) for line in err_bytes.decode().splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    reservation = [r for r in records if "reservation" in r["msg"] and "job-1" in r["msg"]]
    assert reservation and reservation[0]["request_id"] == "req-json-1", records
    assert reservation[0]["level"] == "info"
    start = [r for r in records if r.get("instance_id") == iid and r["level"] == "warning"]
    assert start and start[0]["request_id"] == "req-json-2", records
    assert API_KEY not in err_bytes.decode()

"""Backend log lines leave the machine redacted: control's log_batch, GET and WS .../logs.

A real host (uvicorn, the control link, a real backend process) and a real Socket.IO server
playing control. The scripted backend prints the host key and the instance's own key, as a
backend echoing its `--api-key` does; the host's own log was redacted, these three paths were
not.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect as ws_connect

from solar_host.backends.registry import BackendRegistry
from tests.fixtures.control_server import ControlServer
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config

INSTANCE_KEY = "instance-key-REDACTME-0123"
PRINTED = (
    f"loading with --api-key {API_KEY}",
    f"extra key {INSTANCE_KEY} accepted",
    f"GET /v1/models Authorization: Bearer {API_KEY}",
)


def _leaks(lines: list[str]) -> list[str]:
    return [line for line in lines if API_KEY in line or INSTANCE_KEY in line]


async def _until(predicate: Any, within_s: float = 30.0) -> Any:
    deadline = time.monotonic() + within_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.05)
    return value


async def test_keys_printed_by_a_backend_are_redacted_wherever_its_lines_go(
    tmp_path: Path,
) -> None:
    async with ControlServer(known_keys={API_KEY: "host-1"}) as control:
        settings = host_settings(
            tmp_path, solar_control_url=control.url, outbox_flush_interval_s=0.05
        )
        backends = BackendRegistry([ScriptBackend()])
        async with running_host(settings, backends=backends) as h:
            await control.wait_event("host_health", within_s=15)
            cfg = script_config(tmp_path, "--lines", ",".join(PRINTED), api_key=INSTANCE_KEY)
            r = await h.client.post("/instances", json={"config": cfg})
            iid = r.json()["instance"]["id"]
            r = await h.client.post(f"/instances/{iid}/start")
            assert r.status_code == 200, r.text

            def sent() -> list[str]:
                batches = control.events("log_batch")
                return [e["line"] for b in batches for e in b["entries"] if e["instance_id"] == iid]

            to_control = await _until(lambda: len(sent()) >= len(PRINTED) and sent())
            rest = [e["line"] for e in (await h.client.get(f"/instances/{iid}/logs")).json()]
            ws_url = h.url.replace("http://", "ws://") + f"/instances/{iid}/logs"
            streamed: list[str] = []
            async with ws_connect(ws_url, additional_headers={"X-API-Key": API_KEY}) as ws:
                while len(streamed) < len(PRINTED):
                    msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    if "line" in msg:
                        streamed.append(msg["line"])

            redacted = [
                "loading with --api-key ***",
                "extra key *** accepted",
                "GET /v1/models Authorization: Bearer ***",
            ]
            for where, lines in (("control", to_control), ("REST", rest), ("WS", streamed)):
                assert not _leaks(lines), (where, _leaks(lines))
                assert lines[: len(PRINTED)] == redacted, (where, lines)
            # Readiness still reads the backend's own lines: the start above succeeded.
            status = (await h.client.get(f"/instances/{iid}")).json()["status"]
            assert status == "running"
            await h.client.post(f"/instances/{iid}/stop")
            # Deleted, its lines are read back from its log file: the host's secrets are
            # replaced the same way (the deleted instance's own key is no longer known).
            assert (await h.client.delete(f"/instances/{iid}")).status_code == 200
            r = await h.client.get(f"/instances/{iid}/logs")
            from_file = [e["line"] for e in r.json()]
            assert "loading with --api-key ***" in from_file, from_file
            assert not any(API_KEY in ln for ln in from_file), from_file

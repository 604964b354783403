"""No secret in any log (issue 17): a whole scenario against a real host process (its own
logging, uvicorn's WebSocket lines, a real llama-server, a failing registry pull) leaves the
host key, the instance's key and the registry password and HF token in no log file and no
captured output; the WebSocket line that carried `?api_key=` is there, redacted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from websockets.asyncio.client import connect as ws_connect

from solar_host.platform.logging_setup import Redactor
from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf
from tests.fixtures.hostproc import HostProc

HOST_KEY = "host-key-REDACTME-0123456789"
INSTANCE_KEY = "instance-key-REDACTME-0123"
HARBOR_PASSWORD = "harbor-pass-REDACTME-0123"
HF_TOKEN = "hf_REDACTMEtoken0123456789"
SECRETS = (HOST_KEY, INSTANCE_KEY, HARBOR_PASSWORD, HF_TOKEN)


def test_redactor_patterns() -> None:
    r = Redactor([HOST_KEY])
    cases = {
        '127.0.0.1:5 - "WebSocket /instances/x/logs?api_key=abc123def&tail=5" [accepted]':
            '127.0.0.1:5 - "WebSocket /instances/x/logs?api_key=***&tail=5" [accepted]',
        "GET /x?token=zz&harbor_password=pw HTTP/1.1":
            "GET /x?token=***&harbor_password=*** HTTP/1.1",
        "Authorization: Bearer abc.def-ghi": "Authorization: Bearer ***",
        '{"X-API-Key": "kkkkkk"}': '{"X-API-Key": "***"}',
        f"the key is {HOST_KEY}.": "the key is ***.",
        "https://robot:pw0rd@harbor.local/v2/": "https://robot:***@harbor.local/v2/",
        "model=m.gguf alias=a ctx_size=256": "model=m.gguf alias=a ctx_size=256",
    }  # fmt: skip
    for given, want in cases.items():
        assert r(given) == want, given


async def _ws_lines(url: str, n: int) -> list[str]:
    out: list[str] = []
    async with ws_connect(url) as ws:
        while len(out) < n:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if "line" in msg:
                out.append(msg["line"])
    return out


def test_a_whole_scenario_leaves_no_secret_in_any_log(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "host" / "models" / "tiny.gguf")
    env = {
        "LLAMA_SERVER_BIN": llama_server_binary(),
        "LOG_LEVEL": "debug",
        "HF_TOKEN": HF_TOKEN,
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HARBOR_URL": "http://127.0.0.1:9",
        "HARBOR_USERNAME": "robot",
        "HARBOR_PASSWORD": HARBOR_PASSWORD,
    }
    with HostProc(tmp_path / "host", backend="real", env=env, api_key=HOST_KEY) as host:
        host.start()
        with host.client(timeout=120) as c:
            cfg = {
                "backend_type": "llamacpp",
                "alias": "tiny",
                "model": str(model),
                "ctx_size": 256,
                "host": "127.0.0.1",
                "api_key": INSTANCE_KEY,
            }
            r = c.post("/instances", json={"config": cfg})
            assert r.status_code == 200, r.text
            iid = r.json()["instance"]["id"]
            r = c.post(f"/instances/{iid}/start")
            assert r.status_code == 200, r.text
            port = r.json()["instance"]["port"]
            # Requests with each key, so the backend logs them if it logs anything of keys.
            for key in (HOST_KEY, INSTANCE_KEY):
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                    timeout=120,
                )
                assert r.status_code == 200, r.text
            ws_url = host.url.replace("http://", "ws://") + f"/instances/{iid}/logs"
            lines = asyncio.run(_ws_lines(f"{ws_url}?api_key={HOST_KEY}", 3))
            assert lines
            # A query-string key on a plain request, and pulls that reach the registry code.
            httpx.get(f"{host.url}/instances?api_key={HOST_KEY}", timeout=30)
            for body in (
                {"source": "harbor", "source_uri": "repo://m:1", "harbor_ref": "m:1"},
                {"source": "huggingface", "source_uri": "huggingface://org/m", "model_id": "org/m"},
            ):
                r = c.post("/models/pull", json=body)
                assert 400 <= r.status_code < 600 or r.status_code == 202, r.text
            r = c.post(f"/instances/{iid}/stop")
            assert r.status_code == 200
        host.stop()
        host_log = host.log_path.read_text("utf-8", "replace")
    assert "WebSocket" in host_log and "api_key=***" in host_log, host_log[-3000:]
    files = [host.log_path, *(tmp_path / "host" / "logs").glob("*")]
    files += [p for p in (tmp_path / "host").rglob("*.log")]
    assert len(files) >= 2
    for f in files:
        if f.is_file():
            text = f.read_text("utf-8", "replace")
            for secret in SECRETS:
                assert secret not in text, (f.name, secret)

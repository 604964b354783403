"""The command line `launch()` builds, run for real on the tiny GGUF (no host involved).

Checks what only the real server can tell: that it takes the keys from LLAMA_API_KEY (host
key and instance key both work, no key is refused), that its readiness line is the one we
wait for, that its log gives one GenerationMetrics per request, and that no key shows in
/proc/<pid>/cmdline.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from solar_host.backends.base import LaunchContext
from solar_host.backends.llamacpp import BACKEND, usage_snapshot
from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.backends.prometheus import parse_prometheus_text
from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]

HOST_KEY = "host-secret-7f3a9c"
INSTANCE_KEY = "instance-secret-42d1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path, ready_s: float):
        self.proc, self.port, self.log, self.ready_s = proc, port, log, ready_s
        self.url = f"http://127.0.0.1:{port}"

    def lines(self) -> list[str]:
        return self.log.read_text("utf-8", "replace").splitlines()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama-real")
    model = write_tiny_gguf(tmp / "tiny-f16.gguf")
    port = _free_port()
    config = LlamaCppConfig(
        alias="tiny:1",
        model=str(model),
        host="127.0.0.1",
        ctx_size=512,
        threads=2,
        api_key=INSTANCE_KEY,
    )
    ctx = LaunchContext(
        instance_id="inst-1",
        port=port,
        host_api_key=HOST_KEY,
        models_dir=tmp,
        llama_server_bin=llama_server_binary(),
    )
    spec = BACKEND.launch(config, ctx)
    env = dict(os.environ)
    for k in spec.env_remove:
        env.pop(k, None)
    env.update(spec.env)
    log = tmp / "server.log"
    with open(log, "wb") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            spec.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        ready_line = healthy = False
        deadline = t0 + 60
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline and not (ready_line and healthy):
                assert proc.poll() is None, log.read_text("utf-8", "replace")[-3000:]
                if not ready_line:
                    text = log.read_text("utf-8", "replace")
                    ready_line = any(BACKEND.is_ready_line(ln) for ln in text.splitlines())
                if not healthy:
                    try:
                        healthy = client.get(f"http://127.0.0.1:{port}/health").status_code == 200
                    except httpx.TransportError:
                        healthy = False
                if not (ready_line and healthy):
                    time.sleep(0.02)
        ready_s = time.monotonic() - t0
        assert ready_line and healthy, log.read_text("utf-8", "replace")[-3000:]
        print(f"\nllama-server {ctx.llama_server_bin}: ready in {ready_s:.3f} s")
        yield Server(proc, port, log, ready_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _chat(server: Server, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 12},
        headers=headers,
        timeout=30,
    )


def test_keys_from_environment(server):
    r = _chat(server, HOST_KEY)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "the cat is", "max_tokens": 8},
        headers={"Authorization": f"Bearer {HOST_KEY}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert _chat(server, None).status_code == 401
    assert _chat(server, "wrong-key").status_code == 401
    assert _chat(server, INSTANCE_KEY).status_code == 200


def test_keys_not_on_command_line(server):
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    assert b"--model" in cmdline
    assert HOST_KEY.encode() not in cmdline and INSTANCE_KEY.encode() not in cmdline
    assert b"--api-key" not in cmdline


def test_ready_line_in_real_log(server):
    ready = [ln for ln in server.lines() if BACKEND.is_ready_line(ln)]
    assert len(ready) == 1
    assert "listening on http://127.0.0.1:" in ready[0]
    assert server.ready_s < 30


def test_real_log_yields_generation_metrics(server):
    r = _chat(server, HOST_KEY)
    assert r.status_code == 200
    usage = r.json()["usage"]
    deadline = time.monotonic() + 10
    gens = []
    while time.monotonic() < deadline:
        parser = BACKEND.new_parser(None)
        gens = [
            res.generation for ln in server.lines() if (res := parser.feed(ln)) and res.generation
        ]
        if gens and gens[-1].generated_tokens == usage["completion_tokens"]:
            break
        time.sleep(0.05)
    last = gens[-1]
    assert last.source == "log" and last.started_at and last.finished_at
    assert last.generated_tokens == usage["completion_tokens"]
    assert (
        last.prompt_eval_tokens is not None
        and 0 < last.prompt_eval_tokens <= usage["prompt_tokens"]
    )
    assert last.total_tokens == last.prompt_tokens + last.generated_tokens
    assert abs(last.prompt_tokens - usage["prompt_tokens"]) <= 1
    assert last.decode_tps and last.decode_tps > 0
    assert parser.last_state.phase == "idle" and not parser.last_state.busy


def test_metrics_endpoint_maps(server):
    # Its own request first: the prompt counter must not depend on another test having run.
    assert _chat(server, HOST_KEY).status_code == 200
    r = httpx.get(
        f"{server.url}/metrics", headers={"Authorization": f"Bearer {HOST_KEY}"}, timeout=10
    )
    assert r.status_code == 200
    metrics = parse_prometheus_text(r.text)
    snap = usage_snapshot(metrics)
    assert snap is not None and snap["requests_processing"] == 0
    assert snap["prompt_tokens_total"] and snap["prompt_tokens_total"] > 0
    assert BACKEND.new_parser(None).apply_metrics(metrics) is None  # idle agrees with idle

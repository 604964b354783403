"""The HuggingFace backend through a whole host (issue 5): real HTTP, real hf_server processes.

One in-process host (default BackendRegistry) serves the causal and classification models and a
model that must fail (device cuda on this CPU box); a second host runs as its own
`python -m solar_host` process and serves the embedding model, so we can check that a host never
imports torch (the test process does: it builds the models). Every backend of both hosts is
started at once in one module fixture: their torch imports (~5 s of CPU each) overlap.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import pytest_asyncio
from websockets.asyncio.client import connect as ws_connect

from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)
from tests.fixtures.host import API_KEY, free_port, host_settings, running_host
from tests.fixtures.probes import FakeProbe

pytestmark = [
    pytest.mark.hf,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]

HF_TYPES = {
    "huggingface_causal",
    "huggingface_classification",
    "huggingface_embedding",
    "huggingface_vision",
}
BEARER = {"Authorization": f"Bearer {API_KEY}"}
READY_TIMEOUT_S = 300.0  # loaded 2-core machine; a failed start must come back far sooner


def hf_config(backend_type: str, model: Path, alias: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend_type": backend_type,
        "alias": alias,
        "model_id": str(model),
        "host": "127.0.0.1",
        **extra,
    }


@dataclass
class Started:
    id: str
    response: httpx.Response
    elapsed_s: float
    client: httpx.AsyncClient  # of the host that runs it


@dataclass
class HFHosts:
    client: httpx.AsyncClient
    url: str
    started: dict[str, Started]
    sub_url: str
    sub_pid: int
    sub_log: Path


async def create_and_start(client: httpx.AsyncClient, config: dict[str, Any]) -> Started:
    r = await client.post("/instances", json={"config": config})
    assert r.status_code == 200, r.text
    iid = r.json()["instance"]["id"]
    t0 = time.monotonic()
    r = await client.post(f"/instances/{iid}/start", timeout=READY_TIMEOUT_S + 30)
    return Started(iid, r, time.monotonic() - t0, client)


def spawn_subprocess_host(
    tmp: Path, port: int, model_root: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    """`python -m solar_host` configured through the environment only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SOLAR_", "API_KEY"))}
    env.update(
        {
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
            "API_KEY": API_KEY,
            "HOST": "127.0.0.1",
            "PORT": str(port),
            "CONFIG_FILE": str(tmp / "config.json"),
            "LOG_DIR": str(tmp / "logs"),
            "MODELS_DIR": str(tmp / "models"),
            "JOBS_DIR": str(tmp / "jobs"),
            "START_PORT": str(free_port()),
            "SOLAR_CONTROL_URL": "",
            "MAX_RETRIES": "0",
            "MODEL_ROOTS": str(model_root),
            "INSTANCE_READY_TIMEOUT_S": str(READY_TIMEOUT_S),
            "STOP_GRACE_S": "3",
            # Its log is read for the markers of one request alone: no known-answer probes
            # beside it (test_canary_real.py probes these backends).
            "CANARY_INTERVAL_S": "0",
        }
    )
    log = tmp / "host.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "solar_host", "--env-file", "/dev/null"],
            env=env,
            cwd=tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, log


def tail_of(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    async with httpx.AsyncClient(timeout=2) as c:
        for _ in range(300):
            if proc.poll() is not None:
                raise AssertionError(f"host exited {proc.returncode}: {tail_of(log)}")
            try:
                if (await c.get(url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"host did not answer: {tail_of(log)}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hosts(
    tiny_hf_models: TinyHFModels,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[HFHosts]:
    models = tiny_hf_models
    tmp = tmp_path_factory.mktemp("hf-host")
    sub_tmp = tmp_path_factory.mktemp("hf-subhost")
    settings = host_settings(
        tmp,
        model_roots=str(models.causal.parent),  # the session's tiny models live outside tmp
        max_retries=0,
        instance_ready_timeout_s=READY_TIMEOUT_S,
        start_port=free_port(),
    )
    sub_port = free_port()
    proc, sub_log = spawn_subprocess_host(sub_tmp, sub_port, models.causal.parent)
    sub_url = f"http://127.0.0.1:{sub_port}"
    try:
        async with running_host(settings, probe=FakeProbe()) as h:
            await wait_http(sub_url, proc, sub_log)
            configs = {
                "causal": hf_config(
                    "huggingface_causal", models.causal, "tiny:gpt2", max_length=512
                ),
                "cls": hf_config("huggingface_classification", models.classifier, "tiny-cls"),
                "cuda": hf_config(
                    "huggingface_embedding", models.encoder, "tiny-cuda", device="cuda"
                ),
            }
            async with httpx.AsyncClient(
                base_url=sub_url, headers={"X-API-Key": API_KEY}, timeout=30
            ) as sub:
                results = await asyncio.gather(
                    *(create_and_start(h.client, c) for c in configs.values()),
                    create_and_start(
                        sub, hf_config("huggingface_embedding", models.encoder, "tiny-emb")
                    ),
                )
                yield HFHosts(
                    client=h.client,
                    url=h.url,
                    started=dict(zip([*configs, "emb"], results, strict=True)),
                    sub_url=sub_url,
                    sub_pid=proc.pid,
                    sub_log=sub_log,
                )
                for s in results:
                    await s.client.post(f"/instances/{s.id}/stop")
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def running(h: HFHosts, name: str) -> dict[str, Any]:
    s = h.started[name]
    assert s.response.status_code == 200, (s.response.text, tail_of(h.sub_log))
    inst = s.response.json()["instance"]
    assert inst["status"] == "running"
    return inst


def port_url(inst: dict[str, Any]) -> str:
    return f"http://127.0.0.1:{inst['port']}"


# --- host-level metadata --------------------------------------------------------------------------


async def test_supported_backends_lists_huggingface(hosts: HFHosts) -> None:
    for url in (hosts.url, hosts.sub_url):
        async with httpx.AsyncClient(timeout=10) as c:
            body = (await c.get(url + "/")).json()  # public: no key needed
        assert HF_TYPES <= set(body["supported_backends"]), body


async def test_instances_listing_shows_running_metadata(hosts: HFHosts) -> None:
    listing = {}
    async with httpx.AsyncClient(headers={"X-API-Key": API_KEY}, timeout=10) as c:
        for url in (hosts.url, hosts.sub_url):
            listing.update({i["id"]: i for i in (await c.get(url + "/instances")).json()})
    expect = {
        "causal": (
            ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health"],
            "tiny:gpt2",
        ),
        "cls": (["/v1/classify", "/v1/models", "/health"], "tiny-cls"),
        "emb": (["/v1/embeddings", "/v1/models", "/health"], "tiny-emb"),
    }
    for name, (endpoints, served) in expect.items():
        started = running(hosts, name)
        inst = listing[hosts.started[name].id]
        assert inst["status"] == "running"
        assert inst["pid"] == started["pid"] and inst["port"] == started["port"]
        assert psutil.Process(inst["pid"]).is_running()
        assert inst["supported_endpoints"] == endpoints
        assert inst["served_model_name"] == served
        # A text-only causal model has no vision capability; the others carry none.
        assert inst["capabilities"] in (None, [])
        assert inst["config"]["api_key"] == API_KEY  # control's HTTP-poll path (ruling 2)
    # The failed one is listed as failed, with the reason.
    bad = listing[hosts.started["cuda"].id]
    assert bad["status"] == "failed" and bad["pid"] is None and bad["error_message"]


# --- the failed start -----------------------------------------------------------------------------


async def test_cuda_on_cpu_is_a_fast_structured_500(hosts: HFHosts) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the instance asked for it starts")
    s = hosts.started["cuda"]
    assert s.response.status_code == 500, s.response.text
    body = s.response.json()
    assert set(body) == {"detail", "instance_id", "exit_code", "log_tail"}
    assert body["instance_id"] == s.id
    assert body["detail"].startswith("Failed to start instance: Process exited")
    assert body["exit_code"] not in (None, 0)
    assert any("CUDA requested but not available" in line for line in body["log_tail"]), body
    # It ends on the process exit, not on the readiness timeout.
    assert s.elapsed_s < READY_TIMEOUT_S / 3, s.elapsed_s


# --- generation through the instance port ---------------------------------------------------------


CHAT = {"messages": [{"role": "user", "content": "hello world"}], "temperature": 0}


async def test_causal_endpoints_with_host_key(hosts: HFHosts) -> None:
    inst = running(hosts, "causal")
    async with httpx.AsyncClient(base_url=port_url(inst), headers=BEARER, timeout=60) as c:
        assert (
            await c.post(
                "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"}
            )
        ).status_code == 401
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert r.status_code == 200, r.text
        chat = r.json()
        assert chat["model"] == "tiny:gpt2" and chat["choices"][0]["message"]["content"]
        assert chat["usage"]["completion_tokens"] == 5

        r = await c.post(
            "/v1/completions", json={"prompt": "the cat sat", "max_tokens": 4, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4

        events: list[Any] = []
        body = {**CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            async for line in s.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
        assert events[-1] == "[DONE]"
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
        )
        assert text
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6


async def _last_generation_after(hosts: HFHosts, iid: str, before: datetime) -> dict[str, Any]:
    """The record after `before` (the [COMPLETE] line reaches the parser through the log
    follower: poll, with a deadline generous enough for a loaded machine)."""
    deadline = time.monotonic() + 30
    while True:
        g = await hosts.client.get(
            f"/instances/{iid}/last-generation", params={"after": before.isoformat()}
        )
        if g.status_code == 200:
            return g.json()
        assert g.status_code == 404, g.text
        assert time.monotonic() < deadline, g.text
        await asyncio.sleep(0.02)


async def test_last_generation_and_state_after_chat(hosts: HFHosts) -> None:
    inst = running(hosts, "causal")
    iid = inst["id"]
    async with httpx.AsyncClient(base_url=port_url(inst), headers=BEARER, timeout=60) as c:
        # Back to back, each read right after its response: each record must be its own
        # request's, never the one before (which the host may still be reading).
        for n, stream in [(3, False), (5, True), (2, False), (6, True), (4, False)]:
            before = datetime.now(UTC)
            body = {**CHAT, "max_tokens": n}
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
                events = []
                async with c.stream("POST", "/v1/chat/completions", json=body) as s:
                    async for line in s.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            events.append(json.loads(line[6:]))
                usage = events[-1]["usage"]
            else:
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
                usage = r.json()["usage"]
            rec = await _last_generation_after(hosts, iid, before)
            prompt_tokens = usage["prompt_tokens"]
            assert rec["source"] == "log" and rec["instance_id"] == iid
            assert rec["generated_tokens"] == n == usage["completion_tokens"], (rec, n)
            assert rec["prompt_tokens"] == prompt_tokens
            assert rec["total_tokens"] == prompt_tokens + n
            finished = datetime.fromisoformat(rec["finished_at"])
            assert before <= finished <= datetime.now(UTC)
            assert before <= datetime.fromisoformat(rec["started_at"]) <= finished

        # Under load: several at once, each a different length; the record after they all
        # began is one of theirs, and it began after `before`.
        before = datetime.now(UTC)
        lengths = [7, 8, 9, 10, 11, 12]
        rs = await asyncio.gather(
            *(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": n}) for n in lengths)
        )
        assert [r.json()["usage"]["completion_tokens"] for r in rs] == lengths
        prompt_tokens = rs[0].json()["usage"]["prompt_tokens"]
        rec = await _last_generation_after(hosts, iid, before)
        assert rec["generated_tokens"] in lengths and rec["prompt_tokens"] == prompt_tokens
        assert before <= datetime.fromisoformat(rec["started_at"])

    ok = await hosts.client.get(f"/instances/{iid}/last-generation", params={"within_s": 600})
    assert ok.status_code == 200 and ok.json()["generated_tokens"] in lengths
    await asyncio.sleep(0.3)
    stale = await hosts.client.get(f"/instances/{iid}/last-generation", params={"within_s": 0.1})
    assert stale.status_code == 404
    assert stale.json() == {"detail": "No recent generation metrics within the specified window"}
    later = (datetime.now(UTC) + timedelta(seconds=60)).isoformat()
    future = await hosts.client.get(f"/instances/{iid}/last-generation", params={"after": later})
    assert future.status_code == 404

    deadline = time.monotonic() + 30
    while True:  # every [COMPLETE] is in the file; the host reads it soon after
        state = (await hosts.client.get(f"/instances/{iid}/state")).json()
        if not state["busy"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert state["instance_id"] == iid
    assert state["busy"] is False and state["phase"] == "idle" and state["active_slots"] == 0
    assert state["timestamp"]


async def test_embedding_and_classify_do_not_count_as_generations(hosts: HFHosts) -> None:
    cls, emb = running(hosts, "cls"), running(hosts, "emb")
    async with httpx.AsyncClient(headers=BEARER, timeout=60) as c:
        r = await c.post(
            port_url(cls) + "/v1/classify", json={"input": ["the cat sat on the mat", "a"]}
        )
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [ch["label"] in ("NEG", "POS") for ch in choices] == [True, True]
        r = await c.post(port_url(emb) + "/v1/embeddings", json={"input": ["hello", "the cat"]})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert len(data) == 2 and len(data[0]["embedding"]) == 32
        assert r.json()["model"] == "tiny-emb"
    await asyncio.sleep(0.3)
    for name in ("cls", "emb"):
        s = hosts.started[name]
        g = await s.client.get(f"/instances/{s.id}/last-generation")
        assert g.status_code == 404
        assert g.json() == {"detail": "No generation metrics available"}


async def test_logs_websocket_shows_request_markers(hosts: HFHosts) -> None:
    inst = running(hosts, "emb")  # on the subprocess host
    ws_url = hosts.sub_url.replace("http://", "ws://") + f"/instances/{inst['id']}/logs"
    seen: list[str] = []
    async with ws_connect(ws_url, additional_headers={"X-API-Key": API_KEY}) as ws:
        async with httpx.AsyncClient(headers=BEARER, timeout=60) as c:
            r = await c.post(port_url(inst) + "/v1/embeddings", json={"input": "ws marker"})
            assert r.status_code == 200

        async def read_until_complete() -> None:
            while True:
                msg = json.loads(await ws.recv())
                assert set(msg) == {"seq", "timestamp", "line"}
                seen.append(msg["line"])
                if "[COMPLETE]" in msg["line"]:
                    return

        await asyncio.wait_for(read_until_complete(), 10)
    assert any("Uvicorn running on" in line for line in seen)
    req = [line for line in seen if "[REQUEST]" in line]
    done = [line for line in seen if "[COMPLETE]" in line]
    assert req and done and "/v1/embeddings" in req[-1]
    rid = req[-1].split("id=")[1].split()[0]
    assert f"id={rid}" in done[-1]


# --- the host process never imports torch ---------------------------------------------------------


def mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
        return {parts[-1] for line in fh if len(parts := line.split()) >= 6}


async def test_subprocess_host_serves_hf_without_importing_torch(hosts: HFHosts) -> None:
    inst = running(hosts, "emb")
    async with httpx.AsyncClient(headers=BEARER, timeout=60) as c:
        r = await c.post(port_url(inst) + "/v1/embeddings", json={"input": "no torch here"})
        assert r.status_code == 200, r.text
    backend_libs = mapped_files(inst["pid"])
    host_libs = mapped_files(hosts.sub_pid)
    # Positive control: the backend did load torch's shared libraries...
    assert any("/torch/" in p for p in backend_libs)
    # ...and the host that launched, polled and parsed it did not.
    assert not [p for p in host_libs if "/torch/" in p or "libtorch" in p]
    assert any("python" in p for p in host_libs)  # the maps of a real interpreter


# --- stop -----------------------------------------------------------------------------------------


async def test_stop_ends_every_backend(hosts: HFHosts, tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    """Stops instances of its own (one per host), so that no other test depends on running
    before it: the module's shared instances stay up whatever the order."""
    sub = httpx.AsyncClient(base_url=hosts.sub_url, headers={"X-API-Key": API_KEY}, timeout=30)
    async with sub:
        mine = await asyncio.gather(
            create_and_start(
                hosts.client,
                hf_config("huggingface_classification", tiny_hf_models.classifier, "stop-cls"),
            ),
            create_and_start(
                sub, hf_config("huggingface_embedding", tiny_hf_models.encoder, "stop-emb")
            ),
        )
        pids = []
        for s in mine:
            assert s.response.status_code == 200, s.response.json().get("log_tail")
            inst = s.response.json()["instance"]
            assert inst["status"] == "running" and psutil.pid_exists(inst["pid"])
            pids.append(inst["pid"])
            r = await s.client.post(f"/instances/{s.id}/stop")
            assert r.status_code == 200, r.text
            assert r.json()["instance"]["status"] == "stopped"
            assert r.json()["instance"]["pid"] is None
        for pid in pids:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        for s in mine:
            assert (await s.client.get(f"/instances/{s.id}")).json()["status"] == "stopped"
            await s.client.delete(f"/instances/{s.id}")

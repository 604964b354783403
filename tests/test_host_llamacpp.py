"""The host with a real llama-server on a tiny generated GGUF: the whole lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.hostproc import HostProc


@pytest.fixture(scope="module")
def llama_bin() -> str:
    return llama_server_binary()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f16.gguf")


def llama_cfg(model: Path, **extra: object) -> dict:
    return {
        "backend_type": "llamacpp",
        "alias": "tiny:1b",
        "model": str(model),
        "ctx_size": 512,
        "host": "127.0.0.1",
        **extra,
    }


def create_and_start(c: httpx.Client, model: Path) -> tuple[str, dict]:
    """Create a llama.cpp instance on a subprocess host and start it: (id, instance)."""
    iid = c.post("/instances", json={"config": llama_cfg(model)}).json()["instance"]["id"]
    return iid, c.post(f"/instances/{iid}/start").json()["instance"]


def wait_running(c: httpx.Client, iid: str, polls: int = 300) -> dict:
    """Poll until the instance is running (boot re-adopts or restarts it); the last answer."""
    inst: dict = {}
    for _ in range(polls):
        inst = c.get(f"/instances/{iid}").json()
        if inst["status"] == "running":
            break
        time.sleep(0.05)
    return inst


async def chat(port: int, key: str = API_KEY) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "messages": [{"role": "user", "content": "hello world"}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )


async def test_llama_lifecycle_through_the_host(
    tmp_path: Path, llama_bin: str, tiny_gguf: Path
) -> None:
    s = host_settings(tmp_path, llama_server_bin=llama_bin, model_roots=str(tiny_gguf.parent))
    async with running_host(s) as h:
        assert "llamacpp" in (await h.client.get("/")).json()["supported_backends"]
        r = await h.client.post(
            "/instances", json={"config": llama_cfg(tiny_gguf, api_key="inst-key-1")}
        )
        iid = r.json()["instance"]["id"]
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        inst = r.json()["instance"]
        assert inst["status"] == "running"
        assert inst["supported_endpoints"] == [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
        ]
        port, pid = inst["port"], inst["pid"]
        # the key never on the command line
        cmdline = " ".join(psutil.Process(pid).cmdline())
        assert API_KEY not in cmdline and "inst-key-1" not in cmdline
        r = await chat(port)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        assert (await chat(port, "inst-key-1")).status_code == 200
        assert (await chat(port, "wrong")).status_code == 401
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(
                f"http://127.0.0.1:{port}/v1/completions",
                headers={"Authorization": f"Bearer {API_KEY}"},
                json={"prompt": "the cat is", "max_tokens": 4},
            )
            assert r.status_code == 200
            models = (
                await c.get(
                    f"http://127.0.0.1:{port}/v1/models",
                    headers={"Authorization": f"Bearer {API_KEY}"},
                )
            ).json()
            assert any(m["id"] == "tiny:1b" for m in models["data"])
        # runtime state and last-generation come from the log parser
        for _ in range(100):
            r = await h.client.get(f"/instances/{iid}/last-generation", params={"within_s": 60})
            if r.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert r.status_code == 200, r.text
        gen = r.json()
        assert gen["generated_tokens"] and gen["source"] == "log" and gen["finished_at"]
        state = (await h.client.get(f"/instances/{iid}/state")).json()
        assert state["instance_id"] == iid and "busy" in state
        # crash: recovered by the host with a new process
        os.kill(pid, signal.SIGKILL)
        new = None
        for _ in range(200):
            inst = (await h.client.get(f"/instances/{iid}")).json()
            if inst["status"] == "running" and inst["pid"] != pid:
                new = inst
                break
            await asyncio.sleep(0.05)
        assert new is not None
        assert (await chat(new["port"])).status_code == 200
        # restart and stop
        r = await h.client.post(f"/instances/{iid}/restart")
        assert r.status_code == 200 and r.json()["instance"]["status"] == "running"
        last_pid = r.json()["instance"]["pid"]
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200
        assert not psutil.pid_exists(last_pid) or psutil.Process(last_pid).status() == "zombie"
        logs = (await h.client.get(f"/instances/{iid}/logs")).json()
        seqs = [e["seq"] for e in logs]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


async def test_broken_model_file_gives_structured_500_fast(tmp_path: Path, llama_bin: str) -> None:
    broken = tmp_path / "models" / "broken.gguf"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"GGUF" + os.urandom(4096))
    s = host_settings(tmp_path, llama_server_bin=llama_bin, max_retries=1)
    async with running_host(s) as h:
        iid = (await h.client.post("/instances", json={"config": llama_cfg(broken)})).json()[
            "instance"
        ]["id"]
        t0 = time.monotonic()
        r = await h.client.post(f"/instances/{iid}/start")
        assert time.monotonic() - t0 < 15
        assert r.status_code == 500
        body = r.json()
        assert "Process exited" in body["detail"] and body["instance_id"] == iid
        assert isinstance(body["exit_code"], int) and body["log_tail"]
        r = await h.client.get(f"/instances/{iid}/logs")
        assert r.status_code == 200 and r.json()


async def test_concurrent_start_and_stop_calls(
    tmp_path: Path, llama_bin: str, tiny_gguf: Path
) -> None:
    s = host_settings(tmp_path, llama_server_bin=llama_bin, model_roots=str(tiny_gguf.parent))
    async with running_host(s) as h:
        iid = (await h.client.post("/instances", json={"config": llama_cfg(tiny_gguf)})).json()[
            "instance"
        ]["id"]
        calls = [
            h.client.post(f"/instances/{iid}/{op}")
            for op in ("start", "start", "stop", "start", "stop", "start")
        ]
        results = await asyncio.gather(*calls)
        assert all(r.status_code in (200, 409) for r in results), [r.text for r in results]
        final = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]
        assert final["status"] == "running"
        # exactly one backend process for the instance
        procs = [
            p
            for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and str(tiny_gguf) in " ".join(p.info["cmdline"])
        ]
        assert len(procs) == 1 and procs[0].pid == final["pid"]
        await h.client.post(f"/instances/{iid}/stop")


def test_host_sigkill_backend_keeps_serving_and_is_readopted(
    tmp_path: Path, llama_bin: str, tiny_gguf: Path
) -> None:
    with HostProc(
        tmp_path / "host",
        backend="real",
        env={"LLAMA_SERVER_BIN": llama_bin, "MODEL_ROOTS": str(tiny_gguf.parent)},
    ) as host:
        host.start()
        with host.client() as c:
            iid, inst = create_and_start(c, tiny_gguf)
        pid, port = inst["pid"], inst["port"]
        host.kill(signal.SIGKILL)
        # the backend keeps serving while the host is down
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert r.status_code == 200
        host.start()
        with host.client() as c:
            inst = wait_running(c, iid, 200)
            assert inst and inst["status"] == "running" and inst["pid"] == pid
            logs = c.get(f"/instances/{iid}/logs").json()
            assert logs and all(isinstance(e["seq"], int) for e in logs)
            assert c.post(f"/instances/{iid}/stop").status_code == 200
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


def test_stale_record_whose_pid_belongs_to_another_process(
    tmp_path: Path, llama_bin: str, tiny_gguf: Path
) -> None:
    """A recorded pid that is now someone else's is never signalled; the instance restarts."""
    import subprocess
    import sys

    with HostProc(
        tmp_path / "host",
        backend="real",
        env={"LLAMA_SERVER_BIN": llama_bin, "MODEL_ROOTS": str(tiny_gguf.parent)},
    ) as host:
        host.start()
        with host.client() as c:
            iid, inst = create_and_start(c, tiny_gguf)
        host.kill(signal.SIGKILL)
        # the backend dies too; its pid is "reused" by an unrelated process we own
        psutil.Process(inst["pid"]).kill()
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        cfg_path = tmp_path / "host" / "config.json"
        doc = json.loads(cfg_path.read_text())
        doc["instances"][0]["process"]["pid"] = bystander.pid
        cfg_path.write_text(json.dumps(doc))
        try:
            host.start()
            with host.client() as c:
                inst2 = wait_running(c, iid, 300)
                assert inst2 and inst2["status"] == "running"
                assert inst2["pid"] not in (inst["pid"], bystander.pid)
                assert bystander.poll() is None  # untouched
                c.post(f"/instances/{iid}/stop")
        finally:
            bystander.kill()
            bystander.wait()


def test_boot_restarts_instances_that_were_running(
    tmp_path: Path, llama_bin: str, tiny_gguf: Path
) -> None:
    """A graceful shutdown stops backends and remembers them; the next boot starts them."""
    with HostProc(
        tmp_path / "host",
        backend="real",
        env={"LLAMA_SERVER_BIN": llama_bin, "MODEL_ROOTS": str(tiny_gguf.parent)},
    ) as host:
        host.start()
        with host.client() as c:
            iid, started = create_and_start(c, tiny_gguf)
            pid = started["pid"]
        # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status tells why
        assert host.stop() in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in host.log() or "shutdown" in host.log().lower()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        host.start()
        with host.client() as c:
            inst = wait_running(c, iid, 300)
            assert inst and inst["status"] == "running" and inst["pid"] != pid
            c.post(f"/instances/{iid}/stop")


async def test_usage_is_read_from_a_real_llama_server_metrics(
    tmp_path: Path, llama_bin: str, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /instances/{id}/usage carries llama.cpp's own counters from its /metrics. Before
    backends declared their capabilities as methods, the llama.cpp backend's snapshot was a
    module function the supervisor's name lookup never found: usage stayed empty."""
    from solar_host.instances import health as health_module

    monkeypatch.setattr(health_module, "METRICS_POLL_S", 0.1)
    s = host_settings(tmp_path, llama_server_bin=llama_bin, model_roots=str(tiny_gguf.parent))
    async with running_host(s) as h:
        iid = (await h.client.post("/instances", json={"config": llama_cfg(tiny_gguf)})).json()[
            "instance"
        ]["id"]
        inst = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]
        assert (await chat(inst["port"])).status_code == 200
        usage: dict = {}
        for _ in range(100):  # a scrape every 0.1 s
            r = await h.client.get(f"/instances/{iid}/usage")
            usage = r.json()
            if r.status_code == 200 and (usage.get("generated_tokens_total") or 0) > 0:
                break
            await asyncio.sleep(0.1)
        assert usage.get("backend_type") == "llamacpp", usage
        # The counters llama-server exports, under our names (backends/llamacpp.PROMETHEUS_NAMES).
        assert usage["generated_tokens_total"] > 0  # the chat above
        assert usage["prompt_tokens_total"] > 0
        assert usage["requests_processing"] == 0
        assert "timestamp" in usage
        await h.client.post(f"/instances/{iid}/stop")


def _listen_addresses(pid: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


@pytest.mark.parametrize(
    ("backend_host", "config_host", "expected"),
    [
        (None, None, "127.0.0.1"),  # HOST's address: a host kept local keeps its backends local
        ("127.0.0.2", None, "127.0.0.2"),  # BACKEND_HOST
        ("127.0.0.2", "127.0.0.3", "127.0.0.3"),  # the config's own host wins
    ],
)
async def test_backends_bind_where_the_host_says_unless_the_config_does(
    tmp_path: Path,
    llama_bin: str,
    tiny_gguf: Path,
    backend_host: str | None,
    config_host: str | None,
    expected: str,
) -> None:
    """Issue 39: backends bound 0.0.0.0 whatever HOST was, and no setting changed that."""
    s = host_settings(
        tmp_path,
        llama_server_bin=llama_bin,
        model_roots=str(tiny_gguf.parent),
        backend_host=backend_host,
    )
    assert s.host == "127.0.0.1"
    config = llama_cfg(tiny_gguf)
    config.pop("host")
    if config_host is not None:
        config["host"] = config_host
    async with running_host(s) as h:
        r = await h.client.post("/instances", json={"config": config})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        assert r.json()["instance"]["config"]["host"] == expected
        inst = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]
        assert inst["status"] == "running", inst
        assert _listen_addresses(inst["pid"]) == {expected}
        await h.client.post(f"/instances/{iid}/stop")


async def test_a_start_that_fails_before_spawning_says_why_in_the_instance_log(
    tmp_path: Path, llama_bin: str, tiny_gguf: Path
) -> None:
    """Issue 40: a model file gone before the start failed with `log_tail: []` and an empty
    GET .../logs (control's start-failure scenario): the reason was only in the host's log."""
    model = tmp_path / "models" / "gone.gguf"
    model.parent.mkdir(parents=True)
    shutil.copyfile(tiny_gguf, model)
    s = host_settings(tmp_path, llama_server_bin=llama_bin)
    async with running_host(s) as h:
        r = await h.client.post("/instances", json={"config": llama_cfg(model)})
        iid = r.json()["instance"]["id"]
        model.unlink()
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 500, r.text
        tail = r.json()["log_tail"]
        assert any("not started" in line and "gone.gguf" in line for line in tail), tail
        lines = (await h.client.get(f"/instances/{iid}/logs")).json()
        assert any("gone.gguf" in e["line"] for e in lines), lines
        # Kept on disk too: after a delete, the logs are read back from the instance's file.
        assert (await h.client.delete(f"/instances/{iid}")).status_code == 200
        lines = (await h.client.get(f"/instances/{iid}/logs")).json()
        assert any("gone.gguf" in e["line"] for e in lines), lines

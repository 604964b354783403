"""llama.cpp out of the box: with no LLAMA_SERVER_BIN and no llama-server on PATH, the host runs
the llama.cpp server of the xllamacpp distribution (ruling 9), and says so."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import signal
import stat
import time
from pathlib import Path

import httpx
import psutil
import pytest

from solar_host.backends import llamacpp_exec
from solar_host.backends.llamacpp import FLAG_FIELDS, command_args, flags_of
from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.backends.llamacpp_xserver import SUPPORTED_FLAGS, UsageError, parse_args
from tests.fixtures.gguf import write_tiny_gguf
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.hostproc import HostProc

needs_xllamacpp = pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None, reason="xllamacpp is not installed"
)
# A PATH with the system directories only: no llama-server anywhere on it.
BARE_PATH = "/usr/bin:/bin"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f16.gguf")


@pytest.fixture
def bare_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", BARE_PATH)
    monkeypatch.delenv("LLAMA_SERVER_BIN", raising=False)


def _cfg(model: Path, **extra: object) -> dict:
    return {
        "backend_type": "llamacpp",
        "alias": "tiny:1b",
        "model": str(model),
        "ctx_size": 512,
        "host": "127.0.0.1",
        **extra,
    }


# --- resolution ------------------------------------------------------------------------------


def test_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = tmp_path / "bin" / "llama-server"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    # an explicit LLAMA_SERVER_BIN that resolves is used
    assert llamacpp_exec.resolve(str(exe)).argv == (str(exe),)
    # llama-server on PATH
    monkeypatch.setenv("PATH", f"{exe.parent}:{BARE_PATH}")
    found = llamacpp_exec.resolve("llama-server")
    assert found.kind == "binary" and found.uses == str(exe)
    # an explicit one that does not resolve is reported, never replaced by the fallback
    bad = llamacpp_exec.resolve("/nowhere/llama-server")
    assert not bad.available and "LLAMA_SERVER_BIN=/nowhere/llama-server" in bad.reason


@needs_xllamacpp
def test_what_is_advertised_is_an_absolute_path_never_the_working_directory(
    tmp_path: Path, bare_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backends run in MODELS_DIR: a relative LLAMA_SERVER_BIN is anchored where the operator
    typed it (the host's working directory), and a bare name is looked up on PATH only, so a
    stray ./llama-server beside the host hides neither the fallback nor the error."""
    exe = tmp_path / "bin" / "llama-server"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    stray = tmp_path / "llama-server"
    stray.write_text("#!/bin/sh\nexit 0\n")
    stray.chmod(stray.stat().st_mode | stat.S_IXUSR)
    monkeypatch.chdir(tmp_path)
    found = llamacpp_exec.resolve("./bin/llama-server")
    assert found.argv == (str(exe),) and found.uses == str(exe)
    assert llamacpp_exec.resolve("llama-server").kind == "xllamacpp"
    monkeypatch.setenv("PATH", f".:{BARE_PATH}")  # a relative PATH entry resolves absolute too
    assert llamacpp_exec.resolve("llama-server").argv == (str(stray),)


@needs_xllamacpp
def test_xllamacpp_is_the_fallback(bare_path: None) -> None:
    for setting in ("llama-server", "", "  "):
        found = llamacpp_exec.resolve(setting)
        assert found.kind == "xllamacpp", setting
        assert found.argv[1].endswith("llamacpp_xserver.py") and "xllamacpp" in found.uses


def test_nothing_installed_names_the_fix(bare_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "xllamacpp" else real(n, *a)
    )
    found = llamacpp_exec.resolve("llama-server")
    assert not found.available
    for part in ("LLAMA_SERVER_BIN", "llamacpp extra", "PATH"):
        assert part in found.reason
    assert "llama-server-vulkan" not in found.reason


def test_a_packaged_build_under_another_name_is_pointed_at(
    tmp_path: Path, bare_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = tmp_path / "llama-server-vulkan"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{BARE_PATH}")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "xllamacpp" else real(n, *a)
    )
    found = llamacpp_exec.resolve("llama-server")
    assert not found.available  # never guessed
    assert f"LLAMA_SERVER_BIN={exe} uses it" in found.reason


# --- every flag honoured or refused ------------------------------------------------------------


def _full_config(model: str, **over: object) -> LlamaCppConfig:
    return LlamaCppConfig(
        **{
            "alias": "a",
            "model": model,
            "devices": "CUDA0",
            "split_mode": "layer",
            "tensor_split": "1,1",
            "main_gpu": 0,
            "chat_template_file": "/t.jinja",
            "chat_template_kwargs": {"enable_thinking": False},
            "reasoning": "off",
            "reasoning_budget": 0,
            "cache_type_k": "q8_0",
            "cache_type_v": "q8_0",
            "rope_scaling": "yarn",
            "rope_scale": 2.0,
            "yarn_orig_ctx": 4096,
            "special": True,
            "ot": "exps=CPU",
            "mmproj": "/mm.gguf",
            "mmproj_offload": False,
            **over,
        }
    )


def test_every_emitted_flag_is_honoured_or_named() -> None:
    configs = [
        _full_config("/x.gguf"),
        _full_config("/x.gguf", spec_type="draft-mtp", spec_draft_n_max=4),
        _full_config(
            "/x.gguf",
            spec_type="draft-dspark",
            spec_draft_model="/d.gguf",
            spec_draft_n_max=4,
            spec_draft_conf_min=0.5,
        ),
        _full_config("/x.gguf", model_type="embedding", pooling="mean"),
        _full_config("/x.gguf", model_type="reranker"),
    ]
    seen: set[str] = set()
    for c in configs:
        flags = flags_of(command_args(c, 1234))
        seen |= set(flags)
        for flag in flags:
            assert flag in SUPPORTED_FLAGS or flag in FLAG_FIELDS, flag
        # the server refuses exactly the flags it cannot honour, never ignores one
        unsupported = [f for f in flags if f not in SUPPORTED_FLAGS]
        if unsupported:
            with pytest.raises(UsageError, match=unsupported[0]):
                parse_args(command_args(c, 1234))
        else:
            parse_args(command_args(c, 1234))
    assert {"--device", "--spec-type", "--mmproj", "-ot", "--pooling"} <= seen


def test_server_refuses_an_unknown_flag() -> None:
    with pytest.raises(UsageError, match="--frobnicate"):
        parse_args(["--model", "/x.gguf", "--frobnicate"])
    values, switches = parse_args(["-m", "/x.gguf", "--n_gpu_layers", "-1", "--rerank"])
    assert values == {"--model": "/x.gguf", "--n-gpu-layers": "-1"} and switches == {"--rerank"}


@needs_xllamacpp
async def test_create_refuses_fields_xllamacpp_cannot_honour(
    tmp_path: Path, tiny_gguf: Path, bare_path: None
) -> None:
    async with running_host(host_settings(tmp_path, model_roots=str(tiny_gguf.parent))) as h:
        r = await h.client.post(
            "/instances", json={"config": _cfg(tiny_gguf, devices="CUDA0,CUDA1")}
        )
        assert r.status_code == 422, r.text
        err = r.json()["detail"][0]
        assert err["loc"][-1] == "devices" and "--device" in err["msg"]
        assert "LLAMA_SERVER_BIN" in err["msg"]
        r = await h.client.post(
            "/instances",
            json={"config": _cfg(tiny_gguf, spec_type="draft-mtp", spec_draft_n_max=2)},
        )
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "spec_type"
        # an update is checked the same way
        iid = (await h.client.post("/instances", json={"config": _cfg(tiny_gguf)})).json()[
            "instance"
        ]["id"]
        r = await h.client.put(
            f"/instances/{iid}", json={"config": _cfg(tiny_gguf, devices="CUDA0")}
        )
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "devices"


# --- the host on xllamacpp -------------------------------------------------------------------


async def _chat(port: int, key: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )


@needs_xllamacpp
async def test_host_serves_llama_through_xllamacpp(
    tmp_path: Path, tiny_gguf: Path, bare_path: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="solar_host")
    async with running_host(host_settings(tmp_path, model_roots=str(tiny_gguf.parent))) as h:
        root = (await h.client.get("/")).json()
        assert "llamacpp" in root["supported_backends"]
        entry = root["backends"]["llamacpp"]
        assert entry["available"] is True and "xllamacpp" in entry["uses"]
        assert entry["reason"] is None
        # every backend type is reported, with a reason when it is not available
        assert set(root["backends"]) >= {"llamacpp", "sglang", "huggingface_causal"}
        for bt, a in root["backends"].items():
            assert a["available"] or a["reason"], bt
        for _ in range(600):  # logged from a worker thread right after start
            if any("backend llamacpp: available" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        assert any("backend llamacpp: available" in r.getMessage() for r in caplog.records)

        cfg = _cfg(tiny_gguf, api_key="instance-extra-key", chat_template_kwargs={"x": True})
        r = await h.client.post("/instances", json={"config": cfg})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        inst = r.json()["instance"]
        assert inst["status"] == "running"
        proc = psutil.Process(inst["pid"])
        assert proc.cmdline()[1].endswith("llamacpp_xserver.py")
        # keys: the host key and the instance's own key work, nothing else does
        assert (await _chat(inst["port"], API_KEY)).status_code == 200
        assert (await _chat(inst["port"], "instance-extra-key")).status_code == 200
        assert (await _chat(inst["port"], "wrong")).status_code == 401
        assert "instance-extra-key" not in " ".join(proc.cmdline())
        logs = (await h.client.get(f"/instances/{iid}/logs")).json()
        assert any("listening on" in e["line"] for e in logs)
        # supervised like the binary: a crash is restarted
        proc.send_signal(signal.SIGKILL)
        for _ in range(1200):
            inst = (await h.client.get(f"/instances/{iid}")).json()
            if inst["status"] == "running" and inst["pid"] != proc.pid:
                break
            await asyncio.sleep(0.05)
        assert inst["status"] == "running" and inst["pid"] != proc.pid, inst
        assert (await _chat(inst["port"], API_KEY)).status_code == 200
        proc = psutil.Process(inst["pid"])
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200
        assert not psutil.pid_exists(proc.pid) or proc.status() == psutil.STATUS_ZOMBIE


@needs_xllamacpp
def test_xllamacpp_backend_is_readopted_after_host_kill(tmp_path: Path, tiny_gguf: Path) -> None:
    env = {"LLAMA_SERVER_BIN": "", "PATH": BARE_PATH, "MODEL_ROOTS": str(tiny_gguf.parent)}
    with HostProc(tmp_path / "host", backend="real", env=env) as host:
        host.start()
        with host.client() as c:
            assert "xllamacpp" in c.get("/").json()["backends"]["llamacpp"]["uses"]
            iid = c.post("/instances", json={"config": _cfg(tiny_gguf)}).json()["instance"]["id"]
            inst = c.post(f"/instances/{iid}/start", timeout=120).json()["instance"]
        pid = inst["pid"]
        host.kill(signal.SIGKILL)
        host.start()
        with host.client() as c:
            for _ in range(400):
                inst = c.get(f"/instances/{iid}").json()
                if inst["status"] == "running":
                    break
                time.sleep(0.05)
            assert inst["status"] == "running" and inst["pid"] == pid
            assert c.post(f"/instances/{iid}/stop").status_code == 200


@needs_xllamacpp
def test_every_honoured_flag_reaches_xllamacpp_params(tmp_path: Path) -> None:
    """The flags the server says it honours really set xllamacpp's parameters."""
    import xllamacpp as xlc

    from solar_host.backends.llamacpp_xserver import build_params

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    c = _full_config("/m.gguf", devices=None, chat_template_file=str(template), tensor_split="3,1")
    values, switches = parse_args(command_args(c, 4321))
    p = build_params(xlc, values, switches)
    assert p.model.path == "/m.gguf" and p.port == 4321 and p.model_alias == {"a"}
    assert p.split_mode == xlc.llama_split_mode.LLAMA_SPLIT_MODE_LAYER
    assert list(p.tensor_split)[:3] == [3.0, 1.0, 0.0]
    assert p.chat_template == "{{ messages }}"
    assert p.default_template_kwargs == {"enable_thinking": "false"}
    assert p.cache_type_k == xlc.ggml_type.GGML_TYPE_Q8_0
    assert p.cache_type_v == xlc.ggml_type.GGML_TYPE_Q8_0
    assert p.rope_scaling_type == xlc.llama_rope_scaling_type.LLAMA_ROPE_SCALING_TYPE_YARN
    assert p.rope_freq_scale == pytest.approx(0.5) and p.yarn_orig_ctx == 4096
    assert p.special is True and p.tensor_buft_overrides == "exps=CPU"
    assert p.mmproj.path == "/mm.gguf"
    assert p.mmproj_use_gpu is False
    assert p.enable_reasoning == 0 and p.sampling.reasoning_budget_tokens == 0
    assert p.warmup is False and p.endpoint_metrics is True and p.use_jinja is True
    emb = _full_config(
        "/m.gguf",
        devices=None,
        chat_template_file=str(template),
        model_type="embedding",
        pooling="mean",
    )
    values, switches = parse_args(command_args(emb, 1))
    p = build_params(xlc, values, switches)
    assert p.embedding is True
    assert p.pooling_type == xlc.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN

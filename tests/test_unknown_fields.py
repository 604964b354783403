"""Unknown config fields and misspelt settings are never silent."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path

import pytest

from solar_host.instances.config_fields import unknown_fields
from solar_host.platform.spelling import edit_distance, nearest
from solar_host.settings import SettingsError, load_settings, settings_warnings
from tests.fixtures.control_server import ControlServer
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.hostproc import HostProc


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    p = tmp_path / "models" / "m.gguf"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"GGUF" + b"\0" * 60)
    return p


def _cfg(model: Path, **extra: object) -> dict:
    return {"backend_type": "llamacpp", "alias": "tiny", "model": str(model), **extra}


def test_spelling() -> None:
    assert edit_distance("ctx_sise", "ctx_size") == 1
    assert edit_distance("ctx_szie", "ctx_size") == 1  # a swap is one edit
    assert nearest("ctx_sise", ["ctx_size", "threads"]) == "ctx_size"
    assert nearest("zzzzzz", ["ctx_size"]) is None


async def test_an_unknown_field_like_no_known_one_warns_in_response_and_log(
    tmp_path: Path, model_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with running_host(host_settings(tmp_path)) as h:
        r = await h.client.post(
            "/instances", json={"config": _cfg(model_file, speculative_knob=2048)}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        # solar-control may be newer than this host: a field like none of ours is kept
        assert body["warnings"] == ["unknown field speculative_knob"]
        # kept and echoed (control compares configs key by key), the default untouched
        assert body["instance"]["config"]["speculative_knob"] == 2048
        assert body["instance"]["config"]["ctx_size"] == 131072
        assert any("unknown field speculative_knob" in r.getMessage() for r in caplog.records)
        iid = body["instance"]["id"]
        r = await h.client.put(f"/instances/{iid}", json={"config": _cfg(model_file, ip=2)})
        assert r.status_code == 200
        assert r.json()["warnings"] == ["unknown field ip"]  # too short to be a typo of id
        # a clean config: no warnings key at all (the contract's body)
        r = await h.client.post("/instances", json={"config": _cfg(model_file)})
        assert "warnings" not in r.json()


def test_what_counts_as_a_near_miss() -> None:
    def near(key: str) -> str | None:
        (found,) = unknown_fields({"backend_type": "llamacpp", key: 1})
        return found.near_miss

    assert near("ctx_sise") == "ctx_size"  # one letter
    assert near("thredas") == "threads"  # a swap
    assert near("CTX_SIZE") == "ctx_size"  # a case change
    assert near("Id") == "id"  # a case change, however short
    assert near("n_gpu_layrs") == "n_gpu_layers"
    assert near("N-GPU-Layers") == "n_gpu_layers"  # case and - for _ are free
    assert near("ip") is None  # under five letters one edit is another word
    assert near("type") is None  # not dtype
    assert near("min_length") is None  # two edits: a field of its own, not max_length
    assert near("spec_draft_n_min") is None
    assert near("speculative_knob") is None


async def test_a_near_miss_of_a_known_field_is_refused_naming_both(
    tmp_path: Path, model_file: Path
) -> None:
    """Ruling 25: `ctx_sise` stored with a warning ran with the default context; now it is a
    422 on create, update and both estimate routes, and nothing is stored."""
    async with running_host(host_settings(tmp_path)) as h:
        r = await h.client.post("/instances", json={"config": _cfg(model_file, ctx_sise=2048)})
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body", "config", "ctx_sise"]
        assert err["msg"] == "unknown field ctx_sise: did you mean ctx_size?"
        assert (await h.client.get("/instances")).json() == []

        r = await h.client.post("/instances", json={"config": _cfg(model_file)})
        iid = r.json()["instance"]["id"]
        r = await h.client.put(f"/instances/{iid}", json={"config": _cfg(model_file, Threads=2)})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["msg"] == "unknown field Threads: did you mean threads?"
        assert "Threads" not in (await h.client.get(f"/instances/{iid}")).json()["config"]

        r = await h.client.post(
            "/instances/estimate", json={"config": _cfg(model_file, n_gpu_layrs=0)}
        )
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body", "config", "n_gpu_layrs"]
        assert "did you mean n_gpu_layers?" in r.json()["detail"][0]["msg"]


async def test_a_near_miss_is_refused_on_the_cli(tmp_path: Path, model_file: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_cfg(model_file, ctx_sise=2048)))
    async with running_host(host_settings(tmp_path)) as h:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "solar_host", "create", "--file", str(spec),
            "--url", h.url, "--api-key", API_KEY,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode != 0, out
        assert "ctx_sise: did you mean ctx_size?" in err.decode(), err
        assert (await h.client.get("/instances")).json() == []


async def test_a_near_miss_is_refused_on_socket_commands(tmp_path: Path, model_file: Path) -> None:
    server = ControlServer(known_keys={API_KEY: "host-1"})
    await server.start()
    try:
        settings = host_settings(tmp_path, solar_control_url=server.url)
        async with running_host(settings) as h:
            await server.wait_until(lambda: len(server.sids) == 1, 20)
            bad = {"config": _cfg(model_file, ctx_sise=2048)}
            answer = await server.call("create_instance", bad, within_s=30)
            assert answer["ok"] is False and answer["status"] == 422, answer
            assert answer["error"]["code"] == "invalid_body"
            assert "ctx_sise: did you mean ctx_size?" in answer["error"]["message"]
            assert (await h.client.get("/instances")).json() == []

            created = await server.call("create_instance", {"config": _cfg(model_file)})
            assert created["ok"], created
            iid = created["instance"]["id"]
            answer = await server.call(
                "update_instance",
                {"instance_id": iid, "config": _cfg(model_file, ctx_sise=2048)},
                within_s=30,
            )
            assert answer["status"] == 422, answer
            assert "ctx_sise: did you mean ctx_size?" in answer["error"]["message"]
    finally:
        await server.stop()


async def test_fields_control_sends_never_warn(tmp_path: Path, model_file: Path) -> None:
    control_keys = {
        "model_source": "local://m.gguf",
        "file_filters": ["*.gguf"],
        "dtype": "auto",
        "device": "cpu",
        "max_length": 512,
        "labels": ["a"],
        "extra_args": [],
        "extra_env": {},
        "n_ctx": 512,
        "context_size": 512,
        "status": "running",
        "supported_endpoints": [],
        "retry_count": 0,
        "busy": False,
        "prefill_progress": None,
        "active_slots": 0,
        "model_id": "x",  # a key of another backend, as intents carry
    }
    async with running_host(host_settings(tmp_path, strict_config=True)) as h:
        r = await h.client.post("/instances", json={"config": _cfg(model_file, **control_keys)})
        assert r.status_code == 200, r.text
        assert "warnings" not in r.json()


async def test_strict_config_refuses_unknown_fields(tmp_path: Path, model_file: Path) -> None:
    async with running_host(host_settings(tmp_path, strict_config=True)) as h:
        # a field like none of ours, a warning by default (a near miss is refused anyway)
        cfg = _cfg(model_file, speculative_knob=1)
        r = await h.client.post("/instances", json={"config": cfg})
        assert r.status_code == 422
        err = r.json()["detail"][0]
        assert err["loc"] == ["body", "config", "speculative_knob"]
        assert err["msg"] == "unknown field speculative_knob"
        assert (await h.client.get("/instances")).json() == []


def test_settings_choices_any_case() -> None:
    s = load_settings(None, environ={"LOG_LEVEL": "INFO", "LOG_FORMAT": "Json"})
    assert (s.log_level, s.log_format) == ("info", "json")
    with pytest.raises(SettingsError, match="LOG_LEVEL"):
        load_settings(None, environ={"LOG_LEVEL": "LOUD"})


def test_settings_warnings_name_the_nearest_setting(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("LLAMA_SERVR_BIN=/opt/llama-server\nWHATEVER_THING=1\nPORT=9000\n")
    s = load_settings(env_file, environ={"STRAT_PORT": "4000", "HOME": "/root", "TERM": "x"})
    assert s.port == 9000
    assert s.load_warnings == [
        "unknown setting LLAMA_SERVR_BIN in the env file: did you mean LLAMA_SERVER_BIN?",
        "unknown setting WHATEVER_THING in the env file (ignored)",
        "environment variable STRAT_PORT is not a setting: did you mean START_PORT?",
    ]
    # the variables of an ordinary environment are not mistaken for typos
    import os

    assert settings_warnings({}, dict(os.environ)) == []


def test_host_logs_setting_warnings_at_start(tmp_path: Path) -> None:
    host = HostProc(tmp_path / "host", backend="real", env={"LOG_LEVEL": "INFO"})
    host.tmp.mkdir(parents=True)
    (host.tmp / "no.env").write_text("LLAMA_SERVR_BIN=/opt/x\n")
    with host:
        host.start()
        deadline = time.monotonic() + 30
        while "backend llamacpp:" not in host.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = host.log()
    assert "unknown setting LLAMA_SERVR_BIN in the env file: did you mean LLAMA_SERVER_BIN?" in log
    assert "backend llamacpp:" in log  # the availability table is logged too

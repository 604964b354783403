"""Unknown config fields and misspelt settings are never silent."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from solar_host.platform.spelling import edit_distance, nearest
from solar_host.settings import SettingsError, load_settings, settings_warnings
from tests.fixtures.host import host_settings, running_host
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


async def test_unknown_field_warns_in_response_and_log(
    tmp_path: Path, model_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with running_host(host_settings(tmp_path)) as h:
        r = await h.client.post("/instances", json={"config": _cfg(model_file, ctx_sise=2048)})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["warnings"] == ["unknown field ctx_sise: did you mean ctx_size?"]
        # kept and echoed (control compares configs key by key), the default untouched
        assert body["instance"]["config"]["ctx_sise"] == 2048
        assert body["instance"]["config"]["ctx_size"] == 131072
        assert any("unknown field ctx_sise" in r.getMessage() for r in caplog.records)
        iid = body["instance"]["id"]
        r = await h.client.put(f"/instances/{iid}", json={"config": _cfg(model_file, thredas=2)})
        assert r.status_code == 200
        assert r.json()["warnings"] == ["unknown field thredas: did you mean threads?"]
        # a clean config: no warnings key at all (the contract's body)
        r = await h.client.post("/instances", json={"config": _cfg(model_file)})
        assert "warnings" not in r.json()


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
        r = await h.client.post("/instances", json={"config": _cfg(model_file, ctx_sise=1)})
        assert r.status_code == 422
        err = r.json()["detail"][0]
        assert err["loc"] == ["body", "config", "ctx_sise"]
        assert err["msg"] == "unknown field ctx_sise: did you mean ctx_size?"
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

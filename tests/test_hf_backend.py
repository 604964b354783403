"""The HuggingFace backend module: command line, environment, readiness, log parsing, metadata.

Pure functions only; the server itself is exercised over real sockets in test_hf_server.py.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from solar_host.backends.base import HostFacts, LaunchContext, LaunchError
from solar_host.backends.huggingface import API_KEYS_ENV, BACKEND, HFLogParser
from solar_host.instances.schemas import parse_config


def cfg(backend_type: str, **kw):
    kw.setdefault("alias", "m:1b")
    kw.setdefault("model_id", "/models/m")
    return BACKEND.config_model(backend_type).model_validate({"backend_type": backend_type, **kw})


def ctx(**kw) -> LaunchContext:
    base = dict(instance_id="i1", port=40123, host_api_key="host-key", models_dir=Path("/models"))
    return LaunchContext(**{**base, **kw})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_types_and_static_metadata() -> None:
    assert set(BACKEND.backend_types) == {
        "huggingface_causal",
        "huggingface_classification",
        "huggingface_embedding",
        "huggingface_vision",
    }
    assert BACKEND.health_path == "/health"
    assert BACKEND.metrics_path is None
    with pytest.raises(KeyError):
        BACKEND.config_model("llamacpp")


def test_launch_causal_argv_and_env_keys_never_in_argv() -> None:
    c = cfg("huggingface_causal", api_key="inst-key", trust_remote_code=True, dtype="BFloat16")
    spec = BACKEND.launch(c, ctx(python_executable="/venv/bin/python"))
    argv = spec.argv
    assert argv[:3] == ["/venv/bin/python", "-m", "solar_host.servers.hf_server"]
    assert flag(argv, "--model-id") == "/models/m"
    assert flag(argv, "--model-type") == "causal"
    assert flag(argv, "--alias") == "m:1b"
    assert flag(argv, "--port") == "40123"
    assert flag(argv, "--host") == "0.0.0.0"
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--device") == "auto"
    assert flag(argv, "--max-length") == "4096"
    assert flag(argv, "--max-batch-size") == "32"
    assert "--trust-remote-code" in argv and "--use-flash-attention" in argv
    assert not any("key" in a.lower() for a in argv)
    assert spec.env[API_KEYS_ENV] == "host-key,inst-key"  # host key first
    assert spec.env["PYTHONUNBUFFERED"] == "1"


def test_launch_defaults_to_this_interpreter_and_dedupes_keys() -> None:
    spec = BACKEND.launch(cfg("huggingface_embedding", api_key="host-key"), ctx())
    assert spec.argv[0] == sys.executable
    assert spec.env[API_KEYS_ENV] == "host-key"
    assert flag(spec.argv, "--model-type") == "embedding"
    assert "--normalize-embeddings" in spec.argv  # default true
    assert "--use-flash-attention" not in spec.argv  # embedding configs have no such field
    off = BACKEND.launch(cfg("huggingface_embedding", normalize_embeddings=False), ctx())
    assert "--normalize-embeddings" not in off.argv


def test_launch_classification_labels_as_json() -> None:
    labels = ["neg, really", "pos"]
    spec = BACKEND.launch(
        cfg("huggingface_classification", labels=labels, max_batch_size=8, batch_window_ms=5),
        ctx(),
    )
    assert json.loads(flag(spec.argv, "--labels-json")) == labels  # commas survive
    assert flag(spec.argv, "--max-batch-size") == "8"
    assert flag(spec.argv, "--batch-window-ms") == "5.0"
    assert flag(spec.argv, "--max-length") == "512"


def test_launch_refuses_bad_inputs() -> None:
    with pytest.raises(LaunchError, match="commas"):
        BACKEND.launch(cfg("huggingface_causal", api_key="a,b"), ctx())
    c = cfg("huggingface_causal", model_id=None, model_source="repo://x/y")
    with pytest.raises(LaunchError, match="model_id"):
        BACKEND.launch(c, ctx())


def test_ready_line() -> None:
    assert BACKEND.is_ready_line("INFO: Uvicorn running on http://127.0.0.1:8000 (Press CTRL+C)")
    assert BACKEND.is_ready_line("uvicorn running on https://0.0.0.0:1")
    for line in (
        "INFO: Application startup complete.",
        "INFO: Started server process [12]",
        "INFO: Waiting for application startup.",
        "Loading causal model /m as 'a'",
    ):
        assert not BACKEND.is_ready_line(line)


def test_endpoints_and_names() -> None:
    assert BACKEND.supported_endpoints(cfg("huggingface_causal")) == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
    ]
    assert BACKEND.supported_endpoints(cfg("huggingface_classification"))[0] == "/v1/classify"
    assert BACKEND.supported_endpoints(cfg("huggingface_embedding"))[0] == "/v1/embeddings"
    assert "/v1/completions" not in BACKEND.supported_endpoints(cfg("huggingface_vision"))
    assert BACKEND.served_model_name(cfg("huggingface_causal")) == "m:1b"
    assert BACKEND.model_paths(cfg("huggingface_causal")) == ["/models/m"]
    assert BACKEND.model_paths(cfg("huggingface_causal", model_id="org/name")) == []


def test_capabilities(tmp_path: Path) -> None:
    vis = tmp_path / "vl"
    vis.mkdir()
    (vis / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    txt = tmp_path / "txt"
    txt.mkdir()
    (txt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    vl = ["completion", "multimodal"]
    assert BACKEND.capabilities(cfg("huggingface_causal", model_id=str(vis)), tmp_path) == vl
    assert BACKEND.capabilities(cfg("huggingface_causal", model_id="vl"), tmp_path) == vl
    assert BACKEND.capabilities(cfg("huggingface_causal", model_id=str(txt)), tmp_path) is None
    assert BACKEND.capabilities(cfg("huggingface_vision"), tmp_path) == vl
    assert BACKEND.capabilities(cfg("huggingface_embedding", model_id=str(vis)), tmp_path) is None


def test_availability_follows_host_facts() -> None:
    assert BACKEND.is_available(HostFacts(gpu_type="cpu", hf_available=True))
    assert not BACKEND.is_available(HostFacts(gpu_type="nvidia_cuda", hf_available=False))


def test_parser_counts_requests_and_emits_generation_metrics() -> None:
    t = [datetime(2026, 1, 1, tzinfo=UTC)]
    p = HFLogParser(clock=lambda: t[0])
    first = p.feed("INFO: Application startup complete.")
    assert first and first.state and first.state.phase == "idle"
    assert p.feed("INFO: Uvicorn running on http://127.0.0.1:1") is None  # unchanged: no update
    r = p.feed("[REQUEST] id=ab-1 endpoint=/v1/chat/completions")
    assert r and r.state and r.state.busy and r.state.phase == "generating"
    assert r.state.active_slots == 1
    r = p.feed("[REQUEST] id=ab-2 endpoint=/v1/embeddings")
    assert r and r.state and r.state.active_slots == 2
    r = p.feed("[COMPLETE] id=ab-2 endpoint=/v1/embeddings prompt_tokens=4 completion_tokens=0")
    assert r and r.state and r.state.active_slots == 1 and r.generation is None
    t[0] += timedelta(seconds=2)
    r = p.feed(
        "[COMPLETE] id=ab-1 endpoint=/v1/chat/completions prompt_tokens=26 "
        "completion_tokens=50 time_ms=2000.0"
    )
    assert r and r.state and not r.state.busy and r.state.phase == "idle"
    g = r.generation
    assert g is not None and g.source == "log"
    assert (g.prompt_tokens, g.generated_tokens, g.total_tokens) == (26, 50, 76)
    assert g.decode_tps == pytest.approx(25.0) and g.decode_ms_per_token == pytest.approx(40.0)
    assert g.started_at == "2026-01-01T00:00:00+00:00"
    assert g.finished_at == "2026-01-01T00:00:02+00:00"
    assert p.feed("some unrelated line [with brackets]") is None


def test_parser_errors_and_restart_clear_in_flight() -> None:
    p = HFLogParser()
    p.feed("[REQUEST] id=x-1 endpoint=/v1/completions")
    p.feed("[REQUEST] id=x-2 endpoint=/v1/completions")
    r = p.feed("[ERROR] id=x-1 endpoint=/v1/completions status=400 message=bad")
    assert r and r.state and r.state.active_slots == 1 and r.generation is None
    r = p.feed("INFO: Application startup complete.")
    assert r and r.state and r.state.active_slots == 0 and not r.state.busy
    # A COMPLETE whose REQUEST was never seen still yields metrics with a derived start.
    r = p.feed(
        "[COMPLETE] id=z-9 endpoint=/v1/completions prompt_tokens=3 completion_tokens=4 time_ms=500"
    )
    assert r and r.generation and r.generation.started_at and r.generation.finished_at
    assert p.apply_metrics({"x": 1.0}) is None


def test_instance_config_parse_round_trip() -> None:
    c = parse_config(
        {
            "backend_type": "huggingface_embedding",
            "alias": "e",
            "model_id": "/models/m",
            "extra": 1,
        },
        models_dir=Path("/models"),
    )
    spec = BACKEND.launch(c, ctx())
    assert flag(spec.argv, "--model-type") == "embedding"

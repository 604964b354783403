# ruff: noqa: ASYNC240  (tests inspect files on disk between awaits)
"""The /models routes of a whole host (create_app), pulling from the loopback HF Hub."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from solar_host.app import create_app
from solar_host.events import PullProgress
from solar_host.settings import Settings
from tests.fixtures.fakehub import FakeHub

KEY = "k" * 20
H = {"X-API-Key": KEY}
ERROR_KEYS = {"error", "detail", "source_uri", "status_code"}


@pytest.fixture
def hub(tmp_path):
    repo = tmp_path / "hub" / "acme" / "tiny"
    (repo / "sub").mkdir(parents=True)
    (repo / "config.json").write_text("{}")
    (repo / "model-Q4_K_M.gguf").write_bytes(os.urandom(100))
    (repo / "model-Q8_0.gguf").write_bytes(os.urandom(150))
    (repo / "sub" / "tokenizer.json").write_text("x" * 50)
    h = FakeHub(tmp_path / "hub").start()
    yield h
    h.stop()


@pytest.fixture
async def host(tmp_path, hub):
    settings = Settings(
        api_key=KEY,
        models_dir=tmp_path / "models",
        config_file=tmp_path / "config.json",
        log_dir=tmp_path / "logs",
        jobs_dir=tmp_path / "jobs",
        hf_endpoint=hub.url,
        min_free_disk_gb=0,
        pull_progress_interval_s=0.05,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://host") as client:
            yield app.state.host, client


def hf(model_id="acme/tiny", **kw):
    return {
        "source": "huggingface",
        "source_uri": f"huggingface://{model_id}",
        "model_id": model_id,
        **kw,
    }


async def test_auth_required(host):
    _, c = host
    assert (await c.get("/models")).status_code == 401
    assert (await c.get("/models", headers={"X-API-Key": "wrong" * 5})).status_code == 401
    assert (await c.post("/models/pull", json=hf())).status_code == 401
    assert (await c.delete("/models/hf--acme--tiny")).status_code == 401


async def test_wiring(host):
    h, _ = host
    assert h.models.in_use == h.instances.models_in_use
    assert h.models.models_dir.joinpath("manifest.json").exists()


async def test_pull_list_delete_roundtrip(host):
    h, c = host
    seen: list[dict] = []
    h.bus.subscribe(lambda e: seen.append(e.payload), PullProgress)
    r = await c.post("/models/pull", json=hf(), headers=H)
    assert r.status_code == 200, r.text
    body = r.json()
    root = h.models.models_dir / "hf--acme--tiny"
    assert body == {"path": str(root), "cached": False, "source_uri": "huggingface://acme/tiny"}
    assert [e["phase"] for e in seen if e["phase"] in ("completed", "failed")] == ["completed"]

    # llama.cpp asks for a file: the largest GGUF.
    r = await c.post("/models/pull", json=hf(backend_type="llamacpp"), headers=H)
    assert r.json()["cached"] is True
    assert r.json()["path"] == str(root / "model-Q8_0.gguf")

    r = await c.get("/models", headers=H)
    (entry,) = r.json()
    assert entry["name"] == "hf--acme--tiny" and entry["path"] == str(root)
    assert entry["source_uri"] == "huggingface://acme/tiny"
    assert entry["files"] == [
        {"name": "config.json", "size_bytes": 2},
        {"name": "model-Q4_K_M.gguf", "size_bytes": 100},
        {"name": "model-Q8_0.gguf", "size_bytes": 150},
        {"name": "sub/tokenizer.json", "size_bytes": 50},
    ]
    assert entry["size_bytes"] == 302

    # In use by a running instance: 409, nothing deleted.
    h.models.in_use = lambda: [("inst-9", "llamacpp", [str(root / "model-Q4_K_M.gguf")], None)]
    r = await c.delete("/models/hf--acme--tiny", headers=H)
    assert r.status_code == 409 and "inst-9" in r.json()["detail"]
    r = await c.request(
        "DELETE", "/models/hf--acme--tiny", json={"filters": ["*Q4_K_M*"]}, headers=H
    )
    assert r.status_code == 409
    r = await c.request("DELETE", "/models/hf--acme--tiny", json={"filters": ["*Q8*"]}, headers=H)
    assert r.status_code == 200
    assert r.json()["removed"] == ["model-Q8_0.gguf"] and r.json()["freed_bytes"] == 150
    assert r.json()["remaining"] == 3
    assert (await c.get("/models", headers=H)).json()[0]["size_bytes"] == 152

    h.models.in_use = lambda: []
    r = await c.delete("/models/hf--acme--tiny", headers=H)
    assert r.status_code == 200 and r.json()["detail"] == "Model deleted"
    assert not root.exists()
    assert (await c.delete("/models/hf--acme--tiny", headers=H)).status_code == 404
    assert (await c.get("/models", headers=H)).json() == []


@pytest.mark.parametrize(
    "body, field",
    [
        ({"source": "harbor", "source_uri": "repo://a:v1"}, "harbor_ref is required"),
        ({"source": "harbor", "source_uri": "repo://a:v1", "harbor_ref": ""}, "harbor_ref"),
        ({"source": "huggingface", "source_uri": "huggingface://a/b"}, "model_id is required"),
        ({"source": "s3", "source_uri": "s3://a", "model_id": "a"}, "source"),
        ({"source": "huggingface", "model_id": "a/b"}, "source_uri"),
        ({**hf(), "size_bytes": -1}, "size_bytes"),
        ({**hf(), "file_filters": [""]}, "file_filters"),
    ],
)
async def test_pull_validation_is_422_in_the_flat_shape(host, body, field):
    _, c = host
    r = await c.post("/models/pull", json=body, headers=H)
    assert r.status_code == 422
    assert set(r.json()) == ERROR_KEYS and r.json()["status_code"] == 422
    assert field in r.json()["detail"]


async def test_pull_errors_map_to_statuses(host, tmp_path):
    _, c = host
    r = await c.post("/models/pull", json=hf("acme/missing"), headers=H)
    assert r.status_code == 404 and set(r.json()) == ERROR_KEYS
    assert r.json()["source_uri"] == "huggingface://acme/missing"
    r = await c.post("/models/pull", json={**hf(), "model_id": "other/model"}, headers=H)
    assert r.status_code == 422 and r.json()["error"] == "source_mismatch"
    r = await c.post(
        "/models/pull",
        json={"source": "harbor", "source_uri": "huggingface://a/b", "harbor_ref": "p/b:v1"},
        headers=H,
    )
    assert r.status_code in (400, 503)  # 503 here: HARBOR_URL is not set on this host
    assert set(r.json()) == ERROR_KEYS
    r = await c.post("/models/pull", content=b"[1,2]", headers=H)
    assert r.status_code == 422
    assert (await c.get("/models", headers=H)).json() == []


async def test_delete_refuses_path_slugs(host, tmp_path):
    h, c = host
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    for slug in ("..", "..%2Foutside", "%2E%2E", ".partial", "a%2Fb", "manifest.json%00"):
        r = await c.delete(f"/models/{slug}", headers=H)
        assert r.status_code in (400, 404, 405), slug  # 405: the client normalised ".." away
    assert (outside / "keep").exists()
    assert h.models.models_dir.joinpath("manifest.json").exists()


async def test_openapi_documents_the_pull_body(host):
    h, c = host
    spec = (await c.get("/openapi.json")).json()
    op = spec["paths"]["/models/pull"]["post"]
    props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"source", "source_uri", "harbor_ref", "model_id", "file_filters"} <= set(props)
    assert Path(h.models.models_dir).is_dir()


async def test_model_files_no_pull_recorded_are_listed_as_local(host, tmp_path):
    """A GGUF copied into MODELS_DIR (or a MODEL_ROOTS directory) by hand was invisible to
    GET /models; it is listed with source "local", beside what pulls recorded, and a failed
    pull leaves no empty .partial directory behind."""
    h, c = host
    models = h.models.models_dir
    (models / "mine").mkdir()
    (models / "mine" / "hand.gguf").write_bytes(b"GGUF" + bytes(96))
    other = tmp_path / "elsewhere"
    (other / "hf-style").mkdir(parents=True)
    (other / "hf-style" / "config.json").write_text("{}")
    (other / "hf-style" / "model.safetensors").write_bytes(bytes(64))
    h.models.settings = h.models.settings.model_copy(update={"model_roots": str(other)})
    assert (await c.post("/models/pull", json=hf(), headers=H)).status_code == 200

    listed = (await c.get("/models", headers=H)).json()
    assert [(m["source"], m["name"]) for m in listed] == [
        ("pulled", "hf--acme--tiny"),
        ("local", "hf-style"),
        ("local", "mine/hand.gguf"),
    ]
    hand = listed[2]
    assert hand["path"] == str(models / "mine" / "hand.gguf") and hand["size_bytes"] == 100
    assert hand["source_uri"] is None and hand["files"] == [
        {"name": "hand.gguf", "size_bytes": 100}
    ]
    assert listed[1]["size_bytes"] == 66
    # A local file is not the store's to delete.
    assert (await c.delete("/models/mine", headers=H)).status_code == 404
    assert (models / "mine" / "hand.gguf").exists()

    r = await c.post("/models/pull", json=hf("acme/missing"), headers=H)
    assert r.status_code == 404
    assert not (models / ".partial").exists()


async def test_the_cli_lists_local_models(host, capsys):
    from types import SimpleNamespace

    from solar_host.cli.models import cmd_models

    h, c = host
    (h.models.models_dir / "hand.gguf").write_bytes(b"GGUF" + bytes(96))
    listed = (await c.get("/models", headers=H)).json()
    client = SimpleNamespace(models=lambda: listed)
    assert cmd_models(client, SimpleNamespace(json=False)) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["SLUG", "SIZE", "SOURCE", "PATH"]
    assert row.split() == ["hand.gguf", "100", "B", "local", str(h.models.models_dir / "hand.gguf")]

"""Path traversal: every id, slug, pattern and relative path that tries to leave its root is
refused with a 4xx and touches nothing outside (ruling 12; absolute paths and every path-like
field of every backend type are covered by test_model_roots.py)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from solar_host.backends.registry import BackendRegistry
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under `root` (links not followed) with its size and content hash."""
    out: dict[str, tuple[int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            if p.is_symlink():
                out[str(p)] = (-1, os.readlink(p))
            else:
                out[str(p)] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """models/ with one model dir, a symlink escaping it, and an outside/ dir of bait files."""
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "secret.gguf").write_bytes(b"GGUF outside")
    (outside / "deep" / "mmproj-x.gguf").write_bytes(b"GGUF mmproj outside")
    (outside / "x_victim_1.log").write_text("outside log\n")
    (outside / "jobs_store.json").write_text("{}")
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "m" / "model.gguf").write_bytes(b"GGUF inside")
    (models / "escape").symlink_to(outside, target_is_directory=True)
    (models / "m" / "link.gguf").symlink_to(outside / "secret.gguf")
    (tmp_path / "logs").mkdir()
    return {"root": tmp_path, "outside": outside, "models": models}


def registry() -> BackendRegistry:
    return BackendRegistry([ScriptBackend()])


def settings(tmp_path: Path):
    # A hub that cannot answer: nothing here may reach a network anyway.
    # (HARBOR_URL is set so a harbor pull reaches validation; credentials are optional.)
    return host_settings(
        tmp_path,
        hf_endpoint="http://127.0.0.1:9",
        harbor_url="http://127.0.0.1:9",
        harbor_username="u",
        harbor_password="harbor-secret-pw",
    )


LLAMA_BAD_CONFIGS = [
    {"model": "../outside/secret.gguf"},
    {"model": "m/../../outside/secret.gguf"},
    {"model": "escape/secret.gguf"},
    {"model": "m/link.gguf"},
    {"model_source": "local://../outside/secret.gguf"},
    {"model_source": "local://escape/secret.gguf"},
    {"model_source": "local://m/../../outside"},
    {"model_source": f"local://{'/'.join(['..'] * 12)}/etc/passwd"},
    {"model": "m/model.gguf", "model_file": "../../outside/secret.gguf"},
    {"model": "m", "model_file": "../outside/*.gguf"},
    {"model": "m", "model_file": "link.gguf"},
    {"model": "m", "model_file": "**/../../outside/*.gguf"},
    {"model": "m/model.gguf", "mmproj": "../../outside/deep/mmproj-x.gguf"},
    {"model": "m/model.gguf", "mmproj": "../**/mmproj-*.gguf"},
    {
        "model": "m/model.gguf",
        "spec_type": "draft-dspark",
        "spec_draft_n_max": 4,
        "spec_draft_model": "../../outside/secret.gguf",
    },
    {"model": "m/model.gguf\x00.gguf"},
]


async def test_instance_model_paths_cannot_leave_models_dir(layout: dict[str, Path]) -> None:
    root, outside = layout["root"], layout["outside"]
    before = snapshot(outside)
    async with running_host(settings(root), backends=registry()) as h:
        for extra in LLAMA_BAD_CONFIGS:
            cfg = {"backend_type": "llamacpp", "alias": "t", **extra}
            r = await h.client.post("/instances", json={"config": cfg})
            assert r.status_code == 422, (extra, r.status_code, r.text)
            names = ("model", "model_source", "model_file", "mmproj", "spec_draft_model")
            assert any(n in r.text for n in names), (extra, r.text)  # the field is named
        # Nothing was recorded, and every other backend type confines the same way.
        for bt, field in (
            ("huggingface_causal", "model_id"),
            ("huggingface_embedding", "model_id"),
            ("sglang", "model_path"),
        ):
            for bad in ("../outside", "escape", "local://../outside", "m/../../outside"):
                cfg = {"backend_type": bt, "alias": "t", field: bad}
                r = await h.client.post("/instances", json={"config": cfg})
                assert r.status_code == 422, (bt, bad, r.text)
        assert (await h.client.get("/instances")).json() == []
    assert snapshot(outside) == before


async def test_inside_paths_still_work(layout: dict[str, Path]) -> None:
    """The refusals above are not a blanket refusal: the same forms inside MODELS_DIR pass."""
    async with running_host(settings(layout["root"]), backends=registry()) as h:
        for extra in (
            {"model": "m/model.gguf"},
            {"model_source": "local://m/model.gguf"},
            {"model": "m", "model_file": "model.gguf"},
        ):
            cfg = {"backend_type": "llamacpp", "alias": "t", **extra}
            r = await h.client.post("/instances", json={"config": cfg})
            assert r.status_code == 200, (extra, r.text)
            model = r.json()["instance"]["config"]["model"]
            assert Path(model).resolve() == (layout["models"] / "m" / "model.gguf").resolve()  # noqa: ASYNC240


# Bare dot segments ("..") are resolved by every HTTP client before sending; the raw-socket
# test below sends them as is.
BAD_IDS = [
    "...",
    "../outside",
    "..%2F..%2Foutside",
    "%2e%2e",
    "%2e%2e%2f%2e%2e%2foutside",
    "..\\..\\outside",
    "x%00y",
    "victim",
    "*",
    "[a-z]*",
    "jobs_store.json",
    "escape",
]


async def test_model_slugs_and_pulls_cannot_escape(layout: dict[str, Path]) -> None:
    root, outside, models = layout["root"], layout["outside"], layout["models"]
    before_out, before_models = snapshot(outside), snapshot(models)
    async with running_host(settings(root), backends=registry()) as h:
        for slug in BAD_IDS:
            r = await h.client.delete(f"/models/{slug}")
            assert 400 <= r.status_code < 500, (slug, r.status_code, r.text)
            r = await h.client.request(
                "DELETE", f"/models/{slug}", json={"filters": ["../../outside/*", "*"]}
            )
            assert 400 <= r.status_code < 500, (slug, r.status_code, r.text)
        for model_id in ("../../outside", "org/../../outside", "..", "a/./b", "org/m\x00"):
            body = {
                "source": "huggingface",
                "source_uri": f"huggingface://{model_id}",
                "model_id": model_id,
            }
            r = await h.client.post("/models/pull", json=body)
            assert 400 <= r.status_code < 500, (model_id, r.status_code, r.text)
        for ref in ("../../outside:1", "repo://..:1", "repo://a:1/../../../outside"):
            uri = ref if ref.startswith("repo://") else f"repo://{ref}"
            body = {"source": "harbor", "source_uri": uri, "harbor_ref": ref}
            r = await h.client.post("/models/pull", json=body)
            assert 400 <= r.status_code < 600 and r.status_code != 500, (ref, r.text)
        body = {
            "source": "huggingface",
            "source_uri": "huggingface://org/m",
            "model_id": "org/m",
            "file_filters": ["../../outside/*"],
        }
        r = await h.client.post("/models/pull", json=body)
        assert r.status_code != 500 and r.status_code != 200, r.text
    assert snapshot(outside) == before_out
    after_models = snapshot(models)
    after_models.pop(str(models / "manifest.json"), None)  # the store's own (empty) manifest
    assert after_models == before_models


async def test_job_ids_cannot_escape_jobs_dir(layout: dict[str, Path]) -> None:
    root, outside = layout["root"], layout["outside"]
    before = snapshot(outside)
    async with running_host(settings(root), backends=registry()) as h:
        for job_id in BAD_IDS:
            r = await h.client.get(f"/jobs/{job_id}")
            assert r.status_code in (404, 422), (job_id, r.status_code)
            r = await h.client.delete(f"/jobs/{job_id}")
            assert r.status_code in (404, 422), (job_id, r.status_code)
        for job_id in (
            "../outside/evil",
            "..",
            "a/b",
            "jobs_store.json",
            ".hidden",
            "x\x00",
            "/abs",
            "a" * 10_000,
        ):
            body = {
                "job_id": job_id,
                "steps": [{"name": "s", "image": "busybox", "command": "true"}],
            }
            r = await h.client.post("/jobs", json=body)
            assert 400 <= r.status_code < 500, (job_id, r.status_code, r.text)
    assert snapshot(outside) == before
    assert not (root / "evil").exists()


async def test_instance_and_log_ids_cannot_escape(layout: dict[str, Path]) -> None:
    root, outside = layout["root"], layout["outside"]
    before = snapshot(outside)
    async with running_host(settings(root), backends=registry()) as h:
        for iid in BAD_IDS:
            for path in ("", "/logs", "/state", "/usage", "/last-generation"):
                r = await h.client.get(f"/instances/{iid}{path}")
                assert r.status_code in (404, 422), (iid, path, r.status_code, r.text)
                assert "outside log" not in r.text
            for verb in ("start", "stop", "restart"):
                r = await h.client.post(f"/instances/{iid}/{verb}")
                assert r.status_code in (404, 422), (iid, verb, r.status_code)
            assert (await h.client.delete(f"/instances/{iid}")).status_code in (404, 422)
    assert snapshot(outside) == before


async def raw_get(url: str, path: str, key: str) -> tuple[int, bytes]:
    """GET with the path sent byte for byte (no client-side dot-segment normalisation)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nX-API-Key: {key}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data


async def test_raw_dot_segments_are_refused(layout: dict[str, Path]) -> None:
    root, outside = layout["root"], layout["outside"]
    before = snapshot(outside)
    async with running_host(settings(root), backends=registry()) as h:
        key = h.host.api_key
        for path in (
            "/instances/../../outside/logs",
            "/instances/..%2F..%2Foutside/logs",
            "/instances/%2E%2E/logs",
            "/instances/../logs",
            "/jobs/..",
            "/jobs/../../outside",
            "/models/..",
            "/docs/static/../../../../etc/passwd",
            "/docs/static/..%2F..%2F..%2Fsolar_host%2Fsettings.py",
        ):
            status, data = await raw_get(h.url, path, key)
            assert status in (400, 404, 405, 422), (path, status, data[:300])
            assert b"outside log" not in data and b"root:" not in data
            assert b"class Settings" not in data
    assert snapshot(outside) == before

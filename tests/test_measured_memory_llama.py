"""Measured memory on the real llama-server (issue 41): each config is loaded twice through a
host; the second load is admitted from the first's measured peak, and that peak predicts the
second load's within 3 %. The figures are printed (-s)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.probes import FakeProbe

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]

MIB = 1024**2
CONFIGS = [
    ("f16", {"ctx_size": 512}),
    ("f16", {"ctx_size": 8192}),
    ("f16", {"ctx_size": 2048, "cache_type_k": "f32"}),
    ("f32", {"ctx_size": 4096}),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {
        "f16": write_tiny_gguf(root / "tiny-f16.gguf"),
        "f32": write_tiny_gguf(root / "tiny-f32.gguf", f16=False),
    }


async def _serve_and_sample(h, iid: str) -> dict:
    """Start, answer one chat (the compute buffers in use), sample three times: the view."""
    r = await h.client.post(f"/instances/{iid}/start")
    assert r.status_code == 200, r.text
    port = r.json()["instance"]["port"]
    sampler = h.host.memory
    await sampler.sample()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        )
        assert r.status_code == 200, r.text
    for _ in range(3):
        await sampler.sample()
    mem = (await h.client.get(f"/instances/{iid}/usage")).json()["memory"]
    await h.client.post(f"/instances/{iid}/stop")
    return mem


async def test_second_load_is_admitted_from_the_first(tmp_path: Path, models) -> None:
    s = host_settings(
        tmp_path,
        llama_server_bin=llama_server_binary(),
        model_roots=str(next(iter(models.values())).parent),
        memory_sample_interval_s=3600.0,
    )
    async with running_host(s, probe=FakeProbe(ram=(64, 8))) as h:
        rows = []
        for i, (model, extra) in enumerate(CONFIGS):
            config = {
                "backend_type": "llamacpp",
                "alias": f"tiny:{i}",
                "model": str(models[model]),
                "host": "127.0.0.1",
                "n_gpu_layers": 0,
                **extra,
            }
            r = await h.client.post("/instances", json={"config": config})
            iid = r.json()["instance"]["id"]
            first = await _serve_and_sample(h, iid)
            second = await _serve_and_sample(h, iid)
            assert first["source"] == "estimated" and second["source"] == "measured"
            peak1, peak2 = first["sampled"]["peak_bytes"], second["sampled"]["peak_bytes"]
            admission = second["admission"]
            assert admission["measured_bytes"] == peak1
            rows.append(
                (
                    model,
                    extra,
                    first["admission"]["estimated_bytes"],
                    peak1,
                    peak2,
                    admission["admitted_bytes"],
                )
            )
            assert abs(peak2 - peak1) / peak2 < 0.03, rows[-1]
        print()
        for model, extra, est, p1, p2, admitted in rows:
            print(
                f"{model} {extra}: estimate {est / MIB:.1f} MiB, first peak {p1 / MIB:.1f} MiB, "
                f"second peak {p2 / MIB:.1f} MiB ({100 * (p1 - p2) / p2:+.2f} %), "
                f"admitted {admitted / MIB:.1f} MiB ({100 * (admitted - p2) / p2:+.2f} %)"
            )

"""Measured memory on our HF servers (issue 41): each config is loaded twice through a host; the
second load is admitted from the first's measured peak, which predicts the second's within 3 %.
The figures are printed (-s)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.probes import FakeProbe

pytestmark = [
    pytest.mark.hf,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]

MIB = 1024**2


async def _load(h, iid: str) -> dict:
    r = await h.client.post(f"/instances/{iid}/start", timeout=330)
    assert r.status_code == 200, r.text
    for _ in range(3):
        await h.host.memory.sample()
        await asyncio.sleep(0.2)
    mem = (await h.client.get(f"/instances/{iid}/usage")).json()["memory"]
    await h.client.post(f"/instances/{iid}/stop")
    return mem


async def test_second_load_is_admitted_from_the_first(tmp_path, tiny_hf_models) -> None:  # noqa: F811
    models: TinyHFModels = tiny_hf_models
    s = host_settings(
        tmp_path,
        model_roots=str(models.causal.parent),
        instance_ready_timeout_s=300.0,
        memory_sample_interval_s=3600.0,
    )
    configs = [
        ("huggingface_causal", models.causal, {"max_length": 512}),
        ("huggingface_embedding", models.encoder, {}),
    ]
    async with running_host(s, probe=FakeProbe(ram=(64, 8))) as h:
        rows = []
        for i, (bt, model, extra) in enumerate(configs):
            config = {
                "backend_type": bt,
                "alias": f"tiny:{i}",
                "model_id": str(model),
                "host": "127.0.0.1",
                **extra,
            }
            r = await h.client.post("/instances", json={"config": config})
            iid = r.json()["instance"]["id"]
            first = await _load(h, iid)
            second = await _load(h, iid)
            assert first["source"] == "estimated" and second["source"] == "measured"
            p1, p2 = first["sampled"]["peak_bytes"], second["sampled"]["peak_bytes"]
            admitted = second["admission"]["admitted_bytes"]
            assert second["admission"]["measured_bytes"] == p1
            est = first["admission"]["estimated_bytes"]
            rows.append((bt, est, p1, p2, admitted))
            assert abs(p2 - p1) / p2 < 0.03, rows[-1]
        print()
        for bt, est, p1, p2, admitted in rows:
            print(
                f"{bt}: estimate {est / MIB:.1f} MiB, first peak {p1 / MIB:.1f} MiB, second "
                f"peak {p2 / MIB:.1f} MiB ({100 * (p1 - p2) / p2:+.2f} %), admitted "
                f"{admitted / MIB:.1f} MiB ({100 * (admitted - p2) / p2:+.2f} %)"
            )

"""Known-answer canaries against the real tiny backends through a host: llama-server on the
tiny GGUF (generation and embeddings) and our HF server (causal, embedding, classification).
Each records a fingerprint when first ready, answers every later probe right (a healthy
backend is never flagged), and a user's last generation is never the probe's."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf
from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)
from tests.fixtures.host import API_KEY, host_settings, running_host

pytestmark = [
    pytest.mark.hf,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]

INTERVAL_S = 0.3
PROBES = 5  # right answers each backend must give


def configs(gguf: Path, models: TinyHFModels) -> dict[str, dict[str, Any]]:
    llama = {"backend_type": "llamacpp", "model": str(gguf), "host": "127.0.0.1", "threads": 1}
    hf = {"host": "127.0.0.1"}
    return {
        "llama": {**llama, "alias": "k:llama", "ctx_size": 256},
        "llama_emb": {**llama, "alias": "k:llama-emb", "model_type": "embedding"}
        | {"pooling": "mean"},
        "causal": {**hf, "backend_type": "huggingface_causal", "alias": "k:causal"}
        | {"model_id": str(models.causal)},
        "embedding": {**hf, "backend_type": "huggingface_embedding", "alias": "k:emb"}
        | {"model_id": str(models.encoder)},
        "classification": {**hf, "backend_type": "huggingface_classification", "alias": "k:clf"}
        | {"model_id": str(models.classifier)},
    }


async def probes_of(h: Any, iid: str) -> int:
    text = (await h.client.get("/metrics")).text
    m = re.search(rf'solar_host_instance_canary_probes_total{{instance_id="{iid}"}} (\d+)', text)
    return int(m.group(1)) if m else 0


async def test_real_tiny_backends_keep_their_known_answer(
    tmp_path: Path,
    tiny_hf_models: TinyHFModels,  # noqa: F811
) -> None:
    gguf = write_tiny_gguf(tmp_path / "gguf" / "tiny-f16.gguf")
    s = host_settings(
        tmp_path,
        llama_server_bin=llama_server_binary(),
        model_roots=f"{gguf.parent},{tiny_hf_models.causal.parent}",
        instance_ready_timeout_s=300.0,
        canary_interval_s=INTERVAL_S,
    )
    async with running_host(s) as h:
        ids: dict[str, str] = {}
        for name, config in configs(gguf, tiny_hf_models).items():
            r = await h.client.post("/instances", json={"config": config})
            assert r.status_code == 200, r.text
            ids[name] = r.json()["instance"]["id"]
        answers = await asyncio.gather(
            *(h.client.post(f"/instances/{i}/start", timeout=330) for i in ids.values())
        )
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        deadline = time.monotonic() + 120
        while True:
            counts = {n: await probes_of(h, i) for n, i in ids.items()}
            if min(counts.values()) >= PROBES or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert min(counts.values()) >= PROBES, counts
        doc = json.loads(s.config_file.read_text())
        kept = {e["instance"]["id"]: e.get("canary") for e in doc["instances"]}
        for name, iid in ids.items():
            inst = (await h.client.get(f"/instances/{iid}")).json()
            assert inst["status"] == "running", (name, inst)
            recs = (await h.client.get(f"/instances/{iid}/flight-records")).json()["records"]
            assert recs == [], (name, recs)
            assert kept[iid] is not None, name
        assert kept[ids["llama"]]["text"] and kept[ids["causal"]]["text"]
        assert len(kept[ids["embedding"]]["vector"]) > 0
        assert set(kept[ids["classification"]]["scores"]) == {"NEG", "POS"}

        # The probes' own generations are never kept as a user's (each is told by its length).
        for name in ("llama", "causal"):
            r = await h.client.get(f"/instances/{ids[name]}/last-generation")
            assert r.status_code == 404, (name, r.text)

        # A user's generation stays the last one: the probes after it are not kept as such.
        port = (await h.client.get(f"/instances/{ids['causal']}")).json()["port"]
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(
                f"http://127.0.0.1:{port}/v1/completions",
                headers={"Authorization": f"Bearer {API_KEY}"},
                json={"prompt": "hello world, how are you? " * 3, "max_tokens": 3},
            )
            assert r.status_code == 200, r.text
        user_prompt = r.json()["usage"]["prompt_tokens"]
        before = await probes_of(h, ids["causal"])
        deadline = time.monotonic() + 60
        while await probes_of(h, ids["causal"]) < before + 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        r = await h.client.get(f"/instances/{ids['causal']}/last-generation")
        assert r.status_code == 200, r.text
        assert r.json()["prompt_tokens"] == user_prompt
        for iid in ids.values():
            await h.client.post(f"/instances/{iid}/stop")

"""The files of one Hub snapshot are fetched a few at once (HUB_FILES_AT_ONCE), not one by one:
a model of many shards is not held to one connection's rate. Real host store, loopback Hub."""

from __future__ import annotations

import os
import sys

import pytest

from solar_host.model_store.download import HUB_FILES_AT_ONCE
from solar_host.model_store.service import ModelStore
from solar_host.settings import Settings
from tests.fixtures.fakehub import FakeHub

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="loopback servers need Linux")


async def test_the_shards_of_a_model_come_a_few_at_once(tmp_path):
    repo = tmp_path / "hub" / "acme" / "m"
    repo.mkdir(parents=True)
    shards = {f"model-{i:05d}-of-00005.safetensors": os.urandom(400_000) for i in range(1, 6)}
    for name, data in shards.items():
        (repo / name).write_bytes(data)
    hub = FakeHub(tmp_path / "hub").start()
    hub.bytes_per_s = 2e6  # each body takes 0.2 s: the pulls overlap
    try:
        store = ModelStore(
            Settings(models_dir=tmp_path / "models", hf_endpoint=hub.url, min_free_disk_gb=0)
        )
        await store.start()
        body = {"source": "huggingface", "model_id": "acme/m", "source_uri": "huggingface://acme/m"}
        res = await store.pull(body)
    finally:
        hub.stop()
    for name, data in shards.items():
        assert (tmp_path / "models" / "hf--acme--m" / name).read_bytes() == data
    assert res["path"].endswith("hf--acme--m")
    assert 1 < hub.max_bodies_at_once <= HUB_FILES_AT_ONCE

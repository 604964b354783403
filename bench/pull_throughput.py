"""Pull throughput: a 500 MB OCI artifact through the model store vs. curl on the same blob.

Starts the Debian docker-registry on loopback, pushes one file of random bytes with oras, then
times (1) `curl -o` of the blob URL and (2) ModelStore.pull of the artifact (streamed, hashed
while streaming, renamed into place). Prints both MB/s and the ratio (target >= 0.9).
Usage: PYTHONPATH=. .venv/bin/python bench/pull_throughput.py [--mb 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solar_host.model_store.service import ModelStore
from solar_host.settings import Settings
from tests.fixtures.registry import Registry, sha256_file


def make_blob(path: Path, mb: int) -> None:
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))


def curl_once(url: str, out: Path) -> float:
    t = time.perf_counter()
    subprocess.run(["curl", "-sS", "-f", "-o", str(out), url], check=True, timeout=600)
    return time.perf_counter() - t


async def store_once(reg: Registry, models: Path, mb: int) -> tuple[float, float]:
    """(seconds to the model being on disk and recorded, seconds until the stream was done)."""
    settings = Settings(
        models_dir=models,
        harbor_url=reg.url,
        harbor_username="bench",
        harbor_password="bench",
        min_free_disk_gb=0,
        pull_progress_interval_s=5.0,
    )
    store = ModelStore(settings)
    await store.start()
    t = time.perf_counter()
    marks: dict[str, float] = {}

    def on_progress(p: dict) -> None:
        marks.setdefault(p["phase"], time.perf_counter() - t)

    result = await store.pull(
        {"source": "harbor", "source_uri": "repo://bench:v1", "harbor_ref": "bench/bench:v1"},
        on_progress,
    )
    dt = time.perf_counter() - t
    assert not result["cached"], result
    return dt, marks["verifying"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pullbench-"))
    reg = Registry(tmp / "reg").start()
    try:
        art = tmp / "art"
        art.mkdir()
        make_blob(art / "blob.bin", args.mb)
        digest = sha256_file(art / "blob.bin")
        reg.push("bench/bench:v1", [Path("blob.bin")], art)
        url = f"{reg.url}/v2/bench/bench/blobs/{digest}"
        size_mb = (art / "blob.bin").stat().st_size / 1e6
        curl_t, store_t, stream_t = [], [], []
        for i in range(args.rounds):
            out = tmp / f"curl-{i}.bin"
            curl_t.append(curl_once(url, out))
            out.unlink()
            models = tmp / f"models-{i}"
            total, streamed = asyncio.run(store_once(reg, models, args.mb))
            store_t.append(total)
            stream_t.append(streamed)
            shutil.rmtree(models)
        curl_best, store_best = min(curl_t), min(store_t)
        c, s = size_mb / curl_best, size_mb / store_best
        print(f"blob: {size_mb:.0f} MB, rounds: {args.rounds}")
        print(f"curl:        {c:8.1f} MB/s (best of {[round(x, 3) for x in curl_t]} s)")
        print(f"model store: {s:8.1f} MB/s (best of {[round(x, 3) for x in store_t]} s)")
        print(f"ratio: {s / c:.2f} (target >= 0.9)")
        st = size_mb / min(stream_t)
        print(
            f"  of which streaming+hashing: {st:8.1f} MB/s (ratio {st / c:.2f}); the rest is "
            "placing the file and the fsync'ed manifest write"
        )
    finally:
        reg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Pull throughput: a 500 MB OCI artifact through the model store vs. curl on the same blob.

Starts the Debian docker-registry on loopback, pushes one file of random bytes with oras, then
times, interleaved round by round (the order alternates, so drift in the machine's load hits
both sides alike):

- `curl -o` of the blob URL, and the same followed by an fsync of curl's file;
- ModelStore.pull of the artifact: streamed, hashed while streaming, fsynced, renamed into place,
  recorded in the manifest.

Two ratios come out, both against curl on the same bytes:

- download+verify: the store until the blob's digest is checked (the moment it calls
  `streaming.make_durable`), vs. plain `curl -o`, which writes the file and stops there;
- durable (the target): the whole pull, which returns only once the model survives a crash
  (fsync before the rename, manifest fsynced), vs. `curl -o` plus an fsync of its file. This is
  the like-for-like figure: both end with the same bytes safely on disk, and a pull that skipped
  the fsync would be faster only by being unsafe.

Usage: PYTHONPATH=. .venv/bin/python bench/pull_throughput.py [--mb 500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solar_host.model_store import streaming
from solar_host.model_store.service import ModelStore
from solar_host.settings import Settings
from tests.fixtures.registry import Registry, sha256_file

TARGET = 0.9


def make_blob(path: Path, mb: int) -> None:
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def curl_once(url: str, out: Path) -> tuple[float, float]:
    """(seconds of `curl -o`, seconds of `curl -o` plus fsync of the file)."""
    t = time.perf_counter()
    subprocess.run(["curl", "-sS", "-f", "-o", str(out), url], check=True, timeout=600)
    plain = time.perf_counter() - t
    fsync_path(out)
    return plain, time.perf_counter() - t


async def store_once(reg: Registry, models: Path) -> tuple[float, float]:
    """(seconds until the blob was verified, seconds until the model was durable and recorded)."""
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
    verified: list[float] = []
    durable = streaming.make_durable

    def timed_durable(fd: int) -> None:
        verified.append(time.perf_counter())
        durable(fd)

    streaming.make_durable = timed_durable
    try:
        t = time.perf_counter()
        result = await store.pull(
            {"source": "harbor", "source_uri": "repo://bench:v1", "harbor_ref": "bench/bench:v1"}
        )
        dt = time.perf_counter() - t
    finally:
        streaming.make_durable = durable
    assert not result["cached"], result
    return verified[0] - t, dt


def settle() -> None:
    """Start each timing with no dirty pages of the previous one still being written back."""
    os.sync()
    time.sleep(0.5)


def summary(name: str, size_mb: float, times: list[float]) -> float:
    best, med = min(times), statistics.median(times)
    print(
        f"  {name:28s} best {size_mb / best:7.1f} MB/s  median {size_mb / med:7.1f} MB/s  "
        f"({' '.join(f'{x:.2f}' for x in times)} s)"
    )
    return med


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
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
        # Warm-up, not timed: the registry's blob into the page cache, imports (oras) loaded.
        curl_once(url, tmp / "warm.bin")
        (tmp / "warm.bin").unlink()
        load0 = os.getloadavg()
        curl_t, curl_d, store_v, store_d = [], [], [], []
        for i in range(args.rounds):

            def run_curl(i: int = i) -> None:
                out = tmp / f"curl-{i}.bin"
                settle()
                plain, durable = curl_once(url, out)
                curl_t.append(plain)
                curl_d.append(durable)
                out.unlink()

            def run_store(i: int = i) -> None:
                models = tmp / f"models-{i}"
                settle()
                verified, durable = asyncio.run(store_once(reg, models))
                store_v.append(verified)
                store_d.append(durable)
                shutil.rmtree(models)

            for step in (run_curl, run_store) if i % 2 == 0 else (run_store, run_curl):
                step()
        load1 = os.getloadavg()
        print(f"blob: {size_mb:.0f} MB, rounds: {args.rounds}, cores: {os.cpu_count()}")
        print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f}")
        print("download+verify:")
        c = summary("curl -o", size_mb, curl_t)
        s = summary("model store (verified)", size_mb, store_v)
        r_verify = c / s
        print("durable (on disk, survives a crash):")
        c = summary("curl -o + fsync", size_mb, curl_d)
        s = summary("model store (pull returned)", size_mb, store_d)
        r_durable = c / s
        print(f"ratio download+verify (medians): {r_verify:.2f}")
        print(
            f"ratio durable (medians): {r_durable:.2f}  "
            f"(target >= {TARGET}: {'met' if r_durable >= TARGET else 'NOT met'})"
        )
    finally:
        reg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

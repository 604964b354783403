"""PULL_MAX_BYTES_PER_S: how closely a capped Hub pull holds the cap, beside an uncapped pull.

Starts the loopback Hub (tests/fixtures/fakehub.py) with one model of random bytes, then pulls
it with ModelStore, in rounds that alternate:

- uncapped (the baseline: what the loopback gives, so a cap well under it is what binds);
- capped at each `--caps` rate (MB/s), alone;
- capped, two models pulled at once (the cap is the host's, for all pulls together).

Each line prints the measured rate (bytes / wall time of the whole pull, listing and checks
included) and its deviation from the cap; the target is within 5%.

Usage: PYTHONPATH=. .venv/bin/python bench/pull_rate_cap.py [--mb 48] [--caps 8,24] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solar_host.model_store.service import ModelStore
from solar_host.settings import Settings
from tests.fixtures.fakehub import FakeHub, write_repo

MB = 1_000_000
TARGET = 0.05


async def pull(work: Path, hub: FakeHub, names: list[str], cap: int) -> float:
    """Seconds to pull `names` at once into a fresh MODELS_DIR under `cap` bytes/s."""
    models = work / "models"
    shutil.rmtree(models, ignore_errors=True)
    store = ModelStore(
        Settings(
            models_dir=models,
            hf_endpoint=hub.url,
            min_free_disk_gb=0,
            pull_progress_interval_s=5.0,
            pull_max_bytes_per_s=cap,
        )
    )
    await store.start()
    began = time.perf_counter()
    await asyncio.gather(
        *(
            store.pull(
                {
                    "source": "huggingface",
                    "model_id": f"acme/{n}",
                    "source_uri": f"huggingface://acme/{n}",
                }
            )
            for n in names
        )
    )
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=48, help="model size in MB (10^6 bytes)")
    ap.add_argument("--caps", default="8,24", help="caps to measure, MB/s, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    caps = [int(float(c) * MB) for c in args.caps.split(",")]
    size = args.mb * MB
    with tempfile.TemporaryDirectory(prefix="pull-rate-cap-") as tmp:
        work = Path(tmp)
        for name in ("a", "b"):
            write_repo(work / "hub", name, size)
        hub = FakeHub(work / "hub").start()
        worst = 0.0
        try:
            print(f"model {args.mb} MB (+2 B of config); rate = bytes / wall time of the pull")
            for r in range(args.rounds):
                t = asyncio.run(pull(work, hub, ["a"], 0))
                print(f"round {r + 1}: uncapped (baseline)       {size / t / MB:8.1f} MB/s")
                for cap in caps:
                    for names in (["a"], ["a", "b"]):
                        t = asyncio.run(pull(work, hub, names, cap))
                        rate = size * len(names) / t
                        dev = rate / cap - 1
                        worst = max(worst, abs(dev))
                        what = "one pull " if len(names) == 1 else "two pulls"
                        print(
                            f"round {r + 1}: cap {cap / MB:5.1f} MB/s, {what}   "
                            f"{rate / MB:8.1f} MB/s  ({dev:+.1%} of the cap)"
                        )
        finally:
            hub.stop()
    verdict = "within" if worst <= TARGET else "NOT within"
    print(f"worst deviation {worst:.1%}: {verdict} the {TARGET:.0%} target")


if __name__ == "__main__":
    main()

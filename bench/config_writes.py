"""Create latency against the number of instances config.json already holds (issue 16).

Starts a host as a subprocess (`python -m solar_host`, default settings, a temp dir), fills it
to N instances (10, 100, 1000) over HTTP, then has CONCURRENCY clients each loop "create
(timed), delete (not timed)" until CREATES creates were measured, so the file stays at N to
N+CONCURRENCY instances while it is measured. Every create is answered only once config.json
holds it (fsynced). Prints creates/s, median and p99 create latency per N side by side, for
concurrency 1 and 16, and p99 at 1000 over p99 at 10 (target: within 2x).

Run: `.venv/bin/python bench/config_writes.py [--creates 300] [--sizes 10,100,1000]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.hostproc import HostProc  # noqa: E402

TARGET = "p99 at 1000 within 2x of p99 at 10"


def config(model: Path, name: str) -> dict[str, object]:
    return {"backend_type": "llamacpp", "alias": name, "model": str(model), "ctx_size": 4096}


def fill(h: HostProc, model: Path, n: int) -> None:
    def create(i: int) -> None:
        with h.client() as c:
            c.post("/instances", json={"config": config(model, f"fill-{i}")}).raise_for_status()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(create, range(n)))


def measure(h: HostProc, model: Path, creates: int, concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    lock = threading.Lock()
    left = [creates]

    def worker(w: int) -> None:
        with httpx.Client(base_url=h.url, headers={"X-API-Key": h.api_key}, timeout=120.0) as c:
            i = 0
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                t0 = time.perf_counter()
                r = c.post("/instances", json={"config": config(model, f"m-{w}-{i}")})
                dt = time.perf_counter() - t0
                r.raise_for_status()
                with lock:
                    latencies.append(dt)
                c.delete(f"/instances/{r.json()['instance']['id']}").raise_for_status()
                i += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    latencies.sort()
    return {
        # Each measured create is followed by a delete: both are writes, so creates/s counts
        # the create half of that load.
        "creates_s": len(latencies) / wall,
        "p50": statistics.median(latencies) * 1000,
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--creates", type=int, default=300, help="measured creates per size")
    ap.add_argument("--sizes", default="10,100,1000")
    ap.add_argument("--concurrency", default="1,16")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    results: dict[tuple[int, int], dict[str, float]] = {}
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="config-writes-") as tmp:
            with HostProc(Path(tmp), backend="real", env={"LOG_LEVEL": "warning"}) as h:
                h.start(timeout=180)
                model = h.tmp / "models" / "m.gguf"
                model.parent.mkdir(parents=True, exist_ok=True)
                model.write_bytes(b"GGUF")
                fill(h, model, n)
                size = (h.tmp / "config.json").stat().st_size
                for conc in concs:
                    results[(n, conc)] = measure(h, model, args.creates, conc)
                print(f"  N={n}: config.json {size / 1024:.0f} KiB", file=sys.stderr, flush=True)
    head = "".join(f"{'N=' + str(n):>12}" for n in sizes)
    print(f"{args.creates} creates per cell (each followed by a delete), default settings")
    for conc in concs:
        print(f"\nconcurrency {conc:<3} {head}")
        for key, label in (("creates_s", "creates/s"), ("p50", "median ms"), ("p99", "p99 ms")):
            cells = "".join(f"{results[(n, conc)][key]:>12.1f}" for n in sizes)
            print(f"  {label:<15}{cells}")
        if 10 in sizes and 1000 in sizes:
            ratio = results[(1000, conc)]["p99"] / results[(10, conc)]["p99"]
            print(f"  p99 at 1000 / p99 at 10 = {ratio:.2f}  (target: {TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

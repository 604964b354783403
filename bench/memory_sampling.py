"""What the memory sampler costs: milliseconds per sample per instance.

Starts N stand-in backends (a Python process with two children, as a backend with workers),
then times rounds of MemorySampler.read (one NVML query, from a fake probe here, and one RSS
walk of each process tree through /proc/<pid>/task/*/children and statm), beside two
baselines: the walk the usage route and /metrics made before (psutil: a scan of every process
for each tree), and PSS from /proc/<pid>/smaps_rollup over the same trees (the figure that
splits shared pages; the sampler does not use it). Rounds alternate in one run.

    .venv/bin/python bench/memory_sampling.py [--instances 1,10,50] [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from solar_host.estimates.measured import MeasurementStore  # noqa: E402
from solar_host.estimates.sampler import MemorySampler  # noqa: E402
from solar_host.events import EventBus  # noqa: E402
from solar_host.resources.usage import process_tree  # noqa: E402
from tests.fixtures.probes import FakeProbe  # noqa: E402

STAND_IN = (
    "import subprocess, time\n"
    "kids = [subprocess.Popen(['sleep', '600']) for _ in range(2)]\n"
    "buf = bytearray(8 << 20)\n"
    "for i in range(0, len(buf), 4096): buf[i] = 1\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def psutil_tree(pid: int) -> int:
    """The walk before: psutil's children (a scan of /proc) and memory_info per process."""
    total = 0
    for p in process_tree(pid):
        try:
            total += psutil.Process(p).memory_info().rss
        except psutil.Error:
            continue
    return total


def pss_tree(pid: int) -> int:
    """PSS of a process tree (smaps_rollup), the costlier figure that splits shared pages."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", default="1,10,50")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    counts = [int(x) for x in args.instances.split(",")]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(max(counts)):
            p = subprocess.Popen(
                [sys.executable, "-c", STAND_IN], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
            )
            procs.append(p)
        for p in procs:
            assert p.stdout is not None
            p.stdout.readline()  # its children and its 8 MiB are there
        # NVML as the sampler sees it: every stand-in on GPU 0, one stray process.
        probe = FakeProbe(
            gpu_process_memory_by_device={0: {p.pid: 1 << 30 for p in procs} | {1: 1}}
        )
        with tempfile.TemporaryDirectory() as tmp:
            sampler = MemorySampler(
                manager=None,
                probe=probe,
                store=MeasurementStore(Path(tmp) / "m.json"),
                bus=EventBus(),
            )
            print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds, alternating")
            print(
                f"{'instances':>9}  {'sampler ms/inst':>15}  {'psutil walk':>11}  "
                f"{'PSS walk':>9}  (ms per instance, median)"
            )
            for n in counts:
                targets = [(f"i{i}", p.pid, "running") for i, p in enumerate(procs[:n])]
                times: dict[str, list[float]] = {"sampler": [], "psutil": [], "pss": []}
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    figures = sampler.read(targets)
                    times["sampler"].append((time.perf_counter() - t0) * 1000 / n)
                    for name, walk in (("psutil", psutil_tree), ("pss", pss_tree)):
                        t0 = time.perf_counter()
                        for _, pid, _ in targets:
                            walk(pid)
                        times[name].append((time.perf_counter() - t0) * 1000 / n)
                assert all(f.get("cpu", 0) > 8 << 20 for f in figures.values())
                assert all(f.get("cuda:0") == 1 << 30 for f in figures.values())
                a, b, c = (statistics.median(times[k]) for k in ("sampler", "psutil", "pss"))
                print(f"{n:>9}  {a:>15.3f}  {b:>11.3f}  {c:>9.3f}")
    finally:
        for p in procs:
            for child in process_tree(p.pid) - {p.pid}:
                try:
                    os.kill(child, 9)
                except OSError:
                    pass
            p.kill()
            p.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

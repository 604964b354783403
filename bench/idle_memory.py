"""The host's idle RSS (no instance, then 100 stopped instances), its start-up time to the
first GET /health 200, and proof that the host process never loaded torch (/proc/<pid>/maps).

`solar-host serve` answers /health and GET /instances before its REST router is built
(serving.py), so the bench also prints when the first routed call (GET /resources) answered:
that is when the whole API is up.

RSS is in MiB (2**20 bytes), the unit of the old release's figure and of the target, and is
taken after every start (1 s after /health), so the median comes with its spread.

Targets (ruling 22): RSS <= 60 MiB, start-up <= 0.8 s; old release 74 MiB / 1.5 s.
Run: `.venv/bin/python bench/idle_memory.py [--runs 5]` (figures are medians of the runs).
`--root DIR` runs another tree's host (bench/hosts.py; bench/compare_revisions.py pairs two).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.api_load import make_instances  # noqa: E402
from bench.hosts import TreeHost, add_tree_args, print_result, routed_path, tree_host  # noqa: E402

# Native libraries only show in maps: torch (libtorch*.so) is the one the host must never load.
HEAVY = ("torch", "libtorch", "cuda", "numpy")
MIB = 2**20


def loaded_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system, every thread) the process has used so far."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def timed_start(h: TreeHost) -> tuple[float, float, float, float]:
    """(seconds to the first /health 200, seconds to the first routed 200), both from spawn,
    and the host's CPU seconds at each: on a busy machine the wall times swing with the
    load, the CPU a start costs much less."""
    t0 = time.monotonic()
    h.start(wait=False)
    health = h.wait_healthy(20.0, t0)
    health_cpu = cpu_s(h.pid)
    path = routed_path(h)
    with h.client(timeout=5.0) as c:
        while True:
            if c.get(path).status_code == 200:
                return health, time.monotonic() - t0, health_cpu, cpu_s(h.pid)
            assert time.monotonic() - t0 < 20.0, "the REST router never answered"
            time.sleep(0.005)


def with_instances(h: TreeHost, n: int, idle_runs: list[float]) -> tuple[float, list[str], float]:
    """(RSS with `n` instances, heavy modules mapped, start-up with their records)."""
    h.start()
    time.sleep(1.0)
    proc = psutil.Process(h.pid)
    idle_runs.append(proc.memory_info().rss / MIB)
    make_instances(h, n)
    with h.client() as c:
        for _ in range(20):
            c.get("/instances")
    time.sleep(1.0)
    loaded = proc.memory_info().rss / MIB
    maps = loaded_libraries(h.pid)
    heavy = [m for m in HEAVY if re.search(rf"/{m}[/._-]", maps)]
    h.stop()
    # Restart on the same n-instance config: start-up with records to load.
    return loaded, heavy, h.start()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--instances", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="idle starts only (no 100 instances)")
    add_tree_args(ap)
    args = ap.parse_args()
    starts: list[float] = []
    routed: list[float] = []
    idle_runs: list[float] = []
    cpu_health: list[float] = []
    cpu_routed: list[float] = []
    with tempfile.TemporaryDirectory(prefix="idle-mem-") as tmp:
        h = tree_host(Path(tmp), args, env={"LOG_LEVEL": "warning"})
        loaded = with_records = 0.0
        heavy: list[str] = []
        try:
            for _ in range(args.runs):
                health, api, health_cpu, api_cpu = timed_start(h)
                starts.append(health)
                routed.append(api)
                cpu_health.append(health_cpu)
                cpu_routed.append(api_cpu)
                time.sleep(1.0)
                idle_runs.append(psutil.Process(h.pid).memory_info().rss / MIB)
                h.stop()
            if not args.quick:
                loaded, heavy, with_records = with_instances(h, args.instances, idle_runs)
        finally:
            h.reap()
    print(f"host: {h.root}")
    print(
        f"start-up to first /health 200: median {statistics.median(starts):.3f} s "
        f"(runs: {', '.join(f'{s:.2f}' for s in starts)}); with {args.instances} instances "
        f"{with_records:.3f} s   [old 1.5 s, target <= 0.8 s]"
    )
    print(
        f"start-up to the first routed answer (GET {routed_path(h)}): median "
        f"{statistics.median(routed):.3f} s (runs: {', '.join(f'{s:.2f}' for s in routed)})"
    )
    print(
        f"host CPU at the first /health 200: median {statistics.median(cpu_health):.3f} s; "
        f"at the first routed answer {statistics.median(cpu_routed):.3f} s"
    )
    print(
        f"RSS idle: median {statistics.median(idle_runs):.1f} MiB "
        f"({min(idle_runs):.1f}-{max(idle_runs):.1f} over {len(idle_runs)} starts)   "
        f"[old 74 MiB, target <= 60 MiB]"
    )
    print(f"RSS with {args.instances} instances: {loaded:.1f} MiB")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"heavy native modules mapped in the host: {heavy or 'none'}")
    assert "torch" not in heavy, "the host process loaded torch"
    print_result(
        args,
        {
            "health_s": statistics.median(starts),
            "routed_s": statistics.median(routed),
            "health_cpu_s": statistics.median(cpu_health),
            "routed_cpu_s": statistics.median(cpu_routed),
            "rss_mib": statistics.median(idle_runs),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

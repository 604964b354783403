"""The host's idle RSS (no instance, then 100 stopped instances), its start-up time to the
first GET /health 200, and proof that the host process never loaded torch (/proc/<pid>/maps).

`solar-host serve` answers /health and GET /instances before its REST router is built
(serving.py), so the bench prints three times from spawn: the first /health 200, the first
authenticated GET /instances 200 that lists every instance on record (`--start-instances N`
puts N stopped instances on record before the timed starts; the answer is checked), and the
first answer of the whole router (GET /resources; upstream's GET /instances is both).

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
from dataclasses import dataclass
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


@dataclass
class Start:
    """One start, from spawn: seconds and the host's CPU seconds at each first answer (on a
    busy machine the wall times swing with the load, the CPU a start costs much less)."""

    health: float = 0.0
    health_cpu: float = 0.0
    # An authenticated GET /instances listing every instance on record.
    instances: float = 0.0
    instances_cpu: float = 0.0
    # The whole router (routed_path: ours serves /health and GET /instances before it).
    routed: float = 0.0
    routed_cpu: float = 0.0


def timed_start(h: TreeHost, records: int) -> Start:
    t0 = time.monotonic()
    h.start(wait=False)
    got = Start(health=h.wait_healthy(20.0, t0), health_cpu=cpu_s(h.pid))
    with h.client(timeout=5.0) as c:
        while True:
            r = c.get("/instances")
            if r.status_code == 200:
                assert len(r.json()) == records, f"{len(r.json())} instances, {records} on record"
                got.instances, got.instances_cpu = time.monotonic() - t0, cpu_s(h.pid)
                break
            assert time.monotonic() - t0 < 20.0, "GET /instances never answered"
            time.sleep(0.005)
        path = routed_path(h)
        while path != "/instances":
            if c.get(path).status_code == 200:
                got.routed, got.routed_cpu = time.monotonic() - t0, cpu_s(h.pid)
                return got
            assert time.monotonic() - t0 < 20.0, "the REST router never answered"
            time.sleep(0.005)
    got.routed, got.routed_cpu = got.instances, got.instances_cpu
    return got


def with_instances(
    h: TreeHost, n: int, on_record: int, idle_runs: list[float]
) -> tuple[float, list[str], float]:
    """(RSS with `n` instances, heavy modules mapped, start-up with their records)."""
    h.start()
    time.sleep(1.0)
    proc = psutil.Process(h.pid)
    idle_runs.append(proc.memory_info().rss / MIB)
    make_instances(h, n - on_record, first=on_record)
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
    ap.add_argument(
        "--start-instances",
        type=int,
        default=0,
        help="instances on record (stopped) at each timed start",
    )
    add_tree_args(ap)
    args = ap.parse_args()
    runs: list[Start] = []
    idle_runs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="idle-mem-") as tmp:
        h = tree_host(Path(tmp), args, env={"LOG_LEVEL": "warning"})
        loaded = with_records = 0.0
        heavy: list[str] = []
        try:
            if args.start_instances:
                h.start()
                make_instances(h, args.start_instances)
                h.stop()
            for _ in range(args.runs):
                runs.append(timed_start(h, args.start_instances))
                time.sleep(1.0)
                idle_runs.append(psutil.Process(h.pid).memory_info().rss / MIB)
                h.stop()
            if not args.quick:
                loaded, heavy, with_records = with_instances(
                    h, max(args.instances, args.start_instances), args.start_instances, idle_runs
                )
        finally:
            h.reap()

    def median(field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs)

    def each(field: str) -> str:
        return ", ".join(f"{getattr(r, field):.2f}" for r in runs)

    print(f"host: {h.root}; {args.start_instances} instances on record at each timed start")
    print(
        f"start-up to first /health 200: median {median('health'):.3f} s "
        f"(runs: {each('health')}); with {args.instances} instances "
        f"{with_records:.3f} s   [old 1.5 s, target <= 0.8 s]"
    )
    print(
        f"start-up to the first authenticated GET /instances 200 listing them: median "
        f"{median('instances'):.3f} s (runs: {each('instances')})"
    )
    print(
        f"start-up to the whole router (GET {routed_path(h)}): median "
        f"{median('routed'):.3f} s (runs: {each('routed')})"
    )
    print(
        f"host CPU at the first /health 200: median {median('health_cpu'):.3f} s; at GET "
        f"/instances {median('instances_cpu'):.3f} s; at the whole router "
        f"{median('routed_cpu'):.3f} s"
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
            "health_s": median("health"),
            "instances_s": median("instances"),
            "routed_s": median("routed"),
            "health_cpu_s": median("health_cpu"),
            "instances_cpu_s": median("instances_cpu"),
            "routed_cpu_s": median("routed_cpu"),
            "rss_mib": statistics.median(idle_runs),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

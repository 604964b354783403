"""GET /instances (100 instances configured, stopped) and GET /health under load.

Starts a host as a subprocess (`python -m solar_host`, settings from the environment, a temp
dir), configures 100 instances, then drives each route at concurrency 1 and 64 for DURATION s
with `wrk` (apt: wrk; a C load generator, so the client is not the bottleneck) and prints
requests/s, p50, p99 and the host's CPU (psutil on the host pid), beside the old release's
figures and the targets (ruling 22). Run: `.venv/bin/python bench/api_load.py [--duration 10]`.
`--root DIR` runs another tree's host (bench/hosts.py; bench/compare_revisions.py pairs two).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hosts import add_tree_args, print_result, tree_host  # noqa: E402
from tests.fixtures.hostproc import HostProc  # noqa: E402

BASELINE = {"/instances": "~900 req/s, p99 ~130 ms (c=64)"}
TARGET = {"/instances": ">= 1800 req/s, p99 <= 50 ms (c=64)"}


def make_instances(h: HostProc, n: int, first: int = 0) -> None:
    """`n` stopped llama.cpp instances, aliases bench-FIRST onwards."""
    model = h.tmp / "models" / "m.gguf"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(b"GGUF")
    with h.client() as c:
        for i in range(first, first + n):
            cfg = {
                "backend_type": "llamacpp",
                "alias": f"bench-{i}",
                "model": str(model),
                "ctx_size": 4096,
            }
            r = c.post("/instances", json={"config": cfg})
            r.raise_for_status()


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def run_wrk(url: str, key: str, conc: int, duration: int, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [
            "wrk",
            "-t",
            str(min(threads, conc)),
            "-c",
            str(conc),
            "-d",
            f"{duration}s",
            "--latency",
            "-H",
            f"X-API-Key: {key}",
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = dict(re.findall(r"^\s+(50|99)%\s+([\d.]+\w+)", out, re.M))
    res = {"rps": rps}
    for k, v in lat.items():
        m = re.match(r"([\d.]+)(\w+)", v)
        res[f"p{k}"] = _ms(m.group(1), m.group(2))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    res["non2xx"] = float(errors.group(1)) if errors else 0.0
    return res


def measure(h: HostProc, path: str, conc: int, duration: int, threads: int) -> dict[str, float]:
    proc = psutil.Process(h.pid)
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        proc.cpu_percent(None)
        while not stop.wait(0.5):
            samples.append(proc.cpu_percent(None))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        res = run_wrk(h.url + path, h.api_key, conc, duration, threads)
    finally:
        stop.set()
        t.join()
    res["cpu"] = sum(samples) / len(samples) if samples else 0.0
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--instances", type=int, default=100)
    ap.add_argument("--threads", type=int, default=max(1, psutil.cpu_count() // 2))
    ap.add_argument("--conc", default="1,64", help="concurrencies, comma-separated")
    ap.add_argument("--routes", default="/instances,/health", help="paths, comma-separated")
    add_tree_args(ap)
    args = ap.parse_args()
    concs = [int(c) for c in args.conc.split(",")]
    figures: dict[str, float] = {}
    if not shutil.which("wrk"):
        print("wrk is required (apt-get install -y wrk)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="api-load-") as tmp:
        with tree_host(Path(tmp), args, env={"LOG_LEVEL": "warning"}) as h:
            h.start()
            make_instances(h, args.instances)
            print(
                f"host {h.root} pid {h.pid}, {args.instances} instances, "
                f"{psutil.cpu_count()} CPUs, "
                f"wrk threads {args.threads}, {args.duration}s per run"
            )
            print(
                f"{'route':<12} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
                f"{'host CPU%':>9} {'non-2xx':>7}  baseline / target"
            )
            for path in args.routes.split(","):
                for conc in concs:
                    r = measure(h, path, conc, args.duration, args.threads)
                    for k in ("rps", "p50", "p99", "cpu", "non2xx"):
                        figures[f"{path} c{conc} {k}"] = r.get(k, 0.0)
                    # Requests per second of host CPU: what a loaded machine's share buys.
                    figures[f"{path} c{conc} req/cpu-s"] = r["rps"] / max(r["cpu"], 1.0) * 100
                    note = ""
                    if conc == 64 and path in BASELINE:
                        note = f"  {BASELINE[path]} / {TARGET[path]}"
                    print(
                        f"{path:<12} {conc:>4} {r['rps']:>9.0f} {r.get('p50', 0):>8.2f} "
                        f"{r.get('p99', 0):>8.2f} {r['cpu']:>9.0f} {r['non2xx']:>7.0f}{note}",
                        flush=True,
                    )
    print_result(args, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

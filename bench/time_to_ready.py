"""Time from "start" to "serving": the host's POST /instances/{id}/start against spawning the
same llama-server command directly and polling /health.

Prints both medians and their ratio (target: host / direct <= 1.05).

    .venv/bin/python bench/time_to_ready.py [--runs 10]

`--root DIR` runs another tree's host (bench/hosts.py; bench/compare_revisions.py pairs two).
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

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hosts import add_tree_args, print_result, tree_host  # noqa: E402
from solar_host.backends.base import LaunchContext  # noqa: E402
from solar_host.backends.llamacpp import BACKEND  # noqa: E402
from solar_host.backends.llamacpp_config import LlamaCppConfig  # noqa: E402
from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf  # noqa: E402
from tests.fixtures.host import free_port  # noqa: E402

KEY = "bench-key-0123456789abcdef"


def direct_once(binary: str, model: Path, tmp: Path) -> float:
    """Spawn the command the host would build, poll /health every 5 ms until 200."""
    config = LlamaCppConfig(alias="bench:tiny", model=str(model), ctx_size=512, host="127.0.0.1")
    port = free_port()
    ctx = LaunchContext(
        instance_id="bench", port=port, host_api_key=KEY, models_dir=tmp, llama_server_bin=binary
    )
    spec = BACKEND.launch(config, ctx)
    env = {**os.environ, **spec.env}
    t0 = time.monotonic()
    with open(tmp / "direct.log", "ab") as out:
        proc = subprocess.Popen(
            spec.argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        with httpx.Client(timeout=1.0) as c:
            while True:
                try:
                    if c.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError("llama-server exited")
                time.sleep(0.005)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def host_runs(
    binary: str, model: Path, tmp: Path, runs: int, args: argparse.Namespace
) -> list[float]:
    times = []
    with tree_host(tmp / "host", args, env={"LLAMA_SERVER_BIN": binary}, api_key=KEY) as host:
        host.start()
        with host.client() as c:
            r = c.post(
                "/instances",
                json={
                    "config": {
                        "alias": "bench:tiny",
                        "model": str(model),
                        "ctx_size": 512,
                        "host": "127.0.0.1",
                    }
                },
            )
            r.raise_for_status()
            iid = r.json()["instance"]["id"]
            for _ in range(runs):
                t0 = time.monotonic()
                r = c.post(f"/instances/{iid}/start")
                elapsed = time.monotonic() - t0
                r.raise_for_status()
                times.append(elapsed)
                c.post(f"/instances/{iid}/stop").raise_for_status()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    add_tree_args(ap)
    args = ap.parse_args()
    binary = llama_server_binary()
    with tempfile.TemporaryDirectory(prefix="ttr-") as d:
        tmp = Path(d)
        # Inside the host's MODELS_DIR: a model outside the roots is refused (ruling 12).
        (tmp / "host" / "models").mkdir(parents=True)
        model = write_tiny_gguf(tmp / "host" / "models" / "tiny.gguf")
        direct_once(binary, model, tmp)  # warm the page cache
        direct = [direct_once(binary, model, tmp) for _ in range(args.runs)]
        host = host_runs(binary, model, tmp, args.runs, args)
    d_med, h_med = statistics.median(direct), statistics.median(host)
    print(f"llama-server binary: {binary}")
    print(f"{'':24}{'median':>10}{'min':>10}{'max':>10}")
    print(
        f"{'direct spawn + /health':24}{d_med * 1000:>9.1f}ms{min(direct) * 1000:>9.1f}ms"
        f"{max(direct) * 1000:>9.1f}ms"
    )
    print(
        f"{'host start -> 200':24}{h_med * 1000:>9.1f}ms{min(host) * 1000:>9.1f}ms"
        f"{max(host) * 1000:>9.1f}ms"
    )
    print(f"ratio host/direct: {h_med / d_med:.3f}   (target <= 1.05)")
    print_result(
        args,
        {"direct_ms": d_med * 1000, "host_ms": h_med * 1000, "over_ms": (h_med - d_med) * 1000},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

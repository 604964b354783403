"""Time from "start" to "serving": the host's POST /instances/{id}/start against spawning the
same llama-server command directly and polling /health.

Prints both medians and their ratio (target: host / direct <= 1.05), then each step of the
host's own start path timed in-process on this checkout's code (the roots check and preflight,
the command line, the confinement policy and ruleset, the spawn confined against unconfined,
readiness, the proof of the listener), so the share of each in the host's cost shows.

    .venv/bin/python bench/time_to_ready.py [--runs 10]

`--root DIR` runs another tree's host (bench/hosts.py; bench/compare_revisions.py pairs two).
"""

from __future__ import annotations

import argparse
import asyncio
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


def step_runs(binary: str, model: Path, tmp: Path, runs: int) -> dict[str, list[float]]:
    """The host's start path step by step, in this process, as supervisor._attempt runs it
    (the same functions, the host's settings shape, BACKEND_READ_CONFINEMENT=required)."""
    from solar_host.backends.base import HostFacts
    from solar_host.instances import confinement, launch, ownership
    from solar_host.instances import process as procs
    from solar_host.settings import Settings

    settings = Settings(
        api_key=KEY,
        config_file=tmp / "steps" / "config.json",
        log_dir=tmp / "steps" / "logs",
        models_dir=model.parent,
        jobs_dir=tmp / "steps" / "jobs",
        llama_server_bin=binary,
        backend_read_confinement="required",
    )
    facts = HostFacts(gpu_type="cpu", llama_server_bin=binary)
    config = LlamaCppConfig(alias="bench:tiny", model=str(model), ctx_size=512, host="127.0.0.1")
    steps: dict[str, list[float]] = {}

    def lap(name: str, since: float) -> float:
        now = time.monotonic()
        steps.setdefault(name, []).append(now - since)
        return now

    for i in range(runs):
        port = free_port()
        t = time.monotonic()
        BACKEND.capabilities(config, settings.models_dir)
        t = lap("capabilities", t)
        ctx = launch.launch_context(settings, "bench", port, KEY, facts)
        spec = launch.prepare(BACKEND, config, ctx, settings, facts)
        t = lap("roots + preflight + argv", t)
        env = launch.environment(
            spec, settings, marker="bench-marker", port=port, key_hash="h", spawn_id=f"s{i}"
        )
        policy = confinement.access_policy(
            roots=settings.model_root_dirs, argv=spec.argv, env=env, private_files=[]
        )
        t = lap("environment + policy", t)
        proc = procs.spawn(
            spec.argv, env, tmp / "steps" / "b.log", settings.models_dir, policy, "required"
        )
        t = lap("spawn, confined", t)
        try:
            with httpx.Client(timeout=1.0) as c:
                for _ in range(2000):
                    try:
                        if c.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.005)
            t = lap("readiness (the backend's own)", t)
            # What health.prove_listener calls once the backend answers.
            owned = ownership.owns_port(proc.identity, port, proc.marker)
            procs.note_listener(proc, port)
            t = lap("listener proof", t)
            assert owned, "the bench's backend does not own its port"
        finally:
            asyncio.run(procs.terminate(proc, 5.0))
        t = time.monotonic()
        bare = procs.spawn(spec.argv, env, tmp / "steps" / "u.log", settings.models_dir)
        lap("spawn (unconfined, for scale)", t)
        asyncio.run(procs.terminate(bare, 5.0))
    return steps


def paired_runs(
    binary: str, model: Path, tmp: Path, runs: int, args: argparse.Namespace
) -> tuple[list[float], list[float]]:
    """`runs` pairs, each a direct spawn then a host start right after it, so a machine that
    gets busier or quieter weighs on both sides of a pair (the host's cost is read from each
    pair's difference: on a loaded machine the backend's own time swings tenfold)."""
    direct, times = [], []
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
                direct.append(direct_once(binary, model, tmp))
                t0 = time.monotonic()
                r = c.post(f"/instances/{iid}/start")
                elapsed = time.monotonic() - t0
                r.raise_for_status()
                times.append(elapsed)
                c.post(f"/instances/{iid}/stop").raise_for_status()
    return direct, times


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
        direct, host = paired_runs(binary, model, tmp, args.runs, args)
        steps = step_runs(binary, model, tmp, args.runs)
    d_med, h_med = statistics.median(direct), statistics.median(host)
    over = sorted(h - d for h, d in zip(host, direct, strict=True))
    o_med = statistics.median(over)
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
    print(
        f"host over direct, median of the pairs: {o_med * 1000:+.1f} ms (quartiles "
        f"{over[len(over) // 4] * 1000:+.1f} to {over[(3 * len(over)) // 4] * 1000:+.1f} ms; "
        "target <= +5 ms)"
    )
    print("\nthe start path step by step (this checkout, in-process, confinement required):")
    # Shares of the host's own steps; the backend's readiness and a bare spawn are for scale.
    mine = {k: statistics.median(v) for k, v in steps.items() if not k.endswith(")")}
    mine_total = sum(mine.values())
    for name, values in steps.items():
        med = statistics.median(values)
        share = f"{med / mine_total:>8.1%}" if name in mine else "   (scale)"
        print(f"  {name:32}{med * 1000:>9.2f}ms{share}")
    print(f"  {'host steps in all':32}{mine_total * 1000:>9.2f}ms")
    print_result(
        args,
        {"direct_ms": d_med * 1000, "host_ms": h_med * 1000, "over_ms": o_med * 1000},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

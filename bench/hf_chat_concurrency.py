"""Chat throughput and time to first token of hf_server with 1, 4, 8 and 16 streaming clients.

Two hf_server processes serve the same causal model, started with the argv and environment the
host's HuggingFace backend builds (`HuggingFaceBackend.launch`):

- batched: the step-level decode scheduler (hf_decode), max_batch_size 32;
- one-at-a-time: the same server with max_batch_size 1, i.e. requests generated one after
  another, as the server did before step-level batching (and as the old release does).

Each phase runs C streaming chat clients for a fixed time, in a client process of its own (the
clients never share an interpreter with a model); every request asks for `--max-tokens` tokens
at temperature 0 and reads the stream to the end. Tokens are the servers' own usage counts
(stream_options.include_usage); time to first token (TTFT) is from sending the request to the
first chunk with text. Phases of the two servers alternate at each client count, so both see
the same machine, and the whole sequence of phases runs --rounds times, each figure pooling its
phases of every round: a ratio of two figures (8 clients against 1) then compares phases run
minutes apart as often as seconds apart, and a slow spell of the machine (other tenants of the
host) weighs on both sides instead of on whichever phase it fell in. Each round's own ratio is
printed too, as the spread.

Two kinds of load run, each printed as its own table:

- equal lengths: every request asks --max-tokens tokens, so the clients, started together,
  finish together and ask again together: a burst of C new prompts each round, with no running
  batch to join (the prompts of a burst are prefilled while the others wait);
- mixed lengths: each client draws each request's length from half to 1.5 times --max-tokens
  (seeded per client, so both servers get the same requests): arrivals spread out, and a new
  request joins a batch that is already generating, as chat traffic does.

Target (issues 20 and 43): with 8 clients, at least 3x the one-at-a-time aggregate tokens/s,
and a p50 TTFT at most 3x the single-client p50, in both tables. (Equal lengths make a burst
only while the clients stay in step: once one request lags, they arrive one by one and join a
running batch too, each finishing a step or so after the other.)

    .venv/bin/python bench/hf_chat_concurrency.py [--seconds 3] [--rounds 3] [--max-tokens 32]
        [--size tiny|small|medium] [--model DIR] [--clients 1,4,8,16] [--lengths both]
        [--base-root DIR]

--size tiny is the tests' 2-layer 32-wide GPT-2; small is a 4-layer 256-wide one and medium a
12-layer 768-wide one (GPT-2's own shape, random weights, the tiny one's tokenizer): more work
per token, closer to what batching does for a real model. On a CPU, tiny and small are
dominated by per-call overhead, medium by the matrix products.
--model serves a local causal model directory instead.
--base-root runs a third server beside the two, batched as the first but from another checkout
(e.g. `git worktree add /tmp/base HEAD~1`): a change to the server and the code before it,
measured in the same phases of the same run ("batched (base)" in the tables).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-key"
PROMPTS = [
    "hello world, how are you?",
    "the cat sat on the mat",
    "tell me about the stock market",
    "a man is eating a piece of bread",
    "the quick brown fox",
    "what do tiny models do?",
]


# ---- client process ---------------------------------------------------------------------


async def _load(url: str, clients: int, seconds: float, max_tokens: int, lengths: str) -> dict:
    import random

    import aiohttp  # a lighter client than httpx: the clients share the machine with the server

    ttft: list[float] = []
    tokens = 0
    requests = 0
    errors = 0
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(url, connector=conn, headers=headers) as session:

        async def one(i: int, stop_at: float) -> None:
            nonlocal tokens, requests, errors
            n = i
            rng = random.Random(i)  # the same lengths for both servers
            while time.perf_counter() < stop_at:
                wanted = max_tokens
                if lengths == "mixed":
                    wanted = rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2)
                body = {
                    "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}],
                    "max_tokens": wanted,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                n += 1
                t0 = time.perf_counter()
                first = None
                usage = None
                async with session.post("/v1/chat/completions", data=json.dumps(body)) as r:
                    if r.status != 200:
                        errors += 1
                        await r.read()
                        continue
                    async for raw in r.content:
                        line = raw.strip()
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        if first is None and b'"content":"' in line and b'"content":""' not in line:
                            first = time.perf_counter() - t0
                        elif b'"usage":{' in line:
                            usage = json.loads(line[6:])["usage"]
                if usage is None or first is None:
                    errors += 1
                    continue
                tokens += usage["completion_tokens"]
                requests += 1
                ttft.append(first)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, t0 + seconds) for i in range(clients)))
        elapsed = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "requests": requests,
        "errors": errors,
        "seconds": elapsed,
        "ttft": ttft,
    }


def client_main(argv: list[str]) -> None:
    url, clients, seconds, max_tokens = argv[0], int(argv[1]), float(argv[2]), int(argv[3])
    print(json.dumps(asyncio.run(_load(url, clients, seconds, max_tokens, argv[4]))))


def run_client(url: str, clients: int, seconds: float, max_tokens: int, lengths: str) -> dict:
    argv = [url, str(clients), str(seconds), str(max_tokens), lengths]
    out = subprocess.run(
        [sys.executable, __file__, "--client", *argv],
        capture_output=True,
        text=True,
        timeout=seconds + 600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if out.returncode != 0:
        raise SystemExit(f"client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- servers ------------------------------------------------------------------------------


def build_model(root: Path, size: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.hf_models import build_tiny_hf_models

    models = build_tiny_hf_models(root)
    if size == "tiny":
        return models.causal
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(models.causal)
    torch.manual_seed(7)
    width, layers = {"small": (256, 4), "medium": (768, 12)}[size]
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_positions=2048,
        n_embd=width,
        n_layer=layers,
        n_head=width // 64,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # as the tiny one: EOS never wins, so every request runs its length
        model.lm_head.weight[tok.eos_token_id].zero_()
    out = root / f"{size}-gpt2"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def start_server(
    model_dir: Path, max_batch: int, log: Path, root: Path = ROOT
) -> tuple[subprocess.Popen, str]:
    from solar_host.backends.base import LaunchContext
    from solar_host.backends.huggingface import BACKEND
    from tests.fixtures.ports import free_port

    cfg = BACKEND.config_model("huggingface_causal").model_validate(
        {
            "backend_type": "huggingface_causal",
            "alias": f"bench-b{max_batch}",
            "model_id": str(model_dir),
            "host": "127.0.0.1",
            "max_batch_size": max_batch,
            "max_length": 1024,
        }
    )
    port = free_port()
    ctx = LaunchContext(
        instance_id="bench", port=port, host_api_key=KEY, models_dir=model_dir.parent
    )
    spec = BACKEND.launch(cfg, ctx)
    env = {**os.environ, **spec.env, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    fh = open(log, "wb")
    # In the tree's own directory: `python -m` looks there first, before PYTHONPATH.
    proc = subprocess.Popen(spec.argv, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=root)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(procs: list[tuple[subprocess.Popen, str, Path]]) -> None:
    deadline = time.monotonic() + 300
    for proc, _url, log in procs:
        while "Uvicorn running on" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)


def pooled(phases: list[dict]) -> dict:
    """One figure from the same phase of every round: counts and times added up, TTFTs
    together."""
    out = {key: sum(p[key] for p in phases) for key in ("tokens", "requests", "errors", "seconds")}
    out["ttft"] = [t for p in phases for t in p["ttft"]]
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=3, help="length of each phase")
    p.add_argument("--rounds", type=int, default=3, help="times the sequence of phases runs")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--size", choices=["tiny", "small", "medium"], default="tiny")
    p.add_argument("--model", default=None, help="a local causal model directory")
    p.add_argument(
        "--lengths",
        choices=["both", "equal", "mixed"],
        default="both",
        help="equal: every request asks --max-tokens; mixed: from half to 1.5 times it",
    )
    p.add_argument(
        "--base-root",
        default=None,
        help="another checkout whose server runs batched beside this one's, in the same phases",
    )
    args = p.parse_args()
    counts = [int(x) for x in args.clients.split(",")]
    modes = ["equal", "mixed"] if args.lengths == "both" else [args.lengths]
    sys.path.insert(0, str(ROOT))

    with tempfile.TemporaryDirectory(prefix="hf-chat-bench-") as tmp:
        root = Path(tmp)
        model = Path(args.model) if args.model else build_model(root, args.size)
        servers = {}
        kinds = [("batched", 32, ROOT), ("one-at-a-time", 1, ROOT)]
        if args.base_root:
            kinds.append((BASE, 32, Path(args.base_root).resolve()))
        for name, batch, tree in kinds:
            log = root / f"{name.replace(' ', '-')}.log"
            proc, url = start_server(model, batch, log, tree)
            servers[name] = (proc, url, log)
        try:
            wait_ready(list(servers.values()))
            # Warm-up at the largest client count: a GPU meets each new batch shape once
            # (kernel choice, allocator growth), and those first steps belong to no phase.
            for _proc, url, _log in servers.values():
                run_client(url, max(counts), 2.0, args.max_tokens, "mixed")
            rounds: list[dict[tuple[str, str, int], dict]] = []
            for r in range(args.rounds):
                # Alternate which server goes first, so neither always follows the other.
                names = list(servers) if r % 2 == 0 else list(reversed(servers))
                rounds.append({})
                for mode in modes:
                    for c in counts:
                        for name in names:
                            rounds[-1][(mode, name, c)] = run_client(
                                servers[name][1], c, args.seconds, args.max_tokens, mode
                            )
            results = {key: pooled([rnd[key] for rnd in rounds]) for key in rounds[0]}
            decoding = {
                name: scheduler_stats(url)
                for name, (_p, url, _l) in servers.items()
                if name != "one-at-a-time"
            }
        finally:
            for proc, _url, _log in servers.values():
                proc.terminate()
            for proc, _url, _log in servers.values():
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"model: {args.model or args.size}, max_tokens {args.max_tokens}, {args.rounds} rounds "
        f"of {args.seconds:g} s per phase, {os.cpu_count()} CPUs, load average {load}"
    )

    def tps(r: dict) -> float:
        return r["tokens"] / r["seconds"]

    for mode in modes:
        print()
        print(MODE_TITLES[mode].format(n=args.max_tokens))
        print(
            f"{'clients':>7} | {'server':<15} | {'tok/s':>8} | {'req':>5} | {'err':>3} | "
            f"{'TTFT p50 ms':>11} | {'TTFT p99 ms':>11}"
        )
        for c in counts:
            for name in servers:
                r = results[(mode, name, c)]
                print(
                    f"{c:>7} | {name:<15} | {tps(r):>8.1f} | {r['requests']:>5} | "
                    f"{r['errors']:>3} | {pct(r['ttft'], 50) * 1000:>11.1f} | "
                    f"{pct(r['ttft'], 99) * 1000:>11.1f}"
                )
        if 8 in counts and 1 in counts:
            for name in [n for n in servers if n != "one-at-a-time"]:
                summary(mode, name, results, rounds)
    print()
    for name, d in decoding.items():
        # How the scheduler cut the bursts: admitted requests per prefill, and the cost it
        # fitted (the grouping splits a burst only where the fit says a prompt costs more
        # than a call).
        print(
            f"{name} scheduler: {d['prefills']} prefills for {d['admitted']} requests "
            f"({d['admitted'] / max(1, d['prefills']):.2f} a prefill), fitted prefill cost "
            f"{d['prefill_ms_per_call']} ms a call + {d['prefill_ms_per_token']} ms a token, "
            f"hand-over {d['handoff_ms']} ms"
        )


def scheduler_stats(url: str) -> dict:
    """The decode scheduler's counters (the server's /v1/stats `decoding`)."""
    import urllib.request

    req = urllib.request.Request(f"{url}/v1/stats", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["decoding"]


def summary(mode: str, name: str, results: dict, rounds: list[dict]) -> None:
    """The targets' two ratios for one batched server, pooled and per round."""

    def tps(r: dict) -> float:
        return r["tokens"] / r["seconds"]

    b8, o8 = results[(mode, name, 8)], results[(mode, "one-at-a-time", 8)]
    b1 = results[(mode, name, 1)]
    o1 = results[(mode, "one-at-a-time", 1)]
    base = max(tps(o8), tps(o1))  # one at a time: the better of its two figures
    speed = tps(b8) / base
    ttft = statistics.median(b8["ttft"]) / statistics.median(b1["ttft"])
    print(
        f"8 clients, {mode} lengths, {name}: {speed:.2f}x the one-at-a-time aggregate "
        f"tokens/s (target >= 3x); p50 TTFT {ttft:.2f}x the single-client p50 (target <= 3x)"
    )
    each = [
        statistics.median(rnd[(mode, name, 8)]["ttft"] or [math.nan])
        / statistics.median(rnd[(mode, name, 1)]["ttft"] or [math.nan])
        for rnd in rounds
    ]
    print(f"  p50 TTFT ratio of each round: {', '.join(f'{x:.2f}x' for x in each)}")


BASE = "batched (base)"
MODE_TITLES = {
    "equal": (
        "equal lengths (every request asks {n} tokens): the clients finish together and ask "
        "again together, a burst each round, and no running batch to join"
    ),
    "mixed": (
        "mixed lengths (each request asks a length drawn from {n}/2 to 1.5x{n}): requests "
        "arrive while others generate and join the running batch"
    ),
}


if __name__ == "__main__":
    main()

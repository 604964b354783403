"""`llama-server` from the `xllamacpp` distribution, for hosts with no llama-server binary.

xllamacpp embeds llama.cpp's own HTTP server (same code, same log lines, same auth) but ships no
executable. The host runs this file by path with its own Python (`python <this file> ...`), so
the process is one exec (its pid, start time and listening socket are what re-adoption checks)
and it works whatever PYTHONPATH the backend's environment keeps. It imports nothing from
solar_host for the same reason.

It reads the llama-server command line solar-host emits. Every flag is either honoured or
refused: an unknown flag exits with status 2 and a message naming it, never silently dropped.
The host refuses configs needing a flag listed in neither set at create (422), so a refusal here
means a hand-written command line. Keys come from LLAMA_API_KEY, exactly as llama-server reads
them. Serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

# Flags taking a value, and switches, that this server honours (the spelling solar-host emits
# first, aliases after).
VALUE_FLAGS = frozenset(
    {
        "--model", "-m", "--alias", "-a", "--threads", "-t", "--n_gpu_layers",
        "--n-gpu-layers", "-ngl", "--temp", "--top_p", "--top-p", "--top_k", "--top-k",
        "--min_p", "--min-p", "--ctx-size", "-c", "--host", "--port", "--pooling",
        "--chat-template-file", "--chat-template-kwargs", "--parallel", "-np",
        "--split-mode", "--tensor-split", "--main-gpu", "-ctk", "--cache-type-k", "-ctv",
        "--cache-type-v", "--rope-scaling", "--rope-scale", "--yarn-orig-ctx", "-ot",
        "--override-tensor", "--mmproj", "--reasoning", "--reasoning-budget",
    }
)  # fmt: skip
SWITCHES = frozenset(
    {
        "--no-warmup", "--jinja", "--metrics", "--slots", "--embedding", "--rerank",
        "--special", "--no-mmproj-offload",
    }
)  # fmt: skip
SUPPORTED_FLAGS = VALUE_FLAGS | SWITCHES

_CANON = {
    "-m": "--model", "-a": "--alias", "-t": "--threads", "--n_gpu_layers": "--n-gpu-layers",
    "-ngl": "--n-gpu-layers", "--top_p": "--top-p", "--top_k": "--top-k", "--min_p": "--min-p",
    "-c": "--ctx-size", "-np": "--parallel", "-ctk": "--cache-type-k", "-ctv": "--cache-type-v",
    "--override-tensor": "-ot",
}  # fmt: skip


class UsageError(Exception):
    """A command line this server cannot honour."""


def parse_args(argv: list[str]) -> tuple[dict[str, str], set[str]]:
    """(values by canonical flag, switches). Raises UsageError naming an unknown flag."""
    values: dict[str, str] = {}
    switches: set[str] = set()
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in VALUE_FLAGS:
            if i + 1 >= len(argv):
                raise UsageError(f"{a} needs a value")
            values[_CANON.get(a, a)] = argv[i + 1]
            i += 2
            continue
        if a in SWITCHES:
            switches.add(a)
            i += 1
            continue
        raise UsageError(f"unsupported argument {a!r} (xllamacpp cannot honour it)")
    return values, switches


def _enum(enum: Any, prefix: str, name: str) -> Any:
    try:
        return getattr(enum, prefix + name.upper().replace("-", "_"))
    except AttributeError:
        raise UsageError(f"unsupported value {name!r} for {prefix.lower()}") from None


def build_params(xlc: Any, v: dict[str, str], sw: set[str]) -> Any:
    """xllamacpp.CommonParams for a parsed llama-server command line."""
    p = xlc.CommonParams()
    p.model.path = v.get("--model", "")
    if "--alias" in v:
        p.model_alias = {v["--alias"]}
    threads = int(v.get("--threads", "1"))
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.n_gpu_layers = int(v.get("--n-gpu-layers", "-1"))
    p.n_ctx = int(v.get("--ctx-size", "0"))
    p.n_parallel = int(v.get("--parallel", "1"))
    p.hostnames = [v.get("--host", "127.0.0.1")]
    p.port = int(v.get("--port", "8080"))
    s = p.sampling
    for flag, attr, conv in (
        ("--temp", "temp", float),
        ("--top-p", "top_p", float),
        ("--top-k", "top_k", int),
        ("--min-p", "min_p", float),
    ):
        if flag in v:
            setattr(s, attr, conv(v[flag]))
    if "--split-mode" in v:
        p.split_mode = _enum(xlc.llama_split_mode, "LLAMA_SPLIT_MODE_", v["--split-mode"])
    if "--tensor-split" in v:
        parts = [float(x) for x in v["--tensor-split"].split(",")]
        current = list(p.tensor_split)
        p.tensor_split = parts + [0.0] * max(0, len(current) - len(parts))
    if "--main-gpu" in v:
        p.main_gpu = int(v["--main-gpu"])
    if "--chat-template-file" in v:
        with open(v["--chat-template-file"], encoding="utf-8") as f:
            p.chat_template = f.read()
    if "--chat-template-kwargs" in v:
        p.default_template_kwargs = {
            k: json.dumps(val) for k, val in json.loads(v["--chat-template-kwargs"]).items()
        }
    for flag, attr in (("--cache-type-k", "cache_type_k"), ("--cache-type-v", "cache_type_v")):
        if flag in v:
            setattr(p, attr, _enum(xlc.ggml_type, "GGML_TYPE_", v[flag]))
    if "--rope-scaling" in v:
        p.rope_scaling_type = _enum(
            xlc.llama_rope_scaling_type, "LLAMA_ROPE_SCALING_TYPE_", v["--rope-scaling"]
        )
    if "--rope-scale" in v:
        p.rope_freq_scale = 1.0 / float(v["--rope-scale"])  # llama-server does the same
    if "--yarn-orig-ctx" in v:
        p.yarn_orig_ctx = int(v["--yarn-orig-ctx"])
    if "-ot" in v:
        p.tensor_buft_overrides = v["-ot"]
    if "--mmproj" in v:
        p.mmproj.path = v["--mmproj"]
        p.mmproj_use_gpu = "--no-mmproj-offload" not in sw
    if "--reasoning" in v:
        p.enable_reasoning = {"on": 1, "off": 0, "auto": -1}[v["--reasoning"]]
    if "--reasoning-budget" in v:
        s.reasoning_budget_tokens = int(v["--reasoning-budget"])
    p.special = "--special" in sw
    p.warmup = "--no-warmup" not in sw
    p.use_jinja = True
    p.endpoint_metrics = "--metrics" in sw
    p.endpoint_slots = True
    if "--embedding" in sw or "--rerank" in sw:
        p.embedding = True
    pooling = "rank" if "--rerank" in sw else v.get("--pooling")
    if pooling:
        p.pooling_type = _enum(xlc.llama_pooling_type, "LLAMA_POOLING_TYPE_", pooling)
    keys = os.environ.get("LLAMA_API_KEY", "")
    p.api_keys = [k.strip() for k in keys.split(",") if k.strip()]
    return p


def main(argv: list[str]) -> int:
    try:
        values, switches = parse_args(argv)
    except UsageError as err:
        print(f"llama-server (xllamacpp): {err}", file=sys.stderr, flush=True)
        return 2
    import xllamacpp as xlc

    try:
        params = build_params(xlc, values, switches)
    except (UsageError, ValueError, OSError) as err:
        print(f"llama-server (xllamacpp): {err}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = xlc.Server(params)  # logs llama.cpp's "init: listening on" ready line
    sys.stderr.flush()
    stop.wait()
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""solar-host's own HuggingFace inference server, run as its own process by the host.

    python -m solar_host.servers.hf_server --model-id DIR --model-type embedding --alias a \
        --host 127.0.0.1 --port 8000 [--device auto] [--dtype auto] [--max-length 512] ...

API keys come from the environment (SOLAR_HF_API_KEYS, comma-separated), never argv: argv is
visible to every user of the machine. The model is loaded before the socket is opened, so
uvicorn's "Uvicorn running on http://..." line means "ready". Each request logs
`[REQUEST] id=.. endpoint=..` and `[COMPLETE] id=.. endpoint=.. prompt_tokens=N
completion_tokens=M time_ms=T` (generations add `started_at=.. finished_at=..`, and that line is
written before the response's last event) or `[ERROR] id=.. endpoint=.. status=S message=..`,
which the host's log parser turns into runtime state and last-generation metrics (both sides of
each line: log_lines).

This module is the process: its arguments, the port bound before the model loads, the load,
and uvicorn serving the app. The app and its routes are hf_app's; chat and completions are
hf_generation's; requests begun and ended, with their log lines, are request_log's.

Causal chat and completion requests are decoded together, step by step (hf_decode): a request
joins the running batch at the next step.

Too-long inputs: a chat/completion prompt at or over the context is a 400
`context_length_exceeded` (as OpenAI does). Embedding and classification inputs over
max_length tokens are a 400 too, unless the request sends `"truncate": true`, which truncates
them to max_length tokens (keeping the closing special token).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from typing import Any

from solar_host.platform.uvicorn_adapter import guarded_protocol
from solar_host.servers.hf_app import BODY_TIMEOUT_S, HFServer, build_app
from solar_host.servers.log_lines import READY_FORMAT, ready_host

API_KEYS_ENV = "SOLAR_HF_API_KEYS"
MODEL_TYPES = ("causal", "classification", "embedding", "vision")
# Longest wait for a connection's request headers, and for a request's body (BODY_TIMEOUT_S):
# the environment may set others, SOLAR_HF_HEADER_TIMEOUT_S and SOLAR_HF_BODY_TIMEOUT_S.
HEADER_TIMEOUT_S = 15.0


def log_line(text: str) -> None:
    """One marker line on stdout, flushed at once (stdout is a file read by the host)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def seconds_from_env(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


def keys_from_env(environ: dict[str, str] | os._Environ = os.environ) -> list[bytes]:
    raw = environ.get(API_KEYS_ENV, "")
    return [k.strip().encode() for k in raw.split(",") if k.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hf_server", description=__doc__.split("\n")[0])
    p.add_argument("--model-id", required=True)
    p.add_argument("--model-type", required=True, choices=MODEL_TYPES)
    p.add_argument("--alias", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--use-flash-attention", action="store_true")
    p.add_argument("--labels-json", default=None, help='JSON list of labels, e.g. ["neg","pos"]')
    p.add_argument("--normalize-embeddings", action="store_true")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-window-ms", type=float, default=2.0)
    p.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="torch intra-op threads (0: OMP_NUM_THREADS if set, else measured per batch "
        "between all CPUs and all but one)",
    )
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="vision: fetch http(s) image URLs (public addresses only); off: data: URIs only",
    )
    p.add_argument("--max-images", type=int, default=8, help="vision: images per request")
    p.add_argument(
        "--max-image-bytes", type=int, default=10 * 1024 * 1024, help="vision: bytes per image"
    )
    args = p.parse_args(argv)
    if args.max_images < 1 or args.max_image_bytes < 1:
        p.error("--max-images and --max-image-bytes must be >= 1")
    if args.labels_json is not None:
        try:
            labels = json.loads(args.labels_json)
        except ValueError as err:
            p.error(f"--labels-json is not valid JSON: {err}")
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            p.error("--labels-json must be a JSON list of strings")
        args.labels = labels or None
    else:
        args.labels = None
    if args.max_length < 1 or args.max_batch_size < 1 or args.batch_window_ms < 0:
        p.error("--max-length and --max-batch-size must be >= 1, --batch-window-ms >= 0")
    if args.num_threads < 0:
        p.error("--num-threads must be >= 0 (0 picks a count from the CPUs)")
    return args


def _log_config() -> dict[str, Any]:
    """uvicorn's messages on stdout, next to our markers (one file for the host to read)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s: %(message)s"}},
        "handlers": {
            "out": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {
            "uvicorn": {"handlers": ["out"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
        },
    }


def bind_early(host: str, port: int) -> socket.socket:
    """Bind (not listen on) the port before the model loads, as uvicorn would bind it.

    Loading takes seconds (tens on a loaded machine): a port the host found free could be
    taken in that time by any other process that asks the kernel for a free port, and the
    backend would die at the end of its load. Bound but not listening, the port is ours from
    the first moment (against everyone but another SO_REUSEADDR binder, which main()'s listen
    then catches), and a client that connects early is refused at once rather than left
    waiting in a backlog; main() listens on it once the model has loaded.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keys = keys_from_env()
    try:
        sock = bind_early(args.host, args.port)
    except OSError as err:
        print(
            f"[FATAL] Cannot bind {args.host}:{args.port}: {err} (another process has the port)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    loaded = load(args)
    if loaded is None:
        return 1
    engine, device = loaded
    body_timeout_s = seconds_from_env("SOLAR_HF_BODY_TIMEOUT_S", BODY_TIMEOUT_S)
    return serve(args, sock, HFServer(engine, args, device, keys, body_timeout_s))


def load(args: argparse.Namespace) -> tuple[Any, str] | None:
    """The model's engine and its device (None: the load failed, and said why on stderr).
    Sets `args.threads`, the torch thread counts picked for this machine."""
    log_line(f"Loading {args.model_type} model {args.model_id} as '{args.alias}'")
    from solar_host.servers.hf_runtime import (
        LoadError,
        LoadOptions,
        configure_threads,
        load_engine,
    )

    args.threads = configure_threads(args.num_threads)

    opts = LoadOptions(
        model_id=args.model_id,
        model_type=args.model_type,
        device=args.device,
        dtype=args.dtype,
        max_length=args.max_length,
        trust_remote_code=args.trust_remote_code,
        use_flash_attention=args.use_flash_attention,
        labels=args.labels,
        normalize_embeddings=args.normalize_embeddings,
        max_batch_size=args.max_batch_size,
        threads=args.threads,
    )
    t0 = time.perf_counter()
    try:
        engine, device = load_engine(opts)
    except LoadError as err:
        print(f"[FATAL] Model load failed: {err}", file=sys.stderr, flush=True)
        return None
    log_line(
        f"Model loaded on {device} in {time.perf_counter() - t0:.2f} s "
        f"(torch threads: {'/'.join(map(str, args.threads))})"
    )
    return engine, device


def serve(args: argparse.Namespace, sock: socket.socket, srv: HFServer) -> int:
    """Listen on the bound `sock` and serve `srv`'s app until the server is told to stop."""
    import uvicorn

    config = uvicorn.Config(
        build_app(srv),
        host=args.host,
        port=args.port,
        log_config=_log_config(),
        access_log=False,
        proxy_headers=False,  # no proxy in front; its middleware ran on every request
        # Request headers bounded in time and size.
        http=guarded_protocol(seconds_from_env("SOLAR_HF_HEADER_TIMEOUT_S", HEADER_TIMEOUT_S)),
        lifespan="on",
        timeout_graceful_shutdown=5,
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # uvicorn logs this only for sockets it bound itself
                logging.getLogger("uvicorn.error").info(
                    READY_FORMAT, ready_host(args.host), args.port
                )

    # Listen here, where a conflict raises, rather than leave it to uvicorn: SO_REUSEADDR lets
    # two processes bind one port while neither listens, and the second listen(2) then fails
    # with EADDRINUSE, which uvloop's create_server does not report. Without this the second
    # backend logged "Uvicorn running" and served nothing while the first took its requests
    # (two hf_servers handed one port, seen in CI).
    try:
        sock.listen(config.backlog)
    except OSError as err:
        print(
            f"[FATAL] Cannot listen on {args.host}:{args.port}: {err} (another process bound "
            "the port while the model loaded)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    server = Server(config)
    server.run(sockets=[sock])
    if not server.started:
        print("[FATAL] HTTP server did not start (see the error above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A stand-in for llama-server that floods its log with real llama-server lines, for log_flood.py.

It takes llama-server's command line (only --host and --port matter), prints a real start-up
excerpt and the ready line, serves GET /health, then prints N lines cycled from a busy real
server's log (tests/fixtures/llamacpp_server.log: slot launch, prompt progress, decode timing,
release; about 106 bytes each), with task ids advanced each cycle so every pass is a new
request to the host's llama.cpp parser. It times its own flood and prints FLOOD_DONE <seconds>.

The lines are built before the clock starts and written through the same buffered file stdout
as llama-server's log (the host points the backend's stdout at a file), so what the time
measures is writing, and whatever the host's reading and parsing takes from the same cores.

    llama_log_flooder.py --flood-lines N --port P [--host H] [...llama-server flags...]
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REAL_LOG = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llamacpp_server.log"
STARTUP = (
    "build: 6123 (79c1160b) with cc (Debian 12.2.0-14) 12.2.0 for x86_64-linux-gnu",
    "system info: n_threads = 1, n_threads_batch = 1, total_threads = 2",
    "main: loading model",
    "srv    load_model: loading model '{model}'",
    "srv          init: initializing slots, n_slots = 4",
    "main: model loaded",
    "main: server is listening on http://{host}:{port} - starting the main loop",
    "srv  update_slots: all slots are idle",
)
_TASK = re.compile(r"task (\d+)")


def flood_lines(n: int) -> list[str]:
    """`n` lines cycled from the real log, task ids advanced by 100000 per cycle."""
    base = [ln for ln in REAL_LOG.read_text("utf-8").splitlines() if ln.strip()]
    out: list[str] = []
    cycle = 0
    while len(out) < n:
        shift = cycle * 100_000
        for line in base:
            out.append(_TASK.sub(lambda m, s=shift: f"task {int(m.group(1)) + s}", line) + "\n")
            if len(out) == n:
                break
        cycle += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", "-m", default="model.gguf")
    ap.add_argument("--flood-lines", type=int, default=200_000)
    args, _ = ap.parse_known_args()
    lines = flood_lines(args.flood_lines)

    class Health(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            ok = self.path == "/health"
            body = b'{"status":"ok"}' if ok else b'{"error":"not found"}'
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # a health poller that hangs up early is no log line of llama-server's

    server = Server((args.host, args.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = sys.stdout
    for line in STARTUP:
        out.write(line.format(model=args.model, host=args.host, port=args.port) + "\n")
    out.flush()
    time.sleep(0.5)  # let whoever waits for the ready line see it before the flood
    write = out.write
    t0 = time.perf_counter()
    for line in lines:
        write(line)
    out.flush()
    elapsed = time.perf_counter() - t0
    out.write(f"FLOOD_DONE {elapsed:.6f}\n")
    out.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

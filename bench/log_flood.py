"""A llama-server printing 200,000 real log lines: under the host versus on its own.

The backend is bench/llama_log_flooder.py, launched by the host as a `llamacpp` instance
(LLAMA_SERVER_BIN points at it), so its lines go the shipped way: into the log file the host
gives the backend, read by the host's follower, fed to the llama.cpp log parser (runtime state,
generation records) and into the ring, at default settings (LOG_BUFFER_SIZE 1000). The lines are
cycled from a busy real llama-server's log (about 106 bytes each). The baseline is the same
program with the same arguments writing to a file opened the same way (O_APPEND), alone, in the
same run; runs alternate (alone, host, alone, host, ...) so the machine's load hits both alike.

The backend times its own flood (FLOOD_DONE <seconds>). Prints both times in ms, the ratio per
pair (target <= 1.10), that the host read every line (seqs), that the parser produced
generation records, and the machine's load average. One more run with a WebSocket client
streaming the log shows how far behind a live reader is (it gets gap markers where it fell
further behind than the ring).

    .venv/bin/python bench/log_flood.py [--lines 200000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import websockets

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.llama_log_flooder import STARTUP  # noqa: E402
from tests.fixtures.gguf import write_tiny_gguf  # noqa: E402
from tests.fixtures.host import free_port  # noqa: E402
from tests.fixtures.hostproc import HostProc  # noqa: E402

FLOODER = ROOT / "bench" / "llama_log_flooder.py"
POLL_S = 0.2  # both waits poll at this pace, so the waiting costs both sides the same


def make_server_bin(tmp: Path, lines: int) -> Path:
    """An executable `llama-server` that runs the flooder with the line count baked in."""
    path = tmp / "llama-server"
    path.write_text(
        f'#!/bin/sh\nexec {sys.executable} -u {FLOODER} --flood-lines {lines} "$@"\n',
        encoding="utf-8",
    )
    path.chmod(0o755)
    return path


def flood_time(text: str) -> float | None:
    for line in text.splitlines()[::-1]:
        if line.startswith("FLOOD_DONE "):
            return float(line.split()[1])
    return None


def alone(server_bin: Path, model: Path, tmp: Path) -> float:
    """The flooder on its own, stdout and stderr appended to a file as the host spawns it."""
    log_path = tmp / f"alone-{time.monotonic_ns()}.log"
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        p = subprocess.Popen(
            [str(server_bin), "--model", str(model), "--host", "127.0.0.1",
             "--port", str(free_port())],
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    finally:
        os.close(fd)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with open(log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(log_path) - 300))
                t = flood_time(f.read().decode("utf-8", "replace"))
            if t is not None:
                return t
            time.sleep(POLL_S)
        raise TimeoutError("flooder did not finish")
    finally:
        p.kill()
        p.wait()


def host_cpu_s(host: HostProc) -> float:
    t = psutil.Process(host.pid).cpu_times()
    return t.user + t.system


def under_host(host: HostProc, iid: str, lines: int) -> tuple[float, bool, bool, float]:
    """(backend's own flood time, every line read in order, parser produced generations, host
    CPU seconds from the start call to the last line read)."""
    with host.client(timeout=60) as c:
        before = c.get(f"/instances/{iid}/logs").json()
        since = before[-1]["seq"] + 1 if before else 0
        cpu0 = host_cpu_s(host)
        c.post(f"/instances/{iid}/start").raise_for_status()
        deadline = time.monotonic() + 300
        done = None
        while done is None:
            assert time.monotonic() < deadline, "the flood never finished under the host"
            time.sleep(POLL_S)
            for e in c.get(f"/instances/{iid}/logs").json()[-3:]:
                if e["line"].startswith("FLOOD_DONE "):
                    done = e
        cpu = host_cpu_s(host) - cpu0
        ring = c.get(f"/instances/{iid}/logs").json()
        seqs = [e["seq"] for e in ring]
        # startup lines + the flood + FLOOD_DONE, each read once, in order
        every_line = done["seq"] - since + 1 == len(STARTUP) + lines + 1 and seqs == list(
            range(seqs[0], seqs[0] + len(seqs))
        )
        parsed = c.get(f"/instances/{iid}/last-generation").status_code == 200
        c.post(f"/instances/{iid}/stop").raise_for_status()
    return float(done["line"].split()[1]), every_line, parsed, cpu


async def ws_reader(host: HostProc, iid: str) -> tuple[float, int, int]:
    """(start answered -> FLOOD_DONE on the WS client in s, lines received, gap markers)."""
    ws_url = host.url.replace("http", "ws") + f"/instances/{iid}/logs"
    with host.client(timeout=60) as c:
        before = c.get(f"/instances/{iid}/logs").json()
        since = before[-1]["seq"] + 1 if before else 0
        async with websockets.connect(
            f"{ws_url}?since_seq={since}",
            additional_headers={"X-API-Key": host.api_key},
            max_size=None,
        ) as ws:
            await asyncio.to_thread(c.post(f"/instances/{iid}/start").raise_for_status)
            t0 = time.monotonic()
            received = gaps = 0
            async with asyncio.timeout(300):
                while True:
                    msg = json.loads(await ws.recv())
                    if "gap" in msg:
                        gaps += 1
                        continue
                    received += 1
                    if msg.get("line", "").startswith("FLOOD_DONE "):
                        break
            latency = time.monotonic() - t0
        c.post(f"/instances/{iid}/stop").raise_for_status()
    return latency, received, gaps


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="flood-") as d:
        tmp = Path(d)
        server_bin = make_server_bin(tmp, args.lines)
        # In the host's MODELS_DIR: a config's model must lie in a model root (ruling 12).
        model = write_tiny_gguf(tmp / "host" / "models" / "tiny.gguf")
        alone_runs: list[float] = []
        host_runs: list[tuple[float, bool, bool, float]] = []
        with HostProc(
            tmp / "host",
            backend="real",
            env={"LLAMA_SERVER_BIN": str(server_bin), "LOG_LEVEL": "warning"},
        ) as host:
            host.start(timeout=60)
            with host.client() as c:
                r = c.post(
                    "/instances",
                    json={
                        "config": {
                            "backend_type": "llamacpp",
                            "alias": "flood",
                            "model": str(model),
                            "host": "127.0.0.1",
                        }
                    },
                )
                r.raise_for_status()
                iid = r.json()["instance"]["id"]
            for _ in range(args.runs):
                alone_runs.append(alone(server_bin, model, tmp))
                host_runs.append(under_host(host, iid, args.lines))
            ws = asyncio.run(ws_reader(host, iid))
    load_after = os.getloadavg()
    a = [x * 1000 for x in alone_runs]
    h = [r[0] * 1000 for r in host_runs]
    ratios = [hh / aa for hh, aa in zip(h, a, strict=True)]
    print(
        f"{args.lines} real llama-server log lines (~106 B each), {args.runs} alternating pairs; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print(
        f"  under the host: median {statistics.median(h):8.1f} ms ({spread(h)})   "
        f"alone, to a file: median {statistics.median(a):8.1f} ms ({spread(a)})"
    )
    print(
        f"  ratio host / alone: median {statistics.median(ratios):.3f} "
        f"(pairs: {', '.join(f'{x:.2f}' for x in ratios)})   [target <= 1.10; old release ~90x]"
    )
    cpu = [r[3] for r in host_runs]
    print(
        f"  host process CPU per flood (start call to last line read, includes the start): "
        f"median {statistics.median(cpu):.2f} s ({spread(cpu, '{:.2f}')}), "
        f"{statistics.median(cpu) / args.lines * 1e6:.1f} us per line"
    )
    print(
        f"  every line read once, in order: {all(r[1] for r in host_runs)}; "
        f"llama.cpp parser produced generation records: {all(r[2] for r in host_runs)}"
    )
    print(
        f"  a WS client streaming the flood: FLOOD_DONE {ws[0] * 1000:.0f} ms after start "
        f"answered; {ws[1]} lines received, {ws[2]} gap markers (ring of 1000 lines)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

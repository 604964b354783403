"""A backend that prints 200,000 lines: under the host versus writing to a file on its own.

The backend times its own flood (FLOOD_DONE <seconds> in its log). Prints both, their ratio
(target <= 1.10), whether every line reached the ring and the file with contiguous seqs, and
how long after the start answered the last line reached a WebSocket client. (The old release
read the backend's pipe one byte per syscall and slowed such a backend about 90x.)

    .venv/bin/python bench/log_flood.py [--lines 200000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import websockets

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.host import free_port  # noqa: E402
from tests.fixtures.hostproc import HostProc  # noqa: E402

FAKE = ROOT / "tests" / "fixtures" / "fake_backend.py"


def flood_time(text: str) -> float | None:
    for line in text.splitlines()[::-1]:
        if line.startswith("FLOOD_DONE "):
            return float(line.split()[1])
    return None


def alone(lines: int, tmp: Path) -> float:
    out_path = tmp / f"alone-{time.monotonic_ns()}.log"
    with open(out_path, "wb") as out:
        p = subprocess.Popen(
            [
                sys.executable,
                "-u",
                str(FAKE),
                "--port",
                str(free_port()),
                "--flood-after-ready",
                str(lines),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            t = flood_time(out_path.read_bytes()[-300:].decode("utf-8", "replace"))
            if t is not None:
                return t
            time.sleep(0.01)
        raise TimeoutError("flooder did not finish")
    finally:
        p.kill()
        p.wait()


async def under_host(
    host: HostProc, iid: str, lines: int, with_ws: bool
) -> tuple[float, float, bool, int]:
    """(backend's own flood time, start -> last line on the WS client, seqs contiguous,
    lines in the ring). Without `with_ws` nobody streams, so the backend's time shows what the
    host itself costs it; with it, the WS client competes for the same 2 cores."""
    ws_url = host.url.replace("http", "ws") + f"/instances/{iid}/logs"
    headers = {"X-API-Key": host.api_key}
    with host.client() as c:
        before = c.get(f"/instances/{iid}/logs").json()
        since = before[-1]["seq"] + 1 if before else 0
        t0 = time.monotonic()
        last_at = float("nan")
        backend_t = None
        if with_ws:
            async with websockets.connect(
                f"{ws_url}?since_seq={since}", additional_headers=headers, max_size=None
            ) as ws:
                t0 = time.monotonic()
                c.post(f"/instances/{iid}/start").raise_for_status()
                async with asyncio.timeout(180):
                    while backend_t is None:
                        msg = json.loads(await ws.recv())
                        line = msg.get("line", "")
                        if line == f"flood line {lines - 1}":
                            last_at = time.monotonic() - t0
                        elif line.startswith("FLOOD_DONE "):
                            backend_t = float(line.split()[1])
        else:
            c.post(f"/instances/{iid}/start").raise_for_status()
            async with asyncio.timeout(180):
                while backend_t is None:
                    await asyncio.sleep(0.2)
                    tail = c.get(f"/instances/{iid}/logs").json()[-3:]
                    for e in tail:
                        if e["line"].startswith("FLOOD_DONE "):
                            backend_t = float(e["line"].split()[1])
        logs = c.get(f"/instances/{iid}/logs").json()
        seqs = [e["seq"] for e in logs]
        contiguous = seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        in_ring = sum(1 for e in logs if e["line"].startswith("flood line "))
        c.post(f"/instances/{iid}/stop").raise_for_status()
    return backend_t, last_at, contiguous, in_ring


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="flood-") as d:
        tmp = Path(d)
        alone_runs = [alone(args.lines, tmp) for _ in range(args.runs)]
        host_runs = []
        with HostProc(
            tmp / "host", backend="script", env={"LOG_BUFFER_SIZE": str(args.lines + 1000)}
        ) as host:
            host.start()
            model = tmp / "m.gguf"
            model.write_bytes(b"x")
            with host.client() as c:
                r = c.post(
                    "/instances",
                    json={
                        "config": {
                            "alias": "flood",
                            "model": str(model),
                            "host": "127.0.0.1",
                            "fake_args": ["--flood-after-ready", str(args.lines)],
                        }
                    },
                )
                r.raise_for_status()
                iid = r.json()["instance"]["id"]
            for _ in range(args.runs):
                host_runs.append(asyncio.run(under_host(host, iid, args.lines, False)))
            ws_runs = [
                asyncio.run(under_host(host, iid, args.lines, True)) for _ in range(args.runs)
            ]
            files = sorted((tmp / "host" / "logs").glob("*.log"))
            in_file = files[-1].read_text("utf-8", "replace").count("flood line ") if files else 0
    a = statistics.median(alone_runs)
    h = statistics.median(r[0] for r in host_runs)
    ws = statistics.median(r[1] for r in ws_runs)
    ws_backend = statistics.median(r[0] for r in ws_runs)
    print(f"{args.lines} lines, median of {args.runs} runs")
    print(f"  backend alone, stdout to a file:      {a * 1000:8.1f} ms")
    print(f"  backend under the host (its own time): {h * 1000:8.1f} ms")
    print(f"  ratio under host / alone:              {h / a:8.3f}   (target <= 1.10; old ~90x)")
    print(
        f"  with a WS client reading every line (same 2 cores): backend {ws_backend * 1000:.1f} ms"
    )
    print(f"  start answered -> last line on the WS client:         {ws * 1000:8.1f} ms")
    print(
        f"  seqs contiguous: {all(r[2] for r in host_runs + ws_runs)}; lines in ring: "
        f"{host_runs[-1][3]}; lines in newest log file: {in_file}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Pulls from peers (MODEL_PEERS): Hub bytes, wall time and throughput for 1 and 3 hosts, and a
pull from a peer beside one from the source.

Starts the loopback Hub (tests/fixtures/fakehub.py, its file bodies throttled to `--hub-mbps`
to stand for a shared uplink; 0: unthrottled) with one model of random bytes, and whole hosts
on loopback (tests/fixtures/host.py: uvicorn, the real routes). Then:

- one host pulls the model from the Hub;
- three hosts: host 1 pulls from the Hub, then hosts 2 and 3 pull at once with MODEL_PEERS
  naming host 1 (and each other);
- per pull: the bytes of file bodies the Hub served, the wall time and the throughput.

Usage: PYTHONPATH=. .venv/bin/python bench/pull_peers.py [--mb 64] [--hub-mbps 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.fakehub import FakeHub
from tests.fixtures.host import running_host
from tests.fixtures.peers import hub_bytes, peer_settings, pull, serving_model

MB = 1_000_000


async def timed_pull(h) -> float:
    began = time.perf_counter()
    await pull(h, timeout=3600)
    return time.perf_counter() - began


def line(what: str, size: int, seconds: float, hub_sent: int) -> None:
    print(
        f"  {what:34s} {seconds:7.2f} s  {size / seconds / MB:8.1f} MB/s   "
        f"Hub bytes {hub_sent / MB:8.1f} MB ({hub_sent / size:.2f}x the model)"
    )


async def run(work: Path, hub: FakeHub, size: int) -> None:
    def settings(name: str, peers: list[str]):
        return peer_settings(work / name, hub.url, peers, progress_s=1.0)

    print("1 host:")
    async with running_host(settings("solo", [])) as solo:
        before = hub_bytes(hub)
        t = await timed_pull(solo)
        line("host 1 from the Hub", size, t, hub_bytes(hub) - before)
    print("3 hosts (2 and 3 at once, MODEL_PEERS naming the others):")
    before = hub_bytes(hub)
    async with contextlib.AsyncExitStack() as stack:
        h1 = await stack.enter_async_context(running_host(settings("h1", [])))
        t1 = await timed_pull(h1)
        line("host 1 from the Hub", size, t1, hub_bytes(hub) - before)
        h2 = await stack.enter_async_context(running_host(settings("h2", [h1.url])))
        h3 = await stack.enter_async_context(running_host(settings("h3", [h1.url, h2.url])))
        mid = hub_bytes(hub)
        began = time.perf_counter()
        t2, t3 = await asyncio.gather(timed_pull(h2), timed_pull(h3))
        both = time.perf_counter() - began
        sent = hub_bytes(hub) - mid
        line("host 2 from peers", size, t2, sent)
        line("host 3 from peers", size, t3, sent)
        total = hub_bytes(hub) - before
        print(
            f"  all three: {t1 + both:.2f} s, Hub bytes {total / MB:.1f} MB "
            f"({total / size:.3f}x the model; target <= 1.01x)"
        )
        print(f"  a pull from a peer vs from the source: {t2:.2f} s vs {t1:.2f} s ({t1 / t2:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64, help="model size in MB (10^6 bytes)")
    ap.add_argument("--hub-mbps", type=float, default=50.0, help="Hub body rate, MB/s (0: any)")
    args = ap.parse_args()
    size = args.mb * MB
    with (
        tempfile.TemporaryDirectory(prefix="pull-peers-") as tmp,
        serving_model(Path(tmp) / "hub", size) as hub,
    ):
        hub.bytes_per_s = args.hub_mbps * MB or None
        print(f"model {args.mb} MB; Hub bodies at {args.hub_mbps or 'any'} MB/s per connection")
        asyncio.run(run(Path(tmp), hub, size))


if __name__ == "__main__":
    main()

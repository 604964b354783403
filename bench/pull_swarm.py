"""Pulls in a swarm: 8 hosts pull one model at once, every host's upload and the Hub capped at
the same rate, beside one host alone from the Hub at that rate (issue 42, fleet scale).

Starts the loopback Hub (tests/fixtures/fakehub.py) with one model of random bytes, its whole
uplink capped at `--mbps` (all file bodies together), and whole hosts on loopback
(tests/fixtures/host.py: uvicorn, the real peer routes), each with PEER_MAX_UPLOAD_BYTES_PER_S
at the same rate. Then:

- one host, no peers, pulls the model from the Hub: the baseline;
- `--hosts` hosts (MODEL_PEERS naming all the others) pull it at once;
- the wall time of each (the swarm's: until the last host has the model), the ratio, the bytes
  the Hub served (and their ratio to the model's size), and where each host's bytes came from;
- then `--hosts` - 1 new hosts join the first, which has the model, at once: were it their one
  uploader they would take `--hosts` - 1 times as long as one host alone.

The target: the swarm within 1.5x the baseline, the Hub's bytes within 1.01x the model.
Usage: PYTHONPATH=. .venv/bin/python bench/pull_swarm.py [--mb 192] [--mbps 8] [--hosts 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solar_host.model_store.pacing import RateCap
from tests.fixtures.fakehub import FakeHub
from tests.fixtures.host import running_host
from tests.fixtures.peers import (
    hub_bytes,
    introduce,
    origins,
    peer_settings,
    pull,
    running_hosts,
    serving_model,
)

MB = 1_000_000


async def timed_pull(h, got: dict[str, int]) -> float:
    """The pull's wall time; where its bytes came from into `got`."""
    events: list[dict] = []
    began = time.perf_counter()
    await pull(h, events, timeout=3600)
    took = time.perf_counter() - began
    got.update(origins(events))
    return took


async def run(work: Path, hub: FakeHub, size: int, rate: float, n: int) -> None:
    # The hosts share this process, and so the loop's default executor their peer routes read
    # files in: one as large as theirs together stands for theirs.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=8 * n))

    def settings(name: str):
        return peer_settings(
            work / name, hub.url, progress_s=1.0, peer_max_upload_bytes_per_s=int(rate)
        )

    async with running_host(settings("solo")) as solo:
        before = hub_bytes(hub)
        alone = await timed_pull(solo, {})
        sent = hub_bytes(hub) - before
    print(
        f"  1 host alone from the Hub:   {alone:7.2f} s  {size / alone / MB:6.2f} MB/s   "
        f"Hub bytes {sent / size:.3f}x the model"
    )
    async with running_hosts(settings(f"h{i}") for i in range(n)) as hosts:
        introduce(hosts)  # every host names all the others (their ports are known now)
        before = hub_bytes(hub)
        froms: list[dict[str, int]] = [{} for _ in hosts]
        began = time.perf_counter()
        times = await asyncio.gather(*(timed_pull(h, o) for h, o in zip(hosts, froms, strict=True)))
        swarm = time.perf_counter() - began
        sent = hub_bytes(hub) - before
        print(
            f"  {n} hosts at once (a swarm):  {swarm:7.2f} s  {n * size / swarm / MB:6.2f} MB/s "
            f"in all   Hub bytes {sent / size:.3f}x the model (target <= 1.01x)"
        )
        print(f"  swarm / alone: {swarm / alone:.2f}x (target <= 1.5x)")
        show(hosts, times, froms)
        # Host 0 has the model now; n - 1 new hosts join it at once.
        async with running_hosts(settings(f"j{i}") for i in range(1, n)) as joiners:
            introduce(joiners, among=[hosts[0], *joiners])
            before = hub_bytes(hub)
            froms = [{} for _ in joiners]
            began = time.perf_counter()
            times = await asyncio.gather(
                *(timed_pull(h, o) for h, o in zip(joiners, froms, strict=True))
            )
            joined = time.perf_counter() - began
            sent = hub_bytes(hub) - before
            print(
                f"  {n - 1} hosts join one that has it: {joined:7.2f} s "
                f"({joined / alone:.2f}x alone; {n - 1:d}x alone if it were the one uploader)"
                f"   Hub bytes {sent / size:.3f}x"
            )
            show([hosts[0], *joiners], [0.0, *times], [{}, *froms], skip_first=True)


def show(hosts, times, origins, *, skip_first: bool = False) -> None:
    names = {h.url: f"h{i}" for i, h in enumerate(hosts)}
    for i, (t, got) in enumerate(zip(times, origins, strict=True)):
        if skip_first and i == 0:
            continue
        parts = ", ".join(
            f"{names.get(k.removeprefix('peer '), k)} {v / MB:.0f}"
            for k, v in sorted(got.items(), key=lambda kv: -kv[1])
        )
        print(f"    h{i}: {t:6.2f} s   MB from: {parts}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=192, help="model size in MB (10^6 bytes)")
    ap.add_argument("--mbps", type=float, default=8.0, help="the Hub's and each upload's cap, MB/s")
    ap.add_argument("--hosts", type=int, default=8)
    args = ap.parse_args()
    size = args.mb * MB
    rate = args.mbps * MB
    with (
        tempfile.TemporaryDirectory(prefix="pull-swarm-") as tmp,
        serving_model(Path(tmp) / "hub", size) as hub,
    ):
        hub.total = RateCap(rate)
        print(f"model {args.mb} MB; the Hub's uplink and each host's upload at {args.mbps} MB/s")
        asyncio.run(run(Path(tmp), hub, size, rate, args.hosts))


if __name__ == "__main__":
    main()

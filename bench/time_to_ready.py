"""Time from "start" to "serving": the host's POST /instances/{id}/start against spawning the
same llama-server command directly and polling /health.

Prints both medians, their ratio and the median of the pairs' differences (target: the host
at most 5 ms over), then each start in segments with the same marks on both sides (the
backend's first log write, seen by inotify, and its first /health 200 to a 1 ms poll), so the
host's own cost shows apart from the backend's loading, whose swings on a loaded machine swamp
the pairs' difference. Then each step of the host's start path timed in-process on this
checkout (the roots check and preflight, the command line, the confinement policy, the spawn
confined against unconfined, the proof of the listener) and its share of the host's own cost.

    .venv/bin/python bench/time_to_ready.py [--runs 10]

`--root DIR` runs another tree's host (bench/hosts.py; bench/compare_revisions.py pairs two).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import select
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hosts import add_tree_args, print_result, tree_host  # noqa: E402
from solar_host.backends.base import LaunchContext  # noqa: E402
from solar_host.backends.llamacpp import BACKEND  # noqa: E402
from solar_host.backends.llamacpp_config import LlamaCppConfig  # noqa: E402
from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf  # noqa: E402
from tests.fixtures.host import free_port  # noqa: E402

KEY = "bench-key-0123456789abcdef"
_IN_MODIFY = 0x2
_EVENT = struct.Struct("iIII")


class LogClock:
    """When each backend log in a directory was first written to, seen by inotify from a
    thread of the bench. What comes before a backend's first write is the starter's own (the
    host's request, checks and spawn; the bare script's Popen); what comes after is the
    backend's loading plus the starter's readiness check and answer. (Its ready line is no
    mark: llama-server logs from a thread of its own, and that line can land after /health
    answers, or not before it is stopped.)"""

    def __init__(self, directory: Path) -> None:
        self.first: dict[str, float] = {}
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_CLOEXEC)
        if self._fd < 0 or libc.inotify_add_watch(self._fd, os.fsencode(directory), _IN_MODIFY) < 0:
            raise OSError(ctypes.get_errno(), "inotify")
        self._stop = os.pipe()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self._fd, self._stop[0]], [], [])
            now = time.monotonic()
            if self._stop[0] in ready:
                return
            buf = os.read(self._fd, 65536)
            at = 0
            while at < len(buf):
                _wd, _mask, _cookie, n = _EVENT.unpack_from(buf, at)
                name = buf[at + _EVENT.size : at + _EVENT.size + n].rstrip(b"\0").decode()
                at += _EVENT.size + n
                self.first.setdefault(name, now)

    def close(self) -> None:
        os.write(self._stop[1], b"x")
        self._thread.join(5)
        for fd in (self._fd, *self._stop):
            os.close(fd)

    def newest(self) -> str:
        """The file first written to last (the start just timed)."""
        return max(self.first, key=self.first.__getitem__)


def direct_once(binary: str, model: Path, log: Path, poll_s: float = 0.001) -> tuple[float, float]:
    """Spawn the command the host would build, poll /health every `poll_s` until 200; the
    clock at the spawn and at the 200.

    The poll is tight (1 ms by default) so that the baseline is close to the moment the
    backend can first answer: a coarser one (5 ms before 2026-12-07) adds half its period to
    the baseline on average and hides as much of the host's own cost."""
    config = LlamaCppConfig(alias="bench:tiny", model=str(model), ctx_size=512, host="127.0.0.1")
    port = free_port()
    ctx = LaunchContext(
        instance_id="bench",
        port=port,
        host_api_key=KEY,
        models_dir=log.parent,
        llama_server_bin=binary,
    )
    spec = BACKEND.launch(config, ctx)
    env = {**os.environ, **spec.env}
    url = f"http://127.0.0.1:{port}/health"
    c = httpx.Client(timeout=1.0)  # ready before the clock starts, as the host's client is
    t0 = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            spec.argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while True:
            try:
                if c.get(url).status_code == 200:
                    return t0, time.monotonic()
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("llama-server exited")
            time.sleep(poll_s)
    finally:
        c.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def step_runs(binary: str, model: Path, tmp: Path, runs: int) -> dict[str, list[float]]:
    """The host's start path step by step, in this process, as supervisor._attempt runs it
    (the same functions, the host's settings shape, BACKEND_READ_CONFINEMENT=required)."""
    from solar_host.backends.base import HostFacts
    from solar_host.instances import launch, ownership
    from solar_host.instances import process as procs
    from solar_host.settings import Settings

    settings = Settings(
        api_key=KEY,
        config_file=tmp / "steps" / "config.json",
        log_dir=tmp / "steps" / "logs",
        models_dir=model.parent,
        jobs_dir=tmp / "steps" / "jobs",
        llama_server_bin=binary,
        backend_read_confinement="required",
    )
    facts = HostFacts(gpu_type="cpu", llama_server_bin=binary)
    config = LlamaCppConfig(alias="bench:tiny", model=str(model), ctx_size=512, host="127.0.0.1")
    steps: dict[str, list[float]] = {}

    def lap(name: str, since: float) -> float:
        now = time.monotonic()
        steps.setdefault(name, []).append(now - since)
        return now

    for i in range(runs):
        port = free_port()
        t = time.monotonic()
        BACKEND.capabilities(config, settings.models_dir)
        t = lap("capabilities", t)
        ctx = launch.launch_context(settings, "bench", port, KEY, facts)
        spec = launch.prepare(BACKEND, config, ctx, settings, facts)
        t = lap("roots + preflight + argv", t)
        env = launch.environment(
            spec, settings, marker="bench-marker", port=port, key_hash="h", spawn_id=f"s{i}"
        )
        t = lap("environment", t)
        policy = launch.access_policy(spec, env, settings)  # as launch.spawn works it out
        t = lap("confinement policy", t)
        proc = procs.spawn(
            spec.argv, env, tmp / "steps" / "b.log", settings.models_dir, policy, "required"
        )
        confined = time.monotonic() - t
        try:
            with httpx.Client(timeout=1.0) as c:
                for _ in range(2000):
                    try:
                        if c.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.005)
            t = time.monotonic()
            # What health.prove_listener calls once the backend answers.
            owned = ownership.owns_port(proc.identity, port, proc.marker)
            procs.note_listener(proc, port)
            t = lap("listener proof", t)
            assert owned, "the bench's backend does not own its port"
        finally:
            asyncio.run(procs.terminate(proc, 5.0))
        t = time.monotonic()
        bare = procs.spawn(spec.argv, env, tmp / "steps" / "u.log", settings.models_dir)
        extra = confined - (time.monotonic() - t)
        steps.setdefault("spawn, confined, less a bare spawn", []).append(extra)
        asyncio.run(procs.terminate(bare, 5.0))
    return steps


class Prober:
    """Polls a backend's /health every `poll_s` from a thread of the bench while the host
    starts it: the first 200 is when the backend could answer, the same mark the direct side's
    own poll gives, so what the host takes after it shows apart from the backend's loading."""

    def __init__(self, port: int, poll_s: float) -> None:
        self.url = f"http://127.0.0.1:{port}/health"
        self.poll_s = poll_s
        self.answered: float | None = None
        self._done = threading.Event()
        self._client = httpx.Client(timeout=1.0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                if self._client.get(self.url).status_code == 200:
                    self.answered = time.monotonic()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)

    def stop(self) -> float | None:
        self._done.set()
        self._thread.join(5)
        self._client.close()
        return self.answered


class Side:
    """One side's starts: the whole time of each, and its segments (LogClock, Prober)."""

    def __init__(self, clock: LogClock) -> None:
        self.clock = clock
        self.total: list[float] = []
        self.segments: dict[str, list[float]] = {}

    def add(self, t0: float, t1: float, before: set[str], answered: float | None = None) -> None:
        """A start timed from `t0` to `t1`; `before`: the logs there were before it;
        `answered`: when the backend first answered (None: `t1`, the direct side's mark)."""
        self.total.append(t1 - t0)
        new = set(self.clock.first) - before
        if len(new) != 1:
            return  # its first write not seen (or two starts): no segments for this one
        first = self.clock.first[new.pop()]
        answered = t1 if answered is None else answered
        for key, value in (
            ("before its first write", first - t0),
            ("first write to /health 200", answered - first),
            ("after /health 200", t1 - answered),
        ):
            self.segments.setdefault(key, []).append(value)


def paired_runs(
    binary: str, model: Path, tmp: Path, runs: int, args: argparse.Namespace
) -> tuple[Side, Side]:
    """`runs` pairs, each a direct spawn and a host start right after one another (which goes
    first alternates), so a machine that gets busier or quieter weighs on both sides of a pair
    (the host's cost is read from each pair's difference: on a loaded machine the backend's
    own time swings tenfold). The host runs with BACKEND_READ_CONFINEMENT=required: its
    backends are confined, or the start fails."""
    (tmp / "host" / "logs").mkdir(parents=True, exist_ok=True)
    (tmp / "direct").mkdir(exist_ok=True)
    direct, host_side = Side(LogClock(tmp / "direct")), Side(LogClock(tmp / "host" / "logs"))
    env = {"LLAMA_SERVER_BIN": binary, "BACKEND_READ_CONFINEMENT": "required"}

    def bare(i: int) -> None:
        before = set(direct.clock.first)
        log = tmp / "direct" / f"{i}.log"
        direct.add(*direct_once(binary, model, log, args.poll_ms / 1000), before)

    try:
        with tree_host(tmp / "host", args, env=env, api_key=KEY) as host:
            host.start()
            with host.client() as c:
                r = c.post(
                    "/instances",
                    json={
                        "config": {
                            "alias": "bench:tiny",
                            "model": str(model),
                            "ctx_size": 512,
                            "host": "127.0.0.1",
                        }
                    },
                )
                r.raise_for_status()
                iid = r.json()["instance"]["id"]
                # A first start, untimed (the direct side was warmed too): the port it gets is
                # reclaimed by each start after it (ruling 24), so the prober knows it.
                r = c.post(f"/instances/{iid}/start")
                r.raise_for_status()
                port = r.json()["instance"]["port"]
                c.post(f"/instances/{iid}/stop").raise_for_status()
                for i in range(runs):
                    if i % 2 == 0:
                        bare(i)
                    before = set(host_side.clock.first)
                    prober = Prober(port, args.poll_ms / 1000)
                    t0 = time.monotonic()
                    r = c.post(f"/instances/{iid}/start")
                    t1 = time.monotonic()
                    r.raise_for_status()
                    answered = prober.stop()
                    if r.json()["instance"]["port"] != port:
                        answered = None  # not the port probed: no segments from this one
                    host_side.add(t0, t1, before, answered if answered else float("nan"))
                    c.post(f"/instances/{iid}/stop").raise_for_status()
                    if i % 2 == 1:
                        bare(i)
    finally:
        direct.clock.close()
        host_side.clock.close()
    return direct, host_side


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument(
        "--poll-ms", type=float, default=1.0, help="the direct baseline's /health poll period"
    )
    add_tree_args(ap)
    args = ap.parse_args()
    binary = llama_server_binary()
    with tempfile.TemporaryDirectory(prefix="ttr-") as d:
        tmp = Path(d)
        # Inside the host's MODELS_DIR: a model outside the roots is refused (ruling 12).
        (tmp / "host" / "models").mkdir(parents=True)
        model = write_tiny_gguf(tmp / "host" / "models" / "tiny.gguf")
        direct_once(binary, model, tmp / "warm.log")  # warm the page cache
        direct_side, host_side = paired_runs(binary, model, tmp, args.runs, args)
        steps = step_runs(binary, model, tmp, args.runs)
    direct, host = direct_side.total, host_side.total
    d_med, h_med = statistics.median(direct), statistics.median(host)
    over = sorted(h - d for h, d in zip(host, direct, strict=True))
    o_med = statistics.median(over)
    print(f"llama-server binary: {binary}")
    print(f"load average {os.getloadavg()[0]:.2f}; direct polls /health every {args.poll_ms} ms")
    print(f"{'':24}{'median':>10}{'min':>10}{'max':>10}")
    print(
        f"{'direct spawn + /health':24}{d_med * 1000:>9.1f}ms{min(direct) * 1000:>9.1f}ms"
        f"{max(direct) * 1000:>9.1f}ms"
    )
    print(
        f"{'host start -> 200':24}{h_med * 1000:>9.1f}ms{min(host) * 1000:>9.1f}ms"
        f"{max(host) * 1000:>9.1f}ms"
    )
    print(f"ratio host/direct: {h_med / d_med:.3f}   (target <= 1.05)")
    print(
        f"host over direct, median of the pairs: {o_med * 1000:+.1f} ms (quartiles "
        f"{over[len(over) // 4] * 1000:+.1f} to {over[(3 * len(over)) // 4] * 1000:+.1f} ms; "
        "target <= +5 ms)"
    )
    print("\nwhere a start's time goes (medians; the backend's first log write seen by inotify):")
    print(f"  {'':30}{'direct':>9}{'host':>9}{'host-direct':>13}")
    # "after /health 200" is 0 on the direct side by definition (its own poll is the mark).
    seg: dict[str, float] = {}
    for key, d_values in direct_side.segments.items():
        h_values = [v for v in host_side.segments[key] if v == v]  # NaN: not probed
        dm, hm = statistics.median(d_values), statistics.median(h_values)
        seg[key] = hm - dm
        print(f"  {key:30}{dm * 1000:>7.1f}ms{hm * 1000:>7.1f}ms{(hm - dm) * 1000:>+11.1f}ms")
    # The host's own cost without the backend's loading, whose swings (tenfold on a loaded
    # machine) dominate the pairs' difference: what it adds before the backend runs and after
    # the backend answers.
    own = seg["before its first write"] + seg["after /health 200"]
    print(f"  {'the host, before + after':30}{'':18}{own * 1000:>+11.1f}ms")
    print(
        "\nthe host's own cost step by step (each step timed in-process on this checkout,"
        "\nconfinement required; the rest is the host's own cost less the steps):"
    )
    mine = {k: statistics.median(v) for k, v in steps.items()}
    mine["the rest: request, admission, config.json saves, thread hand-offs"] = own - sum(
        mine.values()
    )
    for name, med in mine.items():
        print(f"  {name:66}{med * 1000:>7.2f}ms{med / own:>8.0%}")
    print_result(
        args,
        {
            "direct_ms": d_med * 1000,
            "host_ms": h_med * 1000,
            "over_ms": o_med * 1000,
            "own_ms": own * 1000,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

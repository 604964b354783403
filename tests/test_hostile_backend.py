"""Hostile and broken backends (tests/fixtures/hostile_backend.py), with real processes and real
sockets: workers that leave the backend's session and wipe the environment marker (as
setproctitle does), and backends that write their log faster than the host can read it.

Every process a hostile backend starts is recorded in its pids file and killed by pid at the
end: one that wiped its environment is found by no tag.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from solar_host.instances import ownership
from solar_host.instances.logs import READ_CHUNK
from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

HOSTILE = str(Path(__file__).with_name("fixtures") / "hostile_backend.py")


def alive(pid: int) -> bool:
    return ownership.identity_of(pid) is not None


def pids_in(path: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            role, pid = line.split()
            out.setdefault(role, []).append(int(pid))
    return out


@contextlib.contextmanager
def hostile_host(tmp: Path, **env: str) -> Iterator[HostProc]:
    with HostProc(tmp / "h", env={"STOP_GRACE_S": "2", **env}) as h:
        try:
            yield h
        finally:
            h.kill()
            for f in h.tmp.glob("*.pids"):
                for pids in pids_in(f).values():
                    for pid in pids:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)


def sizes_in(folder: Path, pattern: str) -> dict[str, int]:
    """Sizes of the files matching `pattern` (one rotated away meanwhile is left out)."""
    out = {}
    for f in folder.glob(pattern):
        with contextlib.suppress(OSError):
            out[f.name] = f.stat().st_size
    return out


def create(c: httpx.Client, h: HostProc, alias: str, *opts: str) -> tuple[str, Path]:
    pids = h.tmp / f"{alias}.pids"
    wrapper = [sys.executable, HOSTILE, *opts, "--pids", str(pids), "--"]
    cfg = script_config(h.tmp, alias=alias, fake_wrapper=wrapper)
    r = c.post("/instances", json={"config": cfg})
    assert r.status_code == 200, r.text
    return r.json()["instance"]["id"], pids


def running(c: httpx.Client, iid: str, what: str, within_s: float = 30) -> dict[str, Any]:
    """The instance once it is running (after a restart or a re-adoption)."""
    return wait_for(
        lambda: (i := c.get(f"/instances/{iid}").json())["status"] == "running" and i,
        within_s,
        what,
    )


def start(c: httpx.Client, iid: str) -> dict[str, Any]:
    r = c.post(f"/instances/{iid}/start")
    assert r.status_code == 200, r.text
    return r.json()["instance"]


def exec_while_no_host_ran(h: HostProc) -> tuple[str, Path, dict[str, Any]]:
    """A running backend that exec'd a program listening nowhere (same pid, start time and
    marker) while its host was SIGKILLed, and the host started again: (instance id, its pids
    file, the instance as first started)."""
    h.start()
    with h.client() as c:
        iid, pids = create(c, h, "exec", "--exec-after", "0.5")
        first = start(c, iid)
        wait_for(lambda: ownership.cmdline_of(first["pid"])[:1] == ["sleep"], 10, "the exec")
    h.kill()
    h.start()
    return iid, pids, first


def worker_of(pids: Path) -> int:
    return wait_for(lambda: pids_in(pids).get("worker", [None])[0], 10, "the worker")


@pytest.mark.parametrize("how", ["setsid", "double-fork"])
def test_a_worker_that_left_the_session_and_wiped_its_marker_does_not_survive_a_stop(
    tmp_path: Path, how: str
) -> None:
    with hostile_host(tmp_path) as h:
        h.start()
        with h.client() as c:
            iid, pids = create(c, h, "esc", "--worker", how, "--wipe-env", "worker")
            inst = start(c, iid)
            worker = worker_of(pids)
            assert ownership.marker_of(worker) is None  # the marker cannot find it
            assert worker in ownership.port_holders(inst["port"])
            r = c.post(f"/instances/{iid}/stop")
            assert r.status_code == 200 and r.json()["instance"]["status"] == "stopped"
            wait_for(lambda: not alive(worker), 10, "the escaped worker to be ended")
            assert ownership.port_holders(inst["port"]) == []
            assert r.json()["instance"]["error_message"] is None


def test_a_worker_left_by_a_crash_is_ended_before_the_restart(tmp_path: Path) -> None:
    with hostile_host(tmp_path) as h:
        h.start()
        with h.client() as c:
            iid, pids = create(
                c, h, "crash", "--worker", "setsid", "--wipe-env", "worker", "--exit-after", "1"
            )
            first = start(c, iid)
            worker = worker_of(pids)
            wait_for(
                lambda: (
                    (i := c.get(f"/instances/{iid}").json())["status"] == "running"
                    and i["pid"] != first["pid"]
                ),
                30,
                "the crash restart",
            )
            wait_for(lambda: not alive(worker), 10, "the old worker to be ended")
            c.post(f"/instances/{iid}/stop")


def test_what_a_backend_left_holding_its_port_while_no_host_ran_is_named(tmp_path: Path) -> None:
    """A worker that left the session, wiped its marker and outlived its backend while the host
    was down cannot be proved ours: it is not signalled, but the host says who holds the port,
    and the restart is placed on another one."""
    with hostile_host(tmp_path) as h:
        h.start()
        with h.client() as c:
            iid, pids = create(c, h, "orphan", "--worker", "setsid", "--wipe-env", "worker")
            inst = start(c, iid)
            worker = worker_of(pids)
        h.kill()
        os.kill(inst["pid"], signal.SIGKILL)
        wait_for(lambda: not alive(inst["pid"]), 10, "the backend to die")
        h.start()
        with h.client() as c:
            again = running(c, iid, "the restart at boot")
            assert again["port"] != inst["port"]
            assert alive(worker)
            wait_for(lambda: f"still listened on by {worker}" in h.log(), 10, "the host to name it")
            c.post(f"/instances/{iid}/stop")


def test_a_backend_writing_faster_than_the_host_reads_keeps_its_log_bounded(
    tmp_path: Path,
) -> None:
    limit = 4 * 1024 * 1024
    bound = limit + READ_CHUNK
    with hostile_host(tmp_path, LOG_FILE_MAX_BYTES=str(limit)) as h:
        h.start()
        with h.client() as c:
            iid, _ = create(c, h, "flood", "--stderr-flood", "4")
            start(c, iid)
            logs = h.tmp / "logs"
            biggest = 0
            samples: list[int] = []
            end = time.monotonic() + 5
            while time.monotonic() < end:
                for f in logs.glob("flood_*"):
                    with contextlib.suppress(OSError):
                        size = f.stat().st_size
                        biggest = max(biggest, size)
                        if f.suffix == ".log":
                            samples.append(size)
                time.sleep(0.05)
            # The flood is over (4 s); its last line reaches the file once the host rotated
            # it (what the relay dropped is said in the file: tests/test_log_relay.py).
            wait_for(
                lambda: "after the flood" in json.dumps(c.get(f"/instances/{iid}/logs").json()),
                30,
                "the flood's last line",
            )
            # A stop answers, and the API with it.
            r = c.post(f"/instances/{iid}/stop")
            assert r.status_code == 200
            samples.sort()
            print(
                f"log file sampled every 50 ms in a flood: peak {biggest / 2**20:.2f} MiB, "
                f"median {samples[len(samples) // 2] / 2**20:.2f} MiB"
            )
            # Its relay is the file's one writer and never writes past the bound, however
            # fast the backend writes and however late the host looks: nor does a rotation
            # copy more into a generation.
            assert biggest <= bound, biggest
            sizes = sizes_in(logs, "flood_*")
            assert len(sizes) <= 4 and all(n <= bound for n in sizes.values()), sizes
            assert c.get("/health").status_code == 200

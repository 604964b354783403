"""Bounded logs (issue 17): backend log files rotate by size under a real O_APPEND writer,
one long line is cut with a marker (ring, REST, WebSocket), GET .../logs takes `limit`, and
the host's memory stays bounded whatever a backend prints."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
from websockets.asyncio.client import connect as ws_connect

from solar_host.backends.registry import BackendRegistry
from solar_host.instances.logs import InotifyHub, LogFollower, count_lines
from solar_host.platform.log_limits import CUT_MARKER, RotatingWriter, cut_marker
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import ScriptBackend, script_config

WRITER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
n = int(sys.argv[2])
for i in range(n):
    os.write(fd, b"line %08d " % i + b"y" * 90 + b"\\n")
    if i % 500 == 0:
        time.sleep(0.001)
os.write(fd, b"WRITER_DONE\\n")
"""


async def test_rotation_under_a_real_appending_writer(tmp_path: Path) -> None:
    """The backend's way of writing (its own O_APPEND fd); the host copies out and truncates."""
    path = tmp_path / "a_x_1.log"
    path.touch()
    got: list[str] = []
    moved: list[int] = []
    hub = InotifyHub()
    max_bytes = 256 * 1024
    follower = LogFollower(
        path, got.extend, hub, max_file_bytes=max_bytes, generations=2, on_rotate=moved.append
    )
    follower.hot_polling = True
    follower.start()
    n = 40_000  # ~4 MB: about 15 rotations
    sizes: list[int] = []
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(n)])  # noqa: ASYNC220
    try:
        deadline = time.monotonic() + 120
        while not (got and got[-1] == "WRITER_DONE"):
            assert time.monotonic() < deadline, (len(got), got[-1:])
            sizes.append(path.stat().st_size)
            await asyncio.sleep(0.01)
    finally:
        writer.wait(30)
        await follower.stop(flush=True)
        hub.close()
    numbers = [int(line.split()[1]) for line in got[:-1]]
    assert numbers == sorted(set(numbers)), "lines out of order or repeated"
    lost = n - len(numbers)
    assert follower.rotations >= 5, follower.rotations
    # Only the writes between the last copy and the truncate (two syscalls) can be lost.
    assert lost <= follower.rotations, (lost, follower.rotations)
    assert max(sizes) < max_bytes + 4 * 1024 * 1024, max(sizes)
    gens = sorted(p.name for p in tmp_path.iterdir())  # noqa: ASYNC240
    assert gens == ["a_x_1.log", "a_x_1.log.1", "a_x_1.log.2"], gens
    # Re-adoption's count: lines moved out + lines in the file = lines delivered.
    assert sum(moved) + count_lines(path)[0] == len(got)
    # The newest generation and the current file together are the end of what was delivered
    # (a rotation may cut the file inside a line; the reader never sees that seam).
    joined = (tmp_path / "a_x_1.log.1").read_bytes() + path.read_bytes()
    tail = [x.decode() for x in joined.split(b"\n")[1:-1]]
    assert tail and got[-len(tail) :] == tail
    print(f"rotations={follower.rotations} lost_lines={lost} max_file={max(sizes)}")


def test_step_log_writer_rotates(tmp_path: Path) -> None:
    path = tmp_path / "step.log"
    w = RotatingWriter(path, 10_000, 2)
    for i in range(3000):
        w.write(b"step line %05d\n" % i)
    w.close()
    files = sorted(tmp_path.iterdir())
    assert [p.name for p in files] == ["step.log", "step.log.1", "step.log.2"]
    assert all(p.stat().st_size <= 10_000 for p in files)
    assert path.read_bytes().endswith(b"step line 02999\n")


async def test_long_lines_are_cut_with_a_marker_everywhere(tmp_path: Path) -> None:
    limit = 1024
    marker = cut_marker(limit)
    settings = host_settings(tmp_path, log_line_max_bytes=limit)
    async with running_host(settings, backends=BackendRegistry([ScriptBackend()])) as h:
        cfg = script_config(tmp_path, "--flood-after-ready", "5", "--pad", str(200_000))
        iid = (await h.client.post("/instances", json={"config": cfg})).json()["instance"]["id"]
        ws_url = h.url.replace("http://", "ws://") + f"/instances/{iid}/logs"
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while True:
            logs = (await h.client.get(f"/instances/{iid}/logs")).json()
            if any(e["line"].startswith("FLOOD_DONE") for e in logs):
                break
            assert time.monotonic() < deadline, logs[-3:]
            await asyncio.sleep(0.1)
        flood = [e["line"] for e in logs if e["line"].startswith("flood line")]
        assert len(flood) == 5, [x[:40] for x in flood]  # the rest of a cut line is dropped
        for line in flood:
            assert line.endswith(marker) and len(line.encode()) == limit + len(marker)
        limited = (await h.client.get(f"/instances/{iid}/logs", params={"limit": 2})).json()
        assert [e["seq"] for e in limited] == [e["seq"] for e in logs[-2:]]
        bad = await h.client.get(f"/instances/{iid}/logs", params={"limit": 0})
        assert bad.status_code == 422
        async with ws_connect(ws_url, additional_headers={"X-API-Key": API_KEY}) as ws:
            streamed: list[str] = []
            while not any(x.startswith("FLOOD_DONE") for x in streamed):
                msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if "line" in msg:
                    streamed.append(msg["line"])
        assert [x for x in streamed if x.startswith("flood line")] == flood
        await h.client.post(f"/instances/{iid}/stop")
    # After the stop, the answer comes from the file: cut the same way.
    async with running_host(settings, backends=BackendRegistry([ScriptBackend()])) as h:
        after = (await h.client.get(f"/instances/{iid}/logs")).json()
        cut = [e["line"] for e in after if e["line"].startswith("flood line")]
        assert cut and all(x.endswith(marker) for x in cut)
    assert CUT_MARKER.format(limit=limit) == marker


def test_host_memory_and_disk_stay_bounded_under_a_flood(tmp_path: Path) -> None:
    """2,000 lines of 64 KiB (128 MiB) from one backend: RSS, log files and answers bounded."""
    mib = 1024 * 1024
    env = {"LOG_FILE_MAX_BYTES": str(4 * mib), "LOG_FILE_GENERATIONS": "2"}
    with HostProc(tmp_path / "host", backend="script", env=env) as host:
        host.start()
        rss_before = psutil.Process(host.pid).memory_info().rss
        with host.client(timeout=120) as c:
            cfg = script_config(
                tmp_path / "host", "--flood-after-ready", "2000", "--pad", str(64 * 1024)
            )
            iid = c.post("/instances", json={"config": cfg}).json()["instance"]["id"]
            assert c.post(f"/instances/{iid}/start").status_code == 200
            deadline = time.monotonic() + 240
            peak = 0
            while True:
                peak = max(peak, psutil.Process(host.pid).memory_info().rss)
                last = c.get(f"/instances/{iid}/logs", params={"limit": 1}).json()
                if last and last[0]["line"].startswith("FLOOD_DONE"):
                    break
                assert time.monotonic() < deadline, last
                time.sleep(0.2)
            answer = c.get(f"/instances/{iid}/logs")
            peak = max(peak, psutil.Process(host.pid).memory_info().rss)
            c.post(f"/instances/{iid}/stop")
        logs = list((tmp_path / "host" / "logs").glob("*.log*"))  # not the lock
    growth = peak - rss_before
    print(f"rss_before={rss_before >> 20} MiB peak={peak >> 20} MiB answer={len(answer.content)}")
    # The ring holds 1,000 lines of at most 16 KiB: about 16 MiB, whatever was printed.
    assert growth < 96 * 1024 * 1024, growth >> 20
    assert len(answer.content) < 1000 * (16 * 1024 + 200), len(answer.content)
    assert len(logs) <= 3, [p.name for p in logs]
    # A file is at most the limit plus the rotation's chase (16 MiB) plus one read: 3 files
    # hold well under the 128 MiB printed.
    sizes = [p.stat().st_size for p in logs]
    assert all(s < 4 * mib + 16 * mib + mib for s in sizes), sizes
    assert sum(sizes) < 64 * mib, sizes

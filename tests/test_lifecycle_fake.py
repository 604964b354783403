"""Instance lifecycle through real HTTP against a host in a temp dir, with the scripted backend."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from solar_host.backends.registry import BackendRegistry
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config


def registry(health: bool = True) -> BackendRegistry:
    return BackendRegistry([ScriptBackend(health=health)])


def cfg(tmp_path: Path, *fake_args: str, alias: str = "fake:1b", **extra: object) -> dict:
    return script_config(tmp_path, *fake_args, alias=alias, **extra)


async def create(h, config: dict, **top: object) -> str:
    r = await h.client.post("/instances", json={"config": config, **top})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["instance"]["status"] == "stopped"
    return body["instance"]["id"]


async def test_start_stop_restart(tmp_path: Path) -> None:
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--ready-after", "0.2"))
        t0 = time.monotonic()
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        inst = r.json()["instance"]
        assert inst["status"] == "running"
        assert inst["pid"] and inst["port"]
        assert time.monotonic() - t0 < 5
        proc = psutil.Process(inst["pid"])
        assert "fake_backend.py" in " ".join(proc.cmdline())
        assert os.getpgid(inst["pid"]) == inst["pid"]  # own process group
        # second start shares the outcome, spawns nothing
        r2 = await h.client.post(f"/instances/{iid}/start")
        assert r2.json()["instance"]["pid"] == inst["pid"]
        logs = (await h.client.get(f"/instances/{iid}/logs")).json()
        assert any("listening" in e["line"] for e in logs)
        assert [e["seq"] for e in logs] == list(range(len(logs)))
        r = await h.client.post(f"/instances/{iid}/stop")
        assert r.status_code == 200 and r.json()["instance"]["status"] == "stopped"
        assert (
            not psutil.pid_exists(inst["pid"]) or psutil.Process(inst["pid"]).status() == "zombie"
        )
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200
        r = await h.client.post(f"/instances/{iid}/restart")
        assert r.status_code == 200 and r.json()["instance"]["status"] == "running"
        logs2 = (await h.client.get(f"/instances/{iid}/logs")).json()
        assert logs2[-1]["seq"] > logs[-1]["seq"]
        await h.client.post(f"/instances/{iid}/stop")
        assert (await h.client.delete(f"/instances/{iid}")).status_code == 200


async def test_concurrent_starts_share_one_process(tmp_path: Path) -> None:
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--ready-after", "0.5"))
        rs = await asyncio.gather(*(h.client.post(f"/instances/{iid}/start") for _ in range(5)))
        pids = {r.json()["instance"]["pid"] for r in rs}
        assert all(r.status_code == 200 for r in rs) and len(pids) == 1
        await h.client.post(f"/instances/{iid}/stop")


async def test_failed_start_is_structured_and_fast(tmp_path: Path) -> None:
    s = host_settings(tmp_path, max_retries=1)
    async with running_host(s, backends=registry()) as h:
        iid = await create(
            h, cfg(tmp_path, "--lines", "first,second", "--exit-after", "0", "--exit-code", "7")
        )
        t0 = time.monotonic()
        r = await h.client.post(f"/instances/{iid}/start")
        assert time.monotonic() - t0 < 5
        assert r.status_code == 500
        body = r.json()
        assert set(body) == {"detail", "instance_id", "exit_code", "log_tail"}
        assert "Process exited with code 7" in body["detail"]
        assert body["exit_code"] == 7 and body["instance_id"] == iid
        assert "second" in body["log_tail"]
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "failed" and inst["retry_count"] == 2
        # start from failed works; stop of a failed instance is 200
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200


async def test_readiness_timeout(tmp_path: Path) -> None:
    s = host_settings(tmp_path, max_retries=0, instance_ready_timeout_s=1.0)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--no-health", "--no-ready-line"))
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 500
        assert "did not report readiness" in r.json()["detail"]


async def test_crash_is_detected_and_restarted(tmp_path: Path) -> None:
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, cfg(tmp_path))
        pid = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]["pid"]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        new_pid = None
        while time.monotonic() - t0 < 10:
            inst = (await h.client.get(f"/instances/{iid}")).json()
            if inst["status"] == "running" and inst["pid"] != pid:
                new_pid = inst["pid"]
                break
            await asyncio.sleep(0.05)
        assert new_pid, "crashed backend was not restarted"
        await h.client.post(f"/instances/{iid}/stop")


async def test_intent_managed_crash_waits_for_control(tmp_path: Path) -> None:
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, cfg(tmp_path), managed_by="intent", intent_id="i-1")
        pid = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]["pid"]
        os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            inst = (await h.client.get(f"/instances/{iid}")).json()
            if inst["status"] == "failed":
                break
            await asyncio.sleep(0.05)
        assert inst["status"] == "failed"
        assert "exit code: -9" in inst["error_message"]
        await asyncio.sleep(1.0)
        assert (await h.client.get(f"/instances/{iid}")).json()["status"] == "failed"
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200
        await h.client.post(f"/instances/{iid}/stop")


async def test_stop_kills_sigterm_ignoring_backend(tmp_path: Path) -> None:
    s = host_settings(tmp_path, stop_grace_s=0.5)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--ignore-sigterm"))
        pid = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]["pid"]
        t0 = time.monotonic()
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200
        assert time.monotonic() - t0 < 3
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        # Said where the operator looks, not only in the host's log.
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "stopped", inst
        assert inst["error_message"] == "stopped, but it ignored SIGTERM for 0.5s and was killed"
        # A backend that honours SIGTERM stops with nothing to say.
        await h.client.put(f"/instances/{iid}", json={"config": cfg(tmp_path)})
        await h.client.post(f"/instances/{iid}/start")
        await h.client.post(f"/instances/{iid}/stop")
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "stopped" and inst["error_message"] is None, inst


@pytest.mark.parametrize("keep", [True])
async def test_backend_survives_host_and_is_readopted(tmp_path: Path, keep: bool) -> None:
    s = host_settings(tmp_path, keep_backends_on_shutdown=keep)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--flood-after-ready", "10"))
        pid = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]["pid"]
        await asyncio.sleep(0.3)
        seq_before = (await h.client.get(f"/instances/{iid}/logs")).json()[-1]["seq"]
    assert psutil.pid_exists(pid)
    async with running_host(s, backends=registry()) as h:
        await asyncio.wait_for(h.instances.boot_done.wait(), 10)
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "running" and inst["pid"] == pid
        logs = (await h.client.get(f"/instances/{iid}/logs")).json()
        assert logs[-1]["seq"] == seq_before
        await h.client.post(f"/instances/{iid}/stop")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


async def test_explicit_port_in_use_is_409(tmp_path: Path) -> None:
    import socket

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    try:
        async with running_host(host_settings(tmp_path), backends=registry()) as h:
            iid = await create(h, cfg(tmp_path, host="127.0.0.1", port=port))
            r = await h.client.post(f"/instances/{iid}/start")
            assert r.status_code == 409, r.text
            assert str(port) in r.json()["detail"]
    finally:
        blocker.close()


async def test_a_quick_restart_never_reads_the_previous_attempts_log(tmp_path: Path) -> None:
    """Two attempts in the same second get separate log files: the second must not take the
    first process's ready line for its own."""
    s = host_settings(tmp_path, max_retries=0, instance_ready_timeout_s=1.0)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path))
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200
        r = await h.client.put(
            f"/instances/{iid}", json={"config": cfg(tmp_path, "--no-health", "--no-ready-line")}
        )
        assert r.status_code == 200
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 500 and "did not report readiness" in r.json()["detail"]
        files = list((tmp_path / "logs").glob(f"*_{iid}_*.log"))
        assert len(files) == 2


async def test_log_stream_replays_follows_and_ends_on_delete(tmp_path: Path) -> None:
    import json

    import websockets

    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--lines", "alpha,beta"))
        await h.client.post(f"/instances/{iid}/start")
        url = h.url.replace("http", "ws") + f"/instances/{iid}/logs"
        async with websockets.connect(url, additional_headers={"X-API-Key": s_key(h)}) as ws:
            first = json.loads(await ws.recv())
            assert set(first) == {"seq", "timestamp", "line"} and first["seq"] == 0
            assert first["line"] == "alpha"
            await h.client.post(f"/instances/{iid}/stop")
            assert (await h.client.delete(f"/instances/{iid}")).status_code == 200
            async with asyncio.timeout(5):
                with pytest.raises(websockets.ConnectionClosed):
                    while True:
                        await ws.recv()
        # since_seq skips what the client already has
        iid = await create(h, cfg(tmp_path, "--lines", "one,two,three"))
        await h.client.post(f"/instances/{iid}/start")
        url = h.url.replace("http", "ws") + f"/instances/{iid}/logs?since_seq=2"
        async with websockets.connect(url, additional_headers={"X-API-Key": s_key(h)}) as ws:
            assert json.loads(await ws.recv())["seq"] == 2
        await h.client.post(f"/instances/{iid}/stop")


def s_key(h) -> str:
    return h.host.api_key


async def test_client_behind_the_ring_gets_a_gap_marker(tmp_path: Path) -> None:
    import json

    import websockets

    s = host_settings(tmp_path, log_buffer_size=50)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--flood-after-ready", "500"))
        await h.client.post(f"/instances/{iid}/start")
        for _ in range(100):
            logs = (await h.client.get(f"/instances/{iid}/logs")).json()
            # From the ring (seqs past 0): until the follower delivered its first lines, GET
            # logs reads the file's tail, numbered from 0, and the log relay may have written
            # the whole flood before the follower's first look.
            if logs[-1]["line"].startswith("FLOOD_DONE") and logs[0]["seq"] > 0:
                break
            await asyncio.sleep(0.05)
        assert len(logs) == 50
        url = h.url.replace("http", "ws") + f"/instances/{iid}/logs?since_seq=0"
        async with websockets.connect(url, additional_headers={"X-API-Key": s_key(h)}) as ws:
            gap = json.loads(await ws.recv())
            assert gap == {"gap": {"from_seq": 0, "to_seq": logs[0]["seq"] - 1}}
            nxt = json.loads(await ws.recv())
            assert nxt["seq"] == logs[0]["seq"]
        await h.client.post(f"/instances/{iid}/stop")


async def test_closed_log_streams_of_a_quiet_instance_leave_nothing_behind(
    tmp_path: Path,
) -> None:
    """Each pass of a log stream waited on the ring's wake-up in a task of its own, and a
    socket that closed first left that task pending until the instance's next line: on a quiet
    instance a client reconnecting in a loop grew the host's memory without bound. A
    since_seq past the newest line made the stream skip every line until the count caught up."""
    import json

    import websockets

    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, cfg(tmp_path))
        url = h.url.replace("http", "ws") + f"/instances/{iid}/logs"
        headers = {"X-API-Key": s_key(h)}

        def waits() -> int:
            return sum("Event.wait" in repr(t.get_coro()) for t in asyncio.all_tasks())

        async def connect_and_close() -> None:
            async with websockets.connect(url, additional_headers=headers):
                pass

        before = waits()
        for _ in range(10):
            await asyncio.gather(*(connect_and_close() for _ in range(20)))
        for _ in range(100):  # the host notices the closes
            await asyncio.sleep(0.05)
            if waits() <= before:
                break
        assert waits() <= before, f"{waits() - before} waits left by closed streams"

        far = url + "?since_seq=1000000000000"
        async with websockets.connect(far, additional_headers=headers) as ws:
            await h.client.post(f"/instances/{iid}/start")
            line = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert line["seq"] == 0, line
        await h.client.post(f"/instances/{iid}/stop")


async def crash_looped(h, iid: str) -> dict:
    """The instance once the host gave up on its crash loop (10 s at most)."""
    for _ in range(200):
        inst = (await h.client.get(f"/instances/{iid}")).json()
        if inst["status"] == "failed" and "not restarting" in (inst["error_message"] or ""):
            return inst
        await asyncio.sleep(0.05)
    raise AssertionError(inst)


async def test_crash_loop_ends_in_failed_not_a_storm(tmp_path: Path) -> None:
    # MAX_RETRIES pinned: which ends count depends on it.
    s = host_settings(tmp_path, restart_backoff_s=0.05, restart_max_in_window=3, max_retries=2)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--exit-after", "0.3", "--exit-code", "3"))
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        sup = h.instances.supervisor(iid)
        inst = await crash_looped(h, iid)
        assert "crashed 3 times" in inst["error_message"]
        assert sup.counters["restarts"] == 2
        # A spawn that exits before the host has seen it ready (its 0.3 s can pass first, under
        # load) is a failed start attempt, retried within its start, not a crash. The loop
        # counted 3 ends: crashes of a ready backend, and restarts that ran out of attempts.
        records = (await h.client.get(f"/instances/{iid}/flight-records")).json()["records"]
        crashes = [r for r in records if r["phase"] == "running"]
        assert sup.counters["crashes"] == len(crashes), records
        assert len([r for r in records if r in crashes or r["attempt"] == 1 + 2]) == 3, records
        crashed = records[-1]["phase"] == "running"
        said = "exit code: 3" if crashed else "exited with code 3"
        assert said in inst["error_message"], inst
        await asyncio.sleep(0.5)
        assert (await h.client.get(f"/instances/{iid}")).json()["status"] == "failed"


async def test_a_restart_that_finds_everything_as_recorded_does_not_rewrite_config(
    tmp_path: Path,
) -> None:
    settings = host_settings(tmp_path)
    async with running_host(settings, backends=registry()) as h:
        await create(h, cfg(tmp_path))
    path = settings.config_file
    before = path.read_bytes()
    inode = path.stat().st_ino  # every write is a new file renamed into place
    async with running_host(settings, backends=registry()) as h:
        assert len((await h.client.get("/instances")).json()) == 1
    assert path.stat().st_ino == inode and path.read_bytes() == before

    # A file in the upstream format (a bare list of instances) is rewritten in ours on start.
    import json

    doc = json.loads(before)
    path.write_text(json.dumps([e["instance"] for e in doc["instances"]]))
    async with running_host(settings, backends=registry()) as h:
        assert len((await h.client.get("/instances")).json()) == 1
    rewritten = json.loads(path.read_text())
    assert rewritten["instances"][0]["instance"]["id"] == doc["instances"][0]["instance"]["id"]
    assert (
        rewritten["instances"][0]["instance"]["config"] == doc["instances"][0]["instance"]["config"]
    )


WRAP_TRANSIENT = """#!/bin/sh
# $1: a count file. Run 1 serves (the test kills it once the host has it running: a crash);
# runs 2 to 4 fail at load (a port or GPU memory the crashed process still held); from run 5
# on it serves.
C="$1"; shift
n=$(( $(cat "$C" 2>/dev/null || echo 0) + 1 )); echo $n > "$C"
echo "wrapper run $n at $(date +%s.%N)"
if [ $n -eq 1 ]; then exec "$@"; fi
if [ $n -le 4 ]; then echo "load failed: device busy"; exit 1; fi
exec "$@"
"""


async def test_a_crash_restart_that_meets_a_passing_failure_keeps_trying(tmp_path: Path) -> None:
    """After one crash, the restart's attempts fail for a moment: they are spaced by the
    doubling backoff, and a restart that fails altogether counts as one more crash of the loop,
    so the host tries again rather than leaving the instance failed after a single crash."""
    wrap = tmp_path / "wrap.sh"
    wrap.write_text(WRAP_TRANSIENT)
    count = tmp_path / "count"
    s = host_settings(tmp_path, restart_backoff_s=0.05, restart_max_in_window=5, max_retries=1)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, fake_wrapper=["/bin/sh", str(wrap), str(count)]))
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        # A crash of a backend the host has seen ready (one timed from its spawn could end
        # first on a loaded machine: a failed start attempt, not a crash).
        os.kill(r.json()["instance"]["pid"], signal.SIGKILL)
        sup = h.instances.supervisor(iid)
        for _ in range(400):  # 20 s at most
            await asyncio.sleep(0.05)
            if sup.counters["starts"] >= 2:
                break
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "running", (inst, sup.counters, count.read_text())
        assert count.read_text().strip() == "5"
        # Two restarts (the first one's two attempts failed, the second's first one too).
        assert sup.counters["restarts"] == 2 and sup.counters["start_failures"] == 1
        logs = (await h.client.get(f"/instances/{iid}/logs")).json()
        runs = [float(e["line"].split(" at ")[1]) for e in logs if "wrapper run" in e["line"]]
        assert len(runs) == 5
        # Attempts 2 and 3 (one restart) are at least the first backoff apart, not back to back.
        assert runs[2] - runs[1] >= 0.05
        await h.client.post(f"/instances/{iid}/stop")


async def test_a_start_after_a_crash_loop_gets_the_whole_restart_budget(tmp_path: Path) -> None:
    s = host_settings(tmp_path, restart_backoff_s=0.05, restart_max_in_window=2)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--exit-after", "0.3", "--exit-code", "3"))
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        sup = h.instances.supervisor(iid)
        await crash_looped(h, iid)
        assert sup.counters["restarts"] == 1
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        await crash_looped(h, iid)
        # The operator's start began a new loop: its first crash was restarted again.
        assert sup.counters["restarts"] == 2, sup.counters


async def test_a_failed_start_is_counted_once_whatever_its_attempts(tmp_path: Path) -> None:
    """solar_host_instance_start_failures_total: "Starts that failed after all attempts"."""
    s = host_settings(tmp_path, restart_backoff_s=0.01, max_retries=2)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--exit-after", "0", "--exit-code", "1"))
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 500, r.text
        sup = h.instances.supervisor(iid)
        assert sup.instance.retry_count == 3  # three attempts
        assert sup.counters["start_failures"] == 1 and sup.counters["starts"] == 0


async def test_a_host_restart_leaves_failures_to_their_owners(tmp_path: Path) -> None:
    """Ruling 6: an intent-managed instance that crashed waits for control; a crash loop stays
    failed. A graceful host restart must not start either again; an instance that was running
    is started again."""
    s = host_settings(tmp_path, restart_backoff_s=0.05, restart_max_in_window=2)

    async def status_of(h, iid: str, want: str) -> dict:
        for _ in range(200):
            inst = (await h.client.get(f"/instances/{iid}")).json()
            if inst["status"] == want and (want != "failed" or inst["error_message"]):
                return inst
            await asyncio.sleep(0.05)
        raise AssertionError(inst)

    async with running_host(s, backends=registry()) as h:
        intent = await create(
            h, cfg(tmp_path, alias="intent"), managed_by="intent", intent_id="i-1"
        )
        looper = await create(h, cfg(tmp_path, "--exit-after", "0.3", alias="looper"))
        steady = await create(h, cfg(tmp_path, alias="steady"))
        pid = (await h.client.post(f"/instances/{intent}/start")).json()["instance"]["pid"]
        os.kill(pid, signal.SIGKILL)
        await status_of(h, intent, "failed")
        await h.client.post(f"/instances/{looper}/start")
        await crash_looped(h, looper)
        assert (await h.client.post(f"/instances/{steady}/start")).status_code == 200
    async with running_host(s, backends=registry()) as h:
        await status_of(h, steady, "running")
        for iid in (intent, looper):
            inst = await status_of(h, iid, "failed")
            assert inst["pid"] is None
            assert h.instances.supervisor(iid).counters["starts"] == 0
        await h.client.post(f"/instances/{steady}/stop")


async def test_stopped_instances_past_the_retained_buffers_are_read_from_their_files(
    tmp_path: Path,
) -> None:
    s = host_settings(tmp_path, retained_log_buffers=1)
    async with running_host(s, backends=registry()) as h:
        first = await create(h, cfg(tmp_path, alias="first"))
        second = await create(h, cfg(tmp_path, alias="second"))
        buffered = {}
        for iid in (first, second):
            assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
            await h.client.post(f"/instances/{iid}/stop")
            buffered[iid] = [
                e["line"] for e in (await h.client.get(f"/instances/{iid}/logs")).json()
            ]
        sups = [h.instances.supervisor(i) for i in (first, second)]
        assert not sups[0].ring.entries and sups[1].ring.entries  # only one buffer retained
        lines = [e["line"] for e in (await h.client.get(f"/instances/{first}/logs")).json()]
        assert lines == buffered[first] and lines  # the same lines, from its log file


async def test_the_state_stream_of_a_deleted_instance_ends(tmp_path: Path) -> None:
    import json

    import websockets

    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, cfg(tmp_path))
        url = h.url.replace("http", "ws") + f"/instances/{iid}/state"
        async with websockets.connect(url, additional_headers={"X-API-Key": s_key(h)}) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert first["type"] == "instance_state"
            assert (await h.client.delete(f"/instances/{iid}")).status_code == 200
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)


async def test_a_restart_refused_for_a_taken_port_says_so_on_the_instance(tmp_path: Path) -> None:
    import socket

    from tests.fixtures.ports import free_port

    port = free_port()
    s = host_settings(tmp_path, restart_backoff_s=1.0)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--exit-after", "0.3", port=port))
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        for _ in range(200):
            inst = (await h.client.get(f"/instances/{iid}")).json()
            if inst["status"] == "failed":
                break
            await asyncio.sleep(0.02)
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        try:
            for _ in range(200):
                inst = (await h.client.get(f"/instances/{iid}")).json()
                if "refused" in (inst["error_message"] or ""):
                    break
                await asyncio.sleep(0.05)
            assert inst["status"] == "failed"
            assert "the restart was refused" in inst["error_message"], inst
            assert f"Port {port}" in inst["error_message"]
        finally:
            squatter.close()


async def test_an_alias_with_control_characters_is_refused_where_it_is_given(
    tmp_path: Path,
) -> None:
    """An alias is shown on terminals and in solar-control: ESC in it would drive them. Refused
    on create and update (422 naming it); a record an older release kept still loads."""
    settings = host_settings(tmp_path)
    async with running_host(settings, backends=registry()) as h:
        for alias in ("a\x1b[2Jb", "bell\x07", "c1\x9b31m"):
            r = await h.client.post("/instances", json={"config": cfg(tmp_path, alias=alias)})
            assert r.status_code == 422, r.text
            assert "alias" in r.text and "control characters" in r.text
        iid = await create(h, cfg(tmp_path, alias="fine"))
        r = await h.client.put(
            f"/instances/{iid}", json={"config": cfg(tmp_path, alias="x\x1b]0;t\x07")}
        )
        assert r.status_code == 422, r.text
    stored = json.loads(settings.config_file.read_text())
    stored["instances"][0]["instance"]["config"]["alias"] = "old\x1bone"
    settings.config_file.write_text(json.dumps(stored))
    async with running_host(settings, backends=registry()) as h:
        listed = (await h.client.get("/instances")).json()
        assert [i["config"]["alias"] for i in listed] == ["old\x1bone"]


async def test_a_failed_instance_says_when_the_host_tries_again(tmp_path: Path) -> None:
    """ "failed" alone read as given up on: during a crash restart's backoff, and in the pause
    between a start's attempts, the error says what comes next and when."""
    s = host_settings(tmp_path, restart_backoff_s=1.5, max_retries=1, restart_max_in_window=5)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--exit-after", "0.3", "--exit-code", "3"))
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        seen = None
        for _ in range(200):
            inst = (await h.client.get(f"/instances/{iid}")).json()
            if inst["status"] == "failed":
                seen = inst["error_message"]
                break
            await asyncio.sleep(0.02)
        assert seen is not None
        assert "exit code: 3" in seen and "restarting in 1.5s (crash 1 within" in seen, seen
        assert "gives up at 5" in seen
        for _ in range(200):  # the restart brings it back, and the note goes with the failure
            inst = (await h.client.get(f"/instances/{iid}")).json()
            if inst["status"] == "running":
                break
            await asyncio.sleep(0.02)
        assert inst["status"] == "running" and inst["error_message"] is None, inst
        await h.client.post(f"/instances/{iid}/stop")

        iid = await create(h, cfg(tmp_path, "--exit-after", "0", "--exit-code", "1", alias="b"))
        start = asyncio.create_task(h.client.post(f"/instances/{iid}/start"))
        paused = None
        for _ in range(150):
            inst = (await h.client.get(f"/instances/{iid}")).json()
            if inst["status"] == "failed" and not start.done():
                paused = inst["error_message"]
                break
            await asyncio.sleep(0.02)
        assert paused is not None and "next attempt in 1.5s (2 of 2)" in paused, paused
        r = await start
        assert r.status_code == 500 and "next attempt" not in r.text, r.text
        final = (await h.client.get(f"/instances/{iid}")).json()["error_message"]
        assert "next attempt" not in final and "restarting" not in final, final


async def test_configs_are_read_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding a config's model walks its directory (up to 50,000 entries), reads manifest.json
    and model files: a create, an update or an estimate did it on the event loop, which every
    request and every backend's supervision waited for. Each now reads in a worker thread."""
    from solar_host.backends import files

    on_loop: list[str] = []
    real_search = files._search

    def search(*args: object) -> list[Path]:
        try:
            asyncio.get_running_loop()
            on_loop.append("model_file search")
        except RuntimeError:
            pass  # a worker thread: no running loop there
        return real_search(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(files, "_search", search)
    model_dir = tmp_path / "models" / "m"
    for i in range(3):
        (model_dir / f"q{i}").mkdir(parents=True)
        (model_dir / f"q{i}" / f"M-Q{i}.gguf").write_bytes(b"GGUF")
    config = {**cfg(tmp_path), "model": str(model_dir), "model_file": "M-Q1.gguf"}
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, config)
        got = (await h.client.get(f"/instances/{iid}")).json()["config"]["model"]
        assert got.endswith("q1/M-Q1.gguf"), got
        r = await h.client.put(
            f"/instances/{iid}", json={"config": {**config, "model_file": "M-Q2.gguf"}}
        )
        assert r.status_code == 200, r.text
        got = (await h.client.get(f"/instances/{iid}")).json()["config"]["model"]
        assert got.endswith("q2/M-Q2.gguf"), got
        r = await h.client.post("/instances/estimate", json={"config": config})
        assert r.status_code in (200, 422), r.text
    assert on_loop == []


async def _running(h, iid: str, timeout: float = 15.0, not_pid: int | None = None) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        inst = (await h.client.get(f"/instances/{iid}")).json()
        if inst["status"] == "running" and inst["pid"] != not_pid:
            return inst
        assert time.monotonic() < deadline, inst
        await asyncio.sleep(0.05)


async def test_a_backend_that_stops_answering_is_ended_and_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A running backend that no longer answers its health endpoint (here SIGSTOP: alive,
    listening, silent, as a deadlocked or GPU-hung server) stayed `running` for ever while
    control sent it requests. Past UNHEALTHY_AFTER_S it is ended and restarted as a crash."""
    s = host_settings(
        tmp_path, health_check_interval_s=0.2, unhealthy_after_s=1.0, restart_backoff_s=0.1
    )
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path))
        pid = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            inst = await _running(h, iid, timeout=20, not_pid=pid)
            took = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert 1.0 <= took < 15, took
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        sup = h.instances.supervisor(iid)
        assert sup.counters["crashes"] == 1 and sup.counters["restarts"] == 1
        assert "stopped answering /health for" in caplog.text
        assert inst["error_message"] is None
        await h.client.post(f"/instances/{iid}/stop")


async def test_a_short_silence_or_a_disabled_check_ends_nothing(tmp_path: Path) -> None:
    """One probe that times out is only logged: a backend silent for less than
    UNHEALTHY_AFTER_S keeps running, and HEALTH_CHECK_INTERVAL_S=0 probes nothing."""
    for interval, after, pause, fake in (
        (0.2, 3.0, 1.0, ()),
        (0.0, 0.5, 2.0, ()),
        (0.2, 0.5, 0.0, ("--health-503-after", "0.3")),  # an answer, if not a 200: it runs
    ):
        s = host_settings(tmp_path, health_check_interval_s=interval, unhealthy_after_s=after)
        async with running_host(s, backends=registry()) as h:
            iid = await create(h, cfg(tmp_path, *fake))
            pid = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]["pid"]
            if pause:
                os.kill(pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(pause)
                finally:
                    os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(0.5 if pause else 2.0)
            inst = (await h.client.get(f"/instances/{iid}")).json()
            assert inst["status"] == "running" and inst["pid"] == pid, (interval, inst)
            assert h.instances.supervisor(iid).counters["crashes"] == 0
            await h.client.post(f"/instances/{iid}/stop")


async def test_a_backend_busy_but_silent_is_left_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not answering /health while working (a llama-server whose HTTP threads all wait on
    queued requests) is not stuck: ending it would drop every request in flight. Its CPU use
    over the silent window tells the two apart."""
    s = host_settings(tmp_path, health_check_interval_s=0.2, unhealthy_after_s=1.0)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--busy-silent-after", "0.5"))
        pid = (await h.client.post(f"/instances/{iid}/start")).json()["instance"]["pid"]
        await asyncio.sleep(4.0)  # several silent windows
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "running" and inst["pid"] == pid, inst
        assert h.instances.supervisor(iid).counters["crashes"] == 0
        assert "busy, left running" in caplog.text
        await h.client.post(f"/instances/{iid}/stop")

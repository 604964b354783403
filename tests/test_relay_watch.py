"""A serving backend's log relay that ends is replaced on the same pipe (relay_watch.py): the
backend is never touched, and what it writes afterwards reaches its log again."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from solar_host.instances import relay_watch, relays
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.hostproc import HostProc
from tests.fixtures.waiting import wait_for
from tests.test_lifecycle_fake import cfg, create, registry
from tests.test_log_relay import start_kept


async def relay_of(pid: int, other_than: int | None = None, within_s: float = 20.0) -> relays.Relay:
    """The relay reading backend `pid`'s output (not the one of pid `other_than`), once there."""
    for _ in range(int(within_s / 0.05)):
        relay = await asyncio.to_thread(relays.relay_of, pid)
        if relay is not None and relay.identity.pid != other_than:
            return relay
        await asyncio.sleep(0.05)
    raise AssertionError(f"no relay (other than {other_than}) for backend {pid}")


async def say(h, port: int, word: str) -> None:
    """One POST to the backend: the fake says it in its log."""
    async with httpx.AsyncClient(timeout=10.0) as c:
        r = await c.post(
            f"http://127.0.0.1:{port}/v1/{word}",
            json={},
            headers={"Authorization": f"Bearer {h.host.key()}"},
        )
        assert r.status_code == 200, r.text


async def logged(h, iid: str, text: str, within_s: float = 20.0) -> bool:
    for _ in range(int(within_s / 0.05)):
        lines = (await h.client.get(f"/instances/{iid}/logs")).json()
        if any(text in e["line"] for e in lines):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_killed_relay_is_replaced_and_the_log_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="solar_host.instances.relay_watch")
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, cfg(tmp_path, "--answers", '["hello"]'))
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        inst = r.json()["instance"]
        pid, port = inst["pid"], inst["port"]
        first = (await relay_of(pid)).identity.pid
        await say(h, port, "before")
        assert await logged(h, iid, "POST /v1/before")

        os.kill(first, signal.SIGKILL)
        relay = await relay_of(pid, other_than=first)
        second = relay.identity.pid
        await say(h, port, "after")
        assert await logged(h, iid, "POST /v1/after")
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "running" and inst["pid"] == pid  # never touched
        assert any(f"replaced by pid {second}" in rec.getMessage() for rec in caplog.records), (
            caplog.text
        )

        # Stopped: the relay ends with its backend (end of file), and nothing replaces it.
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200
        assert await relays.exited(relay, 20.0)
        await asyncio.sleep(0.5)
        assert await asyncio.to_thread(relays.relay_of, pid) is None


async def test_a_relay_that_keeps_ending_is_left_after_its_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_watch, "RESTARTS_PER_HOUR", 1)
    caplog.set_level(logging.WARNING, logger="solar_host.instances.relay_watch")
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, cfg(tmp_path))
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        pid = r.json()["instance"]["pid"]
        first = (await relay_of(pid)).identity.pid
        os.kill(first, signal.SIGKILL)
        second = (await relay_of(pid, other_than=first)).identity.pid
        os.kill(second, signal.SIGKILL)
        for _ in range(400):
            if "not replaced" in caplog.text:
                break
            await asyncio.sleep(0.05)
        assert "not replaced (ended 1 times in the last hour)" in caplog.text, caplog.text
        assert await asyncio.to_thread(relays.relay_of, pid) is None
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "running" and inst["pid"] == pid  # it serves on
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200


def test_restart_refuses_a_backend_whose_output_is_no_pipe(tmp_path: Path) -> None:
    """A process whose standard output is a file (a backend of an older host, or one that
    closed its pipe and reopened something else) gets no relay."""
    out = open(tmp_path / "own.log", "wb")  # the child keeps its own copy
    child = subprocess.Popen(["sleep", "30"], stdout=out, stdin=subprocess.DEVNULL)
    out.close()
    try:
        ident = relays.ownership.identity_of(child.pid)
        assert ident is not None
        assert relays.restart(ident, tmp_path / "relayed.log", 1 << 20) is None
        assert not (tmp_path / "relayed.log").exists()
    finally:
        child.kill()
        child.wait()


def test_a_relay_that_ended_while_no_host_ran_is_replaced_at_adoption(tmp_path: Path) -> None:
    with HostProc(tmp_path / "h") as h:
        iid, port, pid = start_kept(h)
        first = relays.relay_of(pid)
        assert first is not None
        h.kill()
        os.kill(first.identity.pid, signal.SIGKILL)  # no host runs: nobody replaces it
        wait_for(lambda: relays.relay_of(pid) is None, 20, "the relay gone")
        h.start()
        url = f"http://127.0.0.1:{port}/write?path=/proc/self/fd/1"
        with h.client() as c:
            wait_for(
                lambda: c.get(f"/instances/{iid}").json()["status"] == "running", 30, "adoption"
            )
            assert c.get(f"/instances/{iid}").json()["pid"] == pid
            second = wait_for(lambda: relays.relay_of(pid), 20, "a new relay")
            assert second.identity.pid != first.identity.pid
            assert httpx.get(url, timeout=10).json() == {"wrote": "ok"}
            wait_for(
                lambda: "written by the backend" in str(c.get(f"/instances/{iid}/logs").json()),
                20,
                "the line in the log",
            )
            assert "had ended while no host ran" in h.log()
            assert c.post(f"/instances/{iid}/stop").status_code == 200

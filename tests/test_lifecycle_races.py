"""Races between start, stop, restart and the host's own lifecycle work (crash handling, the
stop a killed host left unfinished), made deterministic: the step a race needs to land in is
held by a gate (an event) until the competing call has reached the supervisor, never by sleeps.

A real host (uvicorn on loopback) with the scripted backend; every backend carries a tag of
its test on its command line, so what survives a test is found (and only that is killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.instances import process as procs
from solar_host.instances import supervisor as supervisor_mod
from solar_host.instances.errors import InstanceConflict
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config
from tests.test_concurrency import tagged

BOUND = 30.0  # seconds: the bound on every wait of these tests


def registry() -> BackendRegistry:
    return BackendRegistry([ScriptBackend()])


@pytest.fixture
def tag() -> Iterator[str]:
    t = f"race-{uuid.uuid4().hex}"
    yield t
    for p in tagged(t):  # only what this test spawned
        with contextlib.suppress(psutil.Error):
            p.kill()


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def until(check: Callable[[], bool], what: str, timeout: float = BOUND) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)
    assert check(), what


async def gone(tag: str, timeout: float = BOUND) -> bool:
    with contextlib.suppress(TimeoutError):
        await until(lambda: not tagged(tag), "backends gone", timeout)
    return not tagged(tag)


def disk_entry(tmp_path: Path, iid: str) -> dict[str, Any]:
    doc = json.loads((tmp_path / "config.json").read_text())
    return next(e for e in doc["instances"] if e["instance"]["id"] == iid)


async def create(h: Any, config: dict[str, Any], **top: Any) -> str:
    r = await h.client.post("/instances", json={"config": config, **top})
    assert r.status_code == 200, r.text
    return r.json()["instance"]["id"]


class WatchedLock(asyncio.Lock):
    """The supervisor's lock, telling when a caller had to wait for it."""

    def __init__(self) -> None:
        super().__init__()
        self.contended = asyncio.Event()

    async def acquire(self) -> bool:
        if self.locked():
            self.contended.set()
        return await super().acquire()


class Gate:
    """Holds every call of an async function while armed, until opened."""

    def __init__(self, fn: Callable[..., Awaitable[Any]]):
        self.fn = fn
        self.armed = False
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.entered.set()
            await asyncio.wait_for(self.opened.wait(), BOUND)
        return await self.fn(*args, **kwargs)

    def open(self) -> None:
        self.armed = False
        self.opened.set()


async def task_or_event(task: asyncio.Task[Any], event: asyncio.Event) -> None:
    """Until `task` ended or `event` is set (bounded)."""
    waiter = asyncio.create_task(event.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=BOUND, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


# --- 1: a start while the host handles a crash ----------------------------------------------


@pytest.mark.parametrize("managed_by", ["intent", None])
async def test_a_start_during_crash_handling_is_not_lost_by_it(
    tmp_path: Path, tag: str, monkeypatch: pytest.MonkeyPatch, managed_by: str | None
) -> None:
    """The backend died and the host is ending its leftovers (status still running): a start
    asked for now is a start after the crash, and its backend is the instance's own."""
    cleanup = Gate(procs.end_tree_leftovers)
    monkeypatch.setattr(procs, "end_tree_leftovers", cleanup)
    s = host_settings(tmp_path, max_retries=0, stop_grace_s=1.0)
    async with running_host(s, backends=registry()) as h:
        top = {"managed_by": managed_by} if managed_by else {}
        iid = await create(h, script_config(tmp_path, "--tag", tag), **top)
        sup = h.instances.supervisor(iid)
        sup.lock = lock = WatchedLock()
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        first = r.json()["instance"]["pid"]

        watch = sup.watch_task
        assert watch is not None
        cleanup.armed = True
        os.kill(first, signal.SIGKILL)
        await asyncio.wait_for(cleanup.entered.wait(), BOUND)  # the crash handling is under way
        lock.contended.clear()
        start = asyncio.create_task(h.client.post(f"/instances/{iid}/start"))
        # Until the start answered (it did not wait for the crash handling), or waits for it.
        await task_or_event(start, lock.contended)
        cleanup.open()
        r = await asyncio.wait_for(start, BOUND)
        await asyncio.wait({watch}, timeout=BOUND)  # the crash handling is over
        assert watch.done()

        assert r.status_code == 200, r.text
        answered = r.json()["instance"]
        assert answered["status"] == "running" and answered["pid"] != first
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "running", inst
        assert inst["pid"] == answered["pid"] and alive(inst["pid"])
        assert inst["port"] is not None
        assert disk_entry(tmp_path, iid)["process"]["pid"] == inst["pid"]
        assert [p.pid for p in tagged(tag)] == [inst["pid"]]  # nothing runs untracked

        r = await h.client.post(f"/instances/{iid}/stop")
        assert r.status_code == 200 and r.json()["instance"]["status"] == "stopped"
        assert await gone(tag), [p.pid for p in tagged(tag)]


# --- 2: a start followed at once by a stop -------------------------------------------------


async def test_a_stop_right_after_a_start_is_the_last_word_on_disk(
    tmp_path: Path, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start's task runs after the stop recorded the instance as not wanted: it must not
    record it as wanted again (the next boot would start what the operator stopped)."""
    admit = Gate(supervisor_mod.admit_start)
    monkeypatch.setattr(supervisor_mod, "admit_start", admit)
    s = host_settings(tmp_path, max_retries=0)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, script_config(tmp_path, "--tag", tag, "--exit-after", "0"))
        # An earlier start failed: the instance is still wanted (want_running on disk).
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 500, r.text
        assert disk_entry(tmp_path, iid)["want_running"] is True
        r = await h.client.put(
            f"/instances/{iid}", json={"config": script_config(tmp_path, "--tag", tag)}
        )
        assert r.status_code == 200, r.text

        sup = h.instances.supervisor(iid)
        save = h.instances.persist_or_raise

        async def persist_or_raise() -> None:
            # The stop's write of "not wanted" lets the start's task go on meanwhile.
            if admit.entered.is_set() and not admit.opened.is_set():
                if not sup.stored.want_running:
                    admit.open()
                    for _ in range(50):  # loop turns, not time: the start task runs on
                        await asyncio.sleep(0)
            await save()

        h.instances.persist_or_raise = persist_or_raise  # type: ignore[method-assign]
        admit.armed = True
        start = asyncio.create_task(h.client.post(f"/instances/{iid}/start"))
        await asyncio.wait_for(admit.entered.wait(), BOUND)
        stop = await h.client.post(f"/instances/{iid}/stop")
        assert stop.status_code == 200 and stop.json()["instance"]["status"] == "stopped"
        r = await asyncio.wait_for(start, BOUND)
        assert r.status_code == 409, r.text  # cancelled by the stop
        assert admit.opened.is_set()
        await until(lambda: sup.start_task is None or sup.start_task.done(), "start ended")

        assert (await h.client.get(f"/instances/{iid}")).json()["status"] == "stopped"
        assert disk_entry(tmp_path, iid)["want_running"] is False
        assert await gone(tag)

    # The next host process leaves it stopped.
    async with running_host(s, backends=registry()) as h:
        await asyncio.wait_for(h.instances.boot_done.wait(), BOUND)
        assert (await h.client.get(f"/instances/{iid}")).json()["status"] == "stopped"
        assert not tagged(tag)


async def test_a_start_refused_before_anything_ran_is_not_remembered_as_wanted(
    tmp_path: Path, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intent is written before the start's task exists; a start the fit check refuses
    (409, nothing spawned) takes it back, so the next boot does not start it."""

    async def refuse(sup: Any) -> None:
        await asyncio.sleep(0)
        raise InstanceConflict("does not fit")

    monkeypatch.setattr(supervisor_mod, "admit_start", refuse)
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, script_config(tmp_path, "--tag", tag))
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 409, r.text
        assert disk_entry(tmp_path, iid)["want_running"] is False
        assert not tagged(tag)


# --- 3: a stop while a restart stops the backend -------------------------------------------


async def test_a_stop_during_a_restart_wins(
    tmp_path: Path, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop comes after the restart: the instance ends stopped and not wanted, and the
    restart answers 409 as a start cancelled by a stop does."""
    ending = Gate(procs.terminate)
    monkeypatch.setattr(procs, "terminate", ending)
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, script_config(tmp_path, "--tag", tag))
        sup = h.instances.supervisor(iid)
        sup.lock = lock = WatchedLock()
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200

        ending.armed = True
        restart = asyncio.create_task(h.client.post(f"/instances/{iid}/restart"))
        await asyncio.wait_for(ending.entered.wait(), BOUND)  # the restart's stop phase
        lock.contended.clear()
        stop = asyncio.create_task(h.client.post(f"/instances/{iid}/stop"))
        await asyncio.wait_for(lock.contended.wait(), BOUND)  # the stop waits for the restart
        ending.open()
        rs, rr = await asyncio.wait_for(asyncio.gather(stop, restart), BOUND)

        assert rs.status_code == 200 and rs.json()["instance"]["status"] == "stopped"
        assert rr.status_code == 409, rr.text
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "stopped" and inst["pid"] is None, inst
        assert disk_entry(tmp_path, iid)["want_running"] is False
        assert await gone(tag), [p.pid for p in tagged(tag)]


# --- 4: a start while the stop a killed host left is finished -------------------------------


@pytest.mark.parametrize("wanted", [False, True], ids=["stop", "restart"])
async def test_a_start_during_the_finish_of_a_leftover_stop_really_starts(
    tmp_path: Path, tag: str, monkeypatch: pytest.MonkeyPatch, wanted: bool
) -> None:
    """A host died while it stopped a backend (an operator's stop, or a restart's stop phase);
    the next one finishes that stop. A start asked for meanwhile waits for it, then starts
    (or joins the start that ends the restart): its 200 means running, with one backend."""
    s = host_settings(tmp_path, keep_backends_on_shutdown=True)
    async with running_host(s, backends=registry()) as h:
        iid = await create(h, script_config(tmp_path, "--tag", tag))
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        old = r.json()["instance"]["pid"]
    # What a host killed in the middle of the operator's stop leaves on disk.
    doc = json.loads((tmp_path / "config.json").read_text())
    entry = next(e for e in doc["instances"] if e["instance"]["id"] == iid)
    entry["instance"]["status"] = "stopping"
    entry["want_running"] = wanted
    (tmp_path / "config.json").write_text(json.dumps(doc))
    assert alive(old)

    ending = Gate(procs.terminate)
    ending.armed = True
    monkeypatch.setattr(procs, "terminate", ending)
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        await asyncio.wait_for(ending.entered.wait(), BOUND)  # finishing the stop
        sup = h.instances.supervisor(iid)
        reached = asyncio.Event()
        original = sup.start

        async def start() -> Any:
            reached.set()
            return await original()

        sup.start = start  # type: ignore[method-assign]
        req = asyncio.create_task(h.client.post(f"/instances/{iid}/start"))
        await task_or_event(req, reached)
        ending.open()
        r = await asyncio.wait_for(req, BOUND)

        assert r.status_code == 200, r.text
        inst = r.json()["instance"]
        assert inst["status"] == "running", inst
        assert inst["pid"] != old and alive(inst["pid"])
        assert not alive(old)
        assert disk_entry(tmp_path, iid)["want_running"] is True
        assert [p.pid for p in tagged(tag)] == [inst["pid"]]
        assert sup.counters["starts"] == 1
        r = await h.client.post(f"/instances/{iid}/stop")
        assert r.status_code == 200 and r.json()["instance"]["status"] == "stopped"
        assert await gone(tag)


# --- 5: restarts in a burst ----------------------------------------------------------------


async def test_restarts_in_a_burst_share_one_start(
    tmp_path: Path, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restarts arriving while a restart's start is in flight join it: every one answers 200
    with the same backend (nobody sent a stop), and one backend runs."""
    admit = Gate(supervisor_mod.admit_start)
    monkeypatch.setattr(supervisor_mod, "admit_start", admit)
    n = 6
    async with running_host(host_settings(tmp_path), backends=registry()) as h:
        iid = await create(h, script_config(tmp_path, "--tag", tag))
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        first = r.json()["instance"]["pid"]
        sup = h.instances.supervisor(iid)
        starts = sup.counters["starts"]

        calls = 0
        restart_of = h.instances.restart

        async def restart(instance_id: str) -> Any:
            nonlocal calls
            calls += 1
            return await restart_of(instance_id)

        h.instances.restart = restart  # type: ignore[method-assign]
        admit.armed = True
        reqs = [asyncio.create_task(h.client.post(f"/instances/{iid}/restart"))]
        await asyncio.wait_for(admit.entered.wait(), BOUND)  # its start is in flight
        reqs += [
            asyncio.create_task(h.client.post(f"/instances/{iid}/restart")) for _ in range(n - 1)
        ]
        await until(lambda: calls == n, "every restart reached the host")
        admit.open()
        answers = await asyncio.wait_for(asyncio.gather(*reqs), BOUND)

        assert [a.status_code for a in answers] == [200] * n, [a.text for a in answers]
        pids = {a.json()["instance"]["pid"] for a in answers}
        assert len(pids) == 1 and first not in pids
        (pid,) = pids
        assert [p.pid for p in tagged(tag)] == [pid]
        assert sup.counters["starts"] == starts + 1
        r = await h.client.post(f"/instances/{iid}/stop")
        assert r.status_code == 200
        assert await gone(tag)

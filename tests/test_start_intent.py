"""A start saves its "wants running" while its fit check runs (intent.py), and waits for that
save before anything else of the start happens; a stop issued meanwhile waits for it too."""

from __future__ import annotations

import asyncio
import errno
import json
import threading
import time
from pathlib import Path

import psutil

from tests.fixtures.host import host_settings, running_host
from tests.test_lifecycle_fake import cfg, create, registry


def backends_of(tmp: Path) -> list[psutil.Process]:
    """The scripted backends of this test still running (children running fake_backend with
    a model under `tmp`; an exited one, a zombie until reaped, is none)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:  # gone, or a zombie
            continue
        if "fake_backend.py" in line and str(tmp) in line:
            found.append(p)
    return found


def on_disk(config_file: Path, iid: str) -> dict:
    for entry in json.loads(config_file.read_bytes())["instances"]:
        if entry["instance"]["id"] == iid:
            return entry
    raise AssertionError(f"{iid} not in {config_file}")


async def test_a_start_whose_intent_cannot_be_saved_leaves_nothing_behind(tmp_path: Path) -> None:
    settings = host_settings(tmp_path, max_retries=0)
    async with running_host(settings, backends=registry()) as h:
        svc = h.host.instances
        iid = await create(h, cfg(tmp_path, "--ready-after", "0.1"))
        real_write = svc.store._write
        failing = threading.Event()
        failing.set()
        claiming = threading.Event()

        def write(data: bytes) -> None:  # in the writer's thread, as the real one
            if failing.is_set():
                claiming.wait(5)  # the port's claim is under way when the save fails
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write(data)

        svc.store._commits._write = write  # the writer's thread calls it
        real_allocate = svc.ports.allocate

        def slow_allocate(host: str, avoid: set[int] | None = None) -> int:
            port = real_allocate(host, avoid)
            claiming.set()
            time.sleep(0.5)  # a loaded machine: the claim's thread ends after the save failed
            return port

        svc.ports.allocate = slow_allocate
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 507, r.text
        assert "No space left on device" in r.json()["detail"]
        sup = svc.supervisor(iid)
        assert sup.instance.status == "stopped" and sup.instance.port is None
        assert not sup.stored.want_running  # as it was, as on disk
        assert not on_disk(settings.config_file, iid).get("want_running")
        assert sup.proc is None and not backends_of(tmp_path)
        assert not svc.ports._claimed  # no port claimed for it
        assert svc.capacity is None or iid not in svc.capacity._holds

        failing.clear()
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        assert on_disk(settings.config_file, iid)["want_running"] is True


async def test_a_stop_issued_while_the_intent_is_saved_is_the_last_word_on_disk(
    tmp_path: Path,
) -> None:
    settings = host_settings(tmp_path, max_retries=0)
    async with running_host(settings, backends=registry()) as h:
        svc = h.host.instances
        iid = await create(h, cfg(tmp_path, "--ready-after", "0.1"))
        sup = svc.supervisor(iid)
        real_write = svc.store._write
        slow = threading.Event()
        slow.set()

        def write(data: bytes) -> None:
            if slow.is_set():  # the start's save of its intent, held up
                slow.clear()
                time.sleep(0.5)
            real_write(data)

        svc.store._commits._write = write  # the writer's thread calls it
        start = asyncio.create_task(h.client.post(f"/instances/{iid}/start"))
        for _ in range(200):  # the start has begun: its intent is set, its save under way
            if sup.stored.want_running:
                break
            await asyncio.sleep(0.005)
        assert sup.stored.want_running
        stop = await h.client.post(f"/instances/{iid}/stop")
        assert stop.status_code == 200, stop.text
        started = await start
        assert started.status_code in (200, 409), started.text  # cancelled, or done before
        assert sup.instance.status == "stopped"
        entry = on_disk(settings.config_file, iid)
        assert not entry.get("want_running") and entry["instance"]["status"] == "stopped"
        for _ in range(100):
            if not backends_of(tmp_path):
                break
            await asyncio.sleep(0.05)
        assert not backends_of(tmp_path)

"""A backend that carries an instance's marker is adopted even when config.json does not
record it (issues 15 and 16): a host killed between spawning a backend and saving its process
record, or a restored older copy of config.json whose record names the instance's previous
backend, must not cost a model load. Real host processes, SIGKILLed; real backends."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def running(h: HostProc, alias: str) -> tuple[str, dict[str, Any]]:
    with h.client() as c:
        cfg = script_config(h.tmp, "--lines", f"hello from {alias}", alias=alias)
        r = c.post("/instances", json={"config": cfg})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        r = c.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        return iid, r.json()["instance"]


def settled_on_disk(h: HostProc, iid: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        doc = json.loads((h.tmp / "config.json").read_text())
        [entry] = [e for e in doc["instances"] if e["instance"]["id"] == iid]
        if entry["instance"]["status"] == "running":
            return
        assert time.monotonic() < deadline, "config.json never recorded the running backend"
        time.sleep(0.05)


def rewrite_entry(h: HostProc, iid: str, change: Any) -> None:
    """Edit the instance's entry in config.json while no host runs."""
    path = h.tmp / "config.json"
    doc = json.loads(path.read_text())
    for entry in doc["instances"]:
        if entry["instance"]["id"] == iid:
            change(entry)
    path.write_text(json.dumps(doc, indent=2))


def instance(h: HostProc, iid: str) -> dict[str, Any]:
    with h.client() as c:
        return c.get(f"/instances/{iid}").json()


def wait_status(h: HostProc, iid: str, status: str, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        inst = instance(h, iid)
        if inst["status"] == status:
            return inst
        assert time.monotonic() < deadline, inst
        time.sleep(0.05)


def no_record(entry: dict[str, Any]) -> None:
    entry["process"] = None  # the host died before saving what it had spawned
    entry["instance"]["status"] = "starting"


def older_record(entry: dict[str, Any]) -> None:
    # A restored older copy: the record names the instance's previous backend, long gone.
    entry["process"]["pid"] = 4_000_000
    entry["process"]["start_ticks"] = 1
    entry["process"]["spawn_id"] = "0" * 32  # that backend's spawn, not this one


@pytest.mark.parametrize("how", [no_record, older_record], ids=["no record", "older record"])
def test_backend_with_the_marker_is_adopted_without_its_record(tmp_path: Path, how) -> None:
    with HostProc(tmp_path) as h:
        h.start()
        iid, before = running(h, "kept")
        other, other_before = running(h, "other")
        settled_on_disk(h, iid)
        h.kill()
        rewrite_entry(h, iid, how)
        h.start()
        inst = wait_status(h, iid, "running")
        assert (inst["pid"], inst["port"]) == (before["pid"], before["port"])
        assert instance(h, other)["pid"] == other_before["pid"]
        # One backend per instance: nothing was spawned again, nothing stopped.
        assert sorted(p.pid for p in h.backends()) == sorted(
            [before["pid"], other_before["pid"]]
        ), [p.cmdline() for p in h.backends()]
        with h.client() as c:
            # Its log file was found again (its standard output), so its lines are there.
            lines = c.get(f"/instances/{iid}/logs").json()
            text = json.dumps(lines)
            assert "hello from kept" in text, text[:500]
            # And the record is whole again: the next host adopts it the usual way.
            doc = json.loads((h.tmp / "config.json").read_text())
            [entry] = [e for e in doc["instances"] if e["instance"]["id"] == iid]
            assert entry["process"]["pid"] == before["pid"]
            assert entry["process"]["port"] == before["port"]
            r = c.post(f"/instances/{iid}/stop")
            assert r.status_code == 200, r.text
        assert before["pid"] not in [p.pid for p in h.backends()]


def test_backend_of_an_instance_recorded_stopped_is_still_stopped(tmp_path: Path) -> None:
    """The operator's last recorded word wins: a marker carrier of an instance that config.json
    says is stopped (and not wanted) is stopped at boot, not adopted."""
    with HostProc(tmp_path) as h:
        h.start()
        iid, before = running(h, "unwanted")
        settled_on_disk(h, iid)
        h.kill()

        def stopped(entry: dict[str, Any]) -> None:
            entry["process"] = None
            entry["want_running"] = False
            entry["instance"].update(status="stopped", pid=None, port=None)

        rewrite_entry(h, iid, stopped)
        h.start()
        deadline = time.monotonic() + 20
        while before["pid"] in [p.pid for p in h.backends()]:
            assert time.monotonic() < deadline, "the unwanted backend was never stopped"
            time.sleep(0.05)
        assert instance(h, iid)["status"] == "stopped"


@pytest.mark.parametrize("how", [no_record, older_record], ids=["no record", "older record"])
def test_unrecorded_backend_still_loading_is_adopted_on_the_port_it_was_given(
    tmp_path: Path, how
) -> None:
    """Killed between spawn and record while the backend still loads (it listens on nothing
    yet): the port the host gave it, in its environment, says which socket will be its API.
    With a record of an earlier spawn on disk too: its spawn id says this one came after."""
    with HostProc(tmp_path) as h:
        h.start()
        with h.client() as c:
            cfg = script_config(h.tmp, "--ready-after", "5", alias="loading")
            iid = c.post("/instances", json={"config": cfg}).json()["instance"]["id"]

            def start() -> None:
                with contextlib.suppress(httpx.HTTPError):  # the host is killed under it
                    h.client().post(f"/instances/{iid}/start")

            starter = threading.Thread(target=start, daemon=True)
            starter.start()
            before = wait_status(h, iid, "starting")
            deadline = time.monotonic() + 10
            while before["pid"] is None:
                assert time.monotonic() < deadline, before
                before = instance(h, iid)
                time.sleep(0.02)
        with pytest.raises(ConnectionRefusedError):  # still loading: nothing listens yet
            socket.create_connection(("127.0.0.1", before["port"]), timeout=2).close()
        h.kill()
        starter.join(10)
        rewrite_entry(h, iid, how)
        h.start()
        inst = instance(h, iid)
        assert inst["status"] == "starting", inst
        assert (inst["pid"], inst["port"]) == (before["pid"], before["port"]), inst
        assert "by its marker" in h.log()
        inst = wait_status(h, iid, "running")
        assert (inst["pid"], inst["port"]) == (before["pid"], before["port"]), inst
        assert [p.pid for p in h.backends()] == [before["pid"]]


def test_backend_adopted_without_its_record_is_restarted_for_a_new_api_key(
    tmp_path: Path,
) -> None:
    """The fingerprint of the key a backend was given travels in its environment: adopted by
    its marker after API_KEY changed, it is restarted like a recorded one."""
    with HostProc(tmp_path, api_key="old-key-0123456789abcdef") as h:
        h.start()
        iid, before = running(h, "keyed")
        settled_on_disk(h, iid)
        h.kill()
        rewrite_entry(h, iid, no_record)
        h.api_key = "new-key-fedcba9876543210"
        h.start()
        deadline = time.monotonic() + 30
        while True:
            inst = instance(h, iid)
            if inst["status"] == "running" and inst["pid"] != before["pid"]:
                break
            assert time.monotonic() < deadline, inst
            time.sleep(0.05)
        url = f"http://127.0.0.1:{inst['port']}/v1/models"
        auth = {"Authorization": f"Bearer {h.api_key}"}
        assert httpx.get(url, headers=auth).status_code == 200
        assert "by its marker" in h.log() and "no longer the host's" in h.log()
        assert [p.pid for p in h.backends()] == [inst["pid"]]

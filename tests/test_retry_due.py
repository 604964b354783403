"""A restart or retry the host owes an instance outlives the host process (ruling 6, README
"When the host starts"): a host SIGKILLed in the backoff before a crash restart, or handed
over or stopped while a start pauses between attempts, leaves the instance `failed` on disk,
and the record's `restart_due` tells the next host to start it. What the host gave up on (a
crash loop, a start out of attempts, an intent-managed crash) stays failed. Real host
processes, scripted backends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from solar_host.instances.store import InstanceStore
from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def create(h: HostProc, alias: str, managed_by: str | None = None, **config: Any) -> str:
    body = {"config": script_config(h.tmp, alias=alias, **config), "managed_by": managed_by}
    with h.client() as c:
        r = c.post("/instances", json=body)
        assert r.status_code == 200, r.text
        return r.json()["instance"]["id"]


def get(h: HostProc, iid: str) -> dict[str, Any]:
    with h.client(timeout=5) as c:
        return c.get(f"/instances/{iid}").json()


def entry(h: HostProc, iid: str) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads((h.tmp / "config.json").read_text())
        for e in doc["instances"]:
            if e["instance"]["id"] == iid:
                return e
    return {}


def failed_on_disk(h: HostProc, iid: str) -> Callable[[], bool]:
    """What a host killed now leaves to the next: `failed` (and whether anything is due)."""
    return lambda: entry(h, iid).get("instance", {}).get("status") == "failed"


def start_running(h: HostProc, iid: str) -> int:
    with h.client() as c:
        r = c.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        return r.json()["instance"]["pid"]


def crash(h: HostProc, pid: int) -> None:
    """The backend dies (OOM killer, a segfault): only a backend this host spawned."""
    assert pid in [p.pid for p in h.backends()]
    os.kill(pid, signal.SIGKILL)


def stays(h: HostProc, iid: str, status: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        inst = get(h, iid)
        assert inst["status"] == status, inst
        time.sleep(0.1)


def test_crash_restart_due_when_the_host_was_killed_in_its_backoff(tmp_path: Path) -> None:
    with HostProc(tmp_path, env={"RESTART_BACKOFF_S": "5"}) as h:
        h.start()
        iid = create(h, "crashy")
        pid = start_running(h, iid)
        crash(h, pid)
        # The failure is on disk (and with it, the restart it waits for); the host dies.
        wait_for(failed_on_disk(h, iid), 10, "the crash on disk")
        h.kill()
        h.start()
        inst = wait_for(
            lambda: (i := get(h, iid))["status"] == "running" and i, 15, "the restart at boot"
        )
        assert inst["pid"] != pid and [p.pid for p in h.backends()] == [inst["pid"]]
        wait_for(lambda: entry(h, iid).get("restart_due") is False, 10, "the marker cleared")


def flaky(tmp_path: Path) -> list[str]:
    """A wrapper whose first spawn exits 3 at once; every later one runs the backend."""
    flag = tmp_path / "first-attempt-done"
    return ["sh", "-c", f'if [ -e {flag} ]; then exec "$@"; fi; touch {flag}; exit 3', "sh"]


@pytest.mark.parametrize("how", ["hand-over", "SIGTERM", "SIGKILL"])
def test_next_attempt_due_when_the_host_went_between_attempts(tmp_path: Path, how: str) -> None:
    env = {"RESTART_BACKOFF_S": "5", "MAX_RETRIES": "2"}
    with HostProc(tmp_path, env=env) as h:
        h.start()
        iid = create(h, "flaky", fake_wrapper=flaky(tmp_path))

        def post() -> None:
            with contextlib.suppress(httpx.HTTPError), h.client(timeout=30) as c:
                c.post(f"/instances/{iid}/start")

        threading.Thread(target=post, daemon=True).start()
        # Attempt 1 failed; the start pauses 5 s before attempt 2.
        wait_for(failed_on_disk(h, iid), 10, "the failed attempt on disk")
        if how == "SIGTERM":
            assert h.stop() in (0, -signal.SIGTERM)  # graceful: within its 30 s, no SIGKILL
        else:
            h.kill({"hand-over": signal.SIGUSR2, "SIGKILL": signal.SIGKILL}[how])
        h.start()
        inst = wait_for(
            lambda: (i := get(h, iid))["status"] == "running" and i, 15, "the start at boot"
        )
        assert [p.pid for p in h.backends()] == [inst["pid"]]


def test_what_the_host_gave_up_on_stays_failed_after_a_restart(tmp_path: Path) -> None:
    """A crash loop, a start out of attempts and an intent-managed crash: nothing is due."""
    env = {"RESTART_MAX_IN_WINDOW": "1", "MAX_RETRIES": "0"}
    with HostProc(tmp_path, env=env) as h:
        h.start()
        looped = create(h, "looped")  # gives up at its first crash (one crash per window)
        intent = create(h, "intent", managed_by="intent")
        pids = [start_running(h, looped), start_running(h, intent)]
        broken = create(h, "broken", fake_args=["--exit-after", "0", "--exit-code", "3"])
        with h.client() as c:
            assert c.post(f"/instances/{broken}/start").status_code != 200
        for pid in pids:
            crash(h, pid)
        for iid in (looped, intent, broken):
            wait_for(failed_on_disk(h, iid), 10, f"{iid} failed on disk")
            assert entry(h, iid)["want_running"] is True
            assert entry(h, iid).get("restart_due") is not True
        h.kill()
        h.start()
        h.kill(signal.SIGUSR2)
        h.start()
        for iid in (looped, intent, broken):
            stays(h, iid, "failed", 1.0)
        assert h.backends() == []


def test_records_without_the_marker_load_as_not_due(tmp_path: Path) -> None:
    store = InstanceStore(tmp_path / "config.json", tmp_path / "models")
    cfg = script_config(tmp_path)
    inst = {"id": "a", "status": "failed", "config": cfg}
    entries = [
        {"instance": {**inst, "id": "old"}, "want_running": True},
        {"instance": {**inst, "id": "due"}, "want_running": True, "restart_due": True},
        {"instance": {**inst, "id": "odd"}, "want_running": True, "restart_due": "yes"},
    ]
    raw = json.dumps({"instances": entries}).encode()
    loaded = {r.instance.id: r.restart_due for r in store.parse(raw).records}
    assert loaded == {"old": False, "due": True, "odd": False}
    # Written back, the field is there for every record (older hosts ignore it).
    doc = json.loads(store.encode_full(store.parse(raw).records, []))
    assert [e["restart_due"] for e in doc["instances"]] == [False, True, False]

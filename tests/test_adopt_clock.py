"""A backend still loading when the host died is awaited, after re-adoption, for what its start
has left of START_DEADLINE_S (ruling 7), and that is measured on the kernel's boot clock: a wall
clock stepped forward between the spawn and the host's restart (NTP, an operator's `date`) must
not make a backend spawned seconds ago look an hour old, to be killed at a 5 s floor, nor take
away the retries of its start.

Stepping the machine's clock needs privileges a test does not have; what such a step leaves
behind is the same as a record whose wall-clock `spawned_at` lies an hour before the real spawn,
so that is what the test writes while no host runs. Real host processes, scripted backends.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

ENV = {"START_DEADLINE_S": "300", "INSTANCE_READY_TIMEOUT_S": "120", "MAX_RETRIES": "1"}


def get(h: HostProc, iid: str) -> dict[str, Any]:
    with h.client(timeout=5) as c:
        return c.get(f"/instances/{iid}").json()


def entry(h: HostProc, iid: str) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads((h.tmp / "config.json").read_text())
        for e in doc["instances"]:
            if e["instance"]["id"] == iid:
                return e
    return None


def spawn_loading(h: HostProc, **config: Any) -> tuple[str, int]:
    """Create and start an instance; return once its loading backend's record is on disk.
    The start's request is left to a thread (it answers only when the backend is ready)."""
    with h.client() as c:
        r = c.post("/instances", json={"config": script_config(h.tmp, alias="slow", **config)})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]

    def post() -> None:
        with contextlib.suppress(httpx.HTTPError), h.client(timeout=30) as c:
            c.post(f"/instances/{iid}/start")

    threading.Thread(target=post, daemon=True).start()
    pid = wait_for(lambda: get(h, iid)["pid"], 15, "the spawn")
    rec = wait_for(lambda: (entry(h, iid) or {}).get("process") or {}, 10, "the record")
    assert rec["pid"] == pid and rec["start_ticks"] and rec["boot_id"], rec
    return iid, pid


def clock_stepped_an_hour(h: HostProc, iid: str) -> None:
    """What config.json holds had the wall clock been stepped forward 1 h after the spawn."""
    path = h.tmp / "config.json"
    doc = json.loads(path.read_text())
    for e in doc["instances"]:
        if e["instance"]["id"] == iid:
            spawned = datetime.fromisoformat(e["process"]["spawned_at"])
            e["process"]["spawned_at"] = (spawned - timedelta(hours=1)).isoformat()
    path.write_text(json.dumps(doc, indent=2))


def test_loading_backend_is_awaited_after_a_clock_step(tmp_path: Path) -> None:
    with HostProc(tmp_path, env=ENV) as h:
        h.start()
        # Ready 12 s after its spawn: the host is back within a few, so the 5 s a backend
        # taken for an hour old would get ends well before it is ready.
        iid, pid = spawn_loading(h, fake_args=["--ready-after", "12"])
        h.kill()
        clock_stepped_an_hour(h, iid)
        h.start()
        inst = get(h, iid)
        assert inst["status"] == "starting" and inst["pid"] == pid, inst
        inst = wait_for(
            lambda: (i := get(h, iid))["status"] != "starting" and i, 30, "the adopted backend"
        )
        assert inst["status"] == "running" and inst["pid"] == pid, (inst, h.log())
        assert [p.pid for p in h.backends()] == [pid]


def test_retries_of_an_adopted_start_survive_a_clock_step(tmp_path: Path) -> None:
    """The budget the start's retries get after a failed adopted load is the same age."""
    flag = tmp_path / "first-spawn-done"
    # The first spawn loads for a minute but dies 8 s in; every later one is ready at once.
    wrapper = [
        "sh",
        "-c",
        f'if [ -e {flag} ]; then exec "$@"; fi; touch {flag}; '
        'exec "$@" --ready-after 60 --exit-after 8 --exit-code 3',
        "sh",
    ]
    with HostProc(tmp_path, env=ENV) as h:
        h.start()
        iid, pid = spawn_loading(h, fake_wrapper=wrapper)
        h.kill()
        clock_stepped_an_hour(h, iid)
        h.start()
        assert get(h, iid)["pid"] == pid
        inst = wait_for(
            lambda: (i := get(h, iid))["status"] == "running" and i["pid"] != pid and i,
            30,
            "the start's retry after the adopted backend died",
        )
        assert [p.pid for p in h.backends()] == [inst["pid"]], h.log()

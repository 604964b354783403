"""State files: last good copies, group commits, incremental encoding, the durable ledger,
restore-state, and SIGKILL during saves of config.json, the jobs store and the ledger.

The SIGKILL loops run a few rounds by default and more with SOLAR_LONG_TESTS=1.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from solar_host.cli.restore import restore_state
from solar_host.events import EventBus
from solar_host.instances.schemas import Instance, parse_config
from solar_host.instances.store import (
    InstanceStore,
    ProcessRecord,
    QuarantinedEntry,
    StoredInstance,
)
from solar_host.platform.statefiles import GroupCommit, StateFileError, atomic_write_bytes
from solar_host.resources.ledger_store import ReservationStore
from solar_host.resources.schemas import ReservationRequest
from solar_host.resources.service import ResourceService
from solar_host.settings import Settings
from tests.fixtures.hostproc import ROOT, HostProc
from tests.fixtures.probes import FakeProbe
from tests.fixtures.script_backend import script_config

ROUNDS = 12 if os.environ.get("SOLAR_LONG_TESTS") else 3


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- last good copy --------------------------------------------------------------------------


def test_each_write_keeps_the_previous_version(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write_bytes(path, b"one", 0o600, keep_previous=True)
    assert not (tmp_path / "state.json.prev").exists()  # nothing to keep yet
    atomic_write_bytes(path, b"two", 0o600, keep_previous=True)
    atomic_write_bytes(path, b"three", 0o600, keep_previous=True)
    assert path.read_bytes() == b"three"
    assert (tmp_path / "state.json.prev").read_bytes() == b"two"
    assert mode(path) == 0o600 and mode(tmp_path / "state.json.prev") == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.prev"]


def test_refusal_names_the_file_and_its_last_good_copy(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"instances": [')
    with pytest.raises(StateFileError) as err:
        InstanceStore(path, tmp_path).load()
    assert "no last good copy exists" in str(err.value)
    (tmp_path / "config.json.prev").write_text('{"instances": []}')
    with pytest.raises(StateFileError) as err:
        InstanceStore(path, tmp_path).load()
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "not valid JSON" in msg
    assert "config.json.prev" in msg and "solar-host restore-state" in msg


# --- group commits ---------------------------------------------------------------------------


async def test_group_commit_covers_every_change_that_arrived_meanwhile() -> None:
    state = {"changes": 0}
    written: list[int] = []

    def write(data: bytes) -> None:
        time.sleep(0.02)  # a slow fsync
        written.append(int(data))

    commits = GroupCommit(lambda: str(state["changes"]).encode(), write)

    async def change() -> int:
        state["changes"] += 1
        mine = state["changes"]
        await commits.commit()
        return mine

    mine = await asyncio.gather(*(change() for _ in range(50)))
    assert written[-1] == 50  # the last write holds every change
    assert len(written) <= 3  # 50 callers, a couple of writes
    # Each caller returned after a write holding its own change.
    assert all(any(w >= m for w in written) for m in mine)


async def test_group_commit_hands_a_write_error_to_every_caller_it_covered() -> None:
    fail = [True]

    def write(data: bytes) -> None:
        time.sleep(0.01)
        if fail[0]:
            raise OSError(28, "No space left on device")

    commits = GroupCommit(lambda: b"x", write)
    results = await asyncio.gather(*(commits.commit() for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results)
    fail[0] = False
    await commits.commit()  # the next write is tried afresh


# --- config.json encoding ----------------------------------------------------------------------


def records(tmp_path: Path, n: int) -> list[StoredInstance]:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    out = []
    for i in range(n):
        raw = {"backend_type": "llamacpp", "alias": f"a{i}", "model": str(model), "x": [i]}
        config = parse_config(raw, models_dir=tmp_path, strict=False)
        inst = Instance(id=str(uuid.uuid4()), config=config, created_at=datetime.now(UTC))
        out.append(StoredInstance(instance=inst))
    return out


@pytest.mark.parametrize("value", ["false", 0, None, [False]])
def test_a_want_running_that_is_not_a_boolean_quarantines_its_entry(
    tmp_path: Path, value: Any
) -> None:
    """bool() read "false" (a hand edit) as true: the host started what the entry said it did
    not want. An entry that does not say true or false is quarantined, as other damage is."""
    store = InstanceStore(tmp_path / "config.json", tmp_path)
    [rec] = records(tmp_path, 1)
    entry = {"instance": rec.instance.model_dump(mode="json"), "want_running": value}
    result = store.parse(json.dumps({"instances": [entry]}).encode())
    assert result.records == []
    [q] = result.quarantined
    assert "want_running" in q.reason


def test_incremental_encoding_gives_the_full_encoding(tmp_path: Path) -> None:
    store = InstanceStore(tmp_path / "config.json", tmp_path)
    recs = records(tmp_path, 30)
    store.extra = {"written_by": {"instances": [0]}}
    store.quarantined = [QuarantinedEntry(2, {"id": "q", "config": {}}, "bad")]
    roles = ["inference"]
    assert store.encode(recs, roles) == store.encode_full(recs, roles)
    # Every kind of assignment is seen: of the record, its instance, config, process.
    recs[0].want_running = True
    recs[1].instance.status = "running"  # type: ignore[assignment]
    recs[2].instance.config.alias = "renamed"
    recs[3].process = ProcessRecord(pid=7, create_time=1.5, cmdline=["x"], port=9)
    assert store.encode(recs, roles) == store.encode_full(recs, roles)
    recs[3].process.port = 10  # type: ignore[union-attr]
    recs[4].instance.config = parse_config(
        {"backend_type": "llamacpp", "alias": "new", "model": str(tmp_path / "m.gguf")},
        models_dir=tmp_path,
        strict=False,
    )
    del recs[5]
    recs.append(records(tmp_path, 1)[0])
    assert store.encode(recs, roles) == store.encode_full(recs, roles)
    assert json.loads(store.encode(recs, roles))["instances"][2]["id"] == "q"
    assert store.encode([], roles) == store.encode_full([], roles)


async def test_a_change_made_in_place_is_written_once_saves_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("solar_host.instances.store.VERIFY_IDLE_S", 0.05)
    path = tmp_path / "config.json"
    store = InstanceStore(path, tmp_path)
    recs = records(tmp_path, 3)
    await store.save(recs, ["inference"])
    recs[1].instance.supported_endpoints.append("/in-place")  # not an assignment
    await store.save(recs, ["inference"])
    deadline = time.monotonic() + 10
    while b"/in-place" not in path.read_bytes():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert path.read_bytes() == store.encode_full(recs, ["inference"])
    store.close()


# --- the durable ledger ------------------------------------------------------------------------


def ledger_service(tmp_path: Path) -> ResourceService:
    settings = Settings(api_key="k" * 20, config_file=tmp_path / "config.json")
    return ResourceService(settings, bus=EventBus(), probe=FakeProbe(ram=(64, 8)))


async def test_reservations_survive_a_restart_and_expired_ones_are_dropped(
    tmp_path: Path,
) -> None:
    svc = ledger_service(tmp_path)
    await svc.load_state()
    kept = await svc.reserve(ReservationRequest(job_id="j1", vram_gb=0, ram_gb=8))
    short = await svc.reserve(ReservationRequest(job_id="j2", vram_gb=0, ram_gb=4, ttl_seconds=1))
    gone = await svc.reserve(ReservationRequest(job_id="j3", vram_gb=0, ram_gb=2))
    await svc.unreserve(gone["id"])
    path = tmp_path / "reservations.json"
    assert mode(path) == 0o600
    assert (tmp_path / "reservations.json.prev").exists()

    again = ledger_service(tmp_path)
    await again.load_state()
    ids = [r["id"] for r in again.snapshot()["reservations"]]
    assert ids == [kept["id"], short["id"]]
    # The claimed capacity counts at once: what control was given is not handed out again.
    assert again.snapshot()["ram"]["reserved_headroom_gb"] == 12.0

    later = ReservationStore(path, list).load(now=datetime.now(UTC) + timedelta(seconds=5))
    assert [r.id for r in later] == [kept["id"]]


async def test_reservation_store_that_cannot_be_parsed_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "reservations.json"
    for damaged in (b"", b"{", b'{"reservations": [{"id": 1}]}', b"\xff"):
        path.write_bytes(damaged)
        with pytest.raises(StateFileError, match="reservations"):
            await ledger_service(tmp_path).load_state()
        assert path.read_bytes() == damaged


DEEP = b"[" * 100_000 + b"]" * 100_000  # deeper than json's recursion


@pytest.mark.parametrize(
    "damaged",
    [b"{}", b'{"roles": ["inference"]}', b'{"instance": []}', DEEP],
)
def test_config_json_without_its_instance_list_is_refused_not_read_as_empty(
    tmp_path: Path, damaged: bytes
) -> None:
    """Read as "no instances", such a file made the boot sweep stop every backend and the
    boot save replace the good previous copy with the damage (review of the state files)."""
    cfg = tmp_path / "config.json"
    cfg.write_bytes(damaged)
    good = b'{"roles": ["inference"], "instances": []}'
    (tmp_path / "config.json.prev").write_bytes(good)
    with pytest.raises(StateFileError, match=r"config\.json"):
        InstanceStore(cfg, tmp_path).load()
    assert cfg.read_bytes() == damaged
    assert (tmp_path / "config.json.prev").read_bytes() == good


@pytest.mark.parametrize("damaged", [b"{}", b'{"version": 1}', b'{"jobs": {}}', DEEP])
def test_a_jobs_store_without_its_job_list_is_refused(tmp_path: Path, damaged: bytes) -> None:
    from solar_host.jobs.store import parse_store

    with pytest.raises(StateFileError, match="jobs"):
        parse_store(tmp_path / "jobs.json", damaged)


def test_restore_state_takes_back_a_file_nested_too_deeply_to_parse(tmp_path: Path) -> None:
    settings = Settings(api_key="k" * 20, config_file=tmp_path / "config.json")
    cfg = tmp_path / "config.json"
    cfg.write_bytes(DEEP)
    good = b'{"roles": ["inference"], "instances": []}'
    (tmp_path / "config.json.prev").write_bytes(good)
    said: list[str] = []
    assert restore_state(settings, say=said.append) == 0
    assert cfg.read_bytes() == good, said
    from solar_host.resources.ledger_store import parse_reservations

    with pytest.raises(StateFileError, match="nested too deeply"):
        parse_reservations(tmp_path / "reservations.json", DEEP)


# --- restore-state -----------------------------------------------------------------------------


def test_restore_state_puts_the_last_good_copy_back_and_keeps_the_damaged_file(
    tmp_path: Path,
) -> None:
    settings = Settings(api_key="k" * 20, config_file=tmp_path / "config.json")
    cfg = tmp_path / "config.json"
    good = b'{"roles": ["inference"], "instances": []}'
    cfg.write_bytes(b'{"roles": ["infe')
    (tmp_path / "config.json.prev").write_bytes(good)
    said: list[str] = []
    assert restore_state(settings, dry_run=True, say=said.append) == 0
    assert cfg.read_bytes() == b'{"roles": ["infe' and "would be replaced" in said[0]
    said.clear()
    assert restore_state(settings, say=said.append) == 0
    assert cfg.read_bytes() == good and mode(cfg) == 0o600
    [aside] = tmp_path.glob("config.json.damaged-*")
    assert aside.read_bytes() == b'{"roles": ["infe'
    assert "DAMAGED" in said[0] and str(aside) in said[0]
    # Nothing left to restore: every file ok.
    said.clear()
    assert restore_state(settings, say=said.append) == 0
    assert all(": ok" in line for line in said)


def test_a_state_file_removed_while_its_last_good_copy_exists_is_refused(
    tmp_path: Path,
) -> None:
    settings = Settings(api_key="k" * 20, config_file=tmp_path / "config.json")
    (tmp_path / "config.json.prev").write_text('{"roles": ["inference"], "instances": []}')
    with pytest.raises(StateFileError, match="missing but its last good copy exists"):
        InstanceStore(tmp_path / "config.json", tmp_path).load()
    assert restore_state(settings, say=lambda _: None) == 0
    assert InstanceStore(tmp_path / "config.json", tmp_path).load().records == []


def test_restore_state_without_a_usable_copy_changes_nothing_and_fails(tmp_path: Path) -> None:
    settings = Settings(api_key="k" * 20, config_file=tmp_path / "config.json")
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b"null")
    said: list[str] = []
    assert restore_state(settings, say=said.append) == 1
    assert cfg.read_bytes() == b"null" and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json"
    ]


# --- SIGKILL during saves --------------------------------------------------------------------


def test_jobs_store_killed_while_saving_loses_no_acknowledged_job(tmp_path: Path) -> None:
    path = tmp_path / "jobs_store.json"
    script = textwrap.dedent(f"""
        import asyncio
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from solar_host.jobs.schemas import JobState, JobStatus
        from solar_host.jobs.store import JobStore

        async def main() -> None:
            store = JobStore(Path({str(path)!r}))
            store.load()
            start = int(sys.argv[1])
            for i in range(start, start + 100000):
                await store.add(JobState(job_id=f"j{{i}}", name="n", status=JobStatus.completed))
                print(f"j{{i}}", flush=True)  # acknowledged: add() returned after the write

        asyncio.run(main())
    """)
    acked: list[str] = []
    rng = random.Random(16)
    for _ in range(ROUNDS):
        p = subprocess.Popen(
            [sys.executable, "-c", script, str(len(acked) * 10 + 1000 * _)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None
        first = p.stdout.readline().strip()
        assert first
        lines = [first]
        time.sleep(rng.uniform(0.05, 0.4))
        p.send_signal(signal.SIGKILL)
        out, _err = p.communicate()
        lines += out.split()
        acked += lines
        doc = json.loads(path.read_text())  # never torn
        on_disk = {j["job_id"] for j in doc["jobs"]}
        missing = [j for j in acked if j not in on_disk]
        assert not missing, missing[:5]
        assert mode(path) == 0o600


def churn_then_kill(h: HostProc, work: Any, rng: random.Random, workers: int = 4) -> None:
    """`workers` clients each call `work(client, rng, mine, seed)` in a loop; the host is
    SIGKILLed under them after a random while."""
    stop = threading.Event()

    def run(seed: int) -> None:
        r = random.Random(seed)
        mine: list[str] = []
        with httpx.Client(base_url=h.url, headers={"X-API-Key": h.api_key}, timeout=10) as c:
            while not stop.is_set():
                try:
                    work(c, r, mine, seed)
                except httpx.HTTPError:
                    return  # the host died under it: that is the point

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.3, 1.2))
    h.kill()
    stop.set()
    for t in threads:
        t.join(15)


def test_reservations_killed_while_saving_lose_no_acknowledged_change(tmp_path: Path) -> None:
    """Concurrent reserve/release over HTTP, host SIGKILLed: every acknowledged reservation is
    there after the restart and every acknowledged release stays released."""
    held: set[str] = set()
    released: set[str] = set()
    lock = threading.Lock()

    def work(c: httpx.Client, r: random.Random, mine: list[str], seed: int) -> None:
        if mine and r.random() < 0.4:
            rid = mine.pop(r.randrange(len(mine)))
            with lock:
                held.discard(rid)  # a release cut short by the kill may or may not be kept
            if c.delete(f"/resources/reservations/{rid}").status_code == 200:
                with lock:
                    released.add(rid)
            return
        body = {"job_id": f"j{seed}", "vram_gb": 0, "ram_gb": 0.0001}
        resp = c.post("/resources/reservations", json=body)
        if resp.status_code == 201:
            with lock:
                held.add(resp.json()["id"])
            mine.append(resp.json()["id"])

    rng = random.Random(4)
    with HostProc(tmp_path) as h:
        for _ in range(ROUNDS):
            h.start(timeout=60)
            churn_then_kill(h, work, rng)
            path = tmp_path / "reservations.json"
            doc = json.loads(path.read_text()) if path.exists() else {"reservations": []}
            on_disk = {r["id"] for r in doc["reservations"]}  # never torn
            assert held <= on_disk, sorted(held - on_disk)[:5]
            assert not (released & on_disk), sorted(released & on_disk)[:5]
            h.start(timeout=60)
            with h.client() as c:
                listed = {r["id"] for r in c.get("/resources").json()["reservations"]}
            assert held <= listed and not (released & listed)
            h.kill()
        assert held, "no reservation was ever acknowledged"


def test_config_json_killed_while_saving_loses_no_acknowledged_change(tmp_path: Path) -> None:
    acked: set[str] = set()
    deleted: set[str] = set()
    lock = threading.Lock()

    def work(c: httpx.Client, r: random.Random, mine: list[str], seed: int) -> None:
        if mine and r.random() < 0.3:
            iid = mine.pop()
            with lock:
                acked.discard(iid)  # a delete cut short by the kill may or may not be kept
            if c.delete(f"/instances/{iid}").status_code == 200:
                with lock:
                    deleted.add(iid)
            return
        cfg = script_config(tmp_path, alias=f"k{seed}")
        resp = c.post("/instances", json={"config": cfg})
        if resp.status_code == 200:
            iid = resp.json()["instance"]["id"]
            with lock:
                acked.add(iid)
            mine.append(iid)

    rng = random.Random(5)
    with HostProc(tmp_path) as h:
        for _ in range(ROUNDS):
            h.start(timeout=60)
            churn_then_kill(h, work, rng)
            doc: dict[str, Any] = json.loads((tmp_path / "config.json").read_text())
            on_disk = {e["instance"]["id"] for e in doc["instances"]}
            assert acked <= on_disk, sorted(acked - on_disk)[:5]
            assert not (deleted & on_disk)
        assert acked


def test_restore_state_refuses_while_a_host_holds_the_state_directory(tmp_path: Path) -> None:
    """A running host would write over what is put back (and restore would replace a file
    under it): nothing is touched, exit 2, and the message names the holder."""
    from solar_host.platform.statelock import StateLock

    settings = Settings(
        api_key="k" * 20,
        config_file=tmp_path / "config.json",
        log_dir=tmp_path / "logs",
        jobs_dir=tmp_path / "jobs",
    )
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"roles": ["infe')
    (tmp_path / "config.json.prev").write_bytes(b'{"roles": ["inference"], "instances": []}')
    lock = StateLock.for_host(settings)
    lock.acquire()
    try:
        said: list[str] = []
        assert restore_state(settings, say=said.append) == 2
        assert cfg.read_bytes() == b'{"roles": ["infe'
        assert "nothing restored" in said[0] and f"pid {os.getpid()}" in said[0]
    finally:
        lock.release()
    assert restore_state(settings, say=lambda _: None) == 0

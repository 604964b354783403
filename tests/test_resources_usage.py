"""Per-container accounting against real processes and real files, and the service's loops."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from solar_host.events import EventBus, ReservationsChanged
from solar_host.resources.ledger import CapacityExceeded, Ledger, SystemUsage
from solar_host.resources.probes import GB
from solar_host.resources.schemas import ReservationRequest
from solar_host.resources.service import ResourceService, read_system_usage
from solar_host.resources.usage import (
    dir_size_bytes,
    measure_jobs,
    process_tree,
    tree_gpu_bytes,
    workspace_dir,
)
from solar_host.settings import Settings
from tests.fixtures.probes import FakeProbe
from tests.test_resources_ledger import FakeJobs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process trees via /proc")

MB = 1024 * 1024


@pytest.fixture
def proc_tree():
    """A real parent with one real child; yields (parent_pid, child_pid)."""
    code = (
        "import subprocess, sys, time;"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
        "print(c.pid, flush=True); time.sleep(30)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        yield parent.pid, child_pid
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait(timeout=10)


def test_dir_size(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "one.bin").write_bytes(b"x" * MB)
    (tmp_path / "a" / "b" / "two.bin").write_bytes(b"y" * MB)
    (tmp_path / "a" / "link").symlink_to(tmp_path / "a" / "one.bin")  # not counted twice
    assert dir_size_bytes(tmp_path / "a") == 2 * MB
    assert dir_size_bytes(tmp_path / "missing") is None


def test_workspace_dir_stays_inside_jobs_dir(tmp_path: Path) -> None:
    assert workspace_dir(tmp_path, "job-1") == tmp_path / "job-1"
    for bad in ("..", "../etc", "a/b", "", "."):
        assert workspace_dir(tmp_path, bad) is None


def test_process_tree_and_gpu_sum(proc_tree) -> None:
    parent, child = proc_tree
    assert {parent, child} <= process_tree(parent)
    gpu = {parent: 2 * GB, child: int(1.5 * GB), 999_999_999: 7 * GB}  # last one unrelated
    assert tree_gpu_bytes(parent, gpu) == int(3.5 * GB)
    assert tree_gpu_bytes(child, gpu) == int(1.5 * GB)  # only the child's subtree
    assert tree_gpu_bytes(parent, {}) is None  # NVML saw nothing
    assert tree_gpu_bytes(0, gpu) is None and tree_gpu_bytes(None, gpu) is None
    assert process_tree(0) == set()


def test_measure_jobs(tmp_path: Path, proc_tree) -> None:
    parent, child = proc_tree
    (tmp_path / "job-1").mkdir()
    (tmp_path / "job-1" / "out.bin").write_bytes(b"z" * MB)
    jobs = FakeJobs()
    jobs.pids["job-1"] = parent
    jobs.memory["job-1"] = 6 * GB
    probe = FakeProbe(gpus=[(80, 10)], gpu_process_memory={child: 2 * GB})
    out = measure_jobs(["job-1", "job-1", "job-2"], jobs, probe, tmp_path)
    assert probe.calls["gpu_process_memory"] == 1
    assert out["job-1"].as_tuple() == (2.0, 6.0, round(MB / GB, 4))
    assert out["job-2"].as_tuple() == (None, None, None)  # no container, no workspace


def test_live_probe_reads_this_machine(tmp_path: Path) -> None:
    from solar_host.resources.probes import LiveProbe

    usage = read_system_usage(LiveProbe(), tmp_path / "models-not-yet-created")
    assert usage.ram is not None and usage.ram.total_bytes == psutil.virtual_memory().total
    assert usage.disk is not None and usage.disk.total_bytes > 0
    assert usage.memory_type in ("VRAM", "RAM")


def test_concurrent_creates_never_overcommit(monkeypatch: pytest.MonkeyPatch) -> None:
    """50 threads race for 10 GiB in 1 GiB..3 GiB pieces, with slow steps around the check."""
    import solar_host.resources.ledger as ledger_mod

    make_id = ledger_mod.new_reservation_id

    def slow_id() -> str:  # runs between the capacity check and the insert
        time.sleep(0.001)
        return make_id()

    monkeypatch.setattr(ledger_mod, "new_reservation_id", slow_id)
    probe = FakeProbe(gpus=[(12, 2)], ram=(64, 0))

    def slow_read() -> SystemUsage:
        time.sleep(0.001)  # widen the window between read and insert
        return read_system_usage(probe, Path("/"))

    ledger = Ledger(lambda job_id: False)
    barrier = threading.Barrier(50)

    def create(i: int) -> bool:
        barrier.wait(timeout=10)
        try:
            ledger.create(
                ReservationRequest(job_id=f"job-{i}", vram_gb=1 + i % 3, ram_gb=0),
                slow_read,
                default_ttl_s=60,
            )
            return True
        except CapacityExceeded:
            return False

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(create, range(50)))
    snap = ledger.snapshot(slow_read())
    reserved = sum(r["vram_gb"] for r in snap["reservations"])
    assert reserved <= 10.0
    assert sum(results) == len(snap["reservations"]) > 0
    assert reserved >= 8.0  # refused only when a piece no longer fit


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        api_key="k" * 20,
        config_file=tmp_path / "config.json",
        models_dir=tmp_path / "models",
        jobs_dir=tmp_path / "jobs",
        resource_usage_interval_s=0.05,
        reservation_cleanup_interval_s=0.05,
    )


async def wait_for(cond, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_loops_refresh_usage_and_expire(settings: Settings, proc_tree) -> None:
    parent, _child = proc_tree
    (settings.jobs_dir / "job-run").mkdir(parents=True)
    (settings.jobs_dir / "job-run" / "ckpt").write_bytes(b"c" * MB)
    probe = FakeProbe(gpus=[(24, 8)], gpu_process_memory={parent: 3 * GB})
    bus = EventBus()
    events: list[str] = []
    bus.subscribe(lambda e: events.append(e.reason), ReservationsChanged)
    svc = ResourceService(settings, bus=bus, probe=probe)
    run = svc.create(ReservationRequest(job_id="job-run", vram_gb=8, ram_gb=4))
    brief = svc.create(ReservationRequest(job_id="job-idle", vram_gb=1, ram_gb=0, ttl_seconds=0.2))
    await svc.start()  # no jobs service yet: nothing runs, the loops still run
    try:
        await wait_for(lambda: svc.usage_refreshes >= 2)
        # Removed by the sweep (get() answers None as soon as the TTL passes, sweep or not).
        await wait_for(lambda: "expired" in events)
        assert svc.get(brief["id"]) is None
        assert events == ["created", "created", "expired"]
        jobs = FakeJobs()
        jobs.running.add("job-run")
        jobs.pids["job-run"] = parent
        jobs.memory["job-run"] = 1 * GB
        svc.jobs = jobs
        await wait_for(lambda: (svc.get(run["id"]) or {}).get("actual_vram_gb") == 3.0)
        view = svc.get(run["id"])
        assert view["status"] == "running"
        assert view["actual_ram_gb"] == 1.0 and view["actual_disk_gb"] == round(MB / GB, 4)
        svc._system = type(svc._system)(0.0)
        snap = svc.snapshot()
        assert snap["vram"]["reserved_headroom_gb"] == 5.0  # 8 reserved - 3 measured
        assert snap["ram"]["reserved_headroom_gb"] == 3.0
        summary = svc.health_summary()
        assert summary["active_count"] == 1 and summary["vram"] == snap["vram"]
        # The job ends: actuals are dropped and the reservation counts in full again.
        jobs.running.clear()
        await wait_for(lambda: svc.ledger._items[run["id"]].actual_vram_gb is None)
        assert svc.snapshot()["vram"]["reserved_headroom_gb"] == 8.0
    finally:
        await svc.stop()
    assert all(t.done() for t in asyncio.all_tasks() if t.get_name().startswith("res"))
    n = svc.usage_refreshes
    await asyncio.sleep(0.15)
    assert svc.usage_refreshes == n  # stopped for good


async def test_loop_survives_a_failing_job_view(settings: Settings) -> None:
    class Broken(FakeJobs):
        def container_memory_bytes(self, job_id: str) -> int | None:
            raise RuntimeError("docker went away")

    jobs = Broken()
    jobs.running.add("job-1")
    svc = ResourceService(settings, bus=EventBus(), probe=FakeProbe(), jobs=jobs)
    svc.create(ReservationRequest(job_id="job-1", vram_gb=0, ram_gb=1))
    await svc.start()
    try:
        await wait_for(lambda: svc.usage_refreshes >= 3)
    finally:
        await svc.stop()
    assert svc.snapshot()["reservations"][0]["actual_ram_gb"] is None

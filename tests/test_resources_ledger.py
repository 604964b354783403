"""The accounting formula, capacity checks, release and expiry of the reservation ledger."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from solar_host.events import EventBus, ReservationsChanged
from solar_host.resources.ledger import (
    CapacityExceeded,
    DimensionUnreadable,
    ReservationNotFound,
    ReservationRunning,
)
from solar_host.resources.schemas import ReservationRequest
from solar_host.resources.service import ResourceService
from solar_host.settings import Settings
from tests.fixtures.probes import FakeProbe


class FakeJobs:
    """A JobView: which jobs run, and what their containers report."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.pids: dict[str, int] = {}
        self.memory: dict[str, int] = {}

    def is_running(self, job_id: str) -> bool:
        return job_id in self.running

    def container_root_pid(self, job_id: str) -> int | None:
        return self.pids.get(job_id)

    def container_memory_bytes(self, job_id: str) -> int | None:
        return self.memory.get(job_id)


def req(job_id: str = "job-1", vram: float = 0.0, ram: float = 0.0, **kw) -> ReservationRequest:
    return ReservationRequest(job_id=job_id, vram_gb=vram, ram_gb=ram, **kw)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        api_key="k" * 20,
        config_file=tmp_path / "config.json",
        models_dir=tmp_path / "models",
        jobs_dir=tmp_path / "jobs",
    )


@pytest.fixture
def gpu_probe() -> FakeProbe:
    return FakeProbe(gpus=[(24, 8)], ram=(16, 4), disk=(500, 100))


@pytest.fixture
def svc(settings: Settings, gpu_probe: FakeProbe) -> ResourceService:
    s = ResourceService(settings, bus=EventBus(), probe=gpu_probe)
    s.jobs = FakeJobs()
    return s


def fresh(svc: ResourceService) -> dict:
    """A snapshot with the 1 s system cache bypassed (the probe was just changed)."""
    svc._system = type(svc._system)(0.0)
    return svc.snapshot()


def test_empty_gpu_host(svc: ResourceService, gpu_probe: FakeProbe, settings: Settings) -> None:
    snap = svc.snapshot()
    assert snap["memory_type"] == "VRAM"
    assert snap["vram"] == {
        "total_gb": 24.0,
        "system_used_gb": 8.0,
        "reserved_headroom_gb": 0.0,
        "reported_used_gb": 8.0,
        "available_gb": 16.0,
    }
    assert snap["ram"]["available_gb"] == 12.0
    assert snap["disk"]["total_gb"] == 500.0 and snap["disk"]["available_gb"] == 400.0
    assert snap["reservations"] == []
    # Ruling 16: the disk dimension is the filesystem of MODELS_DIR.
    assert gpu_probe.disk_paths[-1] == settings.models_dir


def test_pending_counts_in_full(svc: ResourceService) -> None:
    svc.create(req(vram=4))
    snap = svc.snapshot()
    assert snap["vram"]["reserved_headroom_gb"] == 4.0
    assert snap["vram"]["reported_used_gb"] == 12.0
    assert snap["vram"]["available_gb"] == 12.0
    svc.create(req("job-2", vram=3))
    svc.create(req("job-3", vram=2, disk_gb=50))
    snap = svc.snapshot()
    assert snap["vram"]["reserved_headroom_gb"] == 9.0 and snap["vram"]["available_gb"] == 7.0
    assert snap["disk"]["reserved_headroom_gb"] == 50.0 and snap["disk"]["available_gb"] == 350.0
    view = snap["reservations"][0]
    assert view["status"] == "pending" and view["actual_vram_gb"] is None
    assert view["id"].startswith("res-") and len(view["id"]) == 4 + 32
    int(view["id"][4:], 16)


def test_running_counts_unused_headroom_only(svc: ResourceService) -> None:
    view = svc.create(req("job-1", vram=8, ram=4))
    svc.jobs.running.add("job-1")
    svc.ledger.set_actuals({view["id"]: (5.0, 2.0, None)})
    snap = svc.snapshot()
    assert snap["reservations"][0]["status"] == "running"
    assert snap["reservations"][0]["actual_vram_gb"] == 5.0
    assert snap["vram"]["reserved_headroom_gb"] == 3.0 and snap["vram"]["available_gb"] == 13.0
    assert snap["ram"]["reserved_headroom_gb"] == 2.0  # dimensions are independent
    # Actual above reserved: no negative headroom.
    svc.ledger.set_actuals({view["id"]: (9.5, 6.0, None)})
    snap = svc.snapshot()
    assert snap["vram"]["reserved_headroom_gb"] == 0.0 and snap["vram"]["available_gb"] == 16.0
    assert snap["ram"]["reserved_headroom_gb"] == 0.0
    # Running but not yet measured: the whole reservation is still headroom.
    svc.ledger.set_actuals({})
    assert svc.snapshot()["vram"]["reserved_headroom_gb"] == 8.0


def test_status_follows_the_job(svc: ResourceService) -> None:
    view = svc.create(req("job-7", vram=2))
    assert view["status"] == "pending"
    svc.jobs.running.add("job-7")
    assert svc.get(view["id"])["status"] == "running"
    svc.jobs.running.clear()
    assert svc.get(view["id"])["status"] == "pending"
    svc.jobs = None  # no jobs service: nothing runs
    assert svc.snapshot()["reservations"][0]["status"] == "pending"


def test_pending_hides_stale_actuals(svc: ResourceService) -> None:
    view = svc.create(req("job-1", vram=8))
    svc.ledger.set_actuals({view["id"]: (5.0, 1.0, 0.1)})
    snap = svc.snapshot()  # job-1 does not run: full headroom, no actuals shown
    assert snap["vram"]["reserved_headroom_gb"] == 8.0
    assert snap["reservations"][0]["actual_vram_gb"] is None


def test_capacity_exceeded_per_dimension(svc: ResourceService) -> None:
    with pytest.raises(CapacityExceeded) as e:
        svc.create(req(vram=20))
    assert (e.value.dimension, e.value.requested_gb, e.value.available_gb) == ("vram", 20, 16.0)
    with pytest.raises(CapacityExceeded) as e:
        svc.create(req(ram=15))
    assert e.value.dimension == "ram" and e.value.available_gb == 12.0
    with pytest.raises(CapacityExceeded) as e:
        svc.create(req(disk_gb=500))
    assert e.value.dimension == "disk" and e.value.available_gb == 400.0
    assert e.value.body() == {
        "error": "capacity_exceeded",
        "dimension": "disk",
        "requested_gb": 500,
        "available_gb": 400.0,
    }
    svc.create(req(vram=10))
    with pytest.raises(CapacityExceeded):
        svc.create(req(vram=8))
    assert len(svc.snapshot()["reservations"]) == 1  # the refused ones left nothing behind
    svc.create(req(vram=6))  # exactly what is left fits
    assert svc.snapshot()["vram"]["available_gb"] == 0.0


def test_cpu_host_folds_vram_into_ram(settings: Settings) -> None:
    svc = ResourceService(settings, bus=EventBus(), probe=FakeProbe(ram=(16, 4)))
    view = svc.create(req(vram=4, ram=1))
    assert view["vram_gb"] == 0.0 and view["ram_gb"] == 5.0
    # Stored as requested: the fold is the accounting's, not the record's.
    (record,) = svc.ledger.records()
    assert (record.vram_gb, record.ram_gb) == (4.0, 1.0)
    assert svc.reserved_bytes() == {"gpu": 0, "cpu": 5 * 1024**3}
    snap = svc.snapshot()
    assert snap["memory_type"] == "RAM" and snap["vram"] is None
    assert snap["ram"]["reserved_headroom_gb"] == 5.0 and snap["ram"]["available_gb"] == 7.0
    with pytest.raises(CapacityExceeded) as e:
        svc.create(req(vram=20))
    assert e.value.dimension == "ram" and e.value.requested_gb == 20
    # Never null, even on a CPU host (control sums them with float()).
    assert isinstance(snap["reservations"][0]["vram_gb"], float)


def test_gpu_host_stores_request_unchanged(svc: ResourceService) -> None:
    view = svc.create(req(vram=4, ram=1))
    assert (view["vram_gb"], view["ram_gb"], view["disk_gb"]) == (4.0, 1.0, None)


def test_multi_gpu_totals_are_summed(settings: Settings) -> None:
    probe = FakeProbe(gpus=[(80, 10), (80, 30)])
    svc = ResourceService(settings, bus=EventBus(), probe=probe)
    snap = svc.snapshot()
    assert snap["vram"]["total_gb"] == 160.0 and snap["vram"]["available_gb"] == 120.0
    svc.create(req(vram=100))  # larger than one GPU's free memory: fits the summed figure


def test_probe_failures_drop_the_dimension(settings: Settings) -> None:
    probe = FakeProbe(gpus=[(24, 8)])
    probe.fail.update({"gpus", "disk"})
    svc = ResourceService(settings, bus=EventBus(), probe=probe)
    snap = svc.snapshot()
    # Still a GPU host (the probe's gpu_type says so): a failed read is not a CPU host.
    assert snap["memory_type"] == "VRAM" and snap["vram"] is None and snap["disk"] is None
    assert snap["ram"]["total_gb"] == 16.0
    probe.set_disk(None)
    probe.fail.clear()
    assert fresh(svc)["disk"] is None  # a filesystem that cannot be read


def test_system_read_is_cached(svc: ResourceService, gpu_probe: FakeProbe) -> None:
    for _ in range(50):
        svc.snapshot()
        svc.health_summary()
    assert gpu_probe.calls["gpus"] == 1 and gpu_probe.calls["ram"] == 1


def test_release(svc: ResourceService) -> None:
    events: list[ReservationsChanged] = []
    svc.bus.subscribe(events.append, ReservationsChanged)
    view = svc.create(req("job-1", vram=4))
    assert svc.release(view["id"]) == {"detail": "released", "id": view["id"]}
    assert svc.snapshot()["vram"]["available_gb"] == 16.0
    with pytest.raises(ReservationNotFound) as e:
        svc.release(view["id"])
    assert str(e.value) == f"Reservation '{view['id']}' not found"
    running = svc.create(req("job-2", vram=4))
    svc.jobs.running.add("job-2")
    with pytest.raises(ReservationRunning, match="job 'job-2' is currently running"):
        svc.release(running["id"])
    assert [e.reason for e in events] == ["created", "released", "created"]


def test_ttl_and_expiry(svc: ResourceService) -> None:
    now = datetime.now(UTC)
    short = svc.create(req("a", ttl_seconds=60))
    long = svc.create(req("b", ttl_seconds=3600))
    running = svc.create(req("c", ttl_seconds=1))
    default = svc.create(req("d"))
    week = svc.create(req("e", ttl_seconds=7 * 86400))
    svc.jobs.running.add("c")
    expires = datetime.fromisoformat(default["expires_at"])
    assert abs((expires - now).total_seconds() - 86400) < 2  # default TTL applied
    assert svc.cleanup_expired(now + timedelta(seconds=120)) == 1
    ids = {r["id"] for r in svc.snapshot()["reservations"]}
    assert short["id"] not in ids and {long["id"], running["id"]} <= ids
    assert svc.cleanup_expired(now + timedelta(hours=12)) == 1  # b (1 h) goes, d stays
    assert svc.cleanup_expired(now + timedelta(hours=25)) == 1  # d
    assert svc.cleanup_expired(now + timedelta(days=2)) == 0  # the week-long one is kept
    assert week["id"] in {r["id"] for r in svc.snapshot()["reservations"]}
    svc.jobs.running.clear()  # a running reservation expires once its job ends
    assert svc.cleanup_expired(now + timedelta(days=8)) == 2


def test_naive_expires_at_is_utc(svc: ResourceService) -> None:
    naive = (datetime.now(UTC) + timedelta(hours=1)).replace(tzinfo=None, microsecond=0)
    view = svc.create(req(expires_at=naive))
    assert view["expires_at"] == naive.isoformat() + "Z"
    # Comparable with aware times: the sweep works (upstream raised TypeError every cycle).
    assert svc.cleanup_expired(datetime.now(UTC)) == 0
    assert svc.cleanup_expired(datetime.now(UTC) + timedelta(hours=2)) == 1


def test_request_validation() -> None:
    future = datetime.now(UTC) + timedelta(hours=1)
    bad = [
        {"vram_gb": 1, "ram_gb": 1},  # no job_id
        {"job_id": "j", "ram_gb": 1},  # no vram_gb
        {"job_id": "j", "vram_gb": None, "ram_gb": 1},
        {"job_id": "j", "vram_gb": -1, "ram_gb": 1},
        {"job_id": "j", "vram_gb": 1, "ram_gb": 1, "disk_gb": -0.5},
        {"job_id": "j", "vram_gb": float("nan"), "ram_gb": 1},
        {"job_id": "j", "vram_gb": True, "ram_gb": 1},  # a bool is not a size
        {"job_id": "j", "vram_gb": "4", "ram_gb": 1},
        {"job_id": "j", "vram_gb": 1, "ram_gb": 1, "ttl_seconds": 0},
        {"job_id": "j", "vram_gb": 1, "ram_gb": 1, "ttl_seconds": 1e30},
        {"job_id": "j", "vram_gb": 1, "ram_gb": 1, "ttl_seconds": 5, "expires_at": future},
        {"job_id": "j", "vram_gb": 1, "ram_gb": 1, "expires_at": "2001-01-01T00:00:00"},
        {"job_id": "j", "vram_gb": 1, "ram_gb": 1, "workload_type": "gaming"},
        {"job_id": "", "vram_gb": 1, "ram_gb": 1},
    ]
    for body in bad:
        with pytest.raises(ValidationError):
            ReservationRequest.model_validate(body)
    ok = ReservationRequest.model_validate(
        {"job_id": "intent:abc", "vram_gb": 1, "ram_gb": 0.0, "requester": "intent:x", "z": 1}
    )
    assert ok.workload_type == "training" and ok.requester == "intent:x"


def test_create_does_not_count_expired_reservations(svc: ResourceService) -> None:
    events: list[str] = []
    svc.bus.subscribe(lambda e: events.append(e.reason), ReservationsChanged)
    old = svc.create(req("a", vram=16))
    svc.ledger._items[old["id"]].expires_at = datetime.now(UTC) - timedelta(seconds=1)
    new = svc.create(req("b", vram=16))  # would not fit if the expired one still counted
    assert [r["id"] for r in svc.snapshot()["reservations"]] == [new["id"]]
    assert events == ["created", "expired", "created"]


def test_default_ttl_is_bounded(settings: Settings, gpu_probe: FakeProbe) -> None:
    settings.default_reservation_ttl_seconds = 1e30  # would overflow datetime arithmetic
    svc = ResourceService(settings, bus=EventBus(), probe=gpu_probe)
    view = svc.create(req(vram=1))
    assert datetime.fromisoformat(view["expires_at"]).year >= datetime.now(UTC).year + 9


def test_create_reads_the_probe_fresh(svc: ResourceService, gpu_probe: FakeProbe) -> None:
    """The snapshot cache (SYSTEM_READ_TTL_S) never decides a create: a start that finished
    loading within that second has dropped its hold, and only a fresh read shows its memory."""
    assert svc.snapshot()["vram"]["available_gb"] == 16.0  # fills the cache
    gpu_probe.set_gpus((24, 20))  # a backend now holds 12 GiB more
    with pytest.raises(CapacityExceeded) as e:
        svc.create(req(vram=10))
    assert e.value.dimension == "vram" and e.value.available_gb == 4.0
    calls = gpu_probe.calls["gpus"]
    svc.snapshot()
    assert gpu_probe.calls["gpus"] == calls  # snapshots still use the cache


def test_gpu_probe_blip_keeps_vram_claims_vram(svc: ResourceService, gpu_probe: FakeProbe) -> None:
    before = svc.create(req("a", vram=4))
    svc.snapshot()
    gpu_probe.fail.add("gpus")
    # A VRAM request cannot be checked while the GPUs cannot be read: refused, not folded.
    with pytest.raises(DimensionUnreadable) as e:
        svc.create(req("b", vram=4))
    assert e.value.dimension == "vram" and "GPUs" in str(e.value)
    ram_only = svc.create(req("c", ram=1))  # nothing asked of the VRAM dimension
    assert (ram_only["vram_gb"], ram_only["ram_gb"]) == (0.0, 1.0)
    during = fresh(svc)
    assert during["memory_type"] == "VRAM" and during["vram"] is None
    assert during["ram"]["reserved_headroom_gb"] == 1.0  # the VRAM claim did not move to RAM
    gpu_probe.fail.clear()
    snap = fresh(svc)
    assert snap["vram"]["reserved_headroom_gb"] == 4.0 and snap["vram"]["available_gb"] == 12.0
    assert {r["id"]: r["vram_gb"] for r in snap["reservations"]} == {
        before["id"]: 4.0,
        ram_only["id"]: 0.0,
    }
    assert [(r.vram_gb, r.ram_gb) for r in svc.ledger.records()] == [(4.0, 0.0), (0.0, 1.0)]
    assert svc.reserved_bytes() == {"gpu": 4 * 1024**3, "cpu": 1024**3}


def test_gpu_host_whose_first_read_fails_is_no_cpu_host(settings: Settings) -> None:
    probe = FakeProbe(gpus=[(24, 8)])
    probe.fail.add("gpus")
    svc = ResourceService(settings, bus=EventBus(), probe=probe)
    with pytest.raises(DimensionUnreadable):
        svc.create(req(vram=1))
    assert svc.ledger.records() == []


def test_unreadable_ram_or_disk_refuses_requests_in_it(
    svc: ResourceService, gpu_probe: FakeProbe
) -> None:
    gpu_probe.fail.add("ram")
    with pytest.raises(DimensionUnreadable) as e:
        svc.create(req(ram=1))
    assert e.value.dimension == "ram"
    svc.create(req(vram=1))  # VRAM can be checked
    gpu_probe.fail.clear()
    gpu_probe.set_disk(None)  # a filesystem that cannot be read
    with pytest.raises(DimensionUnreadable) as e:
        svc.create(req(disk_gb=1))
    assert e.value.dimension == "disk"
    gpu_probe.fail.add("disk")
    with pytest.raises(DimensionUnreadable):
        svc.create(req(disk_gb=1))
    assert len(svc.ledger.records()) == 1


async def test_unreadable_dimension_is_a_503(tmp_path: Path) -> None:
    from tests.test_api_resources import H, create_app, make_settings, open_client

    probe = FakeProbe(gpus=[(80, 0)], ram=(64, 8))
    app = create_app(make_settings(tmp_path), probe=probe)
    async with open_client(app) as client:
        assert (await client.get("/resources", headers=H)).json()["vram"]["total_gb"] == 80.0
        probe.fail.add("gpus")
        body = {"job_id": "train", "vram_gb": 40, "ram_gb": 0}
        r = await client.post("/resources/reservations", headers=H, json=body)
        assert r.status_code == 503, r.text
        assert r.json()["dimension"] == "vram" and "GPUs" in r.json()["detail"]
        probe.fail.clear()
        r = await client.post("/resources/reservations", headers=H, json=body)
        assert r.status_code == 201 and (r.json()["vram_gb"], r.json()["ram_gb"]) == (40.0, 0.0)


def test_expired_reservations_count_nowhere(svc: ResourceService) -> None:
    """From its expires_at on, a reservation counts in no reader, before the sweep removes it;
    one whose job runs stays (it is removed only once the job ends)."""
    from solar_host.estimates.capacity import CapacityGate

    gone = svc.create(req("a", vram=12, ram=2, disk_gb=50))
    kept = svc.create(req("b", vram=1))
    past = datetime.now(UTC) - timedelta(seconds=1)
    svc.ledger._items[gone["id"]].expires_at = past
    svc.ledger._items[kept["id"]].expires_at = past
    svc.jobs.running.add("b")
    snap = svc.snapshot()
    assert [r["id"] for r in snap["reservations"]] == [kept["id"]]
    assert snap["vram"]["reserved_headroom_gb"] == 1.0 and snap["vram"]["available_gb"] == 15.0
    assert snap["ram"]["reserved_headroom_gb"] == 0.0 and snap["disk"]["available_gb"] == 400.0
    summary = svc.health_summary()
    assert summary["active_count"] == 1 and summary["vram"]["reserved_headroom_gb"] == 1.0
    assert svc.reserved_bytes() == {"gpu": 1024**3, "cpu": 0}
    assert svc.get(gone["id"]) is None and svc.get(kept["id"]) is not None
    gate = CapacityGate(svc.probe, reserved=svc.reserved_bytes)
    assert gate.available(gate.devices())["cuda:0"] == 15 * 1024**3
    assert len(svc.ledger.records()) == 2  # the sweep has not run: only the readers changed

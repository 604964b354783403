"""The capacity gate and the resource service when control's own reservations and a failing
machine meet them: an intent's reservation must not block the start it was made for, a hung
or failing NVML must neither freeze the host nor turn a GPU host into a CPU host, one lost
GPU must not hide the others, and a damaged reservations.json is refused at start-up."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.backends.registry import BackendRegistry
from solar_host.control.payloads import PayloadBuilder
from solar_host.estimates.capacity import CapacityGate, InsufficientMemory
from solar_host.events import EventBus
from solar_host.host import StartupError, build_host
from solar_host.platform.statefiles import StateFileError, last_good_path
from solar_host.resources.ledger_store import parse_reservations
from solar_host.resources.probes import LiveProbe, memory_info
from solar_host.resources.schemas import ReservationRequest
from solar_host.resources.service import ResourceService
from solar_host.settings import Settings
from tests.fixtures.gguf_sized import Shape, write_sized_gguf
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.probes import FakeProbe
from tests.fixtures.script_backend import ScriptBackend, script_config

MIB = 1024**2
GIB = 1024**3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sized_gguf(tmp_path_factory.mktemp("cf") / "weights" / "m.gguf", Shape())


def llama(model: Path, **kw: Any) -> LlamaCppConfig:
    return LlamaCppConfig(alias="m", model=str(model), **{"ctx_size": 4096, **kw})


def gpu_need(model: Path) -> int:
    view = CapacityGate(FakeProbe(gpus=[(80, 0)])).estimate_view("", llama(model))
    return next(d["total_bytes"] for d in view["devices"] if d["device"] == "cuda:0")


def one_gpu_free(free_bytes: float, total_gib: float = 1.0) -> tuple[float, float]:
    """A FakeProbe GPU spec (total, used GiB) with `free_bytes` free."""
    return (total_gib, total_gib - free_bytes / GIB)


def script(tmp: Path, model: Path, alias: str) -> dict[str, Any]:
    c = script_config(tmp, "--ready-after", "0.1", alias=alias, ctx_size=4096)
    c["model"] = str(model)
    return c


async def create(h: Any, config: dict[str, Any], intent_id: str | None = None) -> str:
    body: dict[str, Any] = {"config": config}
    if intent_id is not None:
        body.update(managed_by="intent", intent_id=intent_id)
    r = await h.client.post("/instances", json=body)
    assert r.status_code in (200, 201), r.text
    return r.json()["instance"]["id"]


async def reserve(h: Any, job_id: str, vram_bytes: int) -> str:
    """What control's reconciler sends before it starts an intent's instance (contract 2.5)."""
    body = {
        "job_id": job_id,
        "requester": "intent:m",
        "workload_type": "inference",
        "vram_gb": round(vram_bytes / GIB, 4),
        "ram_gb": 0.0,
        "ttl_seconds": 3300,
    }
    r = await h.client.post("/resources/reservations", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


# --- 1. control's reservation for an intent and the start it was made for ---------------------


async def test_intent_reservation_does_not_block_its_own_start(tmp_path: Path, model: Path) -> None:
    """The reconciler reserves the intent's VRAM, then starts its instance: the start must not
    count that reservation beside its own estimate (it was refused with 1.6x its need free).
    Other starts still count it, and once the instance runs, the reservation and the
    instance's memory (now in the probe's figures) count once, not twice."""
    need = gpu_need(model)
    probe = FakeProbe(gpus=[one_gpu_free(need * 2.6)], ram=(64, 4))
    settings = host_settings(tmp_path, model_roots=str(model.parent))
    backends = BackendRegistry([ScriptBackend()])
    async with running_host(settings, backends=backends, probe=probe) as h:
        mine = await create(h, script(tmp_path, model, "intent-model:1"), intent_id="abc")
        other = await create(h, script(tmp_path, model, "other:1"))
        stranger = await create(h, script(tmp_path, model, "stranger:1"), intent_id="zzz")
        probe.set_gpus(one_gpu_free(need * 1.6))
        await reserve(h, "intent:abc", need)
        # Someone else's start: the reservation keeps its room (1.6 - 1 < 1).
        r = await h.client.post(f"/instances/{other}/start")
        assert r.status_code == 409, r.text
        # An instance of another intent does not get this intent's room either.
        r = await h.client.post(f"/instances/{stranger}/start")
        assert r.status_code == 409, r.text
        # The start it was made for fits in what is free.
        r = await h.client.post(f"/instances/{mine}/start")
        assert r.status_code == 200, r.text
        assert r.json()["instance"]["status"] == "running"
        # Running: its memory is in the probe's figures now; the reservation is still there
        # (control deletes it a tick later) and must not be counted on top of it.
        probe.set_gpus(one_gpu_free(need * 1.6))
        r = await h.client.post(f"/instances/{other}/start")
        assert r.status_code == 200, r.text
        for iid in (mine, other):
            await h.client.post(f"/instances/{iid}/stop")


async def test_a_loading_intent_instance_covers_its_reservation(
    model: Path, tmp_path: Path
) -> None:
    """While the intent's instance loads, its hold and its reservation together count as the
    larger of the two, for every other start."""
    need = gpu_need(model)
    probe = FakeProbe(gpus=[one_gpu_free(need * 2.5)])
    settings = Settings(
        config_file=tmp_path / "config.json",
        models_dir=tmp_path / "models",
        jobs_dir=tmp_path / "jobs",
    )
    resources = ResourceService(settings, bus=EventBus(), probe=probe)
    instances: list[Any] = []
    gate = CapacityGate(
        probe,
        reserved=resources.reserved_bytes,
        gpu_host=resources.gpu_host,
        instances=lambda: instances,
    )
    resources.loading = gate.holds
    resources.create(ReservationRequest(job_id="intent:abc", vram_gb=need / GIB, ram_gb=0))
    loader = SimpleNamespace(id="a", intent_id="abc", status="starting")
    instances.append(loader)
    assert await gate.admit("a", llama(model)) is not None  # its own reservation not counted
    # 2.5 free - 1 held - max(1 reserved - 1 held, 0) = 1.5: a second start fits.
    assert await gate.admit("b", llama(model)) is not None
    gate.release("b")
    # Stopped before it ran: the reservation keeps its room again.
    gate.release("a")
    loader.status = "stopped"
    probe.set_gpus(one_gpu_free(need * 1.5))
    with pytest.raises(InsufficientMemory):
        await gate.admit("b", llama(model))


# --- 2. a hung probe must not freeze the host -------------------------------------------------


class HangingProbe(FakeProbe):
    """gpus() sleeps `hang_s` while `hang` is set: NVML stuck on a GPU fallen off the bus."""

    hang = False
    hang_s = 1.0

    def gpus(self) -> list[Any]:
        if self.hang:
            time.sleep(self.hang_s)
        return super().gpus()


def ping_health(url: str, stop: threading.Event, took: list[float]) -> None:
    """From another thread (the server shares the test's event loop): /health, every 0.1 s
    until `stop`, each one's time in `took`."""
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.wait(0.1):
            t0 = time.perf_counter()
            assert client.get("/health").status_code == 200
            took.append(time.perf_counter() - t0)


async def health_while(h: Any, probe: HangingProbe, method: str, url: str, **kw: Any) -> float:
    """The slowest /health answer while `method url` waits on the hung probe."""
    await asyncio.sleep(1.1)  # past the snapshot cache of system figures
    probe.hang = True
    stop, took = threading.Event(), []
    side = threading.Thread(target=ping_health, args=(h.url, stop, took))
    try:
        side.start()
        t0 = time.perf_counter()
        answer = await h.client.request(method, url, **kw)
        assert time.perf_counter() - t0 > 0.5, f"{url} did not wait on the probe"
        assert answer.status_code < 500, answer.text
    finally:
        probe.hang = False
        stop.set()
        await asyncio.to_thread(side.join, 30)
    assert took, "no /health answer while the probe hung"
    return max(took)


async def test_a_hung_probe_does_not_freeze_the_host(tmp_path: Path, model: Path) -> None:
    probe = HangingProbe(gpus=[(80, 0)])
    settings = host_settings(tmp_path, model_roots=str(model.parent))
    async with running_host(
        settings, backends=BackendRegistry([ScriptBackend()]), probe=probe
    ) as h:
        iid = await create(h, script(tmp_path, model, "hang:1"))
        body = {"job_id": "j", "vram_gb": 1.0, "ram_gb": 0.0}
        calls: list[tuple[str, str, dict[str, Any]]] = [
            ("GET", "/resources", {}),
            ("POST", "/resources/reservations", {"json": body}),
            ("GET", "/metrics", {}),
            ("GET", "/memory", {}),
            ("POST", f"/instances/{iid}/start", {}),
        ]
        took = {url: await health_while(h, probe, m, url, **kw) for m, url, kw in calls}
        assert all(t < 0.5 for t in took.values()), took
        # The start read the hung probe once (in a thread), not again under the gate's lock.
        probe.hang = False
        await h.client.post(f"/instances/{iid}/stop")


def fake_pynvml(
    monkeypatch: pytest.MonkeyPatch, count: int = 8, lost: set[int] | None = None
) -> types.ModuleType:
    """A pynvml whose devices in `lost` raise NVML_ERROR_GPU_IS_LOST; `fake.gate`, when cleared,
    makes every memory query hang until it is set."""
    fake = types.ModuleType("pynvml")
    fake.lost = set(lost or ())  # type: ignore[attr-defined]
    fake.gate = threading.Event()  # type: ignore[attr-defined]
    fake.gate.set()  # type: ignore[attr-defined]
    fake.fail_count = False  # type: ignore[attr-defined]

    def count_fn() -> int:
        if fake.fail_count:  # type: ignore[attr-defined]
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return count

    def mem(h: int) -> Any:
        fake.gate.wait()  # type: ignore[attr-defined]
        if h in fake.lost:  # type: ignore[attr-defined]
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return SimpleNamespace(total=80 * GIB, used=GIB)

    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = count_fn  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = mem  # type: ignore[attr-defined]
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA H100"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUUID = lambda h: f"GPU-{h}".encode()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    # As if the driver were there (LiveProbe asks NVML nothing on a machine without one).
    monkeypatch.setattr("solar_host.resources.probes.NVIDIA_DRIVER_PATHS", ("/",))
    return fake


def test_nvml_reads_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stuck NVML call is a failed read after the bound; while it stays stuck, further reads
    fail at once (no thread piles up behind it); once it returns, reads work again."""
    from solar_host.resources.probes import NvmlTimeout

    fake = fake_pynvml(monkeypatch, count=2)
    probe = LiveProbe(nvml_timeout_s=0.3)
    assert len(probe.gpus()) == 2
    fake.gate.clear()  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    with pytest.raises(NvmlTimeout):
        probe.gpus()
    assert 0.25 < time.perf_counter() - t0 < 1.5
    t0 = time.perf_counter()
    with pytest.raises(NvmlTimeout):
        probe.gpus()
    assert time.perf_counter() - t0 < 0.1
    assert probe.gpu_process_memory_by_device() == {}  # a failed read, logged, not raised
    fake.gate.set()  # type: ignore[attr-defined]
    time.sleep(0.05)
    assert len(probe.gpus()) == 2


# --- 3. an NVML error must not make a GPU host a CPU host --------------------------------------


async def test_failing_gpu_read_refuses_instead_of_placing_on_cpu(model: Path) -> None:
    from solar_host.estimates.capacity import GpusUnreadable

    # The GPU is full and RAM has room: with the GPUs unreadable, the start went to "cpu".
    probe = FakeProbe(gpus=[(24, 23.999)], ram=(64, 4))
    gate = CapacityGate(probe)
    with pytest.raises(InsufficientMemory):
        await gate.admit("a", llama(model))
    probe.fail.add("gpus")
    with pytest.raises(GpusUnreadable) as err:
        await gate.admit("b", llama(model))
    assert err.value.status == 503 and "Cannot read the GPUs" in err.value.detail
    assert gate.env_for("b") == {} and "b" not in gate.placements
    # An empty GPU and full RAM: refused as unreadable (503), not for RAM (409 "on cpu").
    probe.fail.clear()
    probe.set_gpus((80, 0))
    probe.set_ram(16, 15.999)
    probe.fail.add("gpus")
    with pytest.raises(GpusUnreadable):
        await gate.admit("c", llama(model))
    # skip_fit_check: the operator starts it anyway, unchecked.
    assert await gate.admit("d", llama(model, skip_fit_check=True)) is None
    # A host known to have no GPUs does not care about a GPU probe error.
    cpu_gate = CapacityGate(probe, gpu_host=lambda: False)
    probe.set_ram(64, 4)
    assert (await cpu_gate.admit("e", llama(model))).device_names == ["cpu"]


async def test_failing_gpu_read_is_a_503_over_http(tmp_path: Path, model: Path) -> None:
    probe = FakeProbe(gpus=[(80, 0)], ram=(64, 4))
    settings = host_settings(tmp_path, model_roots=str(model.parent))
    async with running_host(
        settings, backends=BackendRegistry([ScriptBackend()]), probe=probe
    ) as h:
        iid = await create(h, script(tmp_path, model, "nvml:1"))
        probe.fail.add("gpus")
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 503, r.text
        assert r.json()["detail"].startswith("Cannot read the GPUs: ")
        assert (await h.client.get(f"/instances/{iid}")).json()["status"] != "running"
        r = await h.client.post(
            "/instances/estimate", json={"config": script(tmp_path, model, "e")}
        )
        assert r.status_code == 503, r.text
        probe.fail.clear()
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        assert r.json()["instance"]["placed_devices"] == ["cuda:0"]
        await h.client.post(f"/instances/{iid}/stop")


# --- 4. one lost GPU must not hide the others --------------------------------------------------


def test_one_lost_gpu_leaves_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_pynvml(monkeypatch, count=8, lost={5})
    probe = LiveProbe()
    gpus = probe.gpus()
    assert [g.index for g in gpus] == [0, 1, 2, 3, 4, 6, 7]
    assert probe.gpu_type() == "nvidia_cuda"
    info = memory_info(probe)
    assert info is not None and info["memory_type"] == "VRAM" and info["total_gb"] == 560.0
    fake.lost.clear()  # type: ignore[attr-defined]
    assert len(probe.gpus()) == 8


def test_a_failed_read_never_decides_the_gpu_type(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_pynvml(monkeypatch, count=2, lost={0, 1})
    probe = LiveProbe()
    with pytest.raises(RuntimeError):
        probe.gpus()  # not one GPU answered: a failed read, not "no GPUs"
    with pytest.raises(RuntimeError):
        probe.gpu_type()
    fake.lost.clear()  # type: ignore[attr-defined]
    fake.fail_count = True  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError):
        probe.gpu_type()
    fake.fail_count = False  # type: ignore[attr-defined]
    assert probe.gpu_type() == "nvidia_cuda"  # decided by the first read that worked


# --- 5. reservations.json values ---------------------------------------------------------------


def ledger_doc(**amounts: Any) -> bytes:
    entry = {
        "id": "res-x",
        "job_id": "j",
        "workload_type": "training",
        "requester": None,
        "vram_gb": 1.0,
        "ram_gb": 0.0,
        "disk_gb": None,
        "created_at": "2025-01-01T00:00:00+00:00",
        "expires_at": None,
        **amounts,
    }
    return json.dumps({"version": 1, "reservations": [entry]}).encode()


@pytest.mark.parametrize(
    "amounts",
    [
        {"vram_gb": -1000.0},
        {"vram_gb": math.nan},
        {"vram_gb": math.inf},
        {"ram_gb": -math.inf},
        {"vram_gb": 1e300},
        {"vram_gb": "5"},
        {"ram_gb": True},
        {"disk_gb": -1.0},
        {"disk_gb": math.nan},
    ],
    ids=repr,
)
def test_damaged_amounts_are_refused(tmp_path: Path, amounts: dict[str, Any]) -> None:
    path = tmp_path / "reservations.json"
    with pytest.raises(StateFileError) as err:
        parse_reservations(path, ledger_doc(**amounts))
    assert "reservation 0" in str(err.value) and next(iter(amounts)) in str(err.value)


def test_sound_amounts_load(tmp_path: Path) -> None:
    [res] = parse_reservations(tmp_path / "r.json", ledger_doc(vram_gb=2, ram_gb=0, disk_gb=0.5))
    assert (res.vram_gb, res.ram_gb, res.disk_gb) == (2.0, 0.0, 0.5)
    assert isinstance(res.vram_gb, float)


@pytest.mark.parametrize("value", [-1000.0, math.nan, math.inf])
async def test_host_refuses_to_start_on_damaged_amounts(tmp_path: Path, value: float) -> None:
    """Refused at start-up, loudly, and nothing erased (as any damaged state file), pointing at
    the last good copy: it used to start, hand out 1020 GiB of a 24 GiB GPU (-1000), or fail
    every start and estimate with a 500 (NaN, inf)."""
    settings = host_settings(tmp_path)
    path = settings.reservations_file
    path.parent.mkdir(parents=True, exist_ok=True)
    damaged, good = ledger_doc(vram_gb=value), ledger_doc(vram_gb=1.0)
    path.write_bytes(damaged)
    last_good_path(path).write_bytes(good)
    host = build_host(settings, probe=FakeProbe(gpus=[(24, 4)]), backends=BackendRegistry([]))
    with pytest.raises(StartupError) as err:
        await host.start()
    line = str(err.value)
    assert f"cannot use state file {path}" in line and "vram_gb" in line
    assert "restore-state" in line
    assert path.read_bytes() == damaged and last_good_path(path).read_bytes() == good


async def test_the_control_reports_read_the_machine_off_the_loop(tmp_path: Path) -> None:
    """host_health (every 10 s, and after every change) read NVML and the capacity snapshot on
    the event loop: a GPU that takes NVML_TIMEOUT_S to answer froze the whole host that long."""
    probe = HangingProbe(gpus=[(80, 0)])
    probe.hang_s = 1.5
    async with running_host(host_settings(tmp_path), probe=probe) as h:
        await asyncio.sleep(1.1)  # past the snapshot cache of system figures
        probe.hang = True
        stop, took = threading.Event(), []
        side = threading.Thread(target=ping_health, args=(h.url, stop, took))
        side.start()
        try:
            t0 = time.perf_counter()
            report = await PayloadBuilder(h.host).host_health()
            assert time.perf_counter() - t0 > 1.0, "host_health did not read the probe"
        finally:
            probe.hang = False
            stop.set()
            await asyncio.to_thread(side.join, 30)
        assert report["data"]["memory"]["memory_type"] == "VRAM", report
        assert report["data"]["resources"]["memory_type"] == "VRAM", report
        assert took and max(took) < 0.5, took


class HungDiskProbe(FakeProbe):
    """disk() blocks while `hung` is set, until `released`: statvfs on a network mount that stopped
    answering (it stays in the kernel, uninterruptible, for as long as the server is away)."""

    def __init__(self) -> None:
        super().__init__()
        self.hung = threading.Event()
        self.released = threading.Event()
        self.disk_calls = 0

    def disk(self, path: Path) -> Any:
        if threading.current_thread().name == "background-reading":  # /health's reading
            self.disk_calls += 1
        if self.hung.is_set():
            self.released.wait(30)
        return super().disk(path)


async def test_a_hung_models_mount_does_not_freeze_health(tmp_path: Path) -> None:
    """GET /health read the disk of MODELS_DIR on the event loop: on a hung NFS mount every
    request, the control link and every backend's supervision stopped with it. Now it answers
    from a reading at most 2 s old, refreshed by one thread (never one more per request)."""
    probe = HungDiskProbe()
    async with running_host(host_settings(tmp_path), probe=probe) as h:
        first = (await h.client.get("/health")).json()
        assert first["disk"] is not None and first["disk"]["total_gb"] > 0, first
        probe.hung.set()
        try:
            await asyncio.sleep(2.1)  # the reading is due again: its refresh hangs
            t0 = time.perf_counter()
            for _ in range(20):
                body = (await h.client.get("/health")).json()
                assert body["disk"] == first["disk"]  # the last reading, not a hang
                await asyncio.sleep(0.2)
            assert (await h.client.get("/instances")).status_code == 200
            assert time.perf_counter() - t0 < 4.0 + 2.0
            calls = probe.disk_calls
            await asyncio.sleep(2.5)
            await h.client.get("/health")
            assert probe.disk_calls == calls, "a second refresh started beside the hung one"
        finally:
            probe.released.set()
        await asyncio.sleep(0.1)
        await h.client.get("/health")  # the hung read came back: the next one is due
        for _ in range(50):
            if probe.disk_calls > calls:
                break
            await asyncio.sleep(0.05)
        assert probe.disk_calls > calls


def test_nvml_is_not_asked_without_an_nvidia_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """No /dev/nvidiactl nor /proc/driver/nvidia: no GPU is read (nor pynvml imported), even
    where a pynvml is installed that would answer."""
    fake_pynvml(monkeypatch, count=2)
    tmp_absent = "/nonexistent-solar-host-test/nvidiactl"
    probe = LiveProbe(driver_paths=(tmp_absent,))
    assert probe.gpus() == []
    assert LiveProbe().gpus() != []  # the same pynvml, the driver "there": both GPUs

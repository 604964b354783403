"""GPU placement and the fit check at the capacity gate, on injected probes of 1, 2 and 8 GPUs
of unequal sizes (no process started: the gate is arithmetic over the probe and the model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.estimates.capacity import CapacityGate, InsufficientMemory
from tests.fixtures.gguf_sized import Shape, write_sized_gguf
from tests.fixtures.probes import FakeProbe

MIB = 1024**2
GIB = 1024**3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_sized_gguf(tmp_path_factory.mktemp("p") / "m.gguf", Shape())


def config(model: Path, **kw) -> LlamaCppConfig:
    return LlamaCppConfig(alias="m", model=str(model), **{"ctx_size": 4096, **kw})


def gpu_need(model: Path) -> int:
    """Bytes the model takes on one GPU (fully offloaded)."""
    gate = CapacityGate(FakeProbe(gpus=[(80, 0)]))
    view = gate.estimate_view("", config(model))
    return next(d["total_bytes"] for d in view["devices"] if d["device"] == "cuda:0")


def free_mib(*mib: float, total_gib: float = 1.0) -> list[tuple[float, float]]:
    """FakeProbe GPU specs (total, used GiB) with the given free MiB."""
    return [(total_gib, total_gib - m / 1024) for m in mib]


async def test_one_gpu_fits_or_409(model: Path) -> None:
    need = gpu_need(model)
    probe = FakeProbe(gpus=free_mib(need / MIB + 5))
    gate = CapacityGate(probe)
    placement = await gate.admit("a", config(model))
    assert placement is not None and placement.device_names == ["cuda:0"]
    assert gate.env_for("a") == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}
    # While "a" loads, its estimate is held: a second start does not fit in what is left.
    with pytest.raises(InsufficientMemory) as err:
        await gate.admit("b", config(model))
    body = err.value.body()
    assert body["instance_id"] == "b" and body["device"] == "cuda:0"
    assert body["needed_bytes"] == need
    assert body["available_bytes"] < need
    assert set(body) == {
        *("detail", "instance_id", "needed_bytes", "available_bytes", "device"),
        *("source", "admitted_bytes", "estimated_bytes", "measured_bytes"),  # issue 41
    }
    gate.release("a")
    assert (await gate.admit("b", config(model))) is not None
    # skip_fit_check and the setting let a start through that does not fit.
    with pytest.raises(InsufficientMemory):
        await gate.admit("c", config(model))
    assert await gate.admit("c", config(model, skip_fit_check=True)) is not None
    off = CapacityGate(FakeProbe(gpus=free_mib(1)), enabled=lambda: False)
    assert await off.admit("d", config(model)) is not None


async def test_two_unequal_gpus_most_free_wins(model: Path) -> None:
    need = gpu_need(model) / MIB
    gate = CapacityGate(FakeProbe(gpus=free_mib(need + 10, need + 40)))
    p = await gate.admit("a", config(model))
    assert p.device_names == ["cuda:1"] and p.chosen
    # cuda:1 now holds "a": "b" fits only on cuda:0.
    p = await gate.admit("b", config(model))
    assert p.device_names == ["cuda:0"]
    assert gate.env_for("b")["CUDA_VISIBLE_DEVICES"] == "0"
    holds = {h["instance_id"]: h["devices"] for h in gate.holds()}
    assert set(holds["a"]) == {"cpu", "cuda:1"} and set(holds["b"]) == {"cpu", "cuda:0"}


async def test_eight_gpus_smallest_set_for_a_split(model: Path) -> None:
    need = gpu_need(model) / MIB
    # No GPU holds it alone; the two freest (cuda:5, cuda:2) together do.
    frees = [need * 0.2, need * 0.3, need * 0.8, need * 0.25, need * 0.1, need * 0.9, 0, need * 0.4]
    gate = CapacityGate(FakeProbe(gpus=free_mib(*frees, total_gib=2.0)))
    p = await gate.admit("a", config(model))
    assert p.device_names == ["cuda:5", "cuda:2"]
    assert gate.env_for("a")["CUDA_VISIBLE_DEVICES"] == "5,2"
    per_device = p.needs
    assert per_device["cuda:5"] <= frees[5] * MIB and per_device["cuda:2"] <= frees[2] * MIB
    # With one big GPU among them, one GPU is the smallest set.
    frees[7] = need * 3
    gate = CapacityGate(FakeProbe(gpus=free_mib(*frees, total_gib=2.0)))
    p = await gate.admit("a", config(model))
    assert p.device_names == ["cuda:7"]


async def test_explicit_devices_are_honoured_and_checked(model: Path) -> None:
    need = gpu_need(model) / MIB
    gate = CapacityGate(FakeProbe(gpus=free_mib(need * 4, need * 2, need * 0.5)))
    p = await gate.admit("a", config(model, devices="CUDA1"))
    assert p.device_names == ["cuda:1"] and not p.chosen
    assert gate.env_for("a") == {}  # the config's --device stands; nothing pinned
    with pytest.raises(InsufficientMemory) as err:
        await gate.admit("b", config(model, devices="CUDA2"))
    assert err.value.device == "cuda:2"
    # An unknown GPU cannot be estimated: the start is not refused by the gate.
    assert await gate.admit("c", config(model, devices="CUDA9")) is None
    p = await gate.admit("d", config(model, devices="none"))
    assert p.device_names == ["cpu"]


async def test_cpu_host_checks_ram(model: Path) -> None:
    probe = FakeProbe(ram=(16, 16 - 0.01))  # ~10 MiB available
    gate = CapacityGate(probe)
    with pytest.raises(InsufficientMemory) as err:
        await gate.admit("a", config(model))
    assert err.value.device == "cpu"
    probe.set_ram(16, 4)
    p = await gate.admit("a", config(model))
    assert p.device_names == ["cpu"] and gate.env_for("a") == {}


async def test_reservations_count_against_gpus(model: Path) -> None:
    need = gpu_need(model)
    gate = CapacityGate(FakeProbe(gpus=free_mib(need / MIB * 1.5)), reserved=lambda: {"gpu": need})
    with pytest.raises(InsufficientMemory):
        await gate.admit("a", config(model))


async def test_loading_holds_and_reservations_see_each_other(tmp_path: Path, model: Path) -> None:
    from solar_host.events import EventBus
    from solar_host.resources.ledger import CapacityExceeded
    from solar_host.resources.schemas import ReservationRequest
    from solar_host.resources.service import ResourceService
    from solar_host.settings import Settings

    probe = FakeProbe(gpus=[(10, 0)])
    settings = Settings(
        config_file=tmp_path / "config.json",
        models_dir=tmp_path / "models",
        jobs_dir=tmp_path / "jobs",
    )
    resources = ResourceService(settings, bus=EventBus(), probe=probe)
    gate = CapacityGate(probe, reserved=resources.reserved_bytes)
    resources.loading = gate.holds
    big = config(model, ctx_size=1_048_576)  # a KV cache of 4 GiB at f16
    placement = await gate.admit("a", big)
    held = placement.needs["cuda:0"]
    assert held > 4 * GIB
    snap = resources.snapshot()
    assert snap["loading_instances"][0]["instance_id"] == "a"
    assert snap["vram"]["reserved_headroom_gb"] == round(held / GIB, 2)
    assert snap["vram"]["available_gb"] == round(10 - held / GIB, 2)
    assert resources.health_summary()["vram"]["reserved_headroom_gb"] == round(held / GIB, 2)
    # A reservation cannot take what the loading instance holds ...
    with pytest.raises(CapacityExceeded):
        resources.create(ReservationRequest(job_id="j", vram_gb=10 - held / GIB + 0.5, ram_gb=0))
    res = resources.create(ReservationRequest(job_id="j", vram_gb=1.0, ram_gb=0))
    # ... and a start cannot take what a reservation keeps.
    gate.release("a")
    probe.set_gpus((held / GIB + 0.5, 0))  # room for it, less the 1 GiB reservation
    with pytest.raises(InsufficientMemory):
        await gate.admit("b", big)
    resources.release(res["id"])
    assert await gate.admit("b", big) is not None


async def test_reservations_come_off_all_gpus_together(model: Path) -> None:
    """A reservation is not charged to one GPU: the share an even spread would put on a full
    GPU must not vanish. cuda:1 is full, so all of it comes off what cuda:0 has."""
    need = gpu_need(model)
    probe = FakeProbe(gpus=free_mib(need / MIB * 1.5, 0))
    gate = CapacityGate(probe, reserved=lambda: {"gpu": need})
    assert gate.available(gate.devices())["cuda:0"] == pytest.approx(need * 0.5, abs=2 * MIB)
    with pytest.raises(InsufficientMemory) as err:
        await gate.admit("a", config(model))
    assert err.value.device == "cuda:0" and err.value.available_bytes < need
    gate.reserved = lambda: {"gpu": need // 4}
    assert (await gate.admit("a", config(model))).device_names == ["cuda:0"]


async def test_a_split_must_fit_what_all_gpus_have_left(model: Path) -> None:
    """Each GPU of a split may have room for its part while the GPUs together have less than
    the parts sum to, once reservations are counted."""
    need = gpu_need(model)
    probe = FakeProbe(gpus=free_mib(need / MIB, need / MIB, total_gib=2.0))
    split = config(model, devices="CUDA0,CUDA1")
    placement, _, short = CapacityGate(probe).place("a", split)
    assert short is None
    on_gpus = sum(placement.needs[d] for d in ("cuda:0", "cuda:1"))
    own = 2 * int(need / MIB * MIB)
    gate = CapacityGate(probe, reserved=lambda: {"gpu": own - on_gpus + MIB})
    avail = gate.available(gate.devices())
    assert all(avail[d] >= placement.needs[d] for d in ("cuda:0", "cuda:1"))
    with pytest.raises(InsufficientMemory) as err:
        await gate.admit("a", split)
    assert err.value.device == "cuda:0,cuda:1" and err.value.needed_bytes == on_gpus
    assert "all GPUs together" in err.value.detail


@pytest.mark.parametrize("pin", [{"split_mode": "none", "main_gpu": 1}, {"tensor_split": "0,1"}])
async def test_a_gpu_set_that_cannot_be_estimated_is_skipped(model: Path, pin: dict) -> None:
    """main_gpu 1 / tensor_split "0,1" cannot be estimated on the first candidate (one GPU):
    the next set is tried, not the whole fit check skipped."""
    probe = FakeProbe(gpus=[(80, 0), (1, 1)])  # the model goes to cuda:1, which is full
    gate = CapacityGate(probe)
    with pytest.raises(InsufficientMemory) as err:
        await gate.admit("a", config(model, **pin))
    assert err.value.device == "cuda:1"
    probe.set_gpus((80, 0), (80, 0))
    p = await gate.admit("a", config(model, **pin))
    assert p is not None and p.device_names == ["cuda:0", "cuda:1"]
    assert p.needs.get("cuda:1", 0) > 0 and "cuda:0" not in p.needs
    # When no set can be estimated, the start goes on unchecked (as before).
    assert await CapacityGate(FakeProbe(gpus=[(80, 0)])).admit("b", config(model, **pin)) is None

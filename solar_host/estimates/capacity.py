"""The fit check and GPU placement of a start, and the memory held by instances still loading.

A start asks `admit()`: the gate reads what each device has free (the probe), takes off what
loading instances hold (per device) and what reservations keep (the ledger; reserved VRAM comes
off all GPUs together, see `budget`), picks devices when the config names none (the GPU with
most free memory that fits, else the smallest set of the freest GPUs for a split), and either
holds the estimate until the start ends or refuses with InsufficientMemory (409). Check and
hold happen under one lock with no await between them, so concurrent starts cannot both count
the same free bytes. Once the start ends the hold goes: a running backend's memory is in the
probe's own figures from then on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solar_host.estimates.dispatch import estimate_config
from solar_host.estimates.gguf import parse_devices
from solar_host.estimates.model import CPU, Device, Estimate, EstimateError, gpu_name
from solar_host.instances.errors import InstanceConflict
from solar_host.model_store.roots import (
    HOST_OPENED_FIELDS,
    OutsideRoots,
    anchor_relative,
    check_config,
)
from solar_host.resources.probes import GB, SystemProbe

log = logging.getLogger(__name__)


class InsufficientMemory(InstanceConflict):
    """The estimate of a start exceeds what its device has free: nothing was spawned."""

    def __init__(
        self, instance_id: str, device: str, needed_bytes: int, available_bytes: int, why: str = ""
    ):
        self.instance_id = instance_id
        self.device = device
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        detail = why or (
            f"Not enough memory on {device}: the instance needs about "
            f"{needed_bytes / GB:.2f} GiB, {max(available_bytes, 0) / GB:.2f} GiB is free "
            "(set skip_fit_check: true in the config to start anyway)"
        )
        super().__init__(detail)

    def body(self) -> dict[str, Any]:
        return {
            "detail": self.detail,
            "instance_id": self.instance_id,
            "needed_bytes": self.needed_bytes,
            "available_bytes": self.available_bytes,
            "device": self.device,
        }


@dataclass(slots=True)
class Placement:
    """Where an instance goes and what it is expected to take there."""

    instance_id: str
    estimate: Estimate
    gpus: list[int]  # GPU indices the backend uses
    chosen: bool  # the host picked them (the config named none): pin them in the environment
    needs: dict[str, int] = field(default_factory=dict)

    @property
    def device_names(self) -> list[str]:
        return [gpu_name(i) for i in self.gpus] or [CPU]


def _candidates(
    config: Any, gpus: list[Device], free: dict[str, int]
) -> list[tuple[list[Device], bool]]:
    """Device sets to try, best first: (devices, chosen by the host)."""
    by_index = {g.index: g for g in gpus}
    order = sorted(gpus, key=lambda g: free.get(g.name, 0), reverse=True)
    bt = config.backend_type
    if bt == "llamacpp":
        named = parse_devices(config.devices)
        if named is not None:
            missing = [i for i in named if i not in by_index]
            if missing:
                raise EstimateError("devices", f"this host has no GPU {missing[0]}")
            return [([by_index[i] for i in named], False)]
        if config.n_gpu_layers == 0 or not gpus:
            return [([], False)]
        return [(order[:k], True) for k in range(1, len(order) + 1)]
    if bt == "sglang":
        return [(order[: int(config.tp_size or 1)], True)]
    if getattr(config, "device", None) in ("cuda", "auto") and gpus:
        return [([g], True) for g in order]
    return [([], False)]


# (device, bytes needed, bytes available, reason): what a refusal names.
Shortfall = tuple[str, int, int, str]


def _shortfall(
    p: Placement, devs: list[Device], avail: dict[str, int], gpu_pool: int
) -> Shortfall | None:
    """Why placement `p` does not fit, or None: a refusal of the backend itself, a device
    short of memory, or its GPUs together needing more than all GPUs have left once
    reservations are counted."""
    needs = p.needs
    if p.estimate.refusal:
        dev = devs[0].name if devs else CPU
        return (dev, needs.get(dev, 0), avail.get(dev, 0), p.estimate.refusal)
    for dev, n in needs.items():
        if n > avail.get(dev, 0):
            return (dev, n, avail.get(dev, 0), "")
    on_gpus = {dev: n for dev, n in needs.items() if dev != CPU}
    total = sum(on_gpus.values())
    if total > gpu_pool:
        names = ",".join(on_gpus)
        why = (
            f"Not enough GPU memory for {names}: the instance needs about {total / GB:.2f} GiB, "
            f"{gpu_pool / GB:.2f} GiB is free on all GPUs together once reservations are "
            "counted (set skip_fit_check: true in the config to start anyway)"
        )
        return (names, total, gpu_pool, why)
    return None


class CapacityGate:
    def __init__(
        self,
        probe: SystemProbe,
        *,
        enabled: Callable[[], bool] = lambda: True,
        reserved: Callable[[], dict[str, int]] | None = None,
        roots: Callable[[], Sequence[Path]] | None = None,
    ):
        self.probe = probe
        self.enabled = enabled
        # The model roots (MODELS_DIR first): every file an estimate opens is judged against
        # them first (_confined). None: a gate built without them (unit tests).
        self.roots = roots
        # Bytes kept by the reservation ledger per dimension ({"gpu": n, "cpu": n}).
        self.reserved = reserved
        self._lock = threading.Lock()
        self._holds: dict[str, Placement] = {}
        self.placements: dict[str, Placement] = {}

    def _confined(self, config: Any) -> Any:
        """`config` as the estimators may open it. Its paths are judged against the model roots
        now, not only at create: a link in a root may point elsewhere since, and what an
        estimate reads (header sizes, config.json values) ends up in its answer. Relative
        paths become MODELS_DIR/<path>, what the backend opens, not the host's working
        directory. Raises EstimateError naming the field."""
        if self.roots is None:
            return config
        roots = list(self.roots())
        try:
            check_config(config, roots)
        except OutsideRoots as err:
            raise EstimateError(err.field, str(err)) from None
        copy = config.model_copy()
        anchor_relative(copy, roots[0], HOST_OPENED_FIELDS)
        return copy

    # --- what is free ----------------------------------------------------------------------------
    def devices(self) -> list[Device]:
        """The CPU (system RAM) and every GPU, with what the probe reports free."""
        out = []
        try:
            ram = self.probe.ram()
            out.append(Device(CPU, None, ram.total_bytes, ram.available_bytes))
        except Exception as err:
            log.warning("RAM probe failed: %s", err)
        try:
            for g in self.probe.gpus():
                out.append(
                    Device(gpu_name(g.index), g.index, g.total_bytes, g.total_bytes - g.used_bytes)
                )
        except Exception as err:
            log.warning("GPU probe failed: %s", err)
        return out

    def held(self, exclude: str | None = None) -> dict[str, int]:
        """Bytes per device held by starts in progress."""
        out: dict[str, int] = {}
        for iid, p in list(self._holds.items()):
            if iid == exclude:
                continue
            for dev, n in p.needs.items():
                out[dev] = out.get(dev, 0) + n
        return out

    def holds(self) -> list[dict[str, Any]]:
        return [
            {"instance_id": iid, "devices": dict(p.needs), "bytes": sum(p.needs.values())}
            for iid, p in list(self._holds.items())
        ]

    def budget(
        self, devices: list[Device], exclude: str | None = None
    ) -> tuple[dict[str, int], int]:
        """(bytes available per device, bytes available on all GPUs together).

        Loading holds are per device. Reservations are per dimension, not per GPU (the job
        decides where it puts its memory), so reserved GPU bytes come off the GPUs' total
        free memory, and no GPU can offer more than that total. Spreading them evenly and
        clamping each GPU at 0 would lose the share charged to a full GPU."""
        return self._budget(devices, self._free_less_holds(devices, exclude))

    def _budget(self, devices: list[Device], own: dict[str, int]) -> tuple[dict[str, int], int]:
        reserved = self.reserved() if self.reserved is not None else {}
        gpu_pool = sum(own[d.name] for d in devices if d.is_gpu) - reserved.get("gpu", 0)
        gpu_pool = max(gpu_pool, 0)
        out: dict[str, int] = {}
        for d in devices:
            if d.is_gpu:
                out[d.name] = min(own[d.name], gpu_pool)
            else:
                out[d.name] = max(own[d.name] - reserved.get("cpu", 0), 0)
        return out, gpu_pool

    def available(self, devices: list[Device], exclude: str | None = None) -> dict[str, int]:
        """Bytes available per device: free, less loading holds and reservations."""
        return self.budget(devices, exclude)[0]

    def _free_less_holds(self, devices: list[Device], exclude: str | None) -> dict[str, int]:
        held = self.held(exclude)
        return {d.name: max(d.free_bytes - held.get(d.name, 0), 0) for d in devices}

    # --- estimate and placement ------------------------------------------------------------------
    def place(
        self, instance_id: str, config: Any, exclude: str | None = None
    ) -> tuple[Placement, dict[str, int], Shortfall | None]:
        """The best placement, what is available, and the first shortfall of it (or None).

        Pure arithmetic once the model headers are cached. A device set the config cannot be
        estimated on (main_gpu or tensor_split naming a GPU outside it) is skipped; raises
        the first candidate's EstimateError only when no set can be estimated.
        """
        devices = self.devices()
        own = self._free_less_holds(devices, exclude or instance_id)
        avail, gpu_pool = self._budget(devices, own)
        # Order and llama.cpp's default split follow each GPU's own free memory; the pool
        # cap only decides whether it fits.
        gpus = [
            Device(d.name, d.index, d.total_bytes, own.get(d.name, 0)) for d in devices if d.is_gpu
        ]
        first: tuple[Placement, Shortfall] | None = None
        error: EstimateError | None = None
        for devs, chosen in _candidates(config, gpus, own):
            try:
                est = estimate_config(config, devs)
            except EstimateError as err:
                error = error or err
                continue
            p = Placement(instance_id, est, [d.index for d in devs if d.index is not None], chosen)
            p.needs = est.by_device()
            short = _shortfall(p, devs, avail, gpu_pool)
            if short is None:
                return p, avail, None
            if first is None:
                first = (p, short)
        if first is None:
            assert error is not None
            raise error
        return first[0], avail, first[1]

    async def admit(self, instance_id: str, config: Any) -> Placement | None:
        """Place and check a start; hold its estimate until `release`. Raises
        InsufficientMemory; None when no estimate can be made (the start goes on unchecked)."""
        try:
            # Header reads (cached per file) off the loop; the check below is arithmetic only.
            config = await asyncio.to_thread(self._confined, config)
            await asyncio.to_thread(self.place, instance_id, config)
        except EstimateError as err:
            log.warning("no memory estimate for %s, starting unchecked: %s", instance_id, err)
            return None
        with self._lock:
            try:
                placement, _, short = self.place(instance_id, config)
            except EstimateError as err:
                log.warning("no memory estimate for %s, starting unchecked: %s", instance_id, err)
                return None
            skip = bool(getattr(config, "skip_fit_check", False)) or not self.enabled()
            if short is not None and not skip:
                dev, needed, available, why = short
                refusal = InsufficientMemory(instance_id, dev, needed, available, why)
                log.warning("start of %s refused: %s", instance_id, refusal.detail)
                raise refusal
            self._holds[instance_id] = placement
            self.placements[instance_id] = placement
        log.info(
            "instance %s placed on %s (estimate %.2f GiB)",
            instance_id,
            ",".join(placement.device_names),
            placement.estimate.total_bytes / GB,
        )
        return placement

    async def hold_adopted(self, instance_id: str, config: Any, placed: list[str] | None) -> None:
        """A backend adopted while still loading (the host restarted mid-start): hold its
        estimate on the devices it was placed on, as the start that spawned it did, until
        `release`. Never refused: it is already there. Without the hold, the memory it is
        about to take counted nowhere and other starts were admitted onto it."""
        try:
            placement = await asyncio.to_thread(self._placement_on, instance_id, config, placed)
        except EstimateError as err:
            log.warning("no memory estimate for adopted %s, nothing held: %s", instance_id, err)
            return
        with self._lock:
            self._holds[instance_id] = placement
            self.placements[instance_id] = placement

    def _placement_on(self, instance_id: str, config: Any, placed: list[str] | None) -> Placement:
        config = self._confined(config)
        named = [d for d in self.devices() if d.name in (placed or ())]
        gpus = [d for d in named if d.is_gpu]
        if not named:  # placed nowhere known (an older record): where a start would go now
            return self.place(instance_id, config)[0]
        est = estimate_config(config, gpus)
        p = Placement(instance_id, est, [d.index for d in gpus if d.index is not None], False)
        p.needs = est.by_device()
        return p

    def release(self, instance_id: str) -> None:
        with self._lock:
            self._holds.pop(instance_id, None)

    def forget(self, instance_id: str) -> None:
        with self._lock:
            self._holds.pop(instance_id, None)
            self.placements.pop(instance_id, None)

    def estimate_view(
        self, instance_id: str, config: Any, *, placed: bool = False
    ) -> dict[str, Any]:
        """The breakdown the estimate endpoints answer. `placed`: the instance runs, so its
        own placement is shown rather than where a start now would go. Raises EstimateError."""
        placement = self.placements.get(instance_id) if placed else None
        if placement is not None:
            avail = self.available(self.devices(), instance_id)
        else:
            placement, avail, _ = self.place(instance_id, self._confined(config))
        doc = placement.estimate.as_dict(avail)
        doc["placement"] = placement.device_names
        return doc

    def env_for(self, instance_id: str) -> dict[str, str]:
        """Environment that pins a backend to the GPUs the host chose for it."""
        p = self.placements.get(instance_id)
        if p is None or not p.chosen or not p.gpus:
            return {}
        return {
            # NVML numbers GPUs by PCI bus; CUDA, by default, fastest first.
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in p.gpus),
        }

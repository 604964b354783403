"""The fit check and GPU placement of a start, and the memory held by instances still loading.

A start asks `admit()`: the gate reads what each device has free (the probe), takes off what
loading instances hold (per device) and what reservations keep (the ledger; reserved VRAM comes
off all GPUs together, see `budget`), picks devices when the config names none (the GPU with
most free memory that fits, else the smallest set of the freest GPUs for a split), and either
holds the estimate until the start ends or refuses with InsufficientMemory (409). Check and
hold happen under one lock with no await between them, so concurrent starts cannot both count
the same free bytes. Once the start ends the hold goes: a running backend's memory is in the
probe's own figures from then on.

The probe is read in a worker thread before the lock (NVML hangs when a GPU falls off the bus;
the event loop must not hang with it); under the lock there is arithmetic only. On a GPU host a
GPU read that fails refuses the start (503, GpusUnreadable): checking it against RAM alone
would place it on the CPU with no GPU pinned.

A reservation control made for an intent (job_id "intent:<intent_id>", control-contract 2.5)
is the room for that intent's instance: its own start does not count it, and while an
instance of the intent starts or runs the reservation counts only what the instance does not
already take (see `_covered`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solar_host.estimates.dispatch import estimate_config
from solar_host.estimates.measured import Measurement, MeasurementStore, memory_key
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


def intent_job_id(intent_id: str) -> str:
    """The job_id control gives the reservation of an intent (control-contract 2.5)."""
    return f"intent:{intent_id}"


class GpusUnreadable(InstanceConflict):
    """A GPU host whose GPUs cannot be read now: the start cannot be checked or placed. 503
    (try again), not 409; an InstanceConflict so that a refused crash restart is handled as
    a fit-check refusal is."""

    status = 503

    def __init__(self, instance_id: str, error: Exception):
        self.instance_id = instance_id
        super().__init__(
            f"Cannot read the GPUs: {error}. The start could not be checked against them and "
            "was not made; try again shortly (or set skip_fit_check: true in the config to "
            "start anyway)"
        )

    def body(self) -> dict[str, Any]:
        return {"detail": self.detail, "instance_id": self.instance_id}


class InsufficientMemory(InstanceConflict):
    """The estimate of a start exceeds what its device has free: nothing was spawned."""

    def __init__(
        self,
        instance_id: str,
        device: str,
        needed_bytes: int,
        available_bytes: int,
        why: str = "",
        placement: Placement | None = None,
    ):
        self.instance_id = instance_id
        self.device = device
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.figures = placement.figures() if placement is not None else {}
        measured = ""
        if self.figures.get("source") == MEASURED:
            measured = " (measured on an earlier load)"
        detail = why or (
            f"Not enough memory on {device}: the instance needs about "
            f"{needed_bytes / GB:.2f} GiB{measured}, {max(available_bytes, 0) / GB:.2f} GiB is "
            "free (set skip_fit_check: true in the config to start anyway)"
        )
        super().__init__(detail)

    def body(self) -> dict[str, Any]:
        return {
            "detail": self.detail,
            "instance_id": self.instance_id,
            "needed_bytes": self.needed_bytes,
            "available_bytes": self.available_bytes,
            "device": self.device,
            **self.figures,
        }


MEASURED = "measured"
ESTIMATED = "estimated"


@dataclass(slots=True)
class Placement:
    """Where an instance goes and what it is expected to take there.

    `needs` is what is admitted per device: the measured peak of an earlier load of the same
    key plus the margin (`source` "measured"), else the estimate (`source` "estimated").
    Drift raises it to what the instance was seen to take (`raise_to`)."""

    instance_id: str
    estimate: Estimate
    gpus: list[int]  # GPU indices the backend uses
    chosen: bool  # the host picked them (the config named none): pin them in the environment
    needs: dict[str, int] = field(default_factory=dict)
    key: str | None = None  # the measurement key of its config (measured.memory_key)
    source: str = ESTIMATED
    measured: dict[str, int] | None = None  # the measured peak per device, without margin

    @property
    def device_names(self) -> list[str]:
        return [gpu_name(i) for i in self.gpus] or [CPU]

    def figures(self) -> dict[str, Any]:
        """Which figure was admitted and both figures, as every answer names them."""
        return {
            "source": self.source,
            "admitted_bytes": sum(self.needs.values()),
            "estimated_bytes": self.estimate.total_bytes,
            "measured_bytes": sum(self.measured.values()) if self.measured is not None else None,
        }

    def admit_measured(self, m: Measurement | None, margin: float) -> None:
        """Admit the measured peak plus `margin` where `m` was measured on as many GPUs."""
        peak = m.peak_on(self.device_names) if m is not None else None
        if peak is None:
            return
        self.measured = peak
        self.needs = {dev: math.ceil(n * (1.0 + margin)) for dev, n in peak.items()}
        self.source = MEASURED


def _candidates(
    config: Any, gpus: list[Device], free: dict[str, int]
) -> list[tuple[list[Device], bool]]:
    """Device sets to try, best first: (devices, chosen by the host)."""
    by_index = {g.index: g for g in gpus}
    order = sorted(gpus, key=lambda g: free.get(g.name, 0), reverse=True)
    bt = config.backend_type
    if bt == "llamacpp":
        # Imported here, as dispatch imports the GGUF estimator: not at every host start.
        from solar_host.estimates.gguf import parse_devices

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
        reserved: Callable[..., dict[str, int]] | None = None,
        roots: Callable[[], Sequence[Path]] | None = None,
        gpu_host: Callable[[], bool | None] | None = None,
        instances: Callable[[], Iterable[Any]] | None = None,
        measurements: MeasurementStore | None = None,
        margin: Callable[[], float] = lambda: 0.05,
        version: Callable[[str], str] = lambda backend_type: "",
    ):
        self.probe = probe
        # What earlier loads took per key (None: admit from the estimate only), the margin
        # added to a measured peak (MEASURED_MEMORY_MARGIN) and each backend type's version
        # (part of the key).
        self.measurements = measurements
        self.margin = margin
        self.version = version
        self.enabled = enabled
        # Whether the host has NVIDIA GPUs (ResourceService.gpu_host: sticky once decided).
        # None: ask the probe (a gate built without it, unit tests).
        self.gpu_host = gpu_host
        # The host's instances (their status and intent_id): which reservations their memory
        # already covers. None: no instance covers any (unit tests).
        self.instances = instances
        # The model roots (MODELS_DIR first): every file an estimate opens is judged against
        # them first (_confined). None: a gate built without them (unit tests).
        self.roots = roots
        # Bytes kept by the reservation ledger per dimension ({"gpu": n, "cpu": n}); called
        # with `covered` (job_id -> {"gpu": n, "cpu": n}) when instances cover some of it.
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
    def devices(self, instance_id: str = "") -> list[Device]:
        """The CPU (system RAM) and every GPU, with what the probe reports free. Blocking (NVML):
        call it off the event loop. Raises GpusUnreadable when the GPUs of a GPU host cannot
        be read: leaving them out would check and place the start as if on a CPU host."""
        out = []
        try:
            ram = self.probe.ram()
            out.append(Device(CPU, None, ram.total_bytes, ram.available_bytes))
        except Exception as err:
            log.warning("RAM probe failed: %s", err)
        try:
            gpus = self.probe.gpus()
        except Exception as err:
            if self._is_gpu_host() is not False:
                log.warning("GPU probe failed, start of %s refused: %s", instance_id, err)
                raise GpusUnreadable(instance_id, err) from None
            log.warning("GPU probe failed on a host without GPUs: %s", err)
            gpus = []
        for g in gpus:
            out.append(
                Device(gpu_name(g.index), g.index, g.total_bytes, g.total_bytes - g.used_bytes)
            )
        return out

    def _is_gpu_host(self) -> bool | None:
        if self.gpu_host is not None:
            return self.gpu_host()
        from solar_host.resources.service import probe_gpu_host

        return probe_gpu_host(self.probe)

    def held(
        self, exclude: str | None = None, earlier: dict[str, Placement] | None = None
    ) -> dict[str, int]:
        """Bytes per device held by starts in progress. `earlier`: the holds when the probe was
        read, counted too: a start that finished loading since has dropped its hold, but the
        figures read before may not show its memory yet."""
        holds = {**(earlier or {}), **self._holds}
        out: dict[str, int] = {}
        for iid, p in holds.items():
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
        return self._budget(devices, self._free_less_holds(devices, exclude), exclude)

    def _budget(
        self, devices: list[Device], own: dict[str, int], instance_id: str | None = None
    ) -> tuple[dict[str, int], int]:
        reserved = self._reserved(instance_id)
        gpu_pool = sum(own[d.name] for d in devices if d.is_gpu) - reserved.get("gpu", 0)
        gpu_pool = max(gpu_pool, 0)
        out: dict[str, int] = {}
        for d in devices:
            if d.is_gpu:
                out[d.name] = min(own[d.name], gpu_pool)
            else:
                out[d.name] = max(own[d.name] - reserved.get("cpu", 0), 0)
        return out, gpu_pool

    def _reserved(self, instance_id: str | None) -> dict[str, int]:
        """What reservations keep for the start (or estimate) of `instance_id`."""
        if self.reserved is None:
            return {}
        covered = self._covered(instance_id)
        return self.reserved(covered) if covered else self.reserved()

    def _covered(self, instance_id: str | None) -> dict[str, dict[str, float]]:
        """job_id -> bytes ({"gpu", "cpu"}) of intent reservations that instances take already.

        Control reserves an intent's memory, then starts its instance, and releases the
        reservation once it sees the instance running (control-contract 2.5). So:
        - the start of `instance_id` does not count its own intent's reservation at all: that
          is the very room it was made for, and the start's full estimate is checked anyway
          (counting both refused any start without twice its need free);
        - an instance of an intent that starts (its hold) or runs (in the probe's figures;
          its estimate stands for what it takes) covers that much of the intent's
          reservation for every other start: the pair counts max(reservation, instance),
          never the sum. Stopped instances cover nothing: the reservation keeps its room."""
        if self.instances is None:
            return {}
        out: dict[str, dict[str, float]] = {}
        for inst in list(self.instances()):
            intent = getattr(inst, "intent_id", None)
            if not intent:
                continue
            job = intent_job_id(intent)
            if inst.id == instance_id:
                out[job] = {"gpu": math.inf, "cpu": math.inf}
                continue
            p = self._taking(inst)
            if p is None:
                continue
            by_kind = out.setdefault(job, {"gpu": 0.0, "cpu": 0.0})
            for dev, n in p.needs.items():
                by_kind["cpu" if dev == CPU else "gpu"] += n
        return out

    def _taking(self, inst: Any) -> Placement | None:
        """The placement whose memory `inst` takes now: its hold while it loads, its last
        placement while it runs. None otherwise, also for a start not yet admitted (its last
        placement is an old one) and for one adopted running at boot (no estimate)."""
        status = str(getattr(inst, "status", ""))
        if status == "starting":
            return self._holds.get(inst.id)
        if status == "running":
            return self.placements.get(inst.id)
        return None

    def available(self, devices: list[Device], exclude: str | None = None) -> dict[str, int]:
        """Bytes available per device: free, less loading holds and reservations."""
        return self.budget(devices, exclude)[0]

    def _free_less_holds(
        self,
        devices: list[Device],
        exclude: str | None,
        earlier: dict[str, Placement] | None = None,
    ) -> dict[str, int]:
        held = self.held(exclude, earlier)
        return {d.name: max(d.free_bytes - held.get(d.name, 0), 0) for d in devices}

    # --- estimate and placement ------------------------------------------------------------------
    def place(
        self, instance_id: str, config: Any, exclude: str | None = None
    ) -> tuple[Placement, dict[str, int], Shortfall | None]:
        """The best placement, what is available, and the first shortfall of it (or None).
        Reads the probe (blocking): call it off the event loop. Raises EstimateError,
        GpusUnreadable."""
        key = self.key_of(config)
        return self._place_on(instance_id, config, self.devices(instance_id), exclude, key=key)

    def key_of(self, config: Any) -> str | None:
        """The measurement key of a confined config (stats its files: blocking); None when
        the gate keeps no measurements or the key cannot be made."""
        if self.measurements is None:
            return None
        try:
            return memory_key(config, self.version(str(config.backend_type)))
        except Exception as err:  # a key is an optimisation: the estimate still answers
            log.warning("no memory measurement key for this config: %s", err)
            return None

    def _place_on(
        self,
        instance_id: str,
        config: Any,
        devices: list[Device],
        exclude: str | None = None,
        earlier: dict[str, Placement] | None = None,
        key: str | None = None,
    ) -> tuple[Placement, dict[str, int], Shortfall | None]:
        """`place` on devices already read: arithmetic only once the model headers are cached.
        `key`: the config's measurement key; a measurement of it is admitted instead of the
        estimate on a device set with as many GPUs as it was measured on.

        A device set the config cannot be estimated on (main_gpu or tensor_split naming a GPU
        outside it) is skipped; raises the first candidate's EstimateError only when no set
        can be estimated.
        """
        own = self._free_less_holds(devices, exclude or instance_id, earlier)
        avail, gpu_pool = self._budget(devices, own, instance_id)
        # Order and llama.cpp's default split follow each GPU's own free memory; the pool
        # cap only decides whether it fits.
        gpus = [
            Device(d.name, d.index, d.total_bytes, own.get(d.name, 0)) for d in devices if d.is_gpu
        ]
        first: tuple[Placement, Shortfall] | None = None
        error: EstimateError | None = None
        measured = self.measurements.get(key) if self.measurements is not None else None
        margin = self.margin()
        for devs, chosen in _candidates(config, gpus, own):
            try:
                est = estimate_config(config, devs)
            except EstimateError as err:
                error = error or err
                continue
            p = Placement(instance_id, est, [d.index for d in devs if d.index is not None], chosen)
            p.needs = est.by_device()
            p.key = key
            p.admit_measured(measured, margin)
            short = _shortfall(p, devs, avail, gpu_pool)
            if short is None:
                return p, avail, None
            if first is None:
                first = (p, short)
        if first is None:
            assert error is not None
            raise error
        return first[0], avail, first[1]

    def _read_for(
        self, instance_id: str, config: Any
    ) -> tuple[Any, list[Device], dict[str, Placement], str | None]:
        """The blocking half of a start's check (worker thread): the config confined, its
        measurement key, the probe read (with the holds at that moment), and one placement on
        them so that the model headers are cached and a config that cannot be estimated says
        so now."""
        config = self._confined(config)
        key = self.key_of(config)
        earlier = dict(self._holds)
        devices = self.devices(instance_id)
        self._place_on(instance_id, config, devices, earlier=earlier, key=key)
        return config, devices, earlier, key

    async def admit(self, instance_id: str, config: Any) -> Placement | None:
        """Place and check a start; hold its estimate until `release`. Raises
        InsufficientMemory, GpusUnreadable; None when no estimate can be made (the start goes
        on unchecked)."""
        skip = bool(getattr(config, "skip_fit_check", False)) or not self.enabled()
        try:
            config, devices, earlier, key = await asyncio.to_thread(
                self._read_for, instance_id, config
            )
        except EstimateError as err:
            log.warning("no memory estimate for %s, starting unchecked: %s", instance_id, err)
            return None
        except GpusUnreadable as err:
            if not skip:
                raise
            log.warning("start of %s unchecked (fit check off): %s", instance_id, err.detail)
            return None
        with self._lock:  # arithmetic only: the probe was read above
            try:
                placement, _, short = self._place_on(
                    instance_id, config, devices, earlier=earlier, key=key
                )
            except EstimateError as err:
                log.warning("no memory estimate for %s, starting unchecked: %s", instance_id, err)
                return None
            if short is not None and not skip:
                dev, needed, available, why = short
                refusal = InsufficientMemory(instance_id, dev, needed, available, why, placement)
                log.warning("start of %s refused: %s", instance_id, refusal.detail)
                raise refusal
            self._holds[instance_id] = placement
            self.placements[instance_id] = placement
        log.info(
            "instance %s placed on %s (%s %.2f GiB, estimate %.2f GiB)",
            instance_id,
            ",".join(placement.device_names),
            placement.source,
            sum(placement.needs.values()) / GB,
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
        except (EstimateError, GpusUnreadable) as err:
            log.warning("no memory estimate for adopted %s, nothing held: %s", instance_id, err)
            return
        with self._lock:
            self._holds[instance_id] = placement
            self.placements[instance_id] = placement

    def _placement_on(self, instance_id: str, config: Any, placed: list[str] | None) -> Placement:
        config = self._confined(config)
        named = [d for d in self.devices(instance_id) if d.name in (placed or ())]
        gpus = [d for d in named if d.is_gpu]
        if not named:  # placed nowhere known (an older record): where a start would go now
            return self.place(instance_id, config)[0]
        est = estimate_config(config, gpus)
        p = Placement(instance_id, est, [d.index for d in gpus if d.index is not None], False)
        p.needs = est.by_device()
        p.key = self.key_of(config)
        p.admit_measured(
            self.measurements.get(p.key) if self.measurements is not None else None,
            self.margin(),
        )
        return p

    def release(self, instance_id: str) -> None:
        with self._lock:
            self._holds.pop(instance_id, None)

    def raise_to(self, instance_id: str, seen: dict[str, int]) -> bool:
        """An instance seen above its admitted figure (drift): what it is admitted with
        becomes what it takes, per device, so that its hold (while it loads) and the
        reservation it covers count it from now on. True when anything was raised."""
        with self._lock:
            p = self.placements.get(instance_id)
            if p is None:
                return False
            raised = False
            for dev, n in seen.items():
                if n > p.needs.get(dev, 0):
                    p.needs[dev] = n
                    raised = True
            return raised

    def forget(self, instance_id: str) -> None:
        with self._lock:
            self._holds.pop(instance_id, None)
            self.placements.pop(instance_id, None)

    def estimate_view(
        self, instance_id: str, config: Any, *, placed: bool = False
    ) -> dict[str, Any]:
        """The breakdown the estimate endpoints answer. `placed`: the instance runs, so its
        own placement is shown rather than where a start now would go. Reads the probe: call
        it off the event loop. Raises EstimateError, GpusUnreadable."""
        placement = self.placements.get(instance_id) if placed else None
        if placement is not None:
            avail = self.available(self.devices(instance_id), instance_id)
        else:
            placement, avail, _ = self.place(instance_id, self._confined(config))
        doc = placement.estimate.as_dict(avail)
        doc["placement"] = placement.device_names
        doc.update(placement.figures())
        if placement.source == MEASURED:
            # The fit of what would be admitted, not of the estimate shown per device.
            doc["admitted_devices"] = dict(placement.needs)
            doc["fits"] = placement.estimate.refusal is None and all(
                n <= avail.get(dev, 0) for dev, n in placement.needs.items()
            )
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

"""The memory sampler: one task for the host that measures every instance's process tree.

Every MEMORY_SAMPLE_INTERVAL_S, for each instance starting or running with a process: the RSS
of its process tree on the CPU and NVML's per-process figures summed over the tree per GPU
(one NVML query for all instances; accounting.measure_tree). The reading happens in a worker
thread; what it means (peaks, drift, events) is worked out back on the event loop, the one
owner of the per-instance state here.

- Peak: the largest figure per device since the backend's process started (loading and
  serving alike). Steady: the last figure while it serves.
- Remembered: once an instance serves, its peak (and steady) are recorded under the
  measurement key its start was admitted with (Placement.key) in the MeasurementStore, and
  written to memory-measurements.json: a new load at once, a peak that grew since within
  WRITE_EVERY_S, everything when the host stops. A load that never became ready is
  not recorded: its peak is not what a load of that config takes.
- Drift: a running instance above its admitted figure on a device by more than
  MEMORY_DRIFT_SHARE (and by at least DRIFT_FLOOR_BYTES) for two samples in a row publishes
  MemoryDrift, logs a warning, counts in
  `drifts` (the metric) and raises its admitted figure to what it takes (CapacityGate.raise_to),
  so its hold and the reservation it covers count the excess for the next start at once.

Sampling misses what rises and falls between two samples: the recorded peak is the largest
figure seen, not necessarily the true one (hence the margin on admission).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from solar_host.estimates.accounting import gpu_memory_by_device, measure_tree
from solar_host.estimates.measured import MeasurementStore
from solar_host.estimates.model import CPU
from solar_host.events import EventBus, MemoryDrift

log = logging.getLogger(__name__)

# An excess smaller than this is not drift: a tiny model's runtime (llama-server's code and
# libraries, ~27 MiB of RSS) is far above its estimate without the model outgrowing anything.
DRIFT_FLOOR_BYTES = 64 * 1024 * 1024

# A peak that only grew since the last write waits this long for the next one: admission
# reads the figures in memory, the file only has to survive a restart.
WRITE_EVERY_S = 30.0

LOADING = "starting"
SERVING = "running"


@dataclass(slots=True)
class Tracked:
    """What the sampler knows of one backend process (a new pid starts afresh)."""

    instance_id: str
    pid: int
    peak: dict[str, int] = field(default_factory=dict)
    last: dict[str, int] = field(default_factory=dict)
    steady: dict[str, int] | None = None
    samples: int = 0
    served: bool = False
    recorded: dict[str, int] | None = None  # the peak last put in the store
    over: dict[str, int] = field(default_factory=dict)  # samples in a row above, per device
    drifting: set[str] = field(default_factory=set)

    def view(self) -> dict[str, Any]:
        return {
            "peak_bytes": sum(self.peak.values()) if self.peak else None,
            "steady_bytes": sum(self.steady.values()) if self.steady else None,
            "peak": dict(self.peak),
            "steady": dict(self.steady) if self.steady else None,
            "samples": self.samples,
            "drifting": sorted(self.drifting),
        }


def _split(figures: dict[str, int], gpu_order: list[str]) -> tuple[int, list[int]]:
    """(cpu bytes, GPU bytes in placement order). GPUs measured outside the placement come
    after it, by name."""
    extra = sorted(d for d in figures if d != CPU and d not in gpu_order)
    return figures.get(CPU, 0), [figures.get(d, 0) for d in [*gpu_order, *extra]]


class MemorySampler:
    """One per host: start()/stop() with the host; `sample()` is one round (tests call it)."""

    def __init__(
        self,
        *,
        manager: Any,
        probe: Any,
        store: MeasurementStore,
        bus: EventBus,
        interval_s: Callable[[], float] = lambda: 2.0,
        drift_share: Callable[[], float] = lambda: 0.10,
    ):
        self.manager = manager
        self.probe = probe
        self.store = store
        self.bus = bus
        self.interval_s = interval_s
        self.drift_share = drift_share
        self.tracked: dict[str, Tracked] = {}
        self.drifts: dict[str, int] = {}  # instance id -> drifts seen (the metric)
        self.rounds = 0
        self.last_cost_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._write_now = False
        self._written_at = time.monotonic()

    # --- lifecycle ---------------------------------------------------------------------------
    async def load_state(self) -> None:
        await asyncio.to_thread(self.store.load)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="memory-sampler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.to_thread(self.store.flush)

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not end sampling for the host's life
                log.exception("memory sample failed")
            await asyncio.sleep(self.interval_s())

    # --- one round ---------------------------------------------------------------------------
    def _targets(self) -> list[tuple[str, int, str]]:
        """(instance id, pid, status) of every instance with a process that loads or serves."""
        out = []
        for sup in list(self.manager.supervisors.values()):
            inst = sup.instance
            status = str(inst.status)
            if inst.pid and status in (LOADING, SERVING):
                out.append((inst.id, int(inst.pid), status))
        return out

    def read(self, targets: list[tuple[str, int, str]]) -> dict[str, dict[str, int]]:
        """The blocking half (worker thread): one NVML query, one tree walk per instance."""
        started = time.perf_counter()
        gpu = gpu_memory_by_device(self.probe) if targets else {}
        out = {iid: measure_tree(pid, gpu) for iid, pid, _ in targets}
        self.last_cost_s = time.perf_counter() - started
        return out

    async def sample(self) -> None:
        targets = self._targets()
        figures = await asyncio.to_thread(self.read, targets)
        self.rounds += 1
        live = {iid for iid, _, _ in targets}
        for iid in [i for i in self.tracked if i not in live]:
            del self.tracked[iid]
        for iid, pid, status in targets:
            seen = figures.get(iid)
            if seen:
                self._take(iid, pid, status, seen)
        if self._write_now or time.monotonic() - self._written_at >= WRITE_EVERY_S:
            self._write_now = False
            self._written_at = time.monotonic()
            await asyncio.to_thread(self.store.flush)

    def _take(self, iid: str, pid: int, status: str, seen: dict[str, int]) -> None:
        t = self.tracked.get(iid)
        if t is None or t.pid != pid:
            t = self.tracked[iid] = Tracked(iid, pid)
        t.samples += 1
        t.last = dict(seen)
        for dev, n in seen.items():
            t.peak[dev] = max(t.peak.get(dev, 0), n)
        if status != SERVING:
            return
        t.steady = dict(seen)
        placement = self._placement(iid)
        self._remember(t, placement)
        if placement is not None:
            self._check_drift(t, placement)

    def _placement(self, iid: str) -> Any:
        gate = self.manager.capacity
        return gate.placements.get(iid) if gate is not None else None

    def _remember(self, t: Tracked, placement: Any) -> None:
        """Record the peak under the key it was admitted with, when it is new or grew (and
        the steady figure with it); the first serving sample of a process is a new load,
        written to the file at once (`sample`)."""
        if placement is None or not placement.key:
            return
        if t.recorded is not None and all(n <= t.recorded.get(dev, 0) for dev, n in t.peak.items()):
            return
        gpus = [d for d in placement.device_names if d != CPU]
        cpu, per_gpu = _split(t.peak, gpus)
        steady = _split(t.steady or {}, gpus)
        self.store.record(
            placement.key,
            cpu,
            per_gpu,
            steady,
            new_load=t.recorded is None,
            backend_type=placement.estimate.backend_type,
        )
        self._write_now = self._write_now or t.recorded is None
        t.recorded = dict(t.peak)

    def _check_drift(self, t: Tracked, placement: Any) -> None:
        share = self.drift_share()
        for dev, admitted in list(placement.needs.items()):
            seen = t.last.get(dev, 0)
            limit = max(admitted * (1.0 + share), admitted + DRIFT_FLOOR_BYTES)
            if admitted <= 0 or seen <= limit:
                t.over[dev] = 0
                continue
            t.over[dev] = t.over.get(dev, 0) + 1
            if t.over[dev] < 2 or dev in t.drifting:
                continue
            t.drifting.add(dev)
            self.drifts[t.instance_id] = self.drifts.get(t.instance_id, 0) + 1
            log.warning(
                "instance %s drifted on %s: it takes %d bytes, %.1f %% above the %d it was "
                "admitted with (%s); counted against the next start",
                t.instance_id,
                dev,
                seen,
                100.0 * (seen - admitted) / admitted,
                admitted,
                placement.source,
            )
            self.bus.publish(
                MemoryDrift(
                    instance_id=t.instance_id,
                    device=dev,
                    admitted_bytes=admitted,
                    measured_bytes=seen,
                    source=placement.source,
                )
            )
        if t.drifting:
            gate = self.manager.capacity
            if gate is not None:
                gate.raise_to(t.instance_id, {d: t.last.get(d, 0) for d in t.drifting})

    def view(self, instance_id: str) -> dict[str, Any] | None:
        t = self.tracked.get(instance_id)
        return t.view() if t is not None else None

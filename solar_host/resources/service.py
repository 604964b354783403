"""ResourceService: the capacity snapshot, the reservation ledger and its two loops.

`snapshot()` is the one function behind `GET /resources` and `host_health.resources`;
`health_summary()` is the legacy host_health `reservations` block. The usage and cleanup loops
run whenever the host runs, with or without a control link (upstream ran them only with one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import replace
from datetime import datetime
from typing import Any

from solar_host.events import EventBus, ReservationsChanged
from solar_host.resources.ledger import Capacity, Ledger, LedgerNotPersisted, SystemUsage
from solar_host.resources.ledger_store import ReservationStore
from solar_host.resources.probes import GB, CachedValue, SystemProbe
from solar_host.resources.schemas import ReservationRequest
from solar_host.resources.usage import JobView, measure_jobs
from solar_host.settings import Settings

log = logging.getLogger(__name__)

# System figures for snapshots are re-read at most this often: a burst of snapshots must not
# hammer NVML. A reservation's capacity check never uses them (it reads the probe fresh).
SYSTEM_READ_TTL_S = 1.0


def probe_gpu_host(probe: SystemProbe) -> bool | None:
    """Whether the probe says this is an NVIDIA host; None when it cannot say."""
    try:
        return probe.gpu_type() == "nvidia_cuda"
    except Exception as err:
        log.warning("GPU type probe failed: %s", err)
        return None


def read_system_usage(
    probe: SystemProbe, disk_path: Any, gpu_host: bool | None = None
) -> SystemUsage:
    """Totals and use per dimension; a failing probe leaves that dimension out (None).

    `gpu_host`: what the caller knows of the host (None: ask the probe). GPUs seen now make
    it a GPU host whatever was said."""
    vram = ram = disk = None
    try:
        gpus = probe.gpus()
        if gpus:
            vram = Capacity(
                total_bytes=sum(g.total_bytes for g in gpus),
                used_bytes=sum(g.used_bytes for g in gpus),
            )
            gpu_host = True
    except Exception as err:
        log.warning("GPU probe failed: %s", err)
    if gpu_host is None:
        gpu_host = probe_gpu_host(probe)
    try:
        r = probe.ram()
        ram = Capacity(total_bytes=r.total_bytes, used_bytes=r.used_bytes)
    except Exception as err:
        log.warning("RAM probe failed: %s", err)
    try:
        d = probe.disk(disk_path)
        if d is not None:
            disk = Capacity(total_bytes=d.total_bytes, used_bytes=d.used_bytes)
    except Exception as err:
        log.warning("disk probe failed: %s", err)
    return SystemUsage(vram=vram, ram=ram, disk=disk, gpu_host=gpu_host)


def loading_bytes(holds: list[dict[str, Any]]) -> tuple[int, int]:
    """(GPU bytes, CPU bytes) held by loading instances."""
    gpu = cpu = 0
    for h in holds:
        for dev, n in h.get("devices", {}).items():
            if dev == "cpu":
                cpu += int(n)
            else:
                gpu += int(n)
    return gpu, cpu


def add_loading(doc: dict[str, Any], holds: list[dict[str, Any]], fold: bool) -> None:
    """Count loading instances' estimates as capacity in use in a snapshot or summary.
    `fold`: a CPU host, where all of it is RAM."""
    gpu, cpu = loading_bytes(holds)
    if fold:
        cpu, gpu = cpu + gpu, 0
    for dim, extra in (("vram", gpu), ("ram", cpu)):
        block = doc.get(dim)
        if not extra or not isinstance(block, dict):
            continue
        gb = extra / GB
        block["reserved_headroom_gb"] = round(block["reserved_headroom_gb"] + gb, 2)
        block["reported_used_gb"] = round(block["reported_used_gb"] + gb, 2)
        block["available_gb"] = round(max(0.0, block["available_gb"] - gb), 2)


def _covered_gb(by_kind: dict[str, int], fold: bool) -> dict[str, float]:
    """Bytes an instance takes per kind ("gpu", "cpu") as GiB per ledger dimension; on a CPU
    host (`fold`) all of it is RAM, as the ledger counts VRAM claims there."""
    gpu, cpu = by_kind.get("gpu", 0) / GB, by_kind.get("cpu", 0) / GB
    return {"vram": 0.0, "ram": gpu + cpu} if fold else {"vram": gpu, "ram": cpu}


class ResourceService:
    """Owns the ledger. `jobs` (a JobView) is set after construction; None: nothing runs."""

    def __init__(
        self,
        settings: Settings,
        *,
        bus: EventBus,
        probe: SystemProbe,
        jobs: JobView | None = None,
    ):
        self.settings = settings
        self.bus = bus
        self.probe = probe
        self.jobs = jobs
        self.ledger = Ledger(self._job_running)
        self.store = ReservationStore(settings.reservations_file, self.ledger.records)
        self._background_saves: set[asyncio.Task[None]] = set()
        self._system = CachedValue(SYSTEM_READ_TTL_S)
        self._system_lock = threading.Lock()
        self._create_lock = threading.Lock()
        # Whether the host has NVIDIA GPUs: decided once (the first answer of the probe, or GPUs
        # seen), so that one failed NVML read never makes a GPU host count as a CPU host.
        self._gpu_host: bool | None = None
        self._gpu_host_lock = threading.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.usage_refreshes = 0
        self.cleanup_runs = 0
        # Memory held by instance starts in progress (CapacityGate.holds), set by build_host:
        # [{instance_id, devices: {cpu | cuda:N: bytes}, bytes}].
        self.loading: Any = None

    # --- reads -------------------------------------------------------------------------------
    def _job_running(self, job_id: str) -> bool:
        jobs = self.jobs
        return jobs is not None and bool(jobs.is_running(job_id))

    def gpu_host(self) -> bool | None:
        """True on a host with NVIDIA GPUs, False on one without, None while undecided (the
        probe could not say). Sticky once decided."""
        with self._gpu_host_lock:
            if self._gpu_host is None:
                self._gpu_host = probe_gpu_host(self.probe)
            return self._gpu_host

    def read_usage(self) -> SystemUsage:
        """The system usage, read from the probe now."""
        usage = read_system_usage(self.probe, self.settings.models_dir, self.gpu_host())
        if usage.gpu_host:  # GPUs seen: a GPU host from now on, whatever the probe said first
            with self._gpu_host_lock:
                self._gpu_host = True
        return usage

    def system_usage(self) -> SystemUsage:
        """The system usage for snapshots, at most SYSTEM_READ_TTL_S old."""
        with self._system_lock:
            return self._system.get(self.read_usage)

    def snapshot(self) -> dict[str, Any]:
        """The ResourceSnapshot (JSON-ready): `GET /resources` and `host_health.resources`."""
        usage = self.system_usage()
        snap = self.ledger.snapshot(usage)
        holds = self._loading()
        add_loading(snap, holds, usage.fold_vram)
        snap["loading_instances"] = holds
        return snap

    def health_summary(self) -> dict[str, Any]:
        """Legacy host_health block: {active_count, vram?, ram?, disk?}."""
        usage = self.system_usage()
        summary = self.ledger.summary(usage)
        add_loading(summary, self._loading(), usage.fold_vram)
        return summary

    def _loading(self) -> list[dict[str, Any]]:
        loading = self.loading
        if loading is None:
            return []
        try:
            return list(loading())
        except Exception:
            log.exception("loading holds unavailable")
            return []

    def reserved_bytes(self, covered: dict[str, dict[str, int]] | None = None) -> dict[str, int]:
        """What reservations keep, as the fit check counts it: {"gpu": bytes, "cpu": bytes}
        (on a CPU host all of it is "cpu").

        `covered`: job_id -> bytes per device kind ("gpu", "cpu") that instances made for that
        job already take (held while they load, in the probe's figures once they run). Control
        reserves an intent's memory (job_id "intent:<id>") before it starts the intent's
        instance and releases it only once it sees the instance running: counting the
        reservation beside the instance's own memory would count that memory twice. A
        reservation counts only what its instance does not already cover, max(reserved -
        covered, 0), so the pair together counts max(reservation, instance)."""
        fold = self.gpu_host() is False
        taken = None
        if covered:
            taken = {job: _covered_gb(by_kind, fold) for job, by_kind in covered.items()}
        headroom = self.ledger.headroom_gb(fold=fold, covered=taken)
        return {"gpu": int(headroom["vram"] * GB), "cpu": int(headroom["ram"] * GB)}

    def _with_loading(self, usage: SystemUsage, earlier: list[dict[str, Any]]) -> SystemUsage:
        """`usage` with the holds of loading instances counted as used: a reservation cannot
        take memory a start is about to fill. The holds are read now (inside the ledger's
        lock: a start admitted meanwhile has its hold counted) and joined with `earlier`, the
        holds seen when the probe was read: a start that finished loading since has dropped
        its hold, but the figures read before may not show its memory yet."""
        holds = {h.get("instance_id"): h for h in earlier}
        holds.update({h.get("instance_id"): h for h in self._loading()})
        gpu, cpu = loading_bytes(list(holds.values()))

        def more(cap: Capacity | None, extra: int) -> Capacity | None:
            if cap is None or not extra:
                return cap
            return Capacity(cap.total_bytes, cap.used_bytes + extra)

        if usage.fold_vram:
            return replace(usage, ram=more(usage.ram, gpu + cpu))
        return replace(usage, vram=more(usage.vram, gpu), ram=more(usage.ram, cpu))

    def get(self, reservation_id: str) -> dict[str, Any] | None:
        return self.ledger.get(reservation_id, fold=self.gpu_host() is False)

    # --- durable changes (the REST routes) ------------------------------------------------------
    async def reserve(self, req: ReservationRequest) -> dict[str, Any]:
        """create(), answered once the ledger file holds it. Raises CapacityExceeded,
        DimensionUnreadable, or LedgerNotPersisted (the reservation is undone). The probe is
        read in a worker thread: a hung NVML must not stop the event loop."""
        self.cleanup_expired(count_run=False)
        view = await asyncio.to_thread(self._check_and_insert, req)
        self._created(view, persist=False)
        try:
            await self.store.commit()
        except OSError as err:
            self.ledger.discard(view["id"])
            self.bus.publish(ReservationsChanged(reason="create undone"))
            raise LedgerNotPersisted(
                f"Cannot write {self.store.path}: {err.strerror or err}; nothing was reserved"
            ) from None
        return view

    async def unreserve(self, reservation_id: str) -> dict[str, str]:
        """release(), answered once the ledger file no longer holds it."""
        res = self.ledger.release(reservation_id)
        try:
            await self.store.commit()
        except OSError as err:
            self.ledger.restore([res])
            raise LedgerNotPersisted(
                f"Cannot write {self.store.path}: {err.strerror or err}; nothing was released"
            ) from None
        log.info("reservation %s released (job %s)", res.id, res.job_id)
        self.bus.publish(ReservationsChanged(reason="released"))
        return {"detail": "released", "id": res.id}

    def _persist_soon(self) -> None:
        """Write the ledger without waiting (expiry sweeps, callers without a loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            try:
                self.store.write_now()
            except OSError as err:
                log.error("cannot write %s: %s", self.store.path, err)
            return

        async def save() -> None:
            try:
                await self.store.commit()
            except OSError as err:
                log.error("cannot write %s: %s", self.store.path, err)

        task = loop.create_task(save())
        self._background_saves.add(task)
        task.add_done_callback(self._background_saves.discard)

    # --- changes (call from the event-loop thread: they publish) ------------------------------
    def create(self, req: ReservationRequest, *, persist: bool = True) -> dict[str, Any]:
        """Reserve capacity; the view of the new reservation. Raises CapacityExceeded, or
        DimensionUnreadable when a dimension it asks for cannot be read now (503).

        Reads the probe on the caller's thread; `reserve()` (the REST route) reads it off the
        loop and waits for the write. Written to the ledger file in the background here."""
        # Expired reservations already count nowhere (ledger.in_force); sweeping them here also
        # takes them out of the ledger file with this write.
        self.cleanup_expired(count_run=False)
        view = self._check_and_insert(req)
        self._created(view, persist=persist)
        return view

    def _check_and_insert(self, req: ReservationRequest) -> dict[str, Any]:
        """The capacity check and insert (any thread). One create at a time reads the probe,
        outside the ledger's lock: the lock then holds arithmetic only, so a probe that hangs
        stalls this create, never the fit check or a snapshot waiting on the lock."""
        with self._create_lock:
            earlier = self._loading()
            usage = self.read_usage()
            return self.ledger.create(
                req,
                lambda: self._with_loading(usage, earlier),
                default_ttl_s=self.settings.default_reservation_ttl_seconds,
            )

    def _created(self, view: dict[str, Any], *, persist: bool) -> None:
        """Log and announce a new reservation (event-loop thread: it publishes)."""
        log.info(
            "reservation %s created for job %s (vram %.2f, ram %.2f, disk %s GiB)",
            view["id"],
            view["job_id"],
            view["vram_gb"],
            view["ram_gb"],
            view["disk_gb"],
        )
        self.bus.publish(ReservationsChanged(reason="created"))
        if persist:
            self._persist_soon()

    def release(self, reservation_id: str) -> dict[str, str]:
        """Raises ReservationNotFound, or ReservationRunning while its job runs."""
        res = self.ledger.release(reservation_id)
        log.info("reservation %s released (job %s)", res.id, res.job_id)
        self.bus.publish(ReservationsChanged(reason="released"))
        self._persist_soon()
        return {"detail": "released", "id": res.id}

    def cleanup_expired(self, now: datetime | None = None, *, count_run: bool = True) -> int:
        """Remove expired reservations whose job does not run; how many went."""
        removed = self.ledger.expire(now)
        if count_run:
            self.cleanup_runs += 1
        if removed:
            log.info("expired reservations removed: %s", ", ".join(removed))
            self.bus.publish(ReservationsChanged(reason="expired"))
            self._persist_soon()
        return len(removed)

    async def refresh_usage(self) -> None:
        """Measure the containers of running jobs; reservations of other jobs lose their actuals."""
        jobs = self.jobs
        running = self.ledger.running_jobs() if jobs is not None else {}
        measured = {}
        if running and jobs is not None:
            measured = await asyncio.to_thread(
                measure_jobs, running.keys(), jobs, self.probe, self.settings.jobs_dir
            )
        actuals = {
            res_id: usage.as_tuple()
            for job_id, usage in measured.items()
            for res_id in running.get(job_id, ())
        }
        self.ledger.set_actuals(actuals)
        self.usage_refreshes += 1

    # --- lifecycle -------------------------------------------------------------------------------
    async def load_state(self) -> None:
        """Read the ledger file before any service starts (Host._load_state); a file that
        cannot be parsed stops the host (StateFileError)."""
        self.ledger.restore(await asyncio.to_thread(self.store.load))

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(
                self._every(self.settings.resource_usage_interval_s, self.refresh_usage),
                name="resource-usage-poll",
            ),
            asyncio.create_task(
                self._every(self.settings.reservation_cleanup_interval_s, self._cleanup_async),
                name="reservation-cleanup",
            ),
        ]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._background_saves:
            await asyncio.gather(*self._background_saves, return_exceptions=True)

    async def _cleanup_async(self) -> None:
        self.cleanup_expired()

    @staticmethod
    async def _every(interval_s: float, action: Any) -> None:
        """Run `action` every `interval_s`; a failure is logged and the loop goes on."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await action()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("resource loop %s failed", getattr(action, "__name__", action))

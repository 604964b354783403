"""The reservation ledger: capacity pre-claimed by solar-control (kept on disk by
ledger_store.py, so a restart does not hand out claimed capacity twice).

Accounting, per dimension d (VRAM, RAM, disk):

    reported_used_d = system_used_d + sum_i headroom_i,d
    available_d     = max(0, total_d - reported_used_d)

where a pending reservation's headroom is its full reserved amount and a running one's is only
what its job has not yet consumed, max(reserved - actual, 0): the consumed part is already in the
measured system usage and must not be counted twice.

Multi-GPU hosts: the VRAM dimension is the SUM over all NVIDIA GPUs (as upstream and as control's
placement expect). A 16 GiB request on two 8 GiB GPUs therefore fits by these figures although no
single GPU holds it; the job itself decides how to split across devices.

CPU hosts (no NVIDIA GPU, decided once: see SystemUsage.gpu_host): a VRAM request is counted
as RAM. Reservations are stored as requested; the fold happens only in the accounting and the
views, so one failed NVML read on a GPU host cannot turn a VRAM claim into a RAM claim.

Expiry: a reservation whose expires_at has passed counts nowhere (snapshot, summary, the fit
check, a create's check) from that moment, not only once the cleanup sweep removes it; one whose
job runs stays until the job ends (`in_force`).

One lock guards check-and-insert, and the system usage for the check is read inside it by the
caller's `read_usage`, which must read the probe fresh (ResourceService.create does; the 1 s
cache of snapshots could still show the memory of a start that has just finished loading as
free), so concurrent creates can never together exceed what was available.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from solar_host.resources.probes import GB
from solar_host.resources.schemas import MAX_TTL_SECONDS, ReservationRequest

DIMENSIONS = ("vram", "ram", "disk")


@dataclass(frozen=True, slots=True)
class Capacity:
    """Total and used bytes of one dimension, as the probe measured them."""

    total_bytes: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class SystemUsage:
    """What the machine has and uses; a dimension that could not be read is None.

    `gpu_host`: the host has NVIDIA GPUs (True), has none (False), or cannot tell (None). On a
    GPU host a None `vram` is a failed read, not a CPU host."""

    vram: Capacity | None
    ram: Capacity | None
    disk: Capacity | None
    gpu_host: bool | None = None

    @property
    def fold_vram(self) -> bool:
        """VRAM requests count as RAM (a CPU host)."""
        return self.gpu_host is False

    @property
    def memory_type(self) -> str:
        return "VRAM" if self.vram is not None or self.gpu_host else "RAM"

    def get(self, dim: str) -> Capacity | None:
        return getattr(self, dim)


class CapacityExceeded(Exception):
    """A reservation would take more than is available in `dimension`."""

    def __init__(self, dimension: str, requested_gb: float, available_gb: float):
        super().__init__(f"{dimension}: requested {requested_gb} GiB, available {available_gb} GiB")
        self.dimension = dimension
        self.requested_gb = requested_gb
        self.available_gb = available_gb

    def body(self) -> dict[str, Any]:
        return {
            "error": "capacity_exceeded",
            "dimension": self.dimension,
            "requested_gb": self.requested_gb,
            "available_gb": self.available_gb,
        }


class DimensionUnreadable(Exception):
    """A request asks for a dimension the probe cannot read now: it cannot be checked (503)."""

    WHAT = {
        "vram": ("this host's GPUs (NVML)", "VRAM"),
        "ram": ("this host's memory", "RAM"),
        "disk": ("the filesystem of MODELS_DIR", "disk"),
    }

    def __init__(self, dim: str):
        what, name = self.WHAT.get(dim, (dim, dim))
        super().__init__(
            f"Cannot read {what} right now, so a request for {name} cannot be checked; "
            "nothing was reserved. Try again shortly."
        )
        self.dimension = dim


class ReservationNotFound(KeyError):
    def __init__(self, reservation_id: str):
        super().__init__(reservation_id)
        self.reservation_id = reservation_id

    def __str__(self) -> str:
        return f"Reservation '{self.reservation_id}' not found"


class LedgerNotPersisted(Exception):
    """The reservation store could not be written; the change was undone (507)."""


class ReservationRunning(Exception):
    """Releasing a reservation whose job holds the capacity right now."""

    def __init__(self, reservation_id: str, job_id: str):
        super().__init__(
            f"Cannot release reservation '{reservation_id}': job '{job_id}' is currently running"
        )
        self.reservation_id = reservation_id
        self.job_id = job_id


@dataclass(slots=True)
class Reservation:
    id: str
    job_id: str
    workload_type: str
    requester: str | None
    vram_gb: float
    ram_gb: float
    disk_gb: float | None
    created_at: datetime
    expires_at: datetime | None
    # Measured use of the job's container; meaningful only while the job runs.
    actual_vram_gb: float | None = None
    actual_ram_gb: float | None = None
    actual_disk_gb: float | None = None

    def reserved(self, dim: str) -> float:
        value = getattr(self, f"{dim}_gb")
        return float(value or 0.0)

    def actual(self, dim: str) -> float | None:
        return getattr(self, f"actual_{dim}_gb")

    def amounts(self, dim: str, fold: bool) -> tuple[float, float | None]:
        """(reserved, actual) GiB of `dim`. `fold` (a CPU host): VRAM asked for is RAM, and
        what the job uses of it is measured as RAM."""
        if not fold or dim == "disk":
            return self.reserved(dim), self.actual(dim)
        if dim == "vram":
            return 0.0, None
        actuals = [a for a in (self.actual_ram_gb, self.actual_vram_gb) if a is not None]
        return self.reserved("ram") + self.reserved("vram"), (sum(actuals) if actuals else None)

    def headroom(self, dim: str, running: bool, fold: bool = False) -> float:
        """What this reservation adds to the reported use of `dim`."""
        reserved, actual = self.amounts(dim, fold)
        if not running:
            return reserved
        return max(reserved - (actual or 0.0), 0.0)

    def view(self, running: bool, fold: bool = False) -> dict[str, Any]:
        return {
            "id": self.id,
            "job_id": self.job_id,
            "workload_type": self.workload_type,
            "requester": self.requester,
            "status": "running" if running else "pending",
            "vram_gb": float(self.amounts("vram", fold)[0]),
            "ram_gb": float(self.amounts("ram", fold)[0]),
            "disk_gb": self.disk_gb,
            "actual_vram_gb": self.actual_vram_gb if running else None,
            "actual_ram_gb": self.actual_ram_gb if running else None,
            "actual_disk_gb": self.actual_disk_gb if running else None,
            "expires_at": iso_z(self.expires_at),
            "created_at": iso_z(self.created_at),
        }


def in_force(res: Reservation, running: bool, now: datetime) -> bool:
    """Whether a reservation holds capacity now: not yet expired, or its job runs (a running
    job's reservation is kept until the job ends). The one test of every reader and the sweep."""
    return running or res.expires_at is None or res.expires_at > now


def iso_z(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def new_reservation_id() -> str:
    return "res-" + secrets.token_hex(16)


def dimension(cap: Capacity, headroom_gb: float) -> dict[str, float]:
    """One dimension of the snapshot, 2 decimals, as control reads it."""
    total = cap.total_bytes / GB
    used = cap.used_bytes / GB
    reported = used + headroom_gb
    return {
        "total_gb": round(total, 2),
        "system_used_gb": round(used, 2),
        "reserved_headroom_gb": round(headroom_gb, 2),
        "reported_used_gb": round(reported, 2),
        "available_gb": round(max(0.0, total - reported), 2),
    }


class Ledger:
    """Reservations by id. `is_running(job_id)` says whether a reservation's job runs now."""

    def __init__(self, is_running: Callable[[str], bool]):
        self._is_running = is_running
        self._items: dict[str, Reservation] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def _running(self, r: Reservation) -> bool:
        try:
            return bool(self._is_running(r.job_id))
        except Exception:  # a broken job view must not break accounting: count it in full
            return False

    def _live(self, now: datetime | None) -> list[tuple[Reservation, bool]]:
        """(reservation, its job runs) of every reservation in force; call under the lock."""
        now = now or datetime.now(UTC)
        out = []
        for r in self._items.values():
            running = self._running(r)
            if in_force(r, running, now):
                out.append((r, running))
        return out

    @staticmethod
    def _headroom(live: list[tuple[Reservation, bool]], fold: bool) -> dict[str, float]:
        return {
            dim: sum(r.headroom(dim, running, fold) for r, running in live) for dim in DIMENSIONS
        }

    @staticmethod
    def _dimensions(
        usage: SystemUsage, live: list[tuple[Reservation, bool]]
    ) -> dict[str, dict[str, float] | None]:
        headroom = Ledger._headroom(live, usage.fold_vram)
        out: dict[str, dict[str, float] | None] = {}
        for dim in DIMENSIONS:
            cap = usage.get(dim)
            out[dim] = None if cap is None else dimension(cap, headroom[dim])
        return out

    def snapshot(self, usage: SystemUsage, now: datetime | None = None) -> dict[str, Any]:
        with self._lock:
            live = self._live(now)
            dims = self._dimensions(usage, live)
            views = [r.view(running, usage.fold_vram) for r, running in live]
        return {"memory_type": usage.memory_type, **dims, "reservations": views}

    def summary(self, usage: SystemUsage, now: datetime | None = None) -> dict[str, Any]:
        """The legacy host_health `reservations` block: a count and the dimensions present."""
        with self._lock:
            live = self._live(now)
            dims = self._dimensions(usage, live)
            out: dict[str, Any] = {"active_count": len(live)}
        out.update({k: v for k, v in dims.items() if v is not None})
        return out

    def headroom_gb(
        self,
        fold: bool,
        now: datetime | None = None,
        covered: dict[str, dict[str, float]] | None = None,
    ) -> dict[str, float]:
        """GiB kept by reservations in force per dimension, unrounded (the fit check).

        `covered`: job_id -> GiB per dimension already counted elsewhere for that job (the
        memory of the instance a reservation was made for): each reservation of the job
        counts only what is left of it, max(headroom - covered, 0)."""
        with self._lock:
            live = self._live(now)
        if not covered:
            return self._headroom(live, fold)
        left = {job: dict(by_dim) for job, by_dim in covered.items()}
        out = dict.fromkeys(DIMENSIONS, 0.0)
        for r, running in live:
            rest = left.get(r.job_id, {})
            for dim in DIMENSIONS:
                headroom = r.headroom(dim, running, fold)
                taken = min(headroom, rest.get(dim, 0.0))
                if taken:
                    rest[dim] -= taken
                out[dim] += headroom - taken
        return out

    def create(
        self,
        req: ReservationRequest,
        read_usage: Callable[[], SystemUsage],
        *,
        default_ttl_s: float | None,
        now: datetime | None = None,
    ) -> dict[str, Any]:
        """Check capacity and insert, atomically. Raises CapacityExceeded, or
        DimensionUnreadable when a dimension asked for cannot be read."""
        now = now or datetime.now(UTC)
        if req.expires_at is not None:
            expires: datetime | None = req.expires_at
        elif req.ttl_seconds is not None:
            expires = now + timedelta(seconds=req.ttl_seconds)
        elif default_ttl_s:
            expires = now + timedelta(seconds=min(default_ttl_s, MAX_TTL_SECONDS))
        else:
            expires = None
        res = Reservation(
            id="",  # named once admitted
            job_id=req.job_id,
            workload_type=req.workload_type,
            requester=req.requester,
            vram_gb=float(req.vram_gb),  # as requested: a CPU host folds it when counting
            ram_gb=float(req.ram_gb),
            disk_gb=req.disk_gb,
            created_at=now,
            expires_at=expires,
        )
        with self._lock:
            usage = read_usage()  # inside the lock, read fresh: see the module docstring
            dims = self._dimensions(usage, self._live(now))
            for dim in DIMENSIONS:
                asked = res.amounts(dim, usage.fold_vram)[0]
                if not asked:
                    continue
                dim_now = dims[dim]
                if dim_now is None:  # a failed read must not leave the request unchecked
                    raise DimensionUnreadable(dim)
                if asked > dim_now["available_gb"]:
                    raise CapacityExceeded(dim, round(asked, 4), dim_now["available_gb"])
            res.id = new_reservation_id()
            self._items[res.id] = res
            return res.view(self._running(res), usage.fold_vram)

    def release(self, reservation_id: str) -> Reservation:
        with self._lock:
            res = self._items.get(reservation_id)
            if res is None:
                raise ReservationNotFound(reservation_id)
            if self._running(res):
                raise ReservationRunning(reservation_id, res.job_id)
            del self._items[reservation_id]
            return res

    def expire(self, now: datetime | None = None) -> list[str]:
        """Remove reservations whose expiry has passed, unless their job runs. Returns ids."""
        now = now or datetime.now(UTC)
        removed = []
        with self._lock:
            for res in list(self._items.values()):
                if not in_force(res, self._running(res), now):
                    del self._items[res.id]
                    removed.append(res.id)
        return removed

    def running_jobs(self) -> dict[str, list[str]]:
        """job_id -> reservation ids, for reservations whose job runs now."""
        out: dict[str, list[str]] = {}
        with self._lock:
            for res in self._items.values():
                if self._running(res):
                    out.setdefault(res.job_id, []).append(res.id)
        return out

    def set_actuals(self, actuals: dict[str, tuple[float | None, float | None, float | None]]):
        """Record measured (vram, ram, disk) GiB per reservation id; clear all others."""
        with self._lock:
            for res in self._items.values():
                vram, ram, disk = actuals.get(res.id, (None, None, None))
                res.actual_vram_gb, res.actual_ram_gb, res.actual_disk_gb = vram, ram, disk

    # --- persistence (ledger_store.py) ------------------------------------------------------

    def records(self) -> list[Reservation]:
        with self._lock:
            return list(self._items.values())

    def restore(self, reservations: list[Reservation]) -> None:
        with self._lock:
            for res in reservations:
                self._items[res.id] = res

    def discard(self, reservation_id: str) -> None:
        """Undo a create that could not be persisted."""
        with self._lock:
            self._items.pop(reservation_id, None)

    def get(
        self, reservation_id: str, fold: bool = False, now: datetime | None = None
    ) -> dict[str, Any] | None:
        """The view of a reservation in force (None: unknown or expired)."""
        with self._lock:
            res = self._items.get(reservation_id)
            if res is None:
                return None
            running = self._running(res)
            if not in_force(res, running, now or datetime.now(UTC)):
                return None
            return res.view(running, fold)

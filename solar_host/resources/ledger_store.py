"""reservations.json: the reservation ledger on disk, so a restart keeps claimed capacity.

Written like config.json (statefiles: atomic, fsynced, 0600, the previous version kept as
reservations.json.prev, group-committed); a file that cannot be parsed stops the host at
start-up. Reservations that expired while the host was down are dropped on load; measured
actuals are not kept (the usage loop measures them again).
"""

from __future__ import annotations

import json
import logging
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from solar_host.platform.statefiles import (
    PRIVATE,
    GroupCommit,
    StateFileError,
    atomic_write_bytes,
    last_good_path,
    parse_json,
    read_state_bytes,
    sweep_temp_files,
    tighten_mode,
)
from solar_host.resources.ledger import Reservation, in_force
from solar_host.resources.schemas import MAX_RESERVATION_GB

log = logging.getLogger(__name__)

FILE_NAME = "reservations.json"


def _dump(res: Reservation) -> dict[str, Any]:
    return {
        "id": res.id,
        "job_id": res.job_id,
        "workload_type": res.workload_type,
        "requester": res.requester,
        "vram_gb": res.vram_gb,
        "ram_gb": res.ram_gb,
        "disk_gb": res.disk_gb,
        "created_at": res.created_at.isoformat(),
        "expires_at": res.expires_at.isoformat() if res.expires_at else None,
    }


def _time(value: Any) -> datetime:
    dt = datetime.fromisoformat(value)
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def _amount(item: dict[str, Any], key: str) -> float:
    """A GiB figure as POST /resources/reservations would have taken it: a JSON number, finite,
    0 to MAX_RESERVATION_GB. Anything else is damage: a negative amount handed capacity out
    (-1000 made 1020 GiB of a 24 GiB GPU available), NaN or infinity made host_health invalid
    JSON and every fit check raise, and a string is no figure the host ever wrote."""
    value = item[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} is not a number: {value!r}")
    value = float(value)
    if not math.isfinite(value) or not 0.0 <= value <= MAX_RESERVATION_GB:
        limit = f"{MAX_RESERVATION_GB:.0f}"
        raise ValueError(f"{key} must be a finite number from 0 to {limit}: {value}")
    return value


def _parse(item: Any) -> Reservation:
    if not isinstance(item, dict):
        raise ValueError("entry is not an object")
    disk = item.get("disk_gb")
    expires = item.get("expires_at")
    return Reservation(
        id=str(item["id"]),
        job_id=str(item["job_id"]),
        workload_type=str(item["workload_type"]),
        requester=None if item.get("requester") is None else str(item["requester"]),
        vram_gb=_amount(item, "vram_gb"),
        ram_gb=_amount(item, "ram_gb"),
        disk_gb=None if disk is None else _amount(item, "disk_gb"),
        created_at=_time(item["created_at"]),
        expires_at=None if expires is None else _time(expires),
    )


def parse_reservations(path: Path, raw: bytes) -> list[Reservation]:
    """Every reservation in the file's bytes; raises StateFileError when it cannot be used."""
    doc = parse_json(path, raw)
    items = doc.get("reservations") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise StateFileError(path, "expected an object with a 'reservations' list")
    out = []
    for index, item in enumerate(items):
        try:
            out.append(_parse(item))
        except (KeyError, TypeError, ValueError) as err:
            # A claim of capacity that cannot be read can be neither honoured nor released.
            raise StateFileError(path, f"reservation {index}: {err!r}") from None
    return out


class ReservationStore:
    """The ledger's file. `source()` returns the reservations to write (read at write time)."""

    def __init__(self, path: Path, source: Any):
        self.path = path
        self._source = source
        self.on_disk: bytes | None = None
        self._commits = GroupCommit(self._encode, self._write)

    def load(self, now: datetime | None = None) -> list[Reservation]:
        """Reservations on disk that have not expired. Raises StateFileError."""
        now = now or datetime.now(UTC)
        raw = read_state_bytes(self.path)
        if raw is None:
            return []
        out: list[Reservation] = []
        for res in parse_reservations(self.path, raw):
            if not in_force(res, False, now):  # no job of it runs before the host has started
                log.info("reservation %s expired while the host was down; dropped", res.id)
                continue
            out.append(res)
        self.on_disk = raw
        tighten_mode(self.path)
        tighten_mode(last_good_path(self.path))
        sweep_temp_files(self.path)  # only once the file is known good
        if out:
            log.info("%d reservation(s) restored from %s", len(out), self.path)
        return out

    def encode(self, reservations: list[Reservation]) -> bytes:
        doc = {"version": 1, "reservations": [_dump(r) for r in reservations]}
        return json.dumps(doc, indent=1).encode()

    def _encode(self) -> bytes | None:
        data = self.encode(self._source())
        return None if data == self.on_disk else data

    def _write(self, data: bytes) -> None:
        atomic_write_bytes(self.path, data, PRIVATE, keep_previous=self.on_disk is not None)
        self.on_disk = data

    def write_now(self) -> None:
        """Write synchronously (callers without an event loop)."""
        data = self._encode()
        if data is not None:
            self._write(data)

    async def commit(self) -> None:
        """Write the ledger as it is now (group-committed); raises OSError."""
        await self._commits.commit()

    async def drain(self) -> None:
        await self._commits.drain()

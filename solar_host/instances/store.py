"""config.json: the durable record of instances and of the backend processes they own.

The file follows statefiles' rules: atomic fsynced writes, the previous version kept as
config.json.prev, 0600 (instance keys), and a file that cannot be parsed refuses the start
(StateFileError) instead of being replaced. An entry that no longer validates (an unknown
backend_type, a field an upgrade made stricter) is quarantined: kept verbatim at its place in
the file, reported, its backend left alone, until an operator fixes or deletes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import to_json

from solar_host.instances.canary import Fingerprint
from solar_host.instances.schemas import ConfigError, Instance, parse_config
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
from solar_host.platform.tracked import DirtySet, Tracked

__all__ = ["InstanceStore", "ProcessRecord", "StoredInstance", "atomic_write_bytes"]

log = logging.getLogger(__name__)


class ProcessRecord(Tracked):
    """What identifies a backend process across host restarts (for re-adoption)."""

    pid: int
    create_time: float = 0.0
    start_ticks: int | None = None  # /proc start time in ticks: exact across clock changes
    # With pid and start_ticks, the process's identity (ownership.Identity). None: a record
    # written before boot ids were kept.
    boot_id: str | None = None
    # MARKER_VAR's value the backend was spawned with (None: a record older than markers).
    marker: str | None = None
    cmdline: list[str] = []  # what was run, for display: an exec wrapper changes it
    port: int
    # ownership.key_fingerprint of the host API key the backend was given (never the key).
    key_hash: str | None = None
    # ownership.SPAWN_VAR's value (None: a record older than spawn ids).
    spawn_id: str | None = None
    log_file: str | None = None
    spawned_at: str | None = None
    # seq of the first line of this log file, so seqs continue after a re-adoption.
    seq_base: int = 0


class StoredInstance(Tracked):
    """An instance as kept on disk: the public record plus what the supervisor needs.

    Change records by assigning attributes (of it, its instance, config or process record), or
    by replacing lists and dicts, not by mutating them in place: saves re-encode only records
    whose attributes were assigned to (tracked.py); an in-place change is written only by the
    idle check, up to VERIFY_IDLE_S after saves pause.
    """

    instance: Instance
    process: ProcessRecord | None = None
    # Whether the operator wants it serving: decides what boot starts again.
    want_running: bool = False
    # A crash restart (in its backoff) or the next attempt of a start is due: the host still
    # owes this `failed` instance a start, so boot starts it. False once the host gives up
    # (a crash loop, a start out of attempts) or the start ends. Absent in older records.
    restart_due: bool = False
    # The port its backend last served on (ruling 24): taken again whenever it is free, and
    # never handed to another instance while this one exists. Absent in older records.
    last_port: int | None = None
    # The known answer of its backend (canary.py), with what it was taken for. Absent in
    # older records and until a probe is answered.
    canary: Fingerprint | None = None


@dataclass
class LoadResult:
    records: list[StoredInstance] = field(default_factory=list)
    quarantined: list[QuarantinedEntry] = field(default_factory=list)
    roles: list[str] | None = None
    # Records read from the previous release's format: their backends may still serve, for
    # the manager's start to settle (adopt_legacy) before anything starts again.
    legacy: list[StoredInstance] = field(default_factory=list)


@dataclass
class QuarantinedEntry:
    """An entry of config.json that no longer validates, kept verbatim where it was.

    Written back unchanged by every save, at its index in the list; shown by
    GET /instances/quarantined; gone only when an operator deletes it (DELETE /instances/{id}).
    """

    index: int
    entry: Any
    reason: str

    @property
    def id(self) -> str | None:
        if not isinstance(self.entry, dict):
            return None
        inner = self.entry.get("instance")
        value = (inner if isinstance(inner, dict) else self.entry).get("id")
        return value if isinstance(value, str) else None

    @property
    def process(self) -> dict[str, Any] | None:
        """The recorded backend process (our format: `process`; upstream's: `pid`, `port`)."""
        if not isinstance(self.entry, dict):
            return None
        proc = self.entry.get("process")
        if isinstance(proc, dict):
            return proc
        pid = self.entry.get("pid")
        if isinstance(pid, int) and not isinstance(pid, bool):
            return {"pid": pid, "port": self.entry.get("port")}
        return None

    @property
    def pid(self) -> int | None:
        pid = (self.process or {}).get("pid")
        return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None

    @property
    def marker(self) -> str | None:
        marker = (self.process or {}).get("marker")
        return marker if isinstance(marker, str) else None

    @property
    def port(self) -> int | None:
        port = (self.process or {}).get("port")
        return port if isinstance(port, int) and not isinstance(port, bool) else None

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "index": self.index,
            "reason": self.reason,
            "pid": self.pid,
            "entry": self.entry,
        }


class InstanceStore:
    """config.json. `load()` refuses a file it cannot parse (StateFileError) and quarantines
    entries that no longer validate; `save()` group-commits (statefiles.GroupCommit)."""

    def __init__(self, path: Path, models_dir: Path):
        self.path = path
        self.models_dir = models_dir
        self.quarantined: list[QuarantinedEntry] = []
        # Top-level keys this version does not know (a newer host wrote them): kept as read.
        self.extra: dict[str, Any] = {}
        # What config.json holds, as this store last read or wrote it: a save of the same bytes
        # (a restart that finds everything as recorded, a shutdown with nothing to add) is
        # skipped rather than rewritten and fsynced.
        self.on_disk: bytes | None = None
        self._latest: tuple[list[StoredInstance], list[str]] = ([], [])
        # id(record) -> (record, its text); id(instance/config/process) -> id(record).
        self._chunks: dict[int, tuple[StoredInstance, bytes]] = {}
        self._owner: dict[int, int] = {}
        self._dirty = DirtySet()
        self._verify_next = False
        self._verify_handle: asyncio.TimerHandle | None = None
        self._verify_task: asyncio.Task[None] | None = None
        self._commits = GroupCommit(self._encode_latest, self._write)

    @property
    def last_good_path(self) -> Path:
        return last_good_path(self.path)

    @property
    def writes(self) -> int:
        return self._commits.writes

    # --- load ------------------------------------------------------------------------------------

    def load(self) -> LoadResult:
        """Read config.json. Raises StateFileError for a file that is there but unusable."""
        raw = read_state_bytes(self.path)
        if raw is None:
            return LoadResult()
        result = self.parse(raw)
        sweep_temp_files(self.path)  # only once the file is known good
        self.on_disk = raw
        tighten_mode(self.path)
        tighten_mode(self.last_good_path)
        for q in self.quarantined:
            log.error(
                "config.json entry %s (index %d) is quarantined: kept unchanged, not loaded, "
                "its backend left alone (pid %s); fix or DELETE /instances/%s: %s",
                q.id,
                q.index,
                q.pid,
                q.id,
                q.reason,
            )
        return result

    def parse(self, raw: bytes) -> LoadResult:
        """Parse the file's bytes; raises StateFileError, fills `quarantined` and `extra`."""
        doc = parse_json(self.path, raw)
        if isinstance(doc, list):  # oldest format: a bare list of instances
            doc = {"instances": doc}
        if not isinstance(doc, dict):
            raise StateFileError(
                self.path, f"expected an object with an 'instances' list, found {_kind(doc)}"
            )
        if "instances" not in doc:
            # Every writer of this file writes the list, empty or not: a document without it
            # is damage, and reading it as "no instances" would stop every backend and let
            # the next save replace the good previous copy.
            raise StateFileError(self.path, "has no 'instances' list")
        entries = doc["instances"]
        if not isinstance(entries, list):
            raise StateFileError(self.path, f"'instances' must be a list, found {_kind(entries)}")
        result = LoadResult()
        roles = doc.get("roles")
        if roles is not None:
            if not (isinstance(roles, list) and all(isinstance(r, str) for r in roles)):
                raise StateFileError(
                    self.path, f"'roles' must be a list of strings, found {roles!r:.80}"
                )
            result.roles = roles
        self.extra = {k: v for k, v in doc.items() if k not in ("roles", "instances")}
        self.quarantined = []
        self._legacy: set[str] = set()  # ids of entries in the previous release's format
        seen: set[str] = set()
        for index, entry in enumerate(entries):
            try:
                stored = self._parse_entry(entry)
                if isinstance(entry, dict) and entry.get("restart_due") is True:
                    stored.restart_due = True  # anything else (older hosts: absent) is not due
                last_port = entry.get("last_port") if isinstance(entry, dict) else None
                if type(last_port) is int and 0 < last_port < 65536:
                    stored.last_port = last_port  # only a preference: anything else is none
                stored.canary = _fingerprint(entry)
                if stored.instance.id in seen:
                    raise ValueError(f"duplicate instance id {stored.instance.id!r}")
            except (ConfigError, ValidationError, ValueError, TypeError, KeyError) as err:
                self.quarantined.append(QuarantinedEntry(index, entry, _reason(err)))
                continue
            seen.add(stored.instance.id)
            result.records.append(stored)
            if stored.instance.id in self._legacy:
                result.legacy.append(stored)
        result.quarantined = list(self.quarantined)
        return result

    def _parse_entry(self, entry: Any) -> StoredInstance:
        if not isinstance(entry, dict):
            raise ValueError("entry is not an object")
        if "instance" in entry:  # our format
            inst_raw = dict(entry["instance"])
            process = entry.get("process")
            want = entry.get("want_running", False)
            if not isinstance(want, bool):  # bool("false") is True: a hand edit, not ours
                raise ValueError(f"want_running is {_kind(want)}, not true or false")
        else:  # upstream's format: the Instance itself, status says what ran
            inst_raw = dict(entry)
            # Its pid and port stay on the instance: the manager's start ends that backend if it
            # still serves (adopt_legacy), as the previous release did at boot.
            process = None
            want = inst_raw.get("status") in ("running", "starting")
            if isinstance(inst_raw.get("id"), str):
                self._legacy.add(inst_raw["id"])
        config = parse_config(inst_raw.get("config"), models_dir=self.models_dir, strict=False)
        inst_raw["config"] = config
        for k in ("busy", "prefill_progress", "active_slots"):
            inst_raw.pop(k, None)
        inst_raw.setdefault("created_at", datetime.now(UTC).isoformat())
        inst = Instance.model_validate(inst_raw)
        return StoredInstance(
            instance=inst,
            process=ProcessRecord.model_validate(process) if process else None,
            want_running=want,
        )

    # --- quarantine ------------------------------------------------------------------------------

    def quarantined_entry(self, instance_id: str) -> QuarantinedEntry | None:
        return next((q for q in self.quarantined if q.id == instance_id), None)

    def protected_pids(self) -> set[int]:
        """Recorded backend pids of quarantined entries: no sweep may stop them."""
        return {q.pid for q in self.quarantined if q.pid is not None}

    def protected_ids(self) -> set[str]:
        """Instance ids of quarantined entries: every process carrying their marker is theirs
        (found so even when the entry's recorded pid is missing or unreadable)."""
        return {q.id for q in self.quarantined if q.id}

    def protected_ports(self) -> set[int]:
        """Recorded ports of quarantined entries: their backends may still listen there."""
        return {q.port for q in self.quarantined if q.port is not None}

    # --- save ------------------------------------------------------------------------------------

    def encode_full(self, records: list[StoredInstance], roles: list[str]) -> bytes:
        """The whole file from scratch. pydantic-core's encoder: the same text as
        json.dumps(indent=2), about 4x faster. Quarantined entries go back where they were."""
        entries: list[Any] = list(records)
        for q in sorted(self.quarantined, key=lambda q: q.index):
            entries.insert(min(q.index, len(entries)), q.entry)
        doc = {"roles": roles, "instances": entries, **self.extra}
        return _dumps(doc)

    def encode(self, records: list[StoredInstance], roles: list[str]) -> bytes:
        """The same bytes as encode_full, re-encoding only records that changed.

        Encoding every record is O(instances) on the event loop for every save (16 ms at 1,000
        instances): the 1,000th create would cost far more than the 10th. Each record's text is
        kept; a record is encoded again when it is new or when it, its instance, config or
        process record was assigned to since (tracked.py). A change made inside a list or dict
        in place is not seen: the idle check (`_verify_soon`) encodes everything afresh once
        saves pause and writes what differs.
        """
        dirty = self._dirty.take()
        owner = self._owner
        changed = {owner.get(key, key) for key in dirty} if dirty else set()
        cache: dict[int, tuple[StoredInstance, bytes]] = {}
        chunks: list[bytes] = []
        old = self._chunks
        for stored in records:
            key = id(stored)
            hit = old.get(key)
            if hit is not None and hit[0] is stored and key not in changed:
                chunk = hit[1]
            else:
                chunk = _entry_chunk(stored)
                inst = stored.instance
                for part in (inst, inst.config, stored.process):
                    if part is not None:
                        owner[id(part)] = key
            cache[key] = (stored, chunk)
            chunks.append(chunk)
        self._chunks = cache
        if len(owner) > 8 * len(cache) + 64:  # parts of records long gone
            owner.clear()
            self._chunks = {}
        for q in sorted(self.quarantined, key=lambda q: q.index):
            chunks.insert(min(q.index, len(chunks)), _entry_chunk(q.entry))
        if not chunks:
            return self.encode_full(records, roles)
        head = _dumps({"roles": roles, "instances": [0], **self.extra})
        body = b'\n  "instances": [\n' + b",\n".join(chunks) + b"\n  ]"
        return head.replace(_INSTANCES_MARKER, body, 1)

    def _encode_latest(self) -> bytes | None:
        data = self.encode(*self._latest)
        if self._verify_next:
            self._verify_next = False
            full = self.encode_full(*self._latest)
            if full != data:
                log.warning(
                    "config.json: a record was changed in place (not by assignment); "
                    "written now by the idle check"
                )
                self._chunks = {}
                data = full
        return None if data == self.on_disk else data

    def _write(self, data: bytes) -> None:
        atomic_write_bytes(self.path, data, PRIVATE, keep_previous=self.on_disk is not None)
        self.on_disk = data

    async def save(self, records: list[StoredInstance], roles: list[str]) -> None:
        """Persist the current records. Concurrent saves are group-committed: one write covers
        every save that arrived while the previous write ran, and each caller returns (or gets
        the OSError) once the write covering its change is done."""
        self._latest = (records, roles)
        try:
            await self._commits.commit()
        finally:
            self._verify_soon()

    def _verify_soon(self) -> None:
        """Once saves pause for VERIFY_IDLE_S, encode everything afresh and write if it differs."""
        if self._verify_handle is not None:
            self._verify_handle.cancel()
        loop = asyncio.get_running_loop()
        self._verify_handle = loop.call_later(VERIFY_IDLE_S, self._verify)

    def _verify(self) -> None:
        self._verify_handle = None
        self._verify_next = True

        async def run() -> None:
            with contextlib.suppress(OSError):
                await self._commits.commit()

        self._verify_task = asyncio.get_running_loop().create_task(run())

    def close(self) -> None:
        """Stop the idle check (service stop)."""
        if self._verify_handle is not None:
            self._verify_handle.cancel()
            self._verify_handle = None

    def save_sync(self, records: list[StoredInstance], roles: list[str]) -> None:
        data = self.encode_full(records, roles)
        if data != self.on_disk:
            self._write(data)


# How long saves must pause before the whole file is encoded afresh and compared.
VERIFY_IDLE_S = 2.0
_INSTANCES_MARKER = b'\n  "instances": [\n    0\n  ]'


def _dumps(doc: Any) -> bytes:
    return to_json(doc, indent=2, by_alias=False, ensure_ascii=True)


def _fingerprint(entry: Any) -> Fingerprint | None:
    """The entry's known answer (canary.py); one that does not parse is none (a new one is
    taken at the next probe), never a reason to quarantine the instance."""
    raw = entry.get("canary") if isinstance(entry, dict) else None
    if not isinstance(raw, dict):
        return None
    try:
        return Fingerprint.model_validate(raw)
    except ValidationError:
        return None


def _entry_chunk(item: Any) -> bytes:
    """One entry as it appears inside the instances list (indented two levels)."""
    return b"    " + _dumps(item).replace(b"\n", b"\n    ")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _reason(err: Exception) -> str:
    if isinstance(err, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}"
            for e in err.errors(include_url=False)
        )
    return str(err) or type(err).__name__

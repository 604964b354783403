"""The flight recorder: one record for every end of a backend nobody asked for (a crash, a
liveness kill) and every failed start attempt (one that failed before a process existed too).

A record says the typed cause (causes.py), the exit code or signal, the last log lines, the
peak memory where it was sampled, the timings, a digest of the config and the backend's
version where its log printed one. Records are kept per instance in
LOG_DIR/flight/<instance>.jsonl, appended with an fsync (a host killed right after loses
none), the newest RECORDS_KEPT read back; the file is cut back to those once it holds twice as
many. They outlive the instance, as its log files do: GET /instances/{id}/flight-records.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from solar_host.backends.base import alias_safe
from solar_host.events import BackendEnded, LogLine
from solar_host.instances import causes, procfs
from solar_host.instances.health import AttemptFailed
from solar_host.instances.logs import append_line, new_log_path
from solar_host.platform.statefiles import atomic_write_bytes

if TYPE_CHECKING:
    from solar_host.instances.supervising import Supervising

log = logging.getLogger(__name__)

RECORDS_KEPT = 50
LOG_LINES_KEPT = 40
# Config keys whose values are secrets: left out of the digest (a rotated key is no new config).
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_SECRET = re.compile(r"key|token|secret|password", re.IGNORECASE)


@dataclass
class FlightRecord:
    instance_id: str
    alias: str
    backend_type: str
    phase: str  # "start" (an attempt failed) or "running" (it ended unasked)
    cause: str
    cause_detail: str
    message: str  # the host's words, as error_message says them (led by the cause)
    exit_code: int | None
    signal: str | None
    attempt: int | None
    log_tail: list[str]
    peak_memory_bytes: int | None
    spawned_at: str | None
    ended_at: str
    run_seconds: float | None
    config_digest: str
    backend_version: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of the config's canonical JSON, secrets left out."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if not _SECRET.search(str(k))}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    canon = json.dumps(clean(config), sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags, for what a SIGILL means; None elsewhere."""
    return procfs.cpu_flags()


def _cgroup_dir() -> Path | None:
    """The host's cgroup v2 directory (its backends are spawned in it)."""
    text = procfs.own_cgroup()
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    return None


def oom_kill_count() -> int | None:
    """The oom_kill counter of the cgroup the backends run in (memory.events), or None
    where it cannot be read."""
    d = _cgroup_dir()
    if d is None:
        return None
    try:
        text = (d / "memory.events").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def build(
    *,
    instance_id: str,
    config: dict[str, Any],
    phase: str,
    reason: str,
    exit_code: int | None,
    lines: Sequence[str],
    host_killed: bool = False,
    oom_kills_before: int | None = None,
    attempt: int | None = None,
    peak_memory_bytes: int | None = None,
    spawned_at: datetime | None = None,
) -> FlightRecord:
    """The record of one end; blocking reads (/proc/cpuinfo, the cgroup): off the loop."""
    sig = causes.exit_signal(exit_code)
    oom_now = oom_kill_count() if sig == 9 else None
    oom_delta = (
        oom_now - oom_kills_before if oom_now is not None and oom_kills_before is not None else None
    )
    cause = causes.classify(
        reason=reason,
        exit_code=exit_code,
        lines=lines,
        host_killed=host_killed,
        oom_kills=oom_delta,
        cpu_flags=cpu_flags() if sig == 4 else None,
    )
    now = datetime.now(UTC)
    return FlightRecord(
        instance_id=instance_id,
        alias=str(config.get("alias", "")),
        backend_type=str(config.get("backend_type", "")),
        phase=phase,
        cause=cause.kind,
        cause_detail=cause.detail,
        message=cause.lead(reason),
        exit_code=exit_code,
        signal=causes.signal_name(sig),
        attempt=attempt,
        log_tail=list(lines[-LOG_LINES_KEPT:]),
        peak_memory_bytes=peak_memory_bytes,
        spawned_at=spawned_at.isoformat() if spawned_at else None,
        ended_at=now.isoformat(),
        run_seconds=round((now - spawned_at).total_seconds(), 3) if spawned_at else None,
        config_digest=config_digest(config),
        backend_version=causes.backend_version(lines),
    )


def path_of(log_dir: Path, instance_id: str) -> Path:
    """The instance's record file; an id that is no plain file name (a caller's own id with
    a slash, "..") is named by its digest, so no id reaches outside LOG_DIR/flight."""
    name = instance_id
    if not _PLAIN_NAME.fullmatch(name):
        name = "id-" + hashlib.sha256(instance_id.encode()).hexdigest()[:32]
    return log_dir / "flight" / f"{name}.jsonl"


def append(log_dir: Path, record: FlightRecord) -> None:
    """Append one record with an fsync (blocking); cut the file back to the newest
    RECORDS_KEPT once it holds twice as many (atomically: a reader sees old or new)."""
    path = path_of(log_dir, record.instance_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record.as_dict(), separators=(",", ":")) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    # Cheap test first: a file this small cannot hold 2 * RECORDS_KEPT records.
    if size > 2 * RECORDS_KEPT * 200:
        kept = _lines(path)
        if len(kept) > 2 * RECORDS_KEPT:
            data = "".join(ln + "\n" for ln in kept[-RECORDS_KEPT:]).encode()
            atomic_write_bytes(path, data, 0o640)


def _lines(path: Path) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return [ln for ln in raw.splitlines() if ln.strip()]


def read(log_dir: Path, instance_id: str) -> list[dict[str, Any]] | None:
    """The newest RECORDS_KEPT records, oldest first; None when the instance never had one.
    A torn last line (a host killed mid-write, before its fsync) is skipped."""
    path = path_of(log_dir, instance_id)
    if not path.exists():
        return None
    out: list[dict[str, Any]] = []
    for ln in _lines(path)[-RECORDS_KEPT:]:
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


@dataclass
class Life:
    """What a record keeps of the backend's life, read while its lease and process record
    still exist (a crash releases both before the record is made)."""

    spawned_at: datetime | None = None
    oom_kills_before: int | None = None  # the cgroup's oom_kill counter when it began serving
    peak_memory_bytes: int | None = None  # the memory sampler's peak of its tree
    host_killed: bool = False  # the host ended it (liveness)
    attempt: int | None = None  # which attempt of a start (1-based)

    @classmethod
    def of(
        cls, sup: Supervising, attempt: int | None = None, spawned_at: datetime | None = None
    ) -> Life:
        rec, lease, peak = sup.stored.process, sup.lease, sup.ctx.peak_memory
        if spawned_at is None and rec is not None:
            spawned_at = parse_time(rec.spawned_at)
        return cls(
            spawned_at=spawned_at,
            oom_kills_before=lease.oom_kills_at_start if lease is not None else None,
            peak_memory_bytes=peak(sup.id) if peak is not None else None,
            attempt=attempt,
        )


def parse_time(text: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(text) if text else None
    except ValueError:
        return None


def version_of(sup: Supervising, lines: list[str]) -> str | None:
    """The build the log printed, else what names the backend's build on this host (blocking:
    it may stat llama-server's executable)."""
    found = causes.backend_version(lines)
    gate = sup.ctx.capacity
    if found is None and gate is not None:
        try:
            found = gate.version(str(sup.instance.config.backend_type)) or None
        except Exception:  # a version is a nicety: never the reason a record is lost
            log.debug("no backend version for %s", sup.id, exc_info=True)
    return found


async def record(
    sup: Supervising, *, phase: str, reason: str, exit_code: int | None, life: Life
) -> str:
    """Make, keep and count the flight record of one end; the message led by its cause (what
    error_message says). A record that cannot be written is logged, never raised: the
    instance's state must still change."""
    config = sup.instance.config.model_dump(mode="json")
    lines = [e.line for e in sup.ring.entries]

    def make() -> FlightRecord:
        rec = build(
            instance_id=sup.id,
            config=config,
            phase=phase,
            reason=reason,
            exit_code=exit_code,
            lines=lines,
            host_killed=life.host_killed,
            oom_kills_before=life.oom_kills_before,
            attempt=life.attempt,
            peak_memory_bytes=life.peak_memory_bytes,
            spawned_at=life.spawned_at,
        )
        rec.backend_version = rec.backend_version or version_of(sup, lines)
        try:
            append(sup.ctx.settings.log_dir, rec)
        except OSError as err:
            log.warning("flight record of %s not written: %s", sup.id, err.strerror or err)
        return rec

    rec = await asyncio.to_thread(make)
    log.warning("flight record of %s: %s (%s)", sup.id, rec.cause, rec.cause_detail)
    sup.ctx.bus.publish(BackendEnded(sup.id, rec.cause))
    return rec.message


async def attempt_failed(
    sup: Supervising, err: AttemptFailed, attempt: int | None, spawned_at: datetime | None
) -> str:
    """The record of a failed start attempt (`attempt`: 1-based); its reason led by the cause."""
    life = Life.of(sup, attempt, spawned_at=spawned_at)
    return await record(sup, phase="start", reason=err.reason, exit_code=err.exit_code, life=life)


async def refused(sup: Supervising, reason: str, attempt: int) -> str:
    """The record of an attempt refused before anything was claimed (a port taken)."""
    return await record(
        sup, phase="start", reason=reason, exit_code=None, life=Life(attempt=attempt)
    )


async def log_unspawned(sup: Supervising, reason: str) -> None:
    """A start that failed before any backend process existed says why in the instance's
    own log (its ring, the bus, and a log file of its own), where control and the
    operator look (GET .../logs, the start's log_tail): it was only in the host's log."""
    line = f"solar-host: the backend was not started: {reason}"
    ts = datetime.now(UTC).isoformat()
    for e in sup.ring.append_many([sup.redactor()(line)], ts):
        sup.ctx.bus.publish(LogLine(sup.id, e.seq, ts, e.line))
    settings = sup.ctx.settings
    path = new_log_path(settings.log_dir, alias_safe(sup.instance.config.alias), sup.id)
    try:
        await asyncio.to_thread(append_line, path, line)
    except OSError as err:
        log.warning("cannot write %s: %s", path, err.strerror or err)

"""What a previous host process left running, and whether it is this instance's backend.

At boot a supervisor asks: is the recorded process still the one spawned, and ours
(`recorded_process`)? Was the record written with the port the backend was really given
(`port_as_spawned`)? Does a backend of this instance run that no record names
(`unrecorded_process`)? How much of its start deadline has it used (`backend_age_s`)? What is
left of a recorded backend that died while no host watched (`end_remains`)?

Each answer comes from the kernel (ownership.py reads /proc) and the process record: never from
a command line, which an exec wrapper changes. Blocking functions say so; the supervisor calls
them off the event loop and alone decides what they mean for the instance's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

from solar_host.instances import ownership
from solar_host.instances import process as procs
from solar_host.instances.store import ProcessRecord

log = logging.getLogger(__name__)


def recorded_process(
    rec: ProcessRecord | None, expected_marker: str
) -> tuple[procs.BackendProcess | None, str]:
    """The recorded backend if it is still the same process and ours, else why not.
    Blocking (/proc reads)."""
    if rec is None:
        return None, "no process recorded"
    if rec.boot_id is not None and rec.start_ticks is not None:
        ident = ownership.Identity(rec.boot_id, rec.pid, rec.start_ticks)
        if rec.boot_id != ownership.boot_id():
            return None, "the machine rebooted since it was spawned"
        if not ownership.is_same(ident):
            return None, "it exited (or its pid now belongs to another process)"
        if rec.marker is not None and rec.marker != expected_marker:
            return None, "it was spawned for another host directory"
        # The identity is the proof: the kernel never gives that boot id, pid and start
        # time to another process. The marker finds backends a record does not name; a
        # recorded one that no longer shows it (its environment wiped by a process title,
        # or an exec with an emptied environment) is still the process spawned, and ending
        # it would load its model a second time. Only another marker is refused.
        live = ownership.marker_of(rec.pid) if rec.marker is not None else None
        if live is not None and live != rec.marker:
            return None, "it carries another marker"
        return procs.BackendProcess(ident, rec.marker, rec.create_time, rec.cmdline), ""
    # A record from before boot ids and markers: the start time, and the command line it
    # was spawned with, which is the best such a record can offer.
    ident = ownership.identity_of(rec.pid)
    if ident is None or (rec.start_ticks is not None and ident.start_ticks != rec.start_ticks):
        return None, "it exited (or its pid now belongs to another process)"
    try:
        cmdline = ownership.cmdline_of(rec.pid)
    except OSError:
        return None, "it exited"
    if cmdline != rec.cmdline:
        return None, "its pid now runs another program"
    marker = ownership.marker_of(rec.pid)
    return procs.BackendProcess(ident, marker if marker == expected_marker else None), ""


def later_spawn(rec: ProcessRecord | None, given: ownership.SpawnFacts) -> bool:
    """Whether a marker carrier with these spawn facts was spawned after the recorded
    process (or with no record at all). The oldest session leader with the marker may be
    a worker outliving the recorded backend (setsid): it has the backend's port and spawn
    id in its environment, but never listens; a different spawn id is a later spawn."""
    if rec is None:
        return True
    return None not in (rec.spawn_id, given.spawn_id) and rec.spawn_id != given.spawn_id


def port_as_spawned(
    proc: procs.BackendProcess, rec: ProcessRecord, instance_id: str
) -> ProcessRecord:
    """The record with the API port the recorded backend was spawned with (PORT_VAR in its
    environment), where the record says another: a damaged record must not make a
    serving backend look like one still loading, to be killed at its deadline. Blocking."""
    given = ownership.spawn_facts(proc.pid)
    if given.port is None or given.port == rec.port:
        return rec
    if None not in (given.spawn_id, rec.spawn_id) and given.spawn_id != rec.spawn_id:
        return rec  # not the spawn this record describes
    log.warning(
        "process record of %s says port %s, but its backend pid %s was spawned with port "
        "%s: the record is corrected",
        instance_id,
        rec.port,
        proc.pid,
        given.port,
    )
    return rec.model_copy(update={"port": given.port})


def unrecorded_process(
    rec: ProcessRecord | None,
    carrying: list[ownership.Identity],
    listening: dict[int, set[int]] | None,
    *,
    marker: str,
    configured_port: int | None,
    log_dir: Path,
    instance_id: str,
) -> tuple[procs.BackendProcess, ProcessRecord] | None:
    """A backend of this instance that runs without a (current) process record `rec`, and the
    record rebuilt from /proc; None when there is none, or no single port tells which
    socket is its API. `carrying`: the live processes with this instance's marker
    (ownership.ours_running, read once for every adoption of a boot). Blocking.

    It carries this instance's marker, so it is ours beyond doubt; what the record would
    add is rebuilt: its API port (with no record, or a record of an earlier spawn,
    ownership.PORT_VAR in its environment; else the one port it listens on, or the config's
    among several), its log file (its standard output, when that lies in LOG_DIR), its
    start time, and the fingerprint of the key and the spawn id it was given
    (ownership.KEY_VAR and SPAWN_VAR; unknown for a backend of an older host)."""
    ident = ownership.backend_root(carrying)
    if ident is None:
        return None
    given = ownership.spawn_facts(ident.pid)
    if given.port is not None and later_spawn(rec, given):
        # The host died between this spawn and its record: the port the host handed it is
        # its API, even before it listens (still loading).
        ports = [given.port]
    else:  # a descendant of the recorded backend, or a backend of an older host
        ports = ownership.listening_ports(ident, listening)
        if configured_port in ports:
            ports = [configured_port]
    if len(ports) != 1:
        log.warning(
            "backend pid %s of %s carries its marker but listens on %s: not adopted",
            ident.pid,
            instance_id,
            ", ".join(map(str, ports)) or "no port yet",
        )
        return None
    log_file = ownership.stdout_path(ident.pid)
    if log_file is not None and log_dir.resolve() not in log_file.resolve().parents:
        log_file = None
    try:
        cmdline = ownership.cmdline_of(ident.pid)
        created = ownership.start_time(ident)
    except OSError:
        return None
    proc = procs.BackendProcess(ident, marker, created, cmdline)
    found = ProcessRecord(
        pid=ident.pid,
        create_time=created,
        start_ticks=ident.start_ticks,
        boot_id=ident.boot_id,
        marker=marker,
        cmdline=cmdline,
        port=ports[0],
        key_hash=given.key_hash,
        spawn_id=given.spawn_id,
        log_file=str(log_file) if log_file is not None else None,
        spawned_at=datetime.fromtimestamp(created, UTC).isoformat(),
    )
    return proc, found


def backend_age_s(proc: procs.BackendProcess, rec: ProcessRecord) -> float:
    """Seconds since an adopted backend was spawned: what its start has used of its deadline.

    From the kernel, on the boot clock: uptime minus the process's start time in ticks. Neither
    moves when the wall clock is stepped (NTP, an operator's `date`), so a backend spawned
    seconds before such a step is not taken for one hours old and killed as past its deadline.
    The live process's identity is the recorded one (or, for a record older than boot ids,
    the same pid and command line): its ticks count from this boot. The record's spawned_at
    (wall clock) only where the kernel cannot tell. Blocking (/proc reads)."""
    ident = proc.identity
    if ident.boot_id == ownership.boot_id():
        try:
            with open("/proc/uptime", "rb") as f:
                uptime = float(f.read().split()[0])
            return max(uptime - ident.start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
        except (OSError, ValueError, IndexError):
            pass
    if rec.spawned_at:
        with contextlib.suppress(ValueError, TypeError):
            spawned = datetime.fromisoformat(rec.spawned_at)
            return max((datetime.now(UTC) - spawned).total_seconds(), 0.0)
    return 0.0


async def end_remains(rec: ProcessRecord, instance_id: str) -> list[str]:
    """The recorded backend is gone (it died while no host watched): end what is left of
    its session (workers whose marker a changed process title wiped), and say who still
    holds its port: what could not be ended, in words. Processes carrying the marker are
    the boot sweep's."""
    if rec.boot_id != ownership.boot_id() or rec.start_ticks is None:
        return []
    ident = ownership.Identity(rec.boot_id, rec.pid, rec.start_ticks)
    if await asyncio.to_thread(ownership.is_same, ident):
        # Not gone: the recorded process itself, refused (recorded_process says why). It
        # is ended with the rest, and said so: "not adopted" alone reads as left running.
        log.warning(
            "ending recorded backend pid %s of %s, which was not adopted", rec.pid, instance_id
        )
    gone = procs.BackendProcess(ident, None, port=rec.port)
    await procs.end_tree_leftovers(gone)
    return gone.left_behind

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
import functools
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from solar_host.estimates.hooks import end_start, hold_adopted
from solar_host.instances import flight, ownership, procfs, relays
from solar_host.instances import process as procs
from solar_host.instances.errors import InstanceConflict, InstanceNotFound, StartFailed
from solar_host.instances.health import AttemptFailed
from solar_host.instances.httpcheck import is_healthy, probe_address
from solar_host.instances.lease import Lease
from solar_host.instances.logs import count_lines, relay_bound, tail_lines
from solar_host.instances.states import InstanceStatus
from solar_host.instances.store import ProcessRecord
from solar_host.instances.supervising import Supervising

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)
S = InstanceStatus


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
    log_file = relays.log_file_of(ident.pid)
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
            uptime = procfs.uptime_s()
            return max(uptime - ident.start_ticks / procfs.clock_ticks(), 0.0)
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


# --- taking a backend back: the flow ------------------------------------------------------------

# How long a backend that was running when the host went away has, once re-adopted, to show
# its listening socket again before it is handled as a crash (it is not loading: it was ready).
ADOPTED_RELISTEN_S = 10.0


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True, slots=True)
class Found:
    """A backend of the instance that a previous host process left running."""

    proc: procs.BackendProcess
    rec: ProcessRecord
    status: InstanceStatus  # what the records say was going on (starting when unrecorded)
    recorded: bool  # the recorded process itself, not a marker carrier found without it


async def find(
    sup: Supervising,
    listening: dict[int, set[int]] | None,
    ours: dict[str, list[ownership.Identity]] | None,
) -> Found | None:
    """The instance's backend left running, by its record or else by its marker; None when
    nothing of it runs (what is left of a dead one is ended, and said in its message)."""
    rec = sup.stored.process
    proc: procs.BackendProcess | None = None
    recorded = False
    if rec is not None:
        proc, why = await asyncio.to_thread(recorded_process, rec, sup.ctx.marker(sup.id))
        recorded = proc is not None
        if proc is None:
            log.info("recorded backend pid %s of %s is not adopted: %s", rec.pid, sup.id, why)
        else:
            fixed = await asyncio.to_thread(port_as_spawned, proc, rec, sup.id)
            if fixed is not rec:
                sup.stored.process = rec = fixed
    inst = sup.instance
    status = inst.status
    carrying = (ours or {}).get(sup.id)
    if proc is None and sup.stored.want_running and carrying:
        found = await asyncio.to_thread(
            unrecorded_process,
            rec,
            carrying,
            listening,
            marker=sup.ctx.marker(sup.id),
            configured_port=inst.config.port,
            log_dir=Path(sup.ctx.settings.log_dir),
            instance_id=sup.id,
        )
        if found is not None:
            proc, rec = found
            sup.stored.process = rec
            if status not in (S.RUNNING, S.STARTING):
                status = S.STARTING
            log.warning(
                "re-adopted backend pid %s of %s on port %s by its marker: config.json "
                "did not record it (a host killed right after the spawn, or a restored "
                "older copy)",
                proc.pid,
                sup.id,
                rec.port,
            )
    if proc is None or rec is None:
        if rec is not None:
            left = await end_remains(rec, sup.id)
            if left:
                sup.stored.instance.error_message = "; ".join(left)
        sup.stored.process = None
        return None
    return Found(proc, rec, status, recorded)


async def adopt(
    sup: Supervising,
    listening: dict[int, set[int]] | None = None,
    ours: dict[str, list[ownership.Identity]] | None = None,
) -> str:
    """Take back a backend the host left running, fast: identity, marker and listener only
    (the API binds only after every supervisor answered). Slower work (log attach, health,
    readiness of a backend still loading) continues in the background.

    Returns "running" or "starting" (adopted), "stopping" (a stop was under way when the
    host died: it is finished in the background) or "gone" (nothing of ours to adopt).
    `listening`: ownership.listeners() read once for every adoption of a boot; `ours`:
    ownership.ours_running(), idem. A backend that carries this instance's marker is
    adopted even when config.json does not record it (see unrecorded_process).
    """
    found = await find(sup, listening, ours)
    if found is None:
        return "gone"
    proc, rec, status, recorded = found.proc, found.rec, found.status, found.recorded
    inst = sup.instance
    sup.lease = Lease(proc, rec.port, sup.ctx.ports)
    if sup.stored.last_port != rec.port:
        sup.stored.last_port = rec.port
    sup.ctx.ports.claim_adopted(rec.port)
    if status in (S.STOPPING, S.STOPPED, S.FAILED) or not sup.stored.want_running:
        # The operator's last word was a stop (or a restart, whose stop comes first).
        sup.set_status(
            S.STOPPING, reason="finishing stop", recovery=True, pid=proc.pid, port=rec.port
        )
        # Its own task, not a start: a start asked for meanwhile waits for it, then starts.
        sup.stop_task = asyncio.create_task(finish_stop(sup), name=f"stop:{sup.id}")
        return "stopping"
    listening_ours = await asyncio.to_thread(
        ownership.owns_port, proc.identity, rec.port, proc.marker, listening
    )
    backend = sup.backend()
    config = inst.config
    fields: dict[str, Any] = {
        "pid": proc.pid,
        "port": rec.port,
        "supported_endpoints": backend.supported_endpoints(config),
        "served_model_name": backend.served_model_name(config),
    }
    if status == S.RUNNING and listening_ours:
        sup.set_status(
            S.RUNNING,
            reason="adopted",
            recovery=True,
            started_at=inst.started_at or datetime.now(UTC),
            **fields,
        )
        sup.watch(proc)
        sup.adopt_task = asyncio.create_task(
            attach_adopted(sup, proc, rec, loading=False), name=f"adopt:{sup.id}"
        )
        log.info("re-adopted backend pid %s of %s on port %s", proc.pid, sup.id, rec.port)
        return "running"
    # Still loading (or not listening yet): awaited in the background under the deadline
    # of the start that spawned it, never killed and loaded again. One that was running
    # was ready already: it gets a moment to show its socket, then it is a crash.
    was_ready = recorded and status == S.RUNNING
    sup.set_status(S.STARTING, reason="adopted", recovery=True, started_at=None, **fields)
    sup.ready = asyncio.Event()
    # Held before boot starts anything else, as the start that spawned it held it.
    await hold_adopted(sup)
    sup.start_task = asyncio.create_task(
        adopted_loading(sup, proc, rec, was_ready=was_ready), name=f"adopt:{sup.id}"
    )
    # Its failure is logged where it fails and answered to a start that joined it: not
    # asyncio's "exception was never retrieved" traceback when none did.
    sup.start_task.add_done_callback(_retrieved)
    log.info(
        "re-adopted backend pid %s of %s on port %s, still loading", proc.pid, sup.id, rec.port
    )
    return "starting"


async def adopted_loading(
    sup: Supervising, proc: procs.BackendProcess, rec: ProcessRecord, *, was_ready: bool = False
) -> Any:
    try:
        return await attach_adopted(sup, proc, rec, loading=True, was_ready=was_ready)
    finally:
        end_start(sup)  # its memory is in the probe's figures from now on, or gone


async def attach_adopted(
    sup: Supervising,
    proc: procs.BackendProcess,
    rec: ProcessRecord,
    *,
    loading: bool,
    was_ready: bool = False,
) -> Any:
    """Background half of an adoption: follow the log, then await readiness (loading) or
    check health once (running; a slow answer is logged, never a reason to replace it)."""
    backend = sup.backend()
    config = sup.instance.config
    if not loading:
        await asyncio.to_thread(procs.note_listener, proc, rec.port)
    else:
        proc.port = rec.port
    # Its log relay, so that its last lines are awaited when it ends (Lease.stop_watching).
    proc.relay = await asyncio.to_thread(relays.relay_of, proc.pid)
    log_path = Path(rec.log_file) if rec.log_file else None
    if proc.relay is None and log_path is not None:
        # One that ended while no host ran (its output has been lost since): another on its
        # pipe. None for a backend of an older host, which writes its file itself.
        bound = relay_bound(sup.ctx.settings.log_file_max_bytes)
        proc.relay = await asyncio.to_thread(relays.restart, proc.identity, log_path, bound)
        if proc.relay is not None:
            log.warning(
                "the log relay of instance %s had ended while no host ran: replaced by pid %d; "
                "what its backend wrote meanwhile was lost",
                sup.id,
                proc.relay.identity.pid,
            )
    if log_path is not None:
        # Continue the log where it is: seq = the attempt's base + lines already in the file.
        lines, size = await asyncio.to_thread(count_lines, log_path)
        tail = await asyncio.to_thread(tail_lines, log_path, sup.ctx.settings.log_buffer_size)
        sup.ring.rebase(rec.seq_base + lines - len(tail))
        redact = sup.redactor()
        sup.ring.append_many([redact(line) for line in tail], datetime.now(UTC).isoformat())
        sup.telemetry.reset(backend.new_parser(config))
        sup.follow(log_path, offset=size, ready_check=backend if loading else None)
        if sup.ready is not None and any(backend.is_ready_line(ln) for ln in tail):
            sup.ready.set()
        if sup.follower is not None and not loading:
            sup.follower.hot_polling = True
    if not loading:
        if backend.health_path and not await is_healthy(
            probe_address(config.host), rec.port, backend.health_path, sup.bearer(), 10.0
        ):
            log.warning(
                "re-adopted backend pid %s of %s does not answer %s yet",
                proc.pid,
                sup.id,
                backend.health_path,
            )
        return sup.instance
    return await await_adopted_ready(sup, proc, rec, was_ready=was_ready)


async def await_adopted_ready(
    sup: Supervising, proc: procs.BackendProcess, rec: ProcessRecord, *, was_ready: bool = False
) -> Any:
    settings = sup.ctx.settings
    # The start that spawned it had START_DEADLINE_S in all, counted from its spawn: this
    # wait and the retries after it share what is left (monotonic from here on).
    age = await asyncio.to_thread(backend_age_s, proc, rec)
    deadline = time.monotonic() + settings.start_deadline_s - age
    # A few seconds at least, so a backend that became ready while the host was down is
    # still seen as ready.
    timeout = max(deadline - time.monotonic(), 5.0)
    if was_ready:
        # Not loading: the backend was ready before the host went away, so the deadline of
        # its start says nothing (it showed a process that exec'd something else, or
        # closed its socket, as "starting" for up to START_DEADLINE_S).
        timeout = ADOPTED_RELISTEN_S
    backend = sup.backend()
    config = sup.instance.config
    try:
        await sup.wait_ready(proc, backend, config.host, rec.port, timeout)
    except AttemptFailed as err:
        log.warning("re-adopted backend of %s did not become ready: %s", sup.id, err.reason)
        if proc.alive():
            await procs.terminate(proc, min(settings.stop_grace_s, 5.0))
        await sup.release()
        if was_ready:
            await adopted_crashed(sup, proc, rec, err)
            raise StartFailed(
                sup.id, sup.instance.error_message or err.reason, None, sup.tail()
            ) from None
        # The start that spawned it had retries left: they are this adoption's, within
        # that start's deadline, as if the host had never restarted.
        retry = (
            err.retryable
            and settings.max_retries > 0
            and deadline > time.monotonic()
            and sup.stored.want_running
            and not sup.deleted
        )
        spawned = flight.parse_time(rec.spawned_at)
        led = await flight.attempt_failed(sup, err, None, spawned)  # the attempt of a host before
        sup.set_status(
            S.FAILED,
            reason="start_failed",
            error_message=led,
            pid=None,
            port=None,
            started_at=None,
        )
        sup.stored.restart_due = retry  # on disk with the failure: a kill now loses no retry
        await sup.ctx.persist()
        sup.after_stop_hook()
        if retry:
            log.info(
                "starting %s again: %d attempt(s) of the start it was in remain",
                sup.id,
                settings.max_retries,
            )
            return await sup.run_start(attempts=settings.max_retries, deadline=deadline)
        sup.counters["start_failures"] += 1
        raise StartFailed(
            sup.id, err.reason, err.exit_code, sup.tail(), retryable=err.retryable
        ) from None
    if sup.follower is not None:
        sup.follower.hot_polling = True
    sup.set_status(S.RUNNING, reason="ready", started_at=datetime.now(UTC), error_message=None)
    sup.stored.restart_due = False  # the start it was in has ended
    sup.ctx.persist_soon()
    sup.watch(proc)
    return sup.instance


async def adopted_crashed(
    sup: Supervising, proc: procs.BackendProcess, rec: ProcessRecord, err: AttemptFailed
) -> None:
    """A backend that was running when the host went away, re-adopted, and no longer
    serving its port (ended already): a crash, under the restart policy as any other,
    never a start that failed (which nothing restarts)."""
    sup.counters["crashes"] += 1
    reason = (
        f"Process stopped serving port {rec.port} while the host was away ({err.reason}); "
        "it was ended"
    )
    await sup.record_crash(proc, reason, None)


async def finish_stop(sup: Supervising) -> None:
    """A stop the previous host process did not finish: finish it, then start again only
    when the instance is still wanted (a restart whose stop was under way). Under the
    lock: a start, stop or restart asked for meanwhile comes after it (a start joins the
    start made here); a stop or restart that got the lock first did it (and cancels this)."""
    async with sup.lock:
        if sup.status != S.STOPPING or sup.deleted:
            return
        proc = sup.proc
        if proc is not None:
            await procs.terminate(proc, sup.ctx.settings.stop_grace_s)
        await sup.record_stopped()
        sup.after_stop_hook()
        log.info("finished the stop of %s that was under way when the host stopped", sup.id)
        if not sup.stored.want_running:
            return
        # Not awaited here: a start asked for meanwhile waits for this task, then joins
        # that start (one deadline, one outcome), as concurrent starts share one launch.
        await sup.begin_start()  # wanted, so on disk already: nothing to write
        assert sup.start_task is not None
        sup.start_task.add_done_callback(functools.partial(start_ended_unheard, sup))


def start_ended_unheard(sup: Supervising, task: asyncio.Task[Any]) -> None:
    """A start no caller awaits (after a stop finished at boot): its failure is logged."""
    if task.cancelled():
        return
    err = task.exception()
    if isinstance(err, StartFailed | InstanceConflict | InstanceNotFound):
        log.warning("start of %s after its unfinished stop failed: %s", sup.id, err)
    elif err is not None:
        log.error("start of %s after its unfinished stop failed", sup.id, exc_info=err)


async def end_recorded(rec: ProcessRecord | None, marker: str, grace_s: float) -> None:
    """Delete path: no backend of the instance survives, workers included: the recorded one
    if it is still ours, then whatever carries its marker."""
    proc, _ = await asyncio.to_thread(recorded_process, rec, marker)
    if proc is not None:
        await procs.terminate(proc, grace_s)
    strays = await asyncio.to_thread(ownership.carriers, marker)
    if strays:
        await procs.end_processes(strays, min(grace_s, 5.0))

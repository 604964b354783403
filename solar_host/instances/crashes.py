"""A backend that ended without being asked to: its crash is recorded, and it is restarted
under the crash policy (restarts.py), or left failed for control (ruling 6) or for good (a
crash loop).

Functions over the supervisor's view (supervising.py); the exit watch runs them under the
supervisor's lock, so a start, stop or restart comes before or after a crash's handling, never
in the middle of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

from solar_host.events import InstanceCrashed
from solar_host.instances import canary_watch, flight, health, relay_watch
from solar_host.instances import process as procs
from solar_host.instances.errors import InstanceConflict, StartFailed
from solar_host.instances.httpcheck import probe_address
from solar_host.instances.logs import relay_bound
from solar_host.instances.states import InstanceStatus
from solar_host.instances.supervising import Supervising

log = logging.getLogger(__name__)
S = InstanceStatus


async def watch_exit(sup: Supervising, proc: procs.BackendProcess) -> None:
    await procs.wait_exit(proc)
    # Under the lock: a start, restart or stop decided meanwhile comes before or after
    # this crash handling as a whole, never in the middle of it (a start made in between
    # would have its new backend forgotten here). A start that finds the process gone
    # waits for this (start: _settling); a stop cancels it.
    async with sup.lock:
        await crashed(sup, proc)


async def crashed(sup: Supervising, proc: procs.BackendProcess) -> None:
    if sup.proc is not proc or sup.status != S.RUNNING:
        return  # an intentional stop owns this exit
    code = proc.exit_code()
    sup.counters["crashes"] += 1
    # What the flight record keeps of its life, read before the lease and record go.
    life = flight.Life.of(sup)
    # Workers that outlived it (in its group, or setsid'd) hold GPU memory and the port.
    await procs.end_tree_leftovers(proc)
    await sup.release()
    reason = (
        f"Process exited unexpectedly (exit code: {code})"
        if code is not None
        else "Process exited unexpectedly"
    )
    if sup.ended_why is not None:
        reason, sup.ended_why = sup.ended_why, None
        life.host_killed = True
    await record_crash(sup, proc, reason, code, life)


async def record_crash(
    sup: Supervising,
    proc: procs.BackendProcess,
    reason: str,
    code: int | None,
    life: flight.Life | None = None,
) -> None:
    """Say the backend crashed (`reason`, with what of it could not be ended, led by its
    cause), keep its flight record, and restart it under the crash policy."""
    if proc.left_behind:
        reason += "; " + "; ".join(proc.left_behind)
    life = life or flight.Life.of(sup)
    if life.spawned_at is None and proc.create_time > 0:
        # Its record is gone already (an adopted backend that stopped serving while the host
        # was away) or never said (an older host's): the kernel's start time says it.
        life.spawned_at = datetime.fromtimestamp(proc.create_time, UTC)
    reason = await flight.record(sup, phase="running", reason=reason, exit_code=code, life=life)
    log.error("backend of %s (%s) crashed: %s", sup.id, sup.instance.config.alias, reason)
    sup.set_status(
        S.FAILED, reason="crashed", error_message=reason, pid=None, port=None, started_at=None
    )
    sup.ctx.bus.publish(InstanceCrashed(sup.id, code))
    sup.after_stop_hook()
    # Decided before the save, so the failure and whether a restart is due reach the disk
    # together: a host killed in the backoff starts it at boot.
    schedule_restart(sup)
    await sup.ctx.persist()


def schedule_restart(sup: Supervising) -> None:
    """Restart with backoff unless control owns recovery (ruling 6) or it crash-loops.
    Records whether a restart is due (StoredInstance.restart_due); the caller saves it."""
    settings = sup.ctx.settings
    sup.stored.restart_due = False
    if sup.instance.managed_by == "intent" or not sup.stored.want_running or sup.deleted:
        log.info(
            "not restarting %s: recovery is %s",
            sup.id,
            "control's" if sup.instance.managed_by == "intent" else "not wanted",
        )
        return
    verdict = sup.crashes.crashed(time.monotonic())
    n, delay = verdict.crashes, verdict.delay_s
    if delay is None:
        msg = (
            f"{sup.instance.error_message}; crashed {n} times within "
            f"{settings.restart_window_s:.0f}s, not restarting"
        )
        sup.stored.instance.error_message = msg
        sup.ctx.changed(sup.id, sup.status.value, "crash_loop")
        return
    log.info("restarting %s in %.1fs (crash %d within the window)", sup.id, delay, n)
    # Said where the operator and control look: "failed" alone reads as given up on.
    sup.crash_reason = sup.instance.error_message
    sup.stored.instance.error_message = (
        f"{sup.crash_reason}; restarting in {delay:.1f}s (crash {n} within "
        f"{settings.restart_window_s:.0f}s; the host gives up at "
        f"{settings.restart_max_in_window})"
    )
    sup.ctx.changed(sup.id, sup.status.value, "restart_scheduled")
    sup.stored.restart_due = True
    sup.restart_task = asyncio.create_task(restart_after(sup, delay), name=f"restart:{sup.id}")


async def restart_after(sup: Supervising, delay: float) -> None:
    await asyncio.sleep(delay)
    async with sup.lock:
        if sup.status != S.FAILED or not sup.stored.want_running or sup.deleted:
            return
        sup.counters["restarts"] += 1
        sup.start_task = asyncio.create_task(sup.run_start(restart=True), name=f"start:{sup.id}")
        task = sup.start_task
        sup.restart_task = None
    # InstanceConflict: the fit check refused the restart (logged by the capacity gate).
    try:
        await task
    except StartFailed as err:
        # A restart that could not bring it back is one more crash of the loop: the next
        # try comes after the next backoff, until RESTART_MAX_IN_WINDOW, rather than never.
        if err.retryable:
            schedule_restart(sup)
            await sup.ctx.persist()
        else:
            await sup.nothing_due()
    except InstanceConflict as err:
        # Not the backend's failure: the fit check or a taken port refused the restart.
        # Said where the operator looks, not only in the host's log.
        log.warning("restart of %s refused: %s", sup.id, err.detail)
        sup.stored.instance.error_message = (
            f"{sup.crash_reason}; the restart was refused: {err.detail}"
        )
        sup.ctx.changed(sup.id, sup.status.value, "restart_refused")
        await sup.nothing_due()
    except asyncio.CancelledError:
        pass


def watch(sup: Supervising, proc: procs.BackendProcess) -> None:
    """Watch a backend that serves: its exit, its liveness, its /metrics."""
    sup.ended_why = None
    lease = sup.lease
    assert lease is not None and lease.proc is proc
    # The kernel's OOM kills so far, to tell one of this backend's from an older one.
    lease.oom_kills_at_start = flight.oom_kill_count()
    lease.watch_task = asyncio.create_task(watch_exit(sup, proc), name=f"watch:{sup.id}")
    if proc.relay is not None:
        follower = lease.follower
        lease.relay_task = asyncio.create_task(
            relay_watch.keep(
                proc,
                lambda: follower.path if follower is not None else None,
                relay_bound(sup.ctx.settings.log_file_max_bytes),
                sup.id,
            ),
            name=f"relay:{sup.id}",
        )
    backend = sup.backend()
    address = probe_address(sup.instance.config.host)
    if backend.metrics_path:
        lease.metrics_task = asyncio.create_task(
            health.poll_metrics(
                backend,
                sup.instance.config.backend_type,
                backend.metrics_path,
                address=address,
                port_of=lambda: sup.instance.port,
                bearer=sup.bearer,
                telemetry=sup.telemetry,
            ),
            name=f"metrics:{sup.id}",
        )
    probe = canary_watch.probe_of(sup) if sup.ctx.settings.canary_interval_s > 0 else None
    if probe is not None:
        lease.canary_task = asyncio.create_task(
            canary_watch.watch(sup, proc, probe), name=f"canary:{sup.id}"
        )
    if backend.health_path and sup.ctx.settings.health_check_interval_s > 0:

        def current() -> bool:
            return sup.proc is proc and sup.status == S.RUNNING

        def end(why: str) -> None:
            sup.ended_why = why  # the crash's reason (crashed)

        lease.liveness_task = asyncio.create_task(
            health.watch_liveness(
                proc,
                backend.health_path,
                settings=sup.ctx.settings,
                address=address,
                port_of=lambda: sup.instance.port,
                bearer=sup.bearer,
                current=current,
                end=end,
                instance_id=sup.id,
            ),
            name=f"liveness:{sup.id}",
        )

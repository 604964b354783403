"""What a host does with its instances when it starts: take back what still runs, record what
is gone, start what should run, stop what carries its marker but nobody owns, and restart
backends that hold an API key the host no longer has.

Functions over the supervisors the instance service loaded; the service calls them in order
(recover before the API serves, the rest in the background).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping

from solar_host.instances import ownership
from solar_host.instances import process as procs
from solar_host.instances.states import ACTIVE, InstanceStatus
from solar_host.instances.supervisor import Supervisor

log = logging.getLogger(__name__)
S = InstanceStatus


async def recover(
    sups: list[Supervisor], host_id: str
) -> tuple[list[Supervisor], list[Supervisor]]:
    """Re-adopt what still runs: (what must start again, what was adopted).

    Awaited before the host serves, so the first answer it gives already tells the truth;
    kept fast (identity, marker and listener from /proc, no HTTP, no waiting on a backend):
    health checks, readiness of backends still loading, stops to finish and the sweep of
    strays all continue in the background."""
    # One read of the socket table and one marker scan for every adoption of the boot.
    recorded = any(s.stored.process is not None or s.stored.want_running for s in sups)
    listening = await asyncio.to_thread(ownership.listeners) if recorded else {}
    wanted = any(s.stored.want_running for s in sups)
    ours = await asyncio.to_thread(ownership.ours_running, host_id) if wanted else {}

    async def adopt(sup: Supervisor) -> str:
        try:
            return await sup.adopt(listening, ours)
        except Exception:
            log.exception("re-adoption of %s failed", sup.id)
            return "gone"

    outcomes = await asyncio.gather(*(adopt(s) for s in sups))
    to_start: list[Supervisor] = []
    for sup, outcome in zip(sups, outcomes, strict=True):
        if outcome != "gone":
            continue
        inst = sup.instance
        if inst.status in ACTIVE:
            # Its backend is gone: record that, then start it again if it is wanted.
            sup.set_status(S.STOPPED, reason="boot", recovery=True, pid=None, port=None)
        # Not a failed one: a failure is left for its owner (the operator, or control for
        # an intent-managed instance); a shutdown records as stopped what it interrupted.
        # Except where the host still owed it a start (restart_due: a crash restart in its
        # backoff, a start pausing between attempts) when it was killed or handed over.
        due = inst.status == S.FAILED and sup.stored.restart_due
        if sup.stored.want_running and (inst.status == S.STOPPED or due):
            to_start.append(sup)
    adopted = [s for s, o in zip(sups, outcomes, strict=True) if o in ("running", "starting")]
    return to_start, adopted


async def start_all(to_start: list[Supervisor], concurrency: int) -> None:
    """Start what should run but does not, `concurrency` at a time; failures are logged."""
    sem = asyncio.Semaphore(concurrency)

    async def start_one(sup: Supervisor) -> None:
        async with sem:
            try:
                await sup.start()
            except Exception as err:
                log.error("boot start of %s failed: %s", sup.id, err)

    await asyncio.gather(*(start_one(s) for s in to_start))


async def sweep_strays(
    host_id: str,
    supervisors: Mapping[str, Supervisor],
    *,
    protected_ids: Collection[str],
    protected_pids: Collection[int],
    grace_s: float,
) -> None:
    """Stop processes that carry this host's marker but that no recorded instance owns.

    A host killed between spawning a backend and recording it, while deleting an instance,
    or after a backend crashed leaving workers behind, leaves such processes: they are
    ours (the marker says so) and nothing would ever manage them. Nothing without this
    host's marker is touched, whatever directory its log is in. Which of them are strays is
    ownership.strays' answer."""
    ours = await asyncio.to_thread(ownership.ours_running, host_id)
    owners = {iid: s.proc.identity for iid, s in supervisors.items() if s.proc is not None}
    starting = {
        iid
        for iid, s in supervisors.items()
        if s.start_task is not None
        and not s.start_task.done()
        and (s.proc is None or s.proc.is_child)
    }
    strays = ownership.strays(
        ours,
        owners,
        starting=starting,
        protected_ids=protected_ids,
        protected_pids=protected_pids,
    )
    if not strays:
        return
    for ident in strays:
        log.warning("stopping unmanaged backend pid %s (it carries this host's marker)", ident.pid)
    await procs.end_processes(strays, grace_s)


async def restart_outdated_keys(
    sups: list[Supervisor], current_hash: str, restart: Callable[[str], Awaitable[object]]
) -> None:
    """A backend accepts the key it was spawned with: after API_KEY changed, restart it so
    that what GET /instances advertises is what it accepts (one at a time)."""
    for sup in sups:
        rec = sup.stored.process
        if rec is None or rec.key_hash is None or rec.key_hash == current_hash:
            continue
        if sup.status not in (S.RUNNING, S.STARTING) or sup.deleted:
            continue
        log.warning(
            "restarting %s (%s): its backend was started with an API key that is no longer "
            "the host's",
            sup.id,
            sup.instance.config.alias,
        )
        try:
            await restart(sup.id)
        except Exception as err:
            log.error("restart of %s for the new API key failed: %s", sup.id, err)

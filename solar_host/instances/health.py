"""Whether a backend serves: readiness at start, proof that the ready port is its own, liveness
while it runs, and its /metrics scrapes.

Functions over one backend process; the supervisor passes what they need and decides what a
verdict means for the instance's state (it alone writes status).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from solar_host.backends.base import Backend
from solar_host.instances import ownership
from solar_host.instances import process as procs
from solar_host.instances.httpcheck import ProbePacer, answer_status, http_get, is_healthy
from solar_host.instances.logs import LogFollower
from solar_host.instances.telemetry import Telemetry
from solar_host.settings import Settings

log = logging.getLogger(__name__)

LISTENER_CHECK_S = 0.05  # between checks that the ready port is the backend's own
METRICS_POLL_S = 2.0
# A backend silent on its health endpoint but using more than this share of one CPU is working
# (requests queued ahead of the probe), not stuck: a deadlocked or stopped one uses next to none.
BUSY_CPU_SHARE = 0.05


class AttemptFailed(Exception):
    """One start attempt failed: `reason` for the operator, whether another attempt may pass."""

    def __init__(self, reason: str, exit_code: int | None = None, retryable: bool = True):
        self.reason = reason
        self.exit_code = exit_code
        self.retryable = retryable
        super().__init__(reason)


def _exited(code: int | None) -> AttemptFailed:
    return AttemptFailed(
        f"Process exited with code {code}" if code is not None else "Process exited", code
    )


async def wait_ready(
    proc: procs.BackendProcess,
    backend: Backend,
    address: str,
    port: int,
    timeout: float,
    *,
    ready: asyncio.Event,
    pacer: ProbePacer,
    bearer: str,
    follower: LogFollower | None,
) -> None:
    """Until the backend is ready (its ready log line sets `ready`, or its health path answers
    200) and proved to listen on `port` itself; AttemptFailed when it exits or `timeout` ends."""
    deadline = time.monotonic() + timeout
    waiters: list[asyncio.Task[Any]] = [
        asyncio.create_task(ready.wait()),
        asyncio.create_task(procs.wait_exit(proc)),
    ]
    if backend.health_path:
        waiters.append(
            asyncio.create_task(poll_health(address, port, backend.health_path, bearer, pacer))
        )
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
    ready_seen = waiters[0] in done or (len(waiters) > 2 and waiters[2] in done)
    if ready_seen and proc.alive():
        await prove_listener(proc, port, deadline)
        return
    if not proc.alive() or waiters[1] in done:
        await procs.wait_exit(proc, 1.0)
        if follower:
            await follower.read_available()
        raise _exited(proc.exit_code())
    raise AttemptFailed(f"Backend did not report readiness within {timeout:.0f}s", None)


async def prove_listener(proc: procs.BackendProcess, port: int, deadline: float) -> None:
    """Ready only when the socket listening on `port` is the backend's own: a 200 from
    another program on the port (one that bound it first) proves nothing."""

    def proved() -> bool:
        if not ownership.owns_port(proc.identity, port, proc.marker):
            return False
        # Its sockets from now on: whoever holds one later is of its tree (process.py).
        procs.note_listener(proc, port)
        return True

    # Checked at once (the backend answered: it listens already), then every LISTENER_CHECK_S;
    # the proof and the note of its sockets in one trip to a worker thread, not two.
    while True:
        if await asyncio.to_thread(proved):
            return
        if not proc.alive():
            raise _exited(proc.exit_code())
        if time.monotonic() >= deadline:
            holders = await asyncio.to_thread(ownership.port_holders, port)
            who = ", ".join(ownership.describe(p) for p in holders) or "nobody"
            raise AttemptFailed(f"Port {port} is not the backend's: it is listened on by {who}")
        await asyncio.sleep(LISTENER_CHECK_S)


async def poll_health(address: str, port: int, path: str, bearer: str, pacer: ProbePacer) -> None:
    """Until `path` answers 200, at the pace every starting backend's probes share."""
    t0 = time.monotonic()
    async with pacer.probing():
        while True:
            if await is_healthy(address, port, path, bearer, timeout=1.0):
                return
            await asyncio.sleep(pacer.interval(time.monotonic() - t0))


async def watch_liveness(
    proc: procs.BackendProcess,
    path: str,
    *,
    settings: Settings,
    address: str,
    port_of: Callable[[], int | None],
    bearer: Callable[[], str],
    current: Callable[[], bool],
    end: Callable[[str], None],
    instance_id: str,
) -> None:
    """A running backend that stops answering its health endpoint for UNHEALTHY_AFTER_S
    and uses (almost) no CPU meanwhile (a deadlock, a stopped process) is ended: `end(why)`
    is told first, then the backend is SIGKILLed, and its exit is a crash like any other.
    Before, it stayed `running` for ever and control kept routing requests to it.

    One that works while it does not answer (a llama-server whose HTTP threads all wait on
    queued requests answers /health only when one frees up) is left running, and said so:
    killing it would drop every request in flight. A slow answer within the probe's timeout
    is an answer, and so is one that is not 200 (a 503 while busy, a 401: it runs); one
    failed probe is only logged. `current()`: whether this backend is still the instance's
    running one (a stop or replacement ends the watch)."""
    interval = settings.health_check_interval_s
    failing_since: float | None = None
    cpu_then = 0.0
    while True:
        await asyncio.sleep(interval)
        port = port_of()
        if not current() or port is None:
            return
        # Any HTTP answer is an answer: a 503 while busy, a 401 for a key the backend no
        # longer shares, a 500, all come from a backend that runs. Silence is not one.
        status = await answer_status(address, port, path, bearer(), min(max(interval, 1.0), 10.0))
        now = time.monotonic()
        if status is not None:
            if failing_since is not None:
                log.info("backend of %s answers %s again", instance_id, path)
            failing_since = None
            continue
        if failing_since is None:
            failing_since = now
            cpu_then = await asyncio.to_thread(procs.cpu_seconds, proc)
            log.warning("backend pid %s of %s did not answer %s", proc.pid, instance_id, path)
            continue
        silent = now - failing_since
        if not current():
            return  # stopped or replaced during the probe: not this watch's to end
        if silent < settings.unhealthy_after_s:
            continue
        cpu_now = await asyncio.to_thread(procs.cpu_seconds, proc)
        if cpu_now - cpu_then > BUSY_CPU_SHARE * silent:
            log.warning(
                "backend pid %s of %s has not answered %s for %.0fs but used %.1fs of CPU "
                "meanwhile: busy, left running",
                proc.pid,
                instance_id,
                path,
                silent,
                cpu_now - cpu_then,
            )
            failing_since, cpu_then = now, cpu_now  # judged again over the next window
            continue
        if not current():
            return
        why = (
            f"Backend stopped answering {path} for {silent:.0f}s (UNHEALTHY_AFTER_S="
            f"{settings.unhealthy_after_s:g}); the host ended it"
        )
        end(why)
        log.error("backend pid %s of %s: %s", proc.pid, instance_id, why)
        # SIGKILL: a hung backend seldom honours SIGTERM, and SIGKILL ends a stopped one.
        # Its exit is then a crash like any other, workers included.
        await asyncio.to_thread(procs.signal_tree, proc, signal.SIGKILL)
        return


async def poll_metrics(
    backend: Backend,
    backend_type: str,
    path: str,
    *,
    address: str,
    port_of: Callable[[], int | None],
    bearer: Callable[[], str],
    telemetry: Telemetry,
) -> None:
    """Scrape the backend's /metrics every METRICS_POLL_S into its telemetry (usage counters
    under our names, and corrections of the log-derived busy state)."""
    from solar_host.backends.prometheus import parse_prometheus_text

    while True:
        await asyncio.sleep(METRICS_POLL_S)
        port = port_of()
        if port is None:
            continue
        try:
            status, body = await http_get(address, port, path, bearer=bearer(), timeout=3.0)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            continue
        if status == 200:
            metrics = parse_prometheus_text(body.decode("utf-8", "replace"))
            telemetry.apply_metrics(metrics, backend.usage_snapshot(metrics), backend_type)

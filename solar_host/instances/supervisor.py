"""One supervisor per instance: the only code that spawns, adopts, watches and stops its backend.

Everyone else calls its methods and reads snapshots. Two callers asking for the same start share
one outcome (one start task); a stop cancels an in-flight start, which kills what it spawned.
Every status change goes through `set_status`, which checks the transition table and publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from solar_host.backends.base import Backend, LaunchContext, LaunchError, alias_safe
from solar_host.estimates.hooks import admit_start, apply_placement, end_start
from solar_host.events import InstanceCrashed, InstanceStartFinished, InstanceStartTimed, LogLine
from solar_host.instances import process as procs
from solar_host.instances.errors import InstanceConflict, InstanceNotFound, StartFailed
from solar_host.instances.httpcheck import http_get, is_healthy, probe_address
from solar_host.instances.logs import LogFollower, LogRing, count_lines, new_log_path, tail_lines
from solar_host.instances.states import InstanceStatus, check_transition
from solar_host.instances.store import ProcessRecord, StoredInstance
from solar_host.instances.telemetry import Telemetry
from solar_host.logging_setup import instance_id_var

if TYPE_CHECKING:
    from solar_host.instances.manager import InstanceManager

log = logging.getLogger(__name__)
S = InstanceStatus

HEALTH_POLL_S = 0.025
METRICS_POLL_S = 2.0


class AttemptFailed(Exception):
    def __init__(self, reason: str, exit_code: int | None = None, retryable: bool = True):
        self.reason = reason
        self.exit_code = exit_code
        self.retryable = retryable
        super().__init__(reason)


class Supervisor:
    def __init__(self, manager: InstanceManager, stored: StoredInstance):
        self.m = manager
        self.stored = stored
        self.id = stored.instance.id
        settings = manager.settings
        self.ring = LogRing(settings.log_buffer_size)
        self.telemetry = Telemetry(self.id, manager.bus, settings.log_buffer_size)
        self.proc: procs.BackendProcess | None = None
        self.follower: LogFollower | None = None
        self.lock = asyncio.Lock()
        self.start_task: asyncio.Task[Any] | None = None
        self.restart_task: asyncio.Task[None] | None = None
        self.watch_task: asyncio.Task[None] | None = None
        self.metrics_task: asyncio.Task[None] | None = None
        self.crashes: deque[float] = deque()
        self.last_exit_code: int | None = None
        self.counters = {"starts": 0, "start_failures": 0, "restarts": 0, "crashes": 0}
        self._ready: asyncio.Event | None = None
        self._backend: Backend | None = None
        self.deleted = False

    # --- snapshots -------------------------------------------------------------------------------

    @property
    def instance(self) -> Any:
        return self.stored.instance

    @property
    def status(self) -> InstanceStatus:
        return self.stored.instance.status

    def backend(self) -> Backend:
        return self.m.backends.for_type(self.instance.config.backend_type)

    # --- state -----------------------------------------------------------------------------------

    def set_status(self, new: InstanceStatus, *, reason: str = "", **fields: Any) -> None:
        inst = self.stored.instance
        if new != inst.status:
            check_transition(inst.status, new)
        inst.status = new
        for k, v in fields.items():
            setattr(inst, k, v)
        self.m.changed(self.id, new.value, reason)

    # --- start -----------------------------------------------------------------------------------

    async def start(self) -> Any:
        """Start (or join the start in flight) and return the running instance."""
        async with self.lock:
            if self.deleted:
                raise InstanceNotFound(self.id)
            if self.status == S.RUNNING and self.proc is not None and self.proc.alive():
                return self.instance
            if self.start_task is None or self.start_task.done():
                if self.restart_task is not None:
                    self.restart_task.cancel()
                    self.restart_task = None
                self.start_task = asyncio.create_task(self._start(), name=f"start:{self.id}")
            task = self.start_task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                # Not a failure of the backend: another call (stop, restart, delete) won.
                raise InstanceConflict(
                    "The start was cancelled by a stop issued while it was in progress"
                ) from None
            raise

    async def _start(self, *, restart: bool = False) -> Any:
        await admit_start(self)  # fit check and placement: 409 before anything is spawned
        token = instance_id_var.set(self.id)
        settings = self.m.settings
        deadline = time.monotonic() + settings.start_deadline_s
        self.stored.want_running = True
        attempts = 1 + settings.max_retries
        last: AttemptFailed | None = None
        try:
            for attempt in range(attempts):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    await self._attempt(attempt, min(settings.instance_ready_timeout_s, remaining))
                except AttemptFailed as err:
                    last = err
                    self.counters["start_failures"] += 1
                    log.warning(
                        "start attempt %d of %s failed: %s", attempt + 1, self.id, err.reason
                    )
                    self.set_status(
                        S.FAILED,
                        reason="start_failed",
                        error_message=err.reason,
                        retry_count=attempt + 1,
                        pid=None,
                        port=None,
                        started_at=None,
                    )
                    await self.m.persist()
                    if not err.retryable:
                        break
                    continue
                self.counters["starts"] += 1
                self.m.bus.publish(InstanceStartFinished(self.id, True, restart))
                return self.instance
            reason = (
                last.reason
                if last
                else (f"start deadline of {settings.start_deadline_s:.0f}s exceeded")
            )
            if self.status != S.FAILED:
                self.set_status(S.FAILED, reason="start_failed", error_message=reason)
                await self.m.persist()
            self.m.bus.publish(InstanceStartFinished(self.id, False, restart))
            raise StartFailed(self.id, reason, last.exit_code if last else None, self._tail())
        finally:
            end_start(self)
            instance_id_var.reset(token)

    def _tail(self) -> list[str]:
        n = self.m.settings.start_failure_log_tail_lines
        return [e.line for e in self.ring.tail(n)]

    def _bearer(self) -> str:
        return self.m.api_key()

    async def _attempt(self, attempt: int, timeout: float) -> None:
        settings = self.m.settings
        inst = self.instance
        config = inst.config
        backend = self.backend()
        # Port: an explicit one is honoured when free (else a clear conflict, not retried).
        if config.port:
            if not self.m.ports.claim(config.port, config.host):
                raise InstanceConflict(
                    f"Port {config.port} is already in use by another instance or process"
                )
            port = config.port
        else:
            port = self.m.ports.allocate(config.host)
        ctx = LaunchContext(
            instance_id=self.id,
            port=port,
            host_api_key=self.m.api_key(),
            models_dir=settings.models_dir,
            llama_server_bin=settings.llama_server_bin,
            sglang_venv_path=settings.sglang_venv_path,
            sglang_prompt_cache_dir=settings.sglang_prompt_cache_dir,
            gpu_type=self.m.facts().gpu_type,
        )
        self.set_status(
            S.STARTING,
            reason="starting",
            port=port,
            pid=None,
            error_message=None,
            retry_count=attempt,
            started_at=None,
            supported_endpoints=backend.supported_endpoints(config),
            served_model_name=backend.served_model_name(config),
            capabilities=backend.capabilities(config, settings.models_dir),
        )
        try:
            hook = getattr(backend, "before_start", None)
            if hook is not None:
                for w in hook(config, ctx) or ():
                    log.warning("%s: %s", config.alias, w)
            spec = backend.launch(config, ctx)
            apply_placement(self, spec)
        except (LaunchError, ValueError, OSError, RuntimeError) as err:
            self.m.ports.release(port)
            self._after_stop_hook()
            raise AttemptFailed(str(err), None, retryable=False) from None
        for w in spec.warnings:
            log.warning("%s: %s", inst.config.alias, w)
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        for k in spec.env_remove:
            env.pop(k, None)
        env.update(spec.env)

        if self.deleted:
            self.m.ports.release(port)
            raise AttemptFailed("the instance was deleted", None, retryable=False)
        log_path = new_log_path(settings.log_dir, alias_safe(config.alias), self.id)
        self.telemetry.reset(backend.new_parser(config))
        spawned_at = time.monotonic()
        try:
            proc = procs.spawn(spec.argv, env, log_path)
        except OSError as err:
            self.m.ports.release(port)
            raise AttemptFailed(f"Cannot run {spec.argv[0]}: {err.strerror or err}", None) from None
        self.proc = proc
        seq_base = self.ring.next_seq
        self.stored.process = ProcessRecord(
            pid=proc.pid,
            create_time=proc.create_time,
            start_ticks=proc.start_ticks,
            cmdline=proc.cmdline,
            port=port,
            log_file=str(log_path),
            spawned_at=datetime.now(UTC).isoformat(),
            seq_base=seq_base,
        )
        self.set_status(S.STARTING, reason="spawned", pid=proc.pid)
        self._ready = asyncio.Event()
        self._follow(log_path, offset=0, ready_check=backend)
        try:
            # The process record is on disk before we wait: a host killed from here on finds
            # the backend at boot (the backend loads its model meanwhile, so this costs no time).
            await self.m.persist()
            await self._wait_ready(proc, backend, config.host, port, timeout)
        except BaseException:
            await self._teardown_attempt(proc, port)
            raise
        # Ready.
        if self.follower is not None:
            self.follower.hot_polling = True
        now = time.monotonic()
        first = self.follower.first_line_at if self.follower else None
        self.set_status(
            S.RUNNING,
            reason="ready",
            started_at=datetime.now(UTC),
            error_message=None,
        )
        # Not awaited: the process record was saved at spawn, and a host that dies before this
        # write re-adopts the backend anyway. Answering "running" should not wait on fsync.
        self.m.persist_soon()
        self.m.bus.publish(
            InstanceStartTimed(
                self.id,
                config.backend_type,
                (first - spawned_at) if first else None,
                now - spawned_at,
            )
        )
        self._watch(proc)

    async def _wait_ready(
        self, proc: procs.BackendProcess, backend: Backend, host: str, port: int, timeout: float
    ) -> None:
        assert self._ready is not None
        ready = self._ready
        waiters: list[asyncio.Task[Any]] = [
            asyncio.create_task(ready.wait()),
            asyncio.create_task(procs.wait_exit(proc)),
        ]
        if backend.health_path:
            waiters.append(asyncio.create_task(self._poll_health(host, port, backend.health_path)))
        try:
            done, _ = await asyncio.wait(
                waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        ready_seen = waiters[0] in done or (len(waiters) > 2 and waiters[2] in done)
        if ready_seen and proc.alive():
            return
        if not proc.alive() or waiters[1] in done:
            await procs.wait_exit(proc, 1.0)
            code = proc.exit_code()
            self.last_exit_code = code
            if self.follower:
                self.follower.read_available()
            raise AttemptFailed(
                f"Process exited with code {code}" if code is not None else "Process exited", code
            )
        raise AttemptFailed(f"Backend did not report readiness within {timeout:.0f}s", None)

    async def _poll_health(self, host: str, port: int, path: str) -> None:
        addr = probe_address(host)
        bearer = self._bearer()
        while True:
            if await is_healthy(addr, port, path, bearer, timeout=1.0):
                return
            await asyncio.sleep(HEALTH_POLL_S)

    async def _teardown_attempt(self, proc: procs.BackendProcess, port: int) -> None:
        code = await procs.terminate(proc, min(self.m.settings.stop_grace_s, 5.0))
        if code is not None:
            self.last_exit_code = code
        await self._stop_follower()
        self.proc = None
        self.stored.process = None
        self.m.ports.release(port)
        self._after_stop_hook()  # e.g. a failed SGLang attempt leaves no prompt cache behind

    # --- logs ------------------------------------------------------------------------------------

    def _follow(self, path: Path, offset: int, ready_check: Backend | None) -> None:
        bus = self.m.bus
        ring = self.ring
        telemetry = self.telemetry
        iid = self.id

        def on_lines(lines: list[str]) -> None:
            ts = datetime.now(UTC).isoformat()
            entries = ring.append_many(lines, ts)
            for e in entries:
                bus.publish(LogLine(iid, e.seq, ts, e.line))
            telemetry.feed(lines)
            ready = self._ready
            if ready_check is not None and ready is not None and not ready.is_set():
                if any(ready_check.is_ready_line(line) for line in lines):
                    ready.set()

        self.follower = LogFollower(path, on_lines, self.m.inotify, offset=offset)
        self.follower.start()

    async def _stop_follower(self) -> None:
        if self.follower is not None:
            await self.follower.stop(flush=True)
            self.follower = None

    # --- running ---------------------------------------------------------------------------------

    def _watch(self, proc: procs.BackendProcess) -> None:
        self.watch_task = asyncio.create_task(self._watch_exit(proc), name=f"watch:{self.id}")
        backend = self.backend()
        if backend.metrics_path:
            self.metrics_task = asyncio.create_task(
                self._poll_metrics(backend.metrics_path), name=f"metrics:{self.id}"
            )

    async def _watch_exit(self, proc: procs.BackendProcess) -> None:
        await procs.wait_exit(proc)
        if self.proc is not proc or self.status != S.RUNNING:
            return  # an intentional stop owns this exit
        code = proc.exit_code()
        self.last_exit_code = code
        self.counters["crashes"] += 1
        self._cancel(self.metrics_task)
        await self._stop_follower()
        self.proc = None
        self.stored.process = None
        self.m.ports.release(self.instance.port)
        reason = (
            f"Process exited unexpectedly (exit code: {code})"
            if code is not None
            else "Process exited unexpectedly"
        )
        log.error("backend of %s (%s) crashed: %s", self.id, self.instance.config.alias, reason)
        self.set_status(
            S.FAILED, reason="crashed", error_message=reason, pid=None, port=None, started_at=None
        )
        self.m.bus.publish(InstanceCrashed(self.id, code))
        await self.m.persist()
        self._after_stop_hook()
        self._schedule_restart()

    def _schedule_restart(self) -> None:
        """Restart with backoff unless control owns recovery (ruling 6) or it crash-loops."""
        settings = self.m.settings
        if self.instance.managed_by == "intent" or not self.stored.want_running or self.deleted:
            log.info(
                "not restarting %s: recovery is %s",
                self.id,
                "control's" if self.instance.managed_by == "intent" else "not wanted",
            )
            return
        now = time.monotonic()
        self.crashes.append(now)
        while self.crashes and now - self.crashes[0] > settings.restart_window_s:
            self.crashes.popleft()
        n = len(self.crashes)
        if n >= settings.restart_max_in_window:
            msg = (
                f"{self.instance.error_message}; crashed {n} times within "
                f"{settings.restart_window_s:.0f}s, not restarting"
            )
            self.stored.instance.error_message = msg
            self.m.changed(self.id, self.status.value, "crash_loop")
            return
        delay = min(settings.restart_backoff_s * (2 ** (n - 1)), settings.restart_backoff_max_s)
        log.info("restarting %s in %.1fs (crash %d within the window)", self.id, delay, n)
        self.restart_task = asyncio.create_task(
            self._restart_after(delay), name=f"restart:{self.id}"
        )

    async def _restart_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        async with self.lock:
            if self.status != S.FAILED or not self.stored.want_running or self.deleted:
                return
            self.counters["restarts"] += 1
            self.start_task = asyncio.create_task(
                self._start(restart=True), name=f"start:{self.id}"
            )
            task = self.start_task
            self.restart_task = None
        # InstanceConflict: the fit check refused the restart (logged by the capacity gate).
        with contextlib.suppress(StartFailed, InstanceConflict, asyncio.CancelledError):
            await task

    async def _poll_metrics(self, path: str) -> None:
        from solar_host.backends.prometheus import parse_prometheus_text

        backend = self.backend()
        backend_type = self.instance.config.backend_type
        while True:
            await asyncio.sleep(METRICS_POLL_S)
            inst = self.instance
            if inst.port is None:
                continue
            try:
                status, body = await http_get(
                    probe_address(inst.config.host),
                    inst.port,
                    path,
                    bearer=self._bearer(),
                    timeout=3.0,
                )
            except (OSError, TimeoutError, asyncio.IncompleteReadError):
                continue
            if status == 200:
                metrics = parse_prometheus_text(body.decode("utf-8", "replace"))
                snapshot_of = getattr(backend, "usage_snapshot", None)
                snapshot = snapshot_of(metrics) if snapshot_of is not None else None
                self.telemetry.apply_metrics(metrics, snapshot, backend_type)

    # --- stop ------------------------------------------------------------------------------------

    @staticmethod
    def _cancel(task: asyncio.Task[Any] | None) -> None:
        if task is not None and not task.done():
            task.cancel()

    async def stop(self, *, forget_intent: bool = True) -> Any:
        """Stop the backend (idempotent). `forget_intent=False` is a host shutdown: the
        instance is remembered as wanted, so the next boot starts it again."""
        async with self.lock:
            if forget_intent:
                self.stored.want_running = False
            self._cancel(self.restart_task)
            self.restart_task = None
            task = self.start_task
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if self.status == S.STOPPED:
                return self.instance
            if self.status == S.FAILED:
                self.set_status(
                    S.STOPPED,
                    reason="stopped",
                    pid=None,
                    port=None,
                    started_at=None,
                    error_message=None,
                )
                self._after_stop_hook()
                await self.m.persist()
                return self.instance
            proc = self.proc
            self.set_status(S.STOPPING, reason="stopping")
            self._cancel(self.metrics_task)
            self._cancel(self.watch_task)
            if proc is not None:
                code = await procs.terminate(proc, self.m.settings.stop_grace_s)
                self.last_exit_code = code
            await self._stop_follower()
            self.proc = None
            self.stored.process = None
            self.m.ports.release(self.instance.port)
            self.set_status(S.STOPPED, reason="stopped", pid=None, port=None, started_at=None)
            await self.m.persist()
        self._after_stop_hook()
        self.m.prune_logs_soon()
        return self.instance

    async def detach(self) -> None:
        """Host shutdown with KEEP_BACKENDS_ON_SHUTDOWN: leave the backend serving."""
        self._cancel(self.restart_task)
        if self.start_task is not None and not self.start_task.done():
            self.start_task.cancel()
            with contextlib.suppress(BaseException):
                await self.start_task
        self._cancel(self.metrics_task)
        self._cancel(self.watch_task)
        await self._stop_follower()

    def _after_stop_hook(self) -> None:
        backend = self.backend()
        hook = getattr(backend, "after_stop", None)
        if hook is not None:
            try:
                hook(self.instance.config, self.m.settings.sglang_prompt_cache_dir, self.id)
            except Exception:
                log.exception("after-stop hook of %s failed", self.id)

    # --- re-adoption -----------------------------------------------------------------------------

    async def adopt(self) -> bool:
        """Take back a backend the host left running. True when it is running again."""
        rec = self.stored.process
        if rec is None:
            return False
        proc = procs.adopt(rec.pid, rec.create_time, rec.cmdline, rec.start_ticks)
        if proc is None:
            log.info(
                "recorded backend pid %s of %s is gone (or the pid was reused)", rec.pid, self.id
            )
            self.stored.process = None
            return False
        backend = self.backend()
        config = self.instance.config
        healthy = False
        if backend.health_path:
            addr = probe_address(config.host)
            for _ in range(30):
                if await is_healthy(addr, rec.port, backend.health_path, self._bearer(), 1.0):
                    healthy = True
                    break
                if not proc.alive():
                    break
                await asyncio.sleep(0.1)
        log_path = Path(rec.log_file) if rec.log_file else None
        if not backend.health_path and log_path is not None:
            healthy = any(backend.is_ready_line(ln) for ln in tail_lines(log_path, 2000))
        if not healthy or log_path is None:
            log.warning(
                "backend pid %s of %s does not answer its health check; replacing it",
                rec.pid,
                self.id,
            )
            await procs.terminate(proc, self.m.settings.stop_grace_s)
            self.stored.process = None
            return False
        # Continue the log where it is: seq = the attempt's base + lines already in the file.
        lines, size = await asyncio.to_thread(count_lines, log_path)
        base = rec.seq_base + lines
        tail = await asyncio.to_thread(tail_lines, log_path, self.m.settings.log_buffer_size)
        self.ring = LogRing(self.m.settings.log_buffer_size, next_seq=base - len(tail))
        ts = datetime.now(UTC).isoformat()
        self.ring.append_many(tail, ts)
        self.telemetry.reset(backend.new_parser(config))
        self.proc = proc
        self.m.ports.claim_adopted(rec.port)
        self._ready = None
        self._follow(log_path, offset=size, ready_check=None)
        if self.follower is not None:
            self.follower.hot_polling = True
        self.set_status(
            S.RUNNING,
            reason="adopted",
            pid=proc.pid,
            port=rec.port,
            started_at=self.instance.started_at or datetime.now(UTC),
            supported_endpoints=backend.supported_endpoints(config),
            served_model_name=backend.served_model_name(config),
        )
        self._watch(proc)
        log.info("re-adopted backend pid %s of %s on port %s", proc.pid, self.id, rec.port)
        return True

    async def kill_recorded(self) -> None:
        """Delete path: make sure no backend of this instance survives."""
        rec = self.stored.process
        if rec is not None:
            proc = procs.adopt(rec.pid, rec.create_time, rec.cmdline, rec.start_ticks)
            if proc is not None:
                await procs.terminate(proc, self.m.settings.stop_grace_s)
            self.stored.process = None

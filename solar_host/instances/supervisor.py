"""One supervisor per instance: the only code that spawns, adopts, watches and stops its backend.

Everyone else calls its methods and reads snapshots. Two callers asking for the same start share
one outcome (one start task); a stop cancels an in-flight start, which kills what it spawned.
Every status change goes through `set_status`, which checks the transition table and publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from solar_host.backends.base import Backend, LaunchContext, LaunchError, alias_safe
from solar_host.estimates.hooks import admit_start, apply_placement, end_start, hold_adopted
from solar_host.events import InstanceCrashed, InstanceStartFinished, InstanceStartTimed, LogLine
from solar_host.instances import adoption, confinement, health, ownership, preflight
from solar_host.instances import process as procs
from solar_host.instances.backend_env import (
    backend_environment,
    parse_passthrough,
    write_private_files,
)
from solar_host.instances.errors import (
    InstanceConflict,
    InstanceNotFound,
    NotPersisted,
    StartFailed,
)
from solar_host.instances.health import AttemptFailed
from solar_host.instances.httpcheck import is_healthy, probe_address
from solar_host.instances.logs import LogFollower, LogRing, count_lines, new_log_path, tail_lines
from solar_host.instances.restarts import CrashLoop, RestartPolicy
from solar_host.instances.states import InstanceStatus, check_transition
from solar_host.instances.store import ProcessRecord, StoredInstance
from solar_host.instances.telemetry import Telemetry
from solar_host.model_store.roots import anchor_relative
from solar_host.model_store.roots import check_config as check_model_roots
from solar_host.platform.logging_setup import Redactor, instance_id_var

if TYPE_CHECKING:
    from solar_host.instances.context import SupervisorContext

log = logging.getLogger(__name__)
S = InstanceStatus

T = TypeVar("T")
# How long a backend that was running when the host went away has, once re-adopted, to show
# its listening socket again before it is handled as a crash (it is not loading: it was ready).
ADOPTED_RELISTEN_S = 10.0


async def _off_loop(fn: Callable[..., T], *args: Any, undo: Callable[[T], Any]) -> T:
    """`fn(*args)` in a worker thread. A cancelled caller cannot stop the thread, so what it
    did (spawned a process, claimed a port) is undone by `undo(result)` once it finishes."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            result = await fut
            undone = undo(result)
            if asyncio.iscoroutine(undone):
                await undone
        raise


async def _kill_unrecorded(proc: procs.BackendProcess) -> None:
    """A backend spawned for a start that was cancelled meanwhile: nobody will manage it."""
    await procs.terminate(proc, 1.0)


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class Supervisor:
    def __init__(self, ctx: SupervisorContext, stored: StoredInstance):
        self.ctx = ctx
        self.stored = stored
        self.id = stored.instance.id
        settings = ctx.settings
        self.ring = LogRing(settings.log_buffer_size)
        self.telemetry = Telemetry(self.id, ctx.bus, settings.log_buffer_size)
        self.proc: procs.BackendProcess | None = None
        self.follower: LogFollower | None = None
        self.lock = asyncio.Lock()
        self.start_task: asyncio.Task[Any] | None = None
        self.restart_task: asyncio.Task[None] | None = None
        self.watch_task: asyncio.Task[None] | None = None
        self.metrics_task: asyncio.Task[None] | None = None
        self.liveness_task: asyncio.Task[None] | None = None
        # Why the host ended a running backend itself (it stopped answering): the crash's reason.
        self._ended_why: str | None = None
        self.crashes = CrashLoop(RestartPolicy.of(ctx.settings))
        # The failure a scheduled restart follows, without the "restarting in" note.
        self._crash_reason: str | None = None
        self.counters = {"starts": 0, "start_failures": 0, "restarts": 0, "crashes": 0}
        self._ready: asyncio.Event | None = None
        self._backend: Backend | None = None
        self.deleted = False
        self._adopt_task: asyncio.Task[Any] | None = None
        # The stop the previous host process left unfinished (adopt); never a start_task.
        self.stop_task: asyncio.Task[Any] | None = None
        # The start task a restart made: a restart arriving while it runs joins it.
        self._restart_start: asyncio.Task[Any] | None = None
        # Set by detach(): an interrupted start leaves its backend to the next host process.
        self._detaching = False

    # --- snapshots -------------------------------------------------------------------------------

    @property
    def instance(self) -> Any:
        return self.stored.instance

    @property
    def status(self) -> InstanceStatus:
        return self.stored.instance.status

    def backend(self) -> Backend:
        return self.ctx.backends.for_type(self.instance.config.backend_type)

    # --- state -----------------------------------------------------------------------------------

    def set_status(
        self, new: InstanceStatus, *, reason: str = "", recovery: bool = False, **fields: Any
    ) -> None:
        """The one place an instance's status changes: checked against the transition table
        (`recovery`: an edge only boot recovery and adoption take, from what a previous host
        process recorded), applied with `fields`, and published."""
        inst = self.stored.instance
        if new != inst.status:
            check_transition(inst.status, new, recovery=recovery)
        inst.status = new
        for k, v in fields.items():
            setattr(inst, k, v)
        self.ctx.changed(self.id, new.value, reason)

    # --- start -----------------------------------------------------------------------------------

    async def start(self) -> Any:
        """Start (or join the start in flight) and return the running instance."""
        while True:
            async with self.lock:
                if self.deleted:
                    raise InstanceNotFound(self.id)
                pending = self._settling()
                if pending is None:
                    if self.status == S.RUNNING and self.proc is not None and self.proc.alive():
                        return self.reached()
                    if self.start_task is None or self.start_task.done():
                        await self._begin_start()
                    task = self.start_task
                    assert task is not None
                    break
            # Decided once it has settled, outside the lock it needs (never cancelled by us).
            await asyncio.wait({pending})
        return await self._join_start(task)

    def reached(self) -> Any:
        """The instance as an operation left it, for its answer: the record itself keeps
        changing (a backend that dies while the manager saves the state is failed before the
        answer is written, and "started successfully" must not come with status failed)."""
        return self.instance.model_copy(deep=True)

    def _settling(self) -> asyncio.Task[Any] | None:
        """What must end before a start can be decided (under the lock): the handling of a
        crash that has begun (the status still says running, the process is gone; it would
        clobber a start made meanwhile), or the stop the previous host left unfinished."""
        stop = self.stop_task
        if stop is not None and not stop.done() and stop is not asyncio.current_task():
            return stop
        watch = self.watch_task
        if (
            self.status == S.RUNNING
            and self.proc is not None
            and watch is not None
            and not watch.done()
            and not self.proc.alive()
        ):
            return watch
        return None

    async def _begin_start(
        self, *, undo_intent: bool | None = None, restart_op: bool = False
    ) -> None:
        """Under the lock: make the start task. The intent is on disk before it exists, so a
        stop issued later (it takes the lock after this) is the last word on disk, and a start
        the next boot would forget is refused with 507 before anything runs."""
        recorded = not self.stored.want_running
        if recorded:
            await self._record_intent(True)
        if self.restart_task is not None:
            self.restart_task.cancel()
            self.restart_task = None
        # Someone asked for this start: the crash loop before it is over, and a crash after it
        # gets the whole restart budget again (as supervisord's start does).
        self.crashes.clear()
        undo = recorded if undo_intent is None else undo_intent
        self.start_task = asyncio.create_task(
            self._start(undo_intent=undo), name=f"start:{self.id}"
        )
        # A restart arriving while this one's start is in flight joins it (restart()).
        self._restart_start = self.start_task if restart_op else None

    async def restart(self) -> Any:
        """Stop, then start again, as one operation: the stop and the creation of the start
        happen under one hold of the lock, so a stop issued meanwhile comes after it and
        cancels that start (the restart then answers 409, as a cancelled start does). A
        restart arriving while another restart's start is in flight shares its outcome."""
        async with self.lock:
            if self.deleted:
                raise InstanceNotFound(self.id)
            task = self.start_task
            if task is None or task.done() or task is not self._restart_start:
                # Wanted from here on, on disk before any signal: a host that dies in the
                # middle finishes the stop at boot and then starts it again (507: nothing done).
                recorded = not self.stored.want_running
                if recorded:
                    await self._record_intent(True)
                if await self._stop_locked(forget_intent=False):
                    self._after_stop_hook()
                    self.ctx.prune_logs_soon()
                await self._begin_start(undo_intent=recorded, restart_op=True)
                task = self.start_task
                assert task is not None
        return await self._join_start(task)

    async def _join_start(self, task: asyncio.Task[Any]) -> Any:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                # Not a failure of the backend: another call (stop, restart, delete) won.
                raise InstanceConflict(
                    "The start was cancelled by a stop issued while it was in progress"
                ) from None
            raise

    async def _start(
        self,
        *,
        restart: bool = False,
        attempts: int | None = None,
        deadline: float | None = None,
        undo_intent: bool = False,
    ) -> Any:
        """A start: up to `attempts` (1 + MAX_RETRIES) attempts until `deadline` (monotonic;
        START_DEADLINE_S from now). An adopted start that failed passes what it has left.
        `undo_intent`: the caller recorded want_running for this start (_begin_start); a start
        refused before anything ran takes it back."""
        try:
            await admit_start(self)  # fit check and placement: 409 before anything is spawned
        except Exception:
            if undo_intent:
                self.stored.want_running = False
                await self.ctx.persist()
            if not restart:
                await self._nothing_due()
            raise
        token = instance_id_var.set(self.id)
        settings = self.ctx.settings
        if deadline is None:
            deadline = time.monotonic() + settings.start_deadline_s
        if attempts is None:
            attempts = 1 + settings.max_retries
        last: AttemptFailed | None = None
        try:
            # want_running is on disk already (_begin_start, under the lock): recording it here,
            # after an await, would undo a stop issued meanwhile.
            for attempt in range(attempts):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    await self._attempt(attempt, min(settings.instance_ready_timeout_s, remaining))
                except AttemptFailed as err:
                    last = err
                    log.warning(
                        "start attempt %d of %s failed: %s", attempt + 1, self.id, err.reason
                    )
                    # What failed now often clears in a moment (a port or GPU memory that the
                    # crashed process still held): pause before the next attempt, doubling.
                    pause = self.crashes.policy.attempt_pause(attempt, deadline - time.monotonic())
                    again = err.retryable and attempt + 1 < attempts and deadline > time.monotonic()
                    # What comes next is said with the failure ("failed" alone reads as final).
                    due = f"; next attempt in {pause:.1f}s ({attempt + 2} of {attempts})"
                    self.set_status(
                        S.FAILED,
                        reason="start_failed",
                        error_message=err.reason + (due if again else ""),
                        retry_count=attempt + 1,
                        pid=None,
                        port=None,
                        started_at=None,
                    )
                    if again or not restart:
                        # On disk with the failure: a host killed or handed over in the pause
                        # starts it at boot instead of leaving it failed; after the last
                        # attempt, nothing is due (a crash restart's: see _restart_after).
                        self.stored.restart_due = again
                    await self.ctx.persist()
                    if not err.retryable:
                        break
                    if again and pause > 0:
                        await asyncio.sleep(pause)
                    continue
                if self.stored.restart_due:
                    # It serves: nothing is due. Not awaited, as the ready state's own save.
                    self.stored.restart_due = False
                    self.ctx.persist_soon()
                self.counters["starts"] += 1
                self.ctx.bus.publish(InstanceStartFinished(self.id, True, restart))
                return self.reached()
            reason = (
                last.reason
                if last
                else (f"start deadline of {settings.start_deadline_s:.0f}s exceeded")
            )
            if self.status != S.FAILED:
                self.set_status(S.FAILED, reason="start_failed", error_message=reason)
                await self.ctx.persist()
            self.ctx.bus.publish(InstanceStartFinished(self.id, False, restart))
            self.counters["start_failures"] += 1
            raise StartFailed(
                self.id,
                reason,
                last.exit_code if last else None,
                self._tail(),
                retryable=last.retryable if last else True,
            )
        except Exception:
            # Out of attempts or time, or ended by what no attempt retries (a port taken, a
            # failed write): it stays as it is. Whether a failed crash restart is tried again
            # is the restart loop's decision (_restart_after). A cancel (a stop, a hand-over)
            # is not an end: the stop decides, and a hand-over leaves what is due on disk.
            if not restart:
                await self._nothing_due()
            raise
        finally:
            end_start(self)
            instance_id_var.reset(token)

    async def _nothing_due(self) -> None:
        """No restart or retry is due any more (see StoredInstance.restart_due): on disk."""
        if self.stored.restart_due:
            self.stored.restart_due = False
            await self.ctx.persist()

    def _tail(self) -> list[str]:
        n = self.ctx.settings.start_failure_log_tail_lines
        return [e.line for e in self.ring.tail(n)]

    def _bearer(self) -> str:
        return self.ctx.api_key()

    async def _attempt(self, attempt: int, timeout: float) -> None:
        settings = self.ctx.settings
        self.ctx.idle_logs.busy(self.id)
        inst = self.instance
        config = inst.config
        backend = self.backend()
        # Port: an explicit one is honoured when free (else a clear conflict, not retried).
        if config.port:
            holder = await _off_loop(
                self.ctx.ports.holder,
                config.port,
                config.host,
                undo=lambda h: h is None and self.ctx.ports.release(config.port),
            )
            if holder is not None:
                raise InstanceConflict(f"Port {config.port} is already in use by {holder}")
            port = config.port
        else:
            port = await _off_loop(
                self.ctx.ports.allocate, config.host, undo=self.ctx.ports.release
            )
        ctx = LaunchContext(
            instance_id=self.id,
            port=port,
            host_api_key=self.ctx.api_key(),
            models_dir=settings.models_dir,
            llama_server_bin=settings.llama_server_bin,
            sglang_venv_path=settings.sglang_venv_path,
            sglang_prompt_cache_dir=settings.sglang_prompt_cache_dir,
            gpu_type=self.ctx.facts().gpu_type,
            private_dir=settings.config_file.parent / "backend-keys",
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
            # Again at start: a symlink inside a root may have been re-pointed since create.
            check_model_roots(config, settings.model_root_dirs)
            # The files as the backend will open them (relative: under MODELS_DIR, where the
            # roots check judged them), never the host's working directory.
            opened = config.model_copy()
            anchor_relative(opened, settings.models_dir)
            preflight.check(backend, opened, self.ctx.facts())  # not retried, nothing spawned
            for w in backend.before_start(config, ctx):
                log.warning("%s: %s", config.alias, w)
            spec = backend.launch(config, ctx)
            apply_placement(self, spec)
        except (LaunchError, ValueError, OSError, RuntimeError) as err:
            self.ctx.ports.release(port)
            self._after_stop_hook()
            raise AttemptFailed(str(err), None, retryable=False) from None
        for w in spec.warnings:
            log.warning("%s: %s", inst.config.alias, w)
        env = backend_environment(
            spec, passthrough=parse_passthrough(settings.backend_env_passthrough)
        )
        # Ours, provably: exec and fork keep it; ownership.py reads it back from /proc.
        env[ownership.MARKER_VAR] = self.ctx.marker(self.id)
        env[ownership.PORT_VAR] = str(port)
        key_hash = self.ctx.key_hash(ctx.host_api_key)
        env[ownership.KEY_VAR] = key_hash
        spawn_id = ownership.new_spawn_id()
        env[ownership.SPAWN_VAR] = spawn_id

        if self.deleted:
            self.ctx.ports.release(port)
            raise AttemptFailed("the instance was deleted", None, retryable=False)
        log_path = new_log_path(settings.log_dir, alias_safe(config.alias), self.id)
        self.telemetry.reset(backend.new_parser(config))
        spawned_at = time.monotonic()
        try:
            if spec.private_files:  # each written with an fsync: off the loop
                await asyncio.to_thread(write_private_files, spec.private_files)

            # Off the loop: fork/exec of a large host takes milliseconds, 200 starts seconds.
            # In MODELS_DIR: what a backend opens by a relative name (a Hub-id-shaped model_id
            # transformers tries as a directory first, an SGLang path) is then the file the
            # roots check judged, never one beside wherever the host was started (ruling 12).
            def spawn() -> procs.BackendProcess:
                # What the backend may read and write is worked out here too (PATH lookups,
                # links).
                policy = confinement.access_policy(
                    roots=settings.model_root_dirs,
                    argv=spec.argv,
                    env=env,
                    private_files=spec.private_files,
                    extra_reads=settings.backend_extra_read_dirs,
                    extra_writes=[*settings.backend_extra_write_dirs, *spec.write_dirs],
                    confine_writes=settings.backend_write_confinement,
                    host_state=confinement.HostState(
                        settings.config_file,
                        settings.log_dir,
                        settings.jobs_dir,
                        settings.env_file,
                    ),
                )
                return procs.spawn(
                    spec.argv,
                    env,
                    log_path,
                    settings.models_dir,
                    policy,
                    settings.backend_read_confinement,
                )

            proc = await _off_loop(spawn, undo=_kill_unrecorded)
        except confinement.ConfinementUnavailable as err:
            self.ctx.ports.release(port)
            raise AttemptFailed(str(err), None, retryable=False) from None
        except OSError as err:
            self.ctx.ports.release(port)
            raise AttemptFailed(f"Cannot run {spec.argv[0]}: {err.strerror or err}", None) from None
        self.proc = proc
        proc.port = port
        seq_base = self.ring.next_seq
        self.stored.process = ProcessRecord(
            pid=proc.pid,
            create_time=proc.create_time,
            start_ticks=proc.start_ticks,
            boot_id=proc.identity.boot_id,
            marker=proc.marker,
            cmdline=proc.cmdline,
            port=port,
            key_hash=key_hash,
            spawn_id=spawn_id,
            log_file=str(log_path),
            spawned_at=datetime.now(UTC).isoformat(),
            seq_base=seq_base,
        )
        self._ready = asyncio.Event()
        self._follow(log_path, offset=0, ready_check=backend)
        try:
            # The process record is on disk before the pid is shown or awaited: a host killed
            # from here on finds the backend at boot by its record (the backend loads its model
            # meanwhile, so this costs no time). Killed before, it finds it by its marker.
            await self.ctx.persist()
            self.set_status(S.STARTING, reason="spawned", pid=proc.pid)
            await self._wait_ready(proc, backend, config.host, port, timeout)
        except asyncio.CancelledError:
            if not self._detaching:
                await self._teardown_attempt(proc, port)
            raise
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
        self.ctx.persist_soon()
        self.ctx.bus.publish(
            InstanceStartTimed(
                self.id,
                config.backend_type,
                (first - spawned_at) if first else None,
                now - spawned_at,
            )
        )
        self._watch(proc)

    async def _teardown_attempt(self, proc: procs.BackendProcess, port: int) -> None:
        await procs.terminate(proc, min(self.ctx.settings.stop_grace_s, 5.0))
        await self._stop_follower()
        self.proc = None
        self.stored.process = None
        self.ctx.ports.release(port)
        self._after_stop_hook()  # e.g. a failed SGLang attempt leaves no prompt cache behind

    # --- logs ------------------------------------------------------------------------------------

    def _redactor(self) -> Redactor:
        return self.ctx.backend_redactor(self.instance.config.api_key)

    def _follow(self, path: Path, offset: int, ready_check: Backend | None) -> None:
        bus = self.ctx.bus
        ring = self.ring
        telemetry = self.telemetry
        iid = self.id
        redact = self._redactor()

        def on_lines(lines: list[str]) -> None:
            ts = datetime.now(UTC).isoformat()
            entries = ring.append_many([redact(line) for line in lines], ts)
            for e in entries:
                bus.publish(LogLine(iid, e.seq, ts, e.line))
            telemetry.feed(lines)
            ready = self._ready
            if ready_check is not None and ready is not None and not ready.is_set():
                if any(ready_check.is_ready_line(line) for line in lines):
                    ready.set()

        settings = self.ctx.settings
        self.follower = LogFollower(
            path,
            on_lines,
            self.ctx.inotify,
            offset=offset,
            max_line_bytes=settings.log_line_max_bytes,
            max_file_bytes=settings.log_file_max_bytes,
            generations=settings.log_file_generations,
            on_rotate=self._rotated,
        )
        self.follower.start()

    def _rotated(self, lines_moved: int) -> None:
        """The log file was rotated: re-adoption counts lines from a higher base now."""
        rec = self.stored.process
        if rec is not None:
            rec.seq_base += lines_moved
            self.ctx.persist_soon()

    async def _stop_follower(self) -> None:
        if self.follower is not None:
            await self.follower.stop(flush=True)
            self.follower = None

    # --- running ---------------------------------------------------------------------------------

    def _wait_ready(
        self, proc: procs.BackendProcess, backend: Backend, host: str, port: int, timeout: float
    ) -> Awaitable[None]:
        assert self._ready is not None
        return health.wait_ready(
            proc,
            backend,
            probe_address(host),
            port,
            timeout,
            ready=self._ready,
            pacer=self.ctx.probe_pacer,
            bearer=self._bearer(),
            follower=self.follower,
        )

    def _port(self) -> int | None:
        return self.instance.port

    def _watch(self, proc: procs.BackendProcess) -> None:
        """Watch a backend that serves: its exit, its liveness, its /metrics."""
        self._ended_why = None
        self.watch_task = asyncio.create_task(self._watch_exit(proc), name=f"watch:{self.id}")
        backend = self.backend()
        address = probe_address(self.instance.config.host)
        if backend.metrics_path:
            self.metrics_task = asyncio.create_task(
                health.poll_metrics(
                    backend,
                    self.instance.config.backend_type,
                    backend.metrics_path,
                    address=address,
                    port_of=self._port,
                    bearer=self._bearer,
                    telemetry=self.telemetry,
                ),
                name=f"metrics:{self.id}",
            )
        if backend.health_path and self.ctx.settings.health_check_interval_s > 0:

            def current() -> bool:
                return self.proc is proc and self.status == S.RUNNING

            def end(why: str) -> None:
                self._ended_why = why  # the crash's reason (_crashed)

            self.liveness_task = asyncio.create_task(
                health.watch_liveness(
                    proc,
                    backend.health_path,
                    settings=self.ctx.settings,
                    address=address,
                    port_of=self._port,
                    bearer=self._bearer,
                    current=current,
                    end=end,
                    instance_id=self.id,
                ),
                name=f"liveness:{self.id}",
            )

    def _cancel_watchers(self) -> None:
        self._cancel(self.metrics_task)
        self._cancel(self.liveness_task)

    async def _watch_exit(self, proc: procs.BackendProcess) -> None:
        await procs.wait_exit(proc)
        # Under the lock: a start, restart or stop decided meanwhile comes before or after
        # this crash handling as a whole, never in the middle of it (a start made in between
        # would have its new backend forgotten here). A start that finds the process gone
        # waits for this (start: _settling); a stop cancels it.
        async with self.lock:
            await self._crashed(proc)

    async def _crashed(self, proc: procs.BackendProcess) -> None:
        if self.proc is not proc or self.status != S.RUNNING:
            return  # an intentional stop owns this exit
        code = proc.exit_code()
        self.counters["crashes"] += 1
        # Workers that outlived it (in its group, or setsid'd) hold GPU memory and the port.
        await procs.end_tree_leftovers(proc)
        self._cancel_watchers()
        await self._stop_follower()
        self.proc = None
        self.stored.process = None
        self.ctx.ports.release(self.instance.port)
        reason = (
            f"Process exited unexpectedly (exit code: {code})"
            if code is not None
            else "Process exited unexpectedly"
        )
        if self._ended_why is not None:
            reason, self._ended_why = self._ended_why, None
        await self._record_crash(proc, reason, code)

    async def _record_crash(
        self, proc: procs.BackendProcess, reason: str, code: int | None
    ) -> None:
        """Say the backend crashed (`reason`, with what of it could not be ended), and restart
        it under the crash policy."""
        if proc.left_behind:
            reason += "; " + "; ".join(proc.left_behind)
        log.error("backend of %s (%s) crashed: %s", self.id, self.instance.config.alias, reason)
        self.set_status(
            S.FAILED, reason="crashed", error_message=reason, pid=None, port=None, started_at=None
        )
        self.ctx.bus.publish(InstanceCrashed(self.id, code))
        self._after_stop_hook()
        # Decided before the save, so the failure and whether a restart is due reach the disk
        # together: a host killed in the backoff starts it at boot.
        self._schedule_restart()
        await self.ctx.persist()

    def _schedule_restart(self) -> None:
        """Restart with backoff unless control owns recovery (ruling 6) or it crash-loops.
        Records whether a restart is due (StoredInstance.restart_due); the caller saves it."""
        settings = self.ctx.settings
        self.stored.restart_due = False
        if self.instance.managed_by == "intent" or not self.stored.want_running or self.deleted:
            log.info(
                "not restarting %s: recovery is %s",
                self.id,
                "control's" if self.instance.managed_by == "intent" else "not wanted",
            )
            return
        verdict = self.crashes.crashed(time.monotonic())
        n, delay = verdict.crashes, verdict.delay_s
        if delay is None:
            msg = (
                f"{self.instance.error_message}; crashed {n} times within "
                f"{settings.restart_window_s:.0f}s, not restarting"
            )
            self.stored.instance.error_message = msg
            self.ctx.changed(self.id, self.status.value, "crash_loop")
            return
        log.info("restarting %s in %.1fs (crash %d within the window)", self.id, delay, n)
        # Said where the operator and control look: "failed" alone reads as given up on.
        self._crash_reason = self.instance.error_message
        self.stored.instance.error_message = (
            f"{self._crash_reason}; restarting in {delay:.1f}s (crash {n} within "
            f"{settings.restart_window_s:.0f}s; the host gives up at "
            f"{settings.restart_max_in_window})"
        )
        self.ctx.changed(self.id, self.status.value, "restart_scheduled")
        self.stored.restart_due = True
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
        try:
            await task
        except StartFailed as err:
            # A restart that could not bring it back is one more crash of the loop: the next
            # try comes after the next backoff, until RESTART_MAX_IN_WINDOW, rather than never.
            if err.retryable:
                self._schedule_restart()
                await self.ctx.persist()
            else:
                await self._nothing_due()
        except InstanceConflict as err:
            # Not the backend's failure: the fit check or a taken port refused the restart.
            # Said where the operator looks, not only in the host's log.
            log.warning("restart of %s refused: %s", self.id, err.detail)
            self.stored.instance.error_message = (
                f"{self._crash_reason}; the restart was refused: {err.detail}"
            )
            self.ctx.changed(self.id, self.status.value, "restart_refused")
            await self._nothing_due()
        except asyncio.CancelledError:
            pass

    # --- stop ------------------------------------------------------------------------------------

    @staticmethod
    def _cancel(task: asyncio.Task[Any] | None) -> None:
        if task is not None and not task.done():
            task.cancel()

    async def _record_intent(self, wanted: bool) -> None:
        """Put `want_running` on disk before acting on it; NotPersisted (507) leaves it as
        it was, so nothing is started or stopped that the next boot would undo."""
        self.stored.want_running = wanted
        try:
            await self.ctx.persist_or_raise()
        except NotPersisted:
            self.stored.want_running = not wanted
            raise

    async def stop(self, *, forget_intent: bool = True) -> Any:
        """Stop the backend (idempotent). `forget_intent=False` is a host shutdown: the
        instance is remembered as wanted, so the next boot starts it again."""
        async with self.lock:
            if self.deleted:  # a delete held the lock while this stop waited for it
                raise InstanceNotFound(self.id)
            stopped = await self._stop_locked(forget_intent=forget_intent)
        if stopped:
            self._after_stop_hook()
            self.ctx.prune_logs_soon()
        return self.instance

    async def _stop_locked(self, *, forget_intent: bool) -> bool:
        """The stop, under the lock (stop, restart). True when a backend was stopped: the
        caller then runs the after-stop hook and prunes the logs."""
        if forget_intent and self.stored.want_running:
            # A stop the next boot would undo (it starts what config.json says is wanted)
            # is refused with 507, and the backend keeps serving.
            await self._record_intent(False)
        # A crash restart in its backoff, or the next attempt of a start that is pausing:
        # StoredInstance.restart_due, set for both.
        restart_pending = self.stored.restart_due
        self._cancel(self.restart_task)
        self.restart_task = None
        task = self.start_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self._cancel(self._adopt_task)
        # The stop the previous host left, not begun yet (this holds the lock it needs):
        # this stop does it.
        self._cancel(self.stop_task)
        if forget_intent:
            self.stored.restart_due = False  # the operator's stop ends what was due
        if self.status == S.STOPPED:
            await self.ctx.persist()  # the intent, if it changed (same bytes: no write)
            return False
        if self.status == S.FAILED and not forget_intent and not restart_pending:
            # A host shutdown keeps a failure as it is: the next boot starts what was
            # running or about to be restarted, never what the host or control gave up on
            # (a crash loop, an intent-managed crash, a start that failed).
            return False
        if self.status == S.FAILED:
            self.set_status(
                S.STOPPED,
                reason="stopped",
                pid=None,
                port=None,
                started_at=None,
                error_message=None,
            )
            # Stopped (and, at a host shutdown, still wanted): boot starts it as such.
            self.stored.restart_due = False
            self._after_stop_hook()
            await self.ctx.persist()
            return False
        proc = self.proc
        self.set_status(S.STOPPING, reason="stopping")
        # What is wanted is on disk before any signal: a host that dies mid-stop finishes
        # the stop at boot (and starts it again only when it is still wanted).
        await self.ctx.persist()
        self._cancel_watchers()
        self._cancel(self.watch_task)
        left: list[str] = []
        if proc is not None:
            await procs.terminate(proc, self.ctx.settings.stop_grace_s)
            left = proc.left_behind
            if proc.killed_after_s is not None:
                # Said where the operator looks: a backend that needs SIGKILL loses what it
                # would have done on SIGTERM (flushing a cache, closing its requests).
                left = [f"it ignored SIGTERM for {proc.killed_after_s:g}s and was killed", *left]
        await self._stop_follower()
        await self._record_stopped(left)
        return True

    async def detach(self) -> None:
        """Host shutdown with KEEP_BACKENDS_ON_SHUTDOWN: leave the backend serving (one still
        loading too: the next host process adopts it and awaits its readiness)."""
        self._detaching = True
        self._cancel(self.restart_task)
        self._cancel(self._adopt_task)
        self._cancel(self.stop_task)  # the next host process finishes it, as this one would
        if self.start_task is not None and not self.start_task.done():
            self.start_task.cancel()
            with contextlib.suppress(BaseException):
                await self.start_task
        self._cancel_watchers()
        self._cancel(self.watch_task)
        await self._stop_follower()

    def _after_stop_hook(self) -> None:
        self.ctx.idle_logs.idle(self.id, self.ring)
        try:
            self.backend().after_stop(
                self.instance.config, self.ctx.settings.sglang_prompt_cache_dir, self.id
            )
        except Exception:
            log.exception("after-stop hook of %s failed", self.id)

    # --- re-adoption -----------------------------------------------------------------------------

    async def adopt(
        self,
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
        rec = self.stored.process
        proc: procs.BackendProcess | None = None
        recorded = False  # the recorded process itself (not a marker carrier found without it)
        if rec is not None:
            proc, why = await asyncio.to_thread(
                adoption.recorded_process, rec, self.ctx.marker(self.id)
            )
            recorded = proc is not None
            if proc is None:
                log.info("recorded backend pid %s of %s is not adopted: %s", rec.pid, self.id, why)
            else:
                fixed = await asyncio.to_thread(adoption.port_as_spawned, proc, rec, self.id)
                if fixed is not rec:
                    self.stored.process = rec = fixed
        inst = self.instance
        # What the records say was going on; a backend found without a record was starting.
        status = inst.status
        carrying = (ours or {}).get(self.id)
        if proc is None and self.stored.want_running and carrying:
            found = await asyncio.to_thread(
                adoption.unrecorded_process,
                rec,
                carrying,
                listening,
                marker=self.ctx.marker(self.id),
                configured_port=inst.config.port,
                log_dir=Path(self.ctx.settings.log_dir),
                instance_id=self.id,
            )
            if found is not None:
                proc, rec = found
                self.stored.process = rec
                if status not in (S.RUNNING, S.STARTING):
                    status = S.STARTING
                log.warning(
                    "re-adopted backend pid %s of %s on port %s by its marker: config.json "
                    "did not record it (a host killed right after the spawn, or a restored "
                    "older copy)",
                    proc.pid,
                    self.id,
                    rec.port,
                )
        if proc is None or rec is None:
            if rec is not None:
                left = await adoption.end_remains(rec, self.id)
                if left:
                    self.stored.instance.error_message = "; ".join(left)
            self.stored.process = None
            return "gone"
        self.proc = proc
        self.ctx.ports.claim_adopted(rec.port)
        if status in (S.STOPPING, S.STOPPED, S.FAILED) or not self.stored.want_running:
            # The operator's last word was a stop (or a restart, whose stop comes first).
            self.set_status(
                S.STOPPING, reason="finishing stop", recovery=True, pid=proc.pid, port=rec.port
            )
            # Its own task, not a start: a start asked for meanwhile waits for it, then starts.
            self.stop_task = asyncio.create_task(self._finish_stop(), name=f"stop:{self.id}")
            return "stopping"
        listening_ours = await asyncio.to_thread(
            ownership.owns_port, proc.identity, rec.port, proc.marker, listening
        )
        backend = self.backend()
        config = inst.config
        fields: dict[str, Any] = {
            "pid": proc.pid,
            "port": rec.port,
            "supported_endpoints": backend.supported_endpoints(config),
            "served_model_name": backend.served_model_name(config),
        }
        if status == S.RUNNING and listening_ours:
            self.set_status(
                S.RUNNING,
                reason="adopted",
                recovery=True,
                started_at=inst.started_at or datetime.now(UTC),
                **fields,
            )
            self._watch(proc)
            self._adopt_task = asyncio.create_task(
                self._attach_adopted(proc, rec, loading=False), name=f"adopt:{self.id}"
            )
            log.info("re-adopted backend pid %s of %s on port %s", proc.pid, self.id, rec.port)
            return "running"
        # Still loading (or not listening yet): awaited in the background under the deadline
        # of the start that spawned it, never killed and loaded again. One that was running
        # was ready already: it gets a moment to show its socket, then it is a crash.
        was_ready = recorded and status == S.RUNNING
        self.set_status(S.STARTING, reason="adopted", recovery=True, started_at=None, **fields)
        self._ready = asyncio.Event()
        # Held before boot starts anything else, as the start that spawned it held it.
        await hold_adopted(self)
        self.start_task = asyncio.create_task(
            self._adopted_loading(proc, rec, was_ready=was_ready), name=f"adopt:{self.id}"
        )
        # Its failure is logged where it fails and answered to a start that joined it: not
        # asyncio's "exception was never retrieved" traceback when none did.
        self.start_task.add_done_callback(_retrieved)
        log.info(
            "re-adopted backend pid %s of %s on port %s, still loading", proc.pid, self.id, rec.port
        )
        return "starting"

    async def _adopted_loading(
        self, proc: procs.BackendProcess, rec: ProcessRecord, *, was_ready: bool = False
    ) -> Any:
        try:
            return await self._attach_adopted(proc, rec, loading=True, was_ready=was_ready)
        finally:
            end_start(self)  # its memory is in the probe's figures from now on, or gone

    async def _attach_adopted(
        self,
        proc: procs.BackendProcess,
        rec: ProcessRecord,
        *,
        loading: bool,
        was_ready: bool = False,
    ) -> Any:
        """Background half of an adoption: follow the log, then await readiness (loading) or
        check health once (running; a slow answer is logged, never a reason to replace it)."""
        backend = self.backend()
        config = self.instance.config
        if not loading:
            await asyncio.to_thread(procs.note_listener, proc, rec.port)
        else:
            proc.port = rec.port
        log_path = Path(rec.log_file) if rec.log_file else None
        if log_path is not None:
            # Continue the log where it is: seq = the attempt's base + lines already in the file.
            lines, size = await asyncio.to_thread(count_lines, log_path)
            tail = await asyncio.to_thread(tail_lines, log_path, self.ctx.settings.log_buffer_size)
            self.ring.rebase(rec.seq_base + lines - len(tail))
            redact = self._redactor()
            self.ring.append_many([redact(line) for line in tail], datetime.now(UTC).isoformat())
            self.telemetry.reset(backend.new_parser(config))
            self._follow(log_path, offset=size, ready_check=backend if loading else None)
            if self._ready is not None and any(backend.is_ready_line(ln) for ln in tail):
                self._ready.set()
            if self.follower is not None and not loading:
                self.follower.hot_polling = True
        if not loading:
            if backend.health_path and not await is_healthy(
                probe_address(config.host), rec.port, backend.health_path, self._bearer(), 10.0
            ):
                log.warning(
                    "re-adopted backend pid %s of %s does not answer %s yet",
                    proc.pid,
                    self.id,
                    backend.health_path,
                )
            return self.instance
        return await self._await_adopted_ready(proc, rec, was_ready=was_ready)

    async def _await_adopted_ready(
        self, proc: procs.BackendProcess, rec: ProcessRecord, *, was_ready: bool = False
    ) -> Any:
        settings = self.ctx.settings
        # The start that spawned it had START_DEADLINE_S in all, counted from its spawn: this
        # wait and the retries after it share what is left (monotonic from here on).
        age = await asyncio.to_thread(adoption.backend_age_s, proc, rec)
        deadline = time.monotonic() + settings.start_deadline_s - age
        # A few seconds at least, so a backend that became ready while the host was down is
        # still seen as ready.
        timeout = max(deadline - time.monotonic(), 5.0)
        if was_ready:
            # Not loading: the backend was ready before the host went away, so the deadline of
            # its start says nothing (it showed a process that exec'd something else, or
            # closed its socket, as "starting" for up to START_DEADLINE_S).
            timeout = ADOPTED_RELISTEN_S
        backend = self.backend()
        config = self.instance.config
        try:
            await self._wait_ready(proc, backend, config.host, rec.port, timeout)
        except AttemptFailed as err:
            log.warning("re-adopted backend of %s did not become ready: %s", self.id, err.reason)
            if proc.alive():
                await procs.terminate(proc, min(settings.stop_grace_s, 5.0))
            await self._stop_follower()
            self.proc = None
            self.stored.process = None
            self.ctx.ports.release(rec.port)
            if was_ready:
                await self._adopted_crashed(proc, rec, err)
                raise StartFailed(
                    self.id, self.instance.error_message or err.reason, None, self._tail()
                ) from None
            # The start that spawned it had retries left: they are this adoption's, within
            # that start's deadline, as if the host had never restarted.
            retry = (
                err.retryable
                and settings.max_retries > 0
                and deadline > time.monotonic()
                and self.stored.want_running
                and not self.deleted
            )
            self.set_status(
                S.FAILED,
                reason="start_failed",
                error_message=err.reason,
                pid=None,
                port=None,
                started_at=None,
            )
            self.stored.restart_due = retry  # on disk with the failure: a kill now loses no retry
            await self.ctx.persist()
            self._after_stop_hook()
            if retry:
                log.info(
                    "starting %s again: %d attempt(s) of the start it was in remain",
                    self.id,
                    settings.max_retries,
                )
                return await self._start(attempts=settings.max_retries, deadline=deadline)
            self.counters["start_failures"] += 1
            raise StartFailed(
                self.id, err.reason, err.exit_code, self._tail(), retryable=err.retryable
            ) from None
        if self.follower is not None:
            self.follower.hot_polling = True
        self.set_status(S.RUNNING, reason="ready", started_at=datetime.now(UTC), error_message=None)
        self.stored.restart_due = False  # the start it was in has ended
        self.ctx.persist_soon()
        self._watch(proc)
        return self.instance

    async def _adopted_crashed(
        self, proc: procs.BackendProcess, rec: ProcessRecord, err: AttemptFailed
    ) -> None:
        """A backend that was running when the host went away, re-adopted, and no longer
        serving its port (ended already): a crash, under the restart policy as any other,
        never a start that failed (which nothing restarts)."""
        self.counters["crashes"] += 1
        reason = (
            f"Process stopped serving port {rec.port} while the host was away ({err.reason}); "
            "it was ended"
        )
        await self._record_crash(proc, reason, None)

    async def _record_stopped(self, left_behind: list[str] | None = None) -> None:
        """The backend is gone: forget its process and port, and say so on disk. What of it
        the stop could not end (`left_behind`) is the instance's message."""
        self.proc = None
        self.stored.process = None
        self.stored.restart_due = False  # stopped: boot starts it if it is still wanted
        self.ctx.ports.release(self.instance.port)
        message = {"error_message": "stopped, but " + "; ".join(left_behind)} if left_behind else {}
        self.set_status(
            S.STOPPED, reason="stopped", pid=None, port=None, started_at=None, **message
        )
        await self.ctx.persist()

    async def _finish_stop(self) -> None:
        """A stop the previous host process did not finish: finish it, then start again only
        when the instance is still wanted (a restart whose stop was under way). Under the
        lock: a start, stop or restart asked for meanwhile comes after it (a start joins the
        start made here); a stop or restart that got the lock first did it (and cancels this)."""
        async with self.lock:
            if self.status != S.STOPPING or self.deleted:
                return
            proc = self.proc
            if proc is not None:
                await procs.terminate(proc, self.ctx.settings.stop_grace_s)
            await self._record_stopped()
            self._after_stop_hook()
            log.info("finished the stop of %s that was under way when the host stopped", self.id)
            if not self.stored.want_running:
                return
            # Not awaited here: a start asked for meanwhile waits for this task, then joins
            # that start (one deadline, one outcome), as concurrent starts share one launch.
            await self._begin_start()  # wanted, so on disk already: nothing to write
            assert self.start_task is not None
            self.start_task.add_done_callback(self._start_ended_unheard)

    def _start_ended_unheard(self, task: asyncio.Task[Any]) -> None:
        """A start no caller awaits (after a stop finished at boot): its failure is logged."""
        if task.cancelled():
            return
        err = task.exception()
        if isinstance(err, StartFailed | InstanceConflict | InstanceNotFound):
            log.warning("start of %s after its unfinished stop failed: %s", self.id, err)
        elif err is not None:
            log.error("start of %s after its unfinished stop failed", self.id, exc_info=err)

    async def kill_recorded(self) -> None:
        """Delete path: make sure no backend of this instance survives, workers included."""
        proc, _ = await asyncio.to_thread(
            adoption.recorded_process, self.stored.process, self.ctx.marker(self.id)
        )
        if proc is not None:
            await procs.terminate(proc, self.ctx.settings.stop_grace_s)
        self.stored.process = None
        strays = await asyncio.to_thread(ownership.carriers, self.ctx.marker(self.id))
        if strays:
            await procs.end_processes(strays, min(self.ctx.settings.stop_grace_s, 5.0))

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
from collections.abc import Awaitable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from solar_host.backends.base import Backend, LaunchSpec, alias_safe
from solar_host.estimates.hooks import admit_start, apply_placement, end_start
from solar_host.events import InstanceStartFinished, InstanceStartTimed
from solar_host.instances import adoption, crashes, flight, health, launch, ownership
from solar_host.instances import process as procs
from solar_host.instances.errors import (
    InstanceConflict,
    InstanceNotFound,
    NotPersisted,
    StartFailed,
)
from solar_host.instances.health import AttemptFailed
from solar_host.instances.httpcheck import probe_address
from solar_host.instances.intent import Intent
from solar_host.instances.lease import Lease, LineSink
from solar_host.instances.logs import LogFollower, LogRing, new_log_path
from solar_host.instances.restarts import CrashLoop, RestartPolicy
from solar_host.instances.states import InstanceStatus, check_transition
from solar_host.instances.store import StoredInstance
from solar_host.instances.telemetry import Telemetry
from solar_host.platform.logging_setup import Redactor, instance_id_var

if TYPE_CHECKING:
    from solar_host.instances.context import SupervisorContext

log = logging.getLogger(__name__)
S = InstanceStatus


class Supervisor:
    def __init__(self, ctx: SupervisorContext, stored: StoredInstance):
        self.ctx = ctx
        self.stored = stored
        self.id = stored.instance.id
        settings = ctx.settings
        self.ring = LogRing(settings.log_buffer_size)
        self.telemetry = Telemetry(self.id, ctx.bus, settings.log_buffer_size)
        # The live backend, with its port, log follower and watchers (None: nothing runs).
        self.lease: Lease | None = None
        self.lock = asyncio.Lock()
        self.start_task: asyncio.Task[Any] | None = None
        self.restart_task: asyncio.Task[None] | None = None
        # Why the host ended a running backend itself (it stopped answering): the crash's reason.
        self.ended_why: str | None = None
        self.crashes = CrashLoop(RestartPolicy.of(ctx.settings))
        # The failure a scheduled restart follows, without the "restarting in" note.
        self.crash_reason: str | None = None
        self.counters = {"starts": 0, "start_failures": 0, "restarts": 0, "crashes": 0}
        self.ready: asyncio.Event | None = None
        self._backend: Backend | None = None
        self.deleted = False
        self.adopt_task: asyncio.Task[Any] | None = None
        # The stop the previous host process left unfinished (adopt); never a start_task.
        self.stop_task: asyncio.Task[Any] | None = None
        # The start task a restart made: a restart arriving while it runs joins it.
        self._restart_start: asyncio.Task[Any] | None = None
        # Set by detach(): an interrupted start leaves its backend to the next host process.
        self._detaching = False
        self.attempt_spawned_at: datetime | None = None  # for a failed attempt's flight record
        self.intent = Intent(stored, lambda: ctx.persist_or_raise())

    # --- snapshots -------------------------------------------------------------------------------

    @property
    def instance(self) -> Any:
        return self.stored.instance

    @property
    def status(self) -> InstanceStatus:
        return self.stored.instance.status

    @property
    def proc(self) -> procs.BackendProcess | None:
        return self.lease.proc if self.lease is not None else None

    @property
    def follower(self) -> LogFollower | None:
        return self.lease.follower if self.lease is not None else None

    @property
    def watch_task(self) -> asyncio.Task[None] | None:
        return self.lease.watch_task if self.lease is not None else None

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
                        await self.begin_start()
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

    async def begin_start(
        self, *, undo_intent: bool | None = None, restart_op: bool = False
    ) -> None:
        """Under the lock: make the start task. Its intent is saved while its fit check runs
        and is on disk before it goes further (507 otherwise, nothing done; intent.py)."""
        await self.intent.settled()
        recorded = not self.intent.wanted
        if recorded:
            self.intent.record_soon(f"intent:{self.id}")
        if self.restart_task is not None:
            self.restart_task.cancel()
            self.restart_task = None
        # Someone asked for this start: the crash loop before it is over, and a crash after it
        # gets the whole restart budget again (as supervisord's start does).
        self.crashes.clear()
        undo = recorded if undo_intent is None else undo_intent
        self.start_task = asyncio.create_task(
            self.run_start(undo_intent=undo), name=f"start:{self.id}"
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
                await self.intent.settled()
                recorded = not self.intent.wanted
                if recorded:
                    await self.intent.record(True)
                if await self._stop_locked(forget_intent=False):
                    self.after_stop_hook()
                    self.ctx.prune_logs_soon()
                await self.begin_start(undo_intent=recorded, restart_op=True)
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

    async def run_start(
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
        claim: asyncio.Task[int] | None = self._claim_port()  # while the fit check runs
        try:
            await self._admit(undo_intent, restart)
        except BaseException:
            await launch.drop_claim(claim, self.ctx.ports)
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
                first, claim = claim, None  # its port, claimed already
                timeout = min(settings.instance_ready_timeout_s, remaining)
                try:
                    await self._attempt(attempt, timeout, first)
                except AttemptFailed as err:
                    last = err
                    if await self._attempt_failed(err, attempt, attempts, deadline, restart):
                        continue
                    break
                if self.stored.restart_due:
                    # It serves: nothing is due. Not awaited, as the ready state's own save.
                    self.stored.restart_due = False
                    self.ctx.persist_soon()
                self.counters["starts"] += 1
                self.ctx.bus.publish(InstanceStartFinished(self.id, True, restart))
                return self.reached()
            await self._out_of_attempts(last, restart)
        except Exception:
            # Out of attempts or time, or ended by what no attempt retries (a port taken, a
            # failed write): it stays as it is. Whether a failed crash restart is tried again
            # is the restart loop's decision (_restart_after). A cancel (a stop, a hand-over)
            # is not an end: the stop decides, and a hand-over leaves what is due on disk.
            if not restart:
                await self.nothing_due()
            raise
        finally:
            if claim is not None:  # out of time before the first attempt
                await launch.drop_claim(claim, self.ctx.ports)
            end_start(self)
            instance_id_var.reset(token)

    async def _admit(self, undo_intent: bool, restart: bool) -> None:
        """The fit check and placement (409 before anything is spawned), then the start's
        intent on disk (507, rather than a 409, when its save failed; nothing of it is left)."""
        placed = self.instance.placed_devices
        try:
            try:
                await admit_start(self)
            except Exception:
                await self.intent.on_disk()
                raise
            await self.intent.on_disk()
        except NotPersisted:
            self.instance.placed_devices = placed
            end_start(self)  # its hold goes too
            raise
        except Exception:
            if undo_intent:
                self.stored.want_running = False
                await self.ctx.persist()
            if not restart:
                await self.nothing_due()
            raise

    def _claim_port(self) -> asyncio.Task[int]:
        """An attempt's port (launch.reserve_port), claimed in a task of its own."""
        ctx, kept = self.ctx, self.ctx.ports_kept_by_others(self.id)
        claim = launch.reserve_port(ctx.ports, self.instance.config, self.stored.last_port, kept)
        return asyncio.ensure_future(claim)

    async def _attempt_failed(
        self, err: AttemptFailed, attempt: int, attempts: int, deadline: float, restart: bool
    ) -> bool:
        """Record a failed attempt, with what comes next; True after the pause before the next
        attempt, False when this start ends here."""
        log.warning("start attempt %d of %s failed: %s", attempt + 1, self.id, err.reason)
        led = await flight.attempt_failed(self, err, attempt + 1, self.attempt_spawned_at)
        # What failed now often clears in a moment (a port or GPU memory that the crashed
        # process still held): pause before the next attempt, doubling.
        pause = self.crashes.policy.attempt_pause(attempt, deadline - time.monotonic())
        again = err.retryable and attempt + 1 < attempts and deadline > time.monotonic()
        # What comes next is said with the failure ("failed" alone reads as final).
        due = f"; next attempt in {pause:.1f}s ({attempt + 2} of {attempts})"
        self.set_status(
            S.FAILED,
            reason="start_failed",
            error_message=led + (due if again else ""),
            retry_count=attempt + 1,
            pid=None,
            port=None,
            started_at=None,
        )
        if again or not restart:
            # On disk with the failure: a host killed or handed over in the pause starts it at
            # boot instead of leaving it failed; after the last attempt, nothing is due (a
            # crash restart's: see _restart_after).
            self.stored.restart_due = again
        await self.ctx.persist()
        if not err.retryable:
            return False
        if again and pause > 0:
            await asyncio.sleep(pause)
        return True

    async def _out_of_attempts(self, last: AttemptFailed | None, restart: bool) -> NoReturn:
        """The start ends failed: out of attempts or time, or refused for good."""
        reason = (
            last.reason
            if last
            else f"start deadline of {self.ctx.settings.start_deadline_s:.0f}s exceeded"
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
            self.tail(),
            retryable=last.retryable if last else True,
        )

    async def nothing_due(self) -> None:
        """No restart or retry is due any more (see StoredInstance.restart_due): on disk."""
        if self.stored.restart_due:
            self.stored.restart_due = False
            await self.ctx.persist()

    def tail(self) -> list[str]:
        n = self.ctx.settings.start_failure_log_tail_lines
        return [e.line for e in self.ring.tail(n)]

    def bearer(self) -> str:
        return self.ctx.api_key()

    async def _attempt(self, attempt: int, timeout: float, claim: asyncio.Task[int] | None) -> None:
        """One attempt of a start: port (`claim`), checks, spawn, readiness (or AttemptFailed)."""
        settings = self.ctx.settings
        self.ctx.idle_logs.busy(self.id)
        config = self.instance.config
        backend = self.backend()
        self.attempt_spawned_at = None
        try:
            port = await (claim or self._claim_port())
        except InstanceConflict as err:  # not retried: said in its flight record, then 409
            await flight.refused(self, err.detail, attempt + 1)
            raise
        if self.stored.last_port != port:
            self.stored.last_port = port  # saved with the process record, before the spawn
        facts = self.ctx.facts()
        api_key = self.ctx.api_key()
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
        key_hash = self.ctx.key_hash(api_key)
        spawn_id = ownership.new_spawn_id()
        ids = dict(marker=self.ctx.marker(self.id), port=port, key_hash=key_hash, spawn_id=spawn_id)
        where = launch.launch_context(settings, self.id, port, api_key, facts)
        if self.deleted:
            self.ctx.ports.release(port)
            raise AttemptFailed("the instance was deleted", None, retryable=False)
        log_path = new_log_path(settings.log_dir, alias_safe(config.alias), self.id)
        self.telemetry.reset(backend.new_parser(config))
        spawned_at = time.monotonic()
        try:
            proc = await launch.spawn(
                backend, config, where, settings, facts, log_path, ids, adjust=self._place
            )
        except AttemptFailed as err:
            self.ctx.ports.release(port)
            if isinstance(err, launch.Unprepared):
                self.after_stop_hook()
            await flight.log_unspawned(self, err.reason)
            raise
        self.attempt_spawned_at = datetime.now(UTC)
        self.lease = Lease(proc, port, self.ctx.ports)
        proc.port = port
        self.stored.process = launch.process_record(
            proc,
            port=port,
            key_hash=key_hash,
            spawn_id=spawn_id,
            log_path=log_path,
            seq_base=self.ring.next_seq,
        )
        await self._until_ready(proc, backend, config, port, timeout, spawned_at, log_path)

    def _place(self, spec: LaunchSpec) -> None:
        apply_placement(self, spec)  # in the spawning thread (launch.spawn)

    async def _until_ready(
        self,
        proc: procs.BackendProcess,
        backend: Backend,
        config: Any,
        port: int,
        timeout: float,
        spawned_at: float,
        log_path: Path,
    ) -> None:
        """A spawned backend, from its record on disk to running (or torn down)."""
        self.ready = asyncio.Event()
        self.follow(log_path, offset=0, ready_check=backend)
        try:
            # The process record is on disk before the pid is shown or awaited: a host killed
            # from here on finds the backend at boot by its record (the backend loads its model
            # meanwhile, so this costs no time). Killed before, it finds it by its marker.
            await self.ctx.persist()
            self.set_status(S.STARTING, reason="spawned", pid=proc.pid)
            await self.wait_ready(proc, backend, config.host, port, timeout)
        except asyncio.CancelledError:
            if not self._detaching:
                await self._teardown_attempt(proc)
            raise
        except BaseException:
            await self._teardown_attempt(proc)
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
        # Not awaited here (nobody waits on a crash restart; the process record was saved at
        # spawn): an operator's start or restart awaits it before answering (manager.start).
        self.ctx.persist_soon()
        self.ctx.bus.publish(
            InstanceStartTimed(
                self.id,
                config.backend_type,
                (first - spawned_at) if first else None,
                now - spawned_at,
            )
        )
        self.watch(proc)

    async def _teardown_attempt(self, proc: procs.BackendProcess) -> None:
        await procs.terminate(proc, min(self.ctx.settings.stop_grace_s, 5.0))
        await self.release()
        self.after_stop_hook()  # e.g. a failed SGLang attempt leaves no prompt cache behind

    # --- logs ------------------------------------------------------------------------------------

    def redactor(self) -> Redactor:
        return self.ctx.backend_redactor(self.instance.config.api_key)

    def follow(self, path: Path, offset: int, ready_check: Backend | None) -> None:
        """Follow the backend's log from `offset`: its lines into the ring, the bus and the
        telemetry; a ready line (of `ready_check`) sets the start's ready event."""
        assert self.lease is not None
        self.lease.follow_log(
            path,
            offset,
            LineSink(
                self.ring,
                self.ctx.bus,
                self.id,
                self.telemetry,
                self.redactor(),
                ready_check,
                lambda: self.ready,
            ),
            self.ctx.inotify,
            self.ctx.settings,
            on_rotate=self._rotated,
        )

    def _rotated(self, lines_moved: int) -> None:
        """The log file was rotated: re-adoption counts lines from a higher base now."""
        rec = self.stored.process
        if rec is not None:
            rec.seq_base += lines_moved
            self.ctx.persist_soon()

    async def release(self) -> None:
        """Give back the lease on the backend, whatever ended it (the caller ended the process
        or found it gone): its watchers stop, the rest of its log is read, its record and its
        port go. The one teardown of a backend."""
        lease = self.lease
        if lease is not None:
            await lease.stop_watching()
        self.lease = None
        self.stored.process = None
        if lease is not None:
            lease.release_port()

    # --- running ---------------------------------------------------------------------------------

    def wait_ready(
        self, proc: procs.BackendProcess, backend: Backend, host: str, port: int, timeout: float
    ) -> Awaitable[None]:
        assert self.ready is not None
        return health.wait_ready(
            proc,
            backend,
            probe_address(host),
            port,
            timeout,
            ready=self.ready,
            pacer=self.ctx.probe_pacer,
            bearer=self.bearer(),
            follower=self.follower,
        )

    def watch(self, proc: procs.BackendProcess) -> None:
        """Watch a backend that serves: its exit, its liveness, its /metrics (crashes.watch)."""
        crashes.watch(self, proc)

    async def record_crash(self, proc: procs.BackendProcess, reason: str, code: int | None) -> None:
        await crashes.record_crash(self, proc, reason, code)

    # --- stop ------------------------------------------------------------------------------------

    @staticmethod
    def _cancel(task: asyncio.Task[Any] | None) -> None:
        if task is not None and not task.done():
            task.cancel()

    async def stop(self, *, forget_intent: bool = True) -> Any:
        """Stop the backend (idempotent). `forget_intent=False` is a host shutdown: the
        instance is remembered as wanted, so the next boot starts it again."""
        async with self.lock:
            if self.deleted:  # a delete held the lock while this stop waited for it
                raise InstanceNotFound(self.id)
            stopped = await self._stop_locked(forget_intent=forget_intent)
        if stopped:
            self.after_stop_hook()
            self.ctx.prune_logs_soon()
        return self.instance

    async def _stop_locked(self, *, forget_intent: bool) -> bool:
        """The stop, under the lock (stop, restart). True when a backend was stopped: the
        caller then runs the after-stop hook and prunes the logs."""
        await self.intent.settled()  # a start's save of it
        if forget_intent and self.intent.wanted:
            # A stop the next boot would undo (it starts what config.json says is wanted)
            # is refused with 507, and the backend keeps serving.
            await self.intent.record(False)
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
        self._cancel(self.adopt_task)
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
            self.after_stop_hook()
            await self.ctx.persist()
            return False
        proc = self.proc
        self.set_status(S.STOPPING, reason="stopping")
        # What is wanted is on disk before any signal: a host that dies mid-stop finishes
        # the stop at boot (and starts it again only when it is still wanted).
        await self.ctx.persist()
        if self.lease is not None:
            self.lease.stop_watchers()  # its exit is no crash; its last lines are read after
        left: list[str] = []
        if proc is not None:
            await procs.terminate(proc, self.ctx.settings.stop_grace_s)
            left = proc.left_behind
            if proc.killed_after_s is not None:
                # Said where the operator looks: a backend that needs SIGKILL loses what it
                # would have done on SIGTERM (flushing a cache, closing its requests).
                left = [f"it ignored SIGTERM for {proc.killed_after_s:g}s and was killed", *left]
        await self.release()
        await self.record_stopped(left)
        return True

    async def detach(self) -> None:
        """Host shutdown with KEEP_BACKENDS_ON_SHUTDOWN: leave the backend serving (one still
        loading too: the next host process adopts it and awaits its readiness)."""
        self._detaching = True
        self._cancel(self.restart_task)
        self._cancel(self.adopt_task)
        self._cancel(self.stop_task)  # the next host process finishes it, as this one would
        if self.start_task is not None and not self.start_task.done():
            self.start_task.cancel()
            with contextlib.suppress(BaseException):
                await self.start_task
        if self.lease is not None:
            await self.lease.stop_watching()  # it keeps serving: the next host adopts it

    def after_stop_hook(self) -> None:
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
        """Take back what the previous host process left running (adoption.adopt)."""
        return await adoption.adopt(self, listening, ours)

    async def record_stopped(self, left_behind: list[str] | None = None) -> None:
        """The backend is gone: forget its process and port, and say so on disk. What of it
        the stop could not end (`left_behind`) is the instance's message."""
        await self.release()
        # A start cancelled between claiming its port and spawning holds it without a lease.
        self.ctx.ports.release(self.instance.port)
        self.stored.restart_due = False  # stopped: boot starts it if it is still wanted
        message = {"error_message": "stopped, but " + "; ".join(left_behind)} if left_behind else {}
        self.set_status(
            S.STOPPED, reason="stopped", pid=None, port=None, started_at=None, **message
        )
        await self.ctx.persist()

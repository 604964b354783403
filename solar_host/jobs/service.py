"""JobService: submit, inspect, cancel and retain containerised multi-step jobs.

The host starts without Docker: `available` is False and submissions get 503 until a daemon
answers; the service re-checks lazily (on submit / list) and every few seconds in the
background, so a daemon started later is picked up without a host restart.

Host shutdown: running jobs cannot be resumed by a new host process (their log streams and
waits die with this one), so `stop()` stops their containers with a short grace, marks the jobs
failed ("Host shut down while the job was running") and publishes job_failed. A host that
crashed instead finds them running in jobs_store.json at start-up: they are marked failed
("Host restarted while the job was running") and their leftover containers removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from solar_host.events import EventBus, utc_now
from solar_host.jobs.docker import DaemonUnavailableError, DockerJobs
from solar_host.jobs.executor import JobExecutor, required_disk_gb
from solar_host.jobs.schemas import (
    TERMINAL,
    JobDefinition,
    JobState,
    JobStatus,
    StepState,
)
from solar_host.jobs.step_logs import RECENT_LOGS, StepLogBuffer
from solar_host.jobs.steps import JobRun, StepRunner
from solar_host.jobs.store import STORE_FILE, JobStore
from solar_host.jobs.workspace import (
    check_disk,
    create_workspace,
    delete_workspace,
    step_log_path,
    workspace_path,
)
from solar_host.platform.threads import in_daemon_thread
from solar_host.resources.probes import SystemProbe
from solar_host.settings import Settings

log = logging.getLogger(__name__)

DOCKER_RECHECK_S = 5.0
SHUTDOWN_STOP_GRACE_S = 5
SHUTDOWN_WAIT_S = 15.0


class JobError(Exception):
    """Base of the errors the REST layer maps to status codes."""


class DockerUnavailable(JobError):
    pass


class JobExists(JobError):
    pass


class JobNotFound(JobError):
    pass


class JobFinished(JobError):
    def __init__(self, job_id: str, status: str) -> None:
        super().__init__(f"Job '{job_id}' is already in terminal state '{status}'")
        self.status = status


class JobNotPersisted(JobError):
    """The job store could not record the job (507): nothing was started."""


class GpuUnavailable(JobError):
    def __init__(self, detail: dict[str, Any]) -> None:
        super().__init__(detail["message"])
        self.detail = detail


def validate_gpus(job: JobDefinition, gpus: list[Any]) -> None:
    """Refuse GPU requests this host cannot satisfy (raises GpuUnavailable)."""
    known = {str(g.index) for g in gpus} | {g.uuid for g in gpus}
    for step in job.steps:
        gpu = step.gpu
        if gpu is None:
            continue
        base = {"error": "gpu_unavailable", "step": step.name, "available_count": len(gpus)}
        if gpu.device_ids is not None:
            unknown = [d for d in gpu.device_ids if d not in known]
            if unknown:
                raise GpuUnavailable(
                    {
                        **base,
                        "requested": gpu.device_ids,
                        "message": f"step '{step.name}': unknown GPU device id(s) {unknown}",
                    }
                )
        elif gpu.count == -1:
            if not gpus:
                raise GpuUnavailable(
                    {
                        **base,
                        "requested": -1,
                        "message": f"step '{step.name}': this host has no GPU",
                    }
                )
        elif gpu.count is not None and gpu.count > len(gpus):
            raise GpuUnavailable(
                {
                    **base,
                    "requested": gpu.count,
                    "message": f"step '{step.name}' requests {gpu.count} GPU(s), "
                    f"the host has {len(gpus)}",
                }
            )


class JobService:
    def __init__(
        self,
        settings: Settings,
        *,
        bus: EventBus,
        probe: SystemProbe,
        docker_factory: Callable[[], DockerJobs] | None = None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.probe = probe
        self.jobs_dir = Path(settings.jobs_dir).absolute()
        self.store = JobStore(self.jobs_dir / STORE_FILE)
        self.buffer = StepLogBuffer(bus, settings.log_buffer_size)
        self.executor = JobExecutor(
            settings,
            bus,
            self.store,
            StepRunner(settings, bus, self.store, self.buffer, probe),
            probe,
        )
        self._docker_factory = docker_factory or DockerJobs.connect
        self._docker: DockerJobs | None = None
        self._last_check = 0.0
        self._check_lock: asyncio.Lock | None = None
        self._runs: dict[str, JobRun] = {}
        self._submitting: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._leftovers_swept = False
        self._interrupted: list[str] | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def load_state(self) -> None:
        """Read the job store before any service starts (Host._load_state): a store that
        cannot be parsed stops the host instead of being replaced by the next submit."""
        self._interrupted = await asyncio.to_thread(self.store.load)

    async def start(self) -> None:
        # JOBS_DIR is created by the first submission, not here: a host that never runs a job
        # leaves no trace of it.
        interrupted, self._interrupted = self._interrupted, None
        if interrupted is None:
            interrupted = await asyncio.to_thread(self.store.load)
        await self.store.save_interrupted(interrupted)
        for job_id in interrupted:
            log.warning("job %s was running when the host stopped; marked failed", job_id)
        await self.ensure_docker(force=True)
        self._tasks = [
            asyncio.create_task(self._retention_loop(), name="jobs-retention"),
            asyncio.create_task(self._docker_watch_loop(), name="jobs-docker-watch"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        runs = list(self._runs.values())
        docker = self._docker
        for run in runs:
            run.shutdown = True
            run.cancel.set()
        if docker is not None:
            await asyncio.gather(
                *(
                    # Each stop in a thread of its own: a stop waits out its grace, and the
                    # shared executor's few workers are every to_thread caller's.
                    in_daemon_thread(
                        docker.stop, run.active_container, SHUTDOWN_STOP_GRACE_S, name="job-stop"
                    )
                    for run in runs
                    if run.active_container
                ),
                return_exceptions=True,
            )
        pending = [run.task for run in runs if run.task is not None and not run.task.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=SHUTDOWN_WAIT_S)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=2.0)
        await self.store.drain()  # the last states (cancelled, failed) on disk before exit
        if docker is not None:
            docker.close()
        self._docker = None

    # --- docker availability -----------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether a Docker daemon answered at the last check."""
        return self._docker is not None

    async def ensure_docker(self, force: bool = False) -> bool:
        """Connect (or confirm the connection), at most every DOCKER_RECHECK_S unless forced."""
        if self._check_lock is None:
            self._check_lock = asyncio.Lock()
        async with self._check_lock:
            now = time.monotonic()
            if not force and now - self._last_check < DOCKER_RECHECK_S:
                return self._docker is not None
            self._last_check = now
            if self._docker is not None:
                if await asyncio.to_thread(self._docker.ping):
                    return True
                log.warning("the Docker daemon stopped answering; job submissions get 503")
                self._docker.close()
                self._docker = None
            try:
                self._docker = await asyncio.to_thread(self._docker_factory)
            except DaemonUnavailableError as err:
                log.debug("%s", err)
                return False
            log.info("Docker daemon available for jobs")
            if not self._leftovers_swept:
                self._leftovers_swept = True
                n = await asyncio.to_thread(
                    self._docker.remove_leftovers, self.jobs_dir, set(self._runs)
                )
                if n:
                    log.info("removed %d leftover job container(s)", n)
            return True

    async def _docker_watch_loop(self) -> None:
        while True:
            await asyncio.sleep(DOCKER_RECHECK_S)
            try:
                if await self.ensure_docker():
                    await self._sweep_leftovers()
            except Exception:
                log.exception("Docker availability check failed")

    async def _sweep_leftovers(self) -> None:
        """Remove containers of this JOBS_DIR whose job is not running (a step whose `remove`
        failed, e.g. while the daemon restarted). `_runs` is passed live: a run is recorded
        before its container is created, so a container listed here has its run in it."""
        docker = self._docker
        if docker is None:
            return
        n = await asyncio.to_thread(docker.remove_leftovers, self.jobs_dir, self._runs)
        if n:
            log.info("removed %d leftover job container(s)", n)

    # --- queries -----------------------------------------------------------------------------

    def get(self, job_id: str) -> JobState | None:
        return self.store.get(job_id)

    def list(self) -> list[JobState]:
        return self.store.all()

    def is_running(self, job_id: str) -> bool:
        job = self.store.get(job_id)
        return job is not None and job.status == JobStatus.running

    def view(self, job: JobState, *, logs: bool = True) -> dict[str, Any]:
        """The JobStateResponse shape: state plus log_file and recent_logs per step
        (`logs=False`: recent_logs left empty, for the list of every job)."""
        data = job.model_dump(mode="json", exclude={"definition"})
        # Where the workspace is now: a store copied along with a moved JOBS_DIR still names
        # the old place.
        data["workspace_path"] = str(workspace_path(self.jobs_dir, job.job_id))
        data["steps"] = [self._step_view(job, s, logs) for s in job.steps]
        return data

    def _step_view(self, job: JobState, step: StepState, logs: bool) -> dict[str, Any]:
        data = step.model_dump(mode="json")
        data["log_file"] = str(step_log_path(self.jobs_dir, job.job_id, step.name))
        if not logs:
            data["recent_logs"] = []
            return data
        data["recent_logs"] = [
            {
                "seq": e["seq"],
                "timestamp": e["timestamp"],
                "stream": e["stream"],
                "line": e["line"],
                "completed": bool(e.get("completed", False)),
                "exit_code": e.get("exit_code"),
            }
            for e in self.buffer.recent(job.job_id, step.name, RECENT_LOGS)
        ]
        return data

    # Blocking helpers for the resources usage refresh: call them from a worker thread.

    def container_root_pid(self, job_id: str) -> int | None:
        run, docker = self._runs.get(job_id), self._docker
        if run is None or docker is None or not run.active_container:
            return None
        return docker.root_pid(run.active_container)

    def container_memory_bytes(self, job_id: str) -> int | None:
        run, docker = self._runs.get(job_id), self._docker
        if run is None or docker is None or not run.active_container:
            return None
        return docker.memory_bytes(run.active_container)

    # --- submit ------------------------------------------------------------------------------

    async def submit(self, job: JobDefinition) -> JobState:
        """Validate against this host, create the workspace, start the job task.

        Raises GpuUnavailable (400), DockerUnavailable (503), JobExists (409),
        InsufficientDiskError (507), JobNotPersisted (507), WorkspaceError (500); nothing is
        written before the checks pass, and nothing is left when the job cannot be recorded.
        """
        gpus = await asyncio.to_thread(self.probe.gpus) if any(s.gpu for s in job.steps) else []
        validate_gpus(job, gpus)
        if not await self.ensure_docker(force=True):
            raise DockerUnavailable("Docker daemon unavailable")
        docker = self._docker
        assert docker is not None
        job_id = job.job_id
        # `_runs`: a cancelled job whose task has not ended yet (its cancel timed out) still
        # owns the id; a new job under it would be rewritten by the old task.
        if job_id in self.store or job_id in self._submitting or job_id in self._runs:
            raise JobExists(f"Job '{job_id}' already exists")
        self._submitting.add(job_id)
        try:
            await asyncio.to_thread(
                check_disk, self.probe, self.jobs_dir, required_disk_gb(self.settings, job)
            )
            path = await asyncio.to_thread(
                create_workspace,
                self.jobs_dir,
                job,
                self.settings.container_uid,
                self.settings.container_gid,
            )
            now = utc_now()
            state = JobState(
                job_id=job_id,
                name=job.display_name,
                status=JobStatus.running,
                steps=[StepState(name=s.name) for s in job.steps],
                workspace_path=str(path),
                created_at=now,
                started_at=now,
                retention_hours=job.retention_hours,
                submission_id=job.submission_id,
                correlation_id=job.correlation_id,
                definition=job,
            )
            try:
                await self.store.add(state)
            except (OSError, ValueError, RecursionError) as err:
                # Nothing started: the workspace goes, the caller hears.
                await asyncio.to_thread(delete_workspace, self.jobs_dir, job_id)
                reason = getattr(err, "strerror", None) or str(err)
                raise JobNotPersisted(f"Cannot write the job store: {reason}") from None
        finally:
            self._submitting.discard(job_id)
        run = JobRun(job_id=job_id)
        self._runs[job_id] = run
        self.executor.publish_started(job_id)
        run.task = asyncio.create_task(self._run(docker, run, job), name=f"job-{job_id}")
        return state

    async def _run(self, docker: DockerJobs, run: JobRun, job: JobDefinition) -> None:
        try:
            await self.executor.run(docker, run, job)
        finally:
            if self._runs.get(job.job_id) is run:
                del self._runs[job.job_id]

    # --- cancel ------------------------------------------------------------------------------

    async def cancel(self, job_id: str) -> None:
        """Stop the job, wait for it (bounded), delete its workspace and forget it."""
        job = self.store.get(job_id)
        if job is None:
            raise JobNotFound(f"Job '{job_id}' not found")
        if job.status in TERMINAL:
            raise JobFinished(job_id, job.status.value)
        run = self._runs.get(job_id)
        if run is not None:
            run.cancel.set()
            docker = self._docker
            if run.active_container and docker is not None:
                await in_daemon_thread(docker.stop, run.active_container, 10, name="job-stop")
            if run.task is not None:
                try:
                    await asyncio.wait_for(
                        asyncio.shield(run.task), self.settings.job_cancel_wait_s
                    )
                except TimeoutError:
                    log.warning(
                        "job %s did not end within %.0f s of its cancel",
                        job_id,
                        self.settings.job_cancel_wait_s,
                    )
                    # Its end is recorded (and job_cancelled sent) now: the job is forgotten
                    # below, and a task ending later finds nothing to finish.
                    state = self.store.get(job_id)
                    if state is not None and state.definition is not None:
                        self.executor.finish(state.definition, run)
                    run.task.cancel()
                except Exception:
                    log.exception("job %s ended with an error while being cancelled", job_id)
        else:
            # No task (should not happen for a running job): record the cancel ourselves.
            self.store.update(job_id, status=JobStatus.cancelled, finished_at=utc_now())
        await self._forget(job_id)

    async def _forget(self, job_id: str) -> None:
        # JOBS_DIR/<id>, not the stored workspace_path (see delete_workspace).
        await asyncio.to_thread(delete_workspace, self.jobs_dir, job_id)
        self.buffer.remove(job_id)
        self.store.remove(job_id)

    # --- retention ---------------------------------------------------------------------------

    async def sweep_expired(self) -> int:
        """Forget finished jobs whose retention has passed; returns how many."""
        now = utc_now()

        def due(j: JobState) -> bool:
            if not j.terminal or j.job_id in self._runs or j.finished_at is None:
                return False
            try:
                return j.finished_at + timedelta(hours=j.retention_hours) <= now
            except (OverflowError, ValueError):  # a retention beyond the calendar: never
                return False

        expired = [j.job_id for j in self.store.all() if due(j)]
        for job_id in expired:
            log.info("job %s reached its retention; removing it and its workspace", job_id)
            await self._forget(job_id)
        return len(expired)

    async def _retention_loop(self) -> None:
        while True:
            try:
                await self.sweep_expired()
            except Exception:
                log.exception("job retention sweep failed")
            await asyncio.sleep(self.settings.job_cleanup_interval_s)

"""Running one step: container spec, environment, and the container's life from create to remove.

All store changes happen here on the loop thread, each followed at once by its lifecycle event,
so a consumer that sees `step_completed` and asks GET /jobs/{id} finds the step completed.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import os
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from solar_host.events import EventBus, JobLifecycle, utc_now
from solar_host.jobs.docker import (
    LABEL_JOB,
    LABEL_JOBS_DIR,
    LABEL_STEP,
    ContainerSpec,
    ContainerStartError,
    DaemonLostError,
    DockerJobs,
)
from solar_host.jobs.schemas import GpuRequest, JobDefinition, StepDefinition, StepStatus
from solar_host.jobs.step_logs import StepLogBuffer, loop_deliverer, pump_container_output
from solar_host.jobs.store import STORE_FILE, JobStore
from solar_host.jobs.workspace import step_log_path, workspace_path
from solar_host.platform.threads import in_daemon_thread
from solar_host.resources.probes import GB, SystemProbe
from solar_host.settings import Settings

log = logging.getLogger(__name__)

Outcome = Literal["completed", "failed", "cancelled"]

WORKSPACE = "/workspace"
HF_HOME_IN_CONTAINER = "/workspace/.cache/huggingface"
HF_HUB_CACHE_IN_CONTAINER = f"{HF_HOME_IN_CONTAINER}/hub"
STDERR_SUMMARY_LINES = 20
LOG_DRAIN_TIMEOUT_S = 5.0
STOP_GRACE_S = 10
SHUTDOWN_MESSAGE = "Host shut down while the job was running"
DISK_FLOOR_MESSAGE = "disk free below floor during step"
# How often a running step's disk use is checked (as pulls do, PULL_DISK_POLL_INTERVAL_S).
JOB_DISK_POLL_INTERVAL_S = 0.5
# Free space kept beyond the floor for the job store's own writes (plus twice its size).
STORE_HEADROOM_BYTES = 4 * 1024 * 1024


@dataclass
class JobRun:
    """Mutable run-time state of one running job (owned by the service, read by the step)."""

    job_id: str
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    shutdown: bool = False
    active_container: str | None = None
    task: asyncio.Task[None] | None = None


def default_hf_home(settings: Settings) -> Path:
    """The host's HF home: HF_CACHE_DIR, else $HF_HOME, else ~/.cache/huggingface."""
    if settings.hf_cache_dir is not None:
        return Path(settings.hf_cache_dir)
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"])
    return Path.home() / ".cache" / "huggingface"


def default_hf_cache(settings: Settings) -> Path:
    """The host's HF hub cache (models and datasets), the only part of the HF home a job sees.

    Not the HF home itself: it holds `token` and `stored_tokens` (`hf auth login`), which
    JOB_INJECT_SECRETS=false must keep from jobs, and which a job must never rewrite.
    HF_HUB_CACHE is honoured as huggingface_hub does, unless the operator chose HF_CACHE_DIR.
    """
    if settings.hf_cache_dir is None and os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return default_hf_home(settings) / "hub"


def nvidia_visible_devices(gpu: GpuRequest) -> str:
    """The devices Docker will give the container, in NVIDIA_VISIBLE_DEVICES form.

    Matches the DeviceRequest (Docker picks the first N indices for a count), so the variable
    never widens what the request grants.
    """
    if gpu.device_ids is not None:
        return ",".join(gpu.device_ids)
    if gpu.count is None or gpu.count < 0:
        return "all"
    return ",".join(str(i) for i in range(gpu.count))


def injected_secrets(settings: Settings) -> list[str]:
    """The secret values steps receive (ruling 14), and the forms tools print them in without
    being asked to: redacted from step logs. `curl -v -u user:pass` prints the Basic header,
    `cat ~/.docker/config.json` after `docker login` its base64 `auth`, and a registry URL
    carries the password percent-encoded. A step that encodes a secret on purpose still can."""
    if not settings.job_inject_secrets:
        return []
    values = [v for v in (settings.hf_token, settings.harbor_password) if v]
    forms = list(values)
    for value in values:
        forms.append(urllib.parse.quote(value, safe=""))
        forms.append(_base64(value))
    if settings.harbor_password:
        forms.append(_base64(f"{settings.harbor_username}:{settings.harbor_password}"))
    return list(dict.fromkeys(forms))


def _base64(text: str) -> str:
    """Unpadded: found whether or not the printed copy has its '=' padding."""
    return base64.b64encode(text.encode()).decode().rstrip("=")


def step_environment(
    settings: Settings, job: JobDefinition, step: StepDefinition, index: int
) -> dict[str, str]:
    env = {
        "JOB_ID": job.job_id,
        "WORKSPACE_MODELS": f"{WORKSPACE}/models",
        "WORKSPACE_DATA": f"{WORKSPACE}/data",
        "WORKSPACE_OUTPUT": f"{WORKSPACE}/output",
        "WORKSPACE_CONFIG": f"{WORKSPACE}/config",
        "JOB_CONFIG": f"{WORKSPACE}/config/job.json",
        "STEP_NAME": step.name,
        "STEP_INDEX": str(index),
        "HF_HOME": HF_HOME_IN_CONTAINER,
        "HF_HUB_CACHE": HF_HUB_CACHE_IN_CONTAINER,
    }
    if settings.job_inject_secrets:  # ruling 14: control's job images expect them
        env.update(
            {
                "HARBOR_URL": settings.harbor_url,
                "HARBOR_USERNAME": settings.harbor_username,
                "HARBOR_PASSWORD": settings.harbor_password,
                "HF_TOKEN": settings.hf_token,
            }
        )
    if step.gpu is not None:
        env["NVIDIA_VISIBLE_DEVICES"] = nvidia_visible_devices(step.gpu)
        env["NVIDIA_DRIVER_CAPABILITIES"] = "compute,utility"
    else:
        # CUDA images set NVIDIA_VISIBLE_DEVICES=all in their own environment: where nvidia is
        # the daemon's default runtime, that alone would give this step every GPU. "void" is
        # the NVIDIA Container Toolkit's "no GPU, no driver" (runc's behaviour).
        env["NVIDIA_VISIBLE_DEVICES"] = "void"
    env.update(step.environment)
    return env


def container_spec(
    settings: Settings, job: JobDefinition, step: StepDefinition, index: int
) -> ContainerSpec:
    root = workspace_path(settings.jobs_dir, job.job_id)
    inputs = "rw" if step.is_preparation_step else "ro"
    binds = {
        str(root / "models"): {"bind": f"{WORKSPACE}/models", "mode": inputs},
        str(root / "data"): {"bind": f"{WORKSPACE}/data", "mode": inputs},
        str(root / "output"): {"bind": f"{WORKSPACE}/output", "mode": "rw"},
        str(root / "config"): {"bind": f"{WORKSPACE}/config", "mode": "rw"},
        # HF_HOME is the job's own (what huggingface_hub writes beside the hub cache: a token
        # a step logs in with, xet and assets caches), removed with the workspace.
        str(root / "hf_home"): {"bind": HF_HOME_IN_CONTAINER, "mode": "rw"},
        # Only the host's hub cache, mounted over HF_HOME/hub, never the host's HF home (its
        # token). Read-only unless the step writes it (a preparation step, or hf_cache_write):
        # one job's training step must not rewrite the models other jobs and instances load.
        str(default_hf_cache(settings).absolute()): {
            "bind": HF_HUB_CACHE_IN_CONTAINER,
            "mode": "rw" if step.writes_hf_cache else "ro",
        },
    }
    return ContainerSpec(
        image=step.image,
        command=step.command,
        environment=step_environment(settings, job, step, index),
        binds=binds,
        name=f"solar-job-{job.job_id}-{step.name}",
        labels={
            LABEL_JOB: job.job_id,
            LABEL_STEP: step.name,
            LABEL_JOBS_DIR: str(Path(settings.jobs_dir).absolute()),
        },
        user=f"{settings.container_uid}:{settings.container_gid}",
        network_mode=settings.job_network_mode,
        gpu=step.gpu,
        pids_limit=settings.job_pids_limit or None,
        memory_bytes=(
            None
            if settings.job_memory_limit_gb is None
            else int(settings.job_memory_limit_gb * 1024**3)
        ),
    )


@dataclass(frozen=True)
class StopReason:
    """Why the host stopped a running step."""

    kind: Literal["timeout", "disk"]
    why: str


def step_disk_floor_gb(settings: Settings, job: JobDefinition) -> float:
    """Free space a running step must leave on JOBS_DIR's filesystem: the host's floor
    (MIN_FREE_DISK_GB), or the job's own min_free_disk_gb where lower. Not the job's value
    where higher: that is what the job needs free to start, and its steps are meant to use it."""
    floor = settings.min_free_disk_gb
    if job.min_free_disk_gb is not None:
        floor = min(floor, job.min_free_disk_gb)
    return floor


@dataclass(frozen=True)
class TimeLimit:
    seconds: float
    source: str  # what set it, for the step's error: "timeout_s" or "JOB_STEP_TIMEOUT_S"


def step_time_limit(settings: Settings, step: StepDefinition) -> TimeLimit | None:
    """The step's own timeout_s, capped by the operator's JOB_STEP_TIMEOUT_S (which is also the
    limit of steps that give none); None: the step runs until it ends."""
    ceiling = settings.job_step_timeout_s
    if step.timeout_s is not None and (ceiling is None or step.timeout_s <= ceiling):
        return TimeLimit(step.timeout_s, "timeout_s")
    if ceiling is not None:
        return TimeLimit(ceiling, "JOB_STEP_TIMEOUT_S")
    return None


def _iso(dt: Any) -> str:
    return dt.isoformat()


class StepRunner:
    """Runs the steps of jobs; one instance per service."""

    def __init__(
        self,
        settings: Settings,
        bus: EventBus,
        store: JobStore,
        buffer: StepLogBuffer,
        probe: SystemProbe,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.store = store
        self.buffer = buffer
        self.probe = probe

    def _publish(self, name: str, payload: dict[str, Any]) -> None:
        self.bus.publish(JobLifecycle(name, payload))

    def _step_payload(
        self, job_id: str, step: str, index: int, status: str, ts: Any
    ) -> dict[str, Any]:
        return {
            "job_id": job_id,
            "step_name": step,
            "step_index": index,
            "status": status,
            "timestamp": _iso(ts),
        }

    async def run(self, docker: DockerJobs, run: JobRun, job: JobDefinition, index: int) -> Outcome:
        step = job.steps[index]
        job_id = job.job_id
        started = utc_now()
        limit = step_time_limit(self.settings, step)
        self.store.update(job_id, current_step_index=index)
        self.store.update_step(
            job_id,
            index,
            status=StepStatus.running,
            started_at=started,
            time_limit_s=None if limit is None else limit.seconds,
        )
        self._publish(
            "step_started", self._step_payload(job_id, step.name, index, "running", started)
        )

        # The step's failure, with its exit code (None: no exit) and what to say.
        fail = functools.partial(self._failed, job_id, step.name, index, started)
        spec = container_spec(self.settings, job, step, index)
        container_id: str | None = None
        try:
            try:
                await asyncio.to_thread(
                    default_hf_cache(self.settings).mkdir, parents=True, exist_ok=True
                )
            except OSError as err:
                raise ContainerStartError(f"cannot create the HF cache directory: {err}") from err
            container_id = await asyncio.to_thread(docker.create, spec)
            run.active_container = container_id
            self.store.update_step(job_id, index, container_id=container_id)
            if run.cancel.is_set():
                return self._cancelled(job_id, step.name, index, started, None)
            stream = await asyncio.to_thread(docker.attach, container_id)
            pump = self._pump_logs(stream, job_id, step.name, index)
            await asyncio.to_thread(docker.start, container_id)
            if run.cancel.is_set():  # a cancel that raced the start: stop what we started
                await in_daemon_thread(docker.stop, container_id, STOP_GRACE_S, name="job-stop")
            try:
                exit_code, stopped = await self._wait(docker, job, container_id, limit)
            except Exception as err:  # the daemon went away (killed, restarted) mid-step
                lost = f"the connection to the Docker daemon was lost: {err}"
                raise DaemonLostError(lost) from err
            try:
                await asyncio.wait_for(asyncio.shield(pump), LOG_DRAIN_TIMEOUT_S)
            except TimeoutError:
                log.warning("job %s step %s: log stream did not end in time", job_id, step.name)
            except Exception as err:  # the logs are incomplete; the step's outcome stands
                log.warning("job %s step %s: step log incomplete: %s", job_id, step.name, err)
            if run.shutdown:  # the host stopped it: the step failed, as its job does
                return fail(exit_code, summary=SHUTDOWN_MESSAGE, job_message=SHUTDOWN_MESSAGE)
            if run.cancel.is_set():
                return self._cancelled(job_id, step.name, index, started, exit_code)
            if exit_code == 0 and stopped is None:
                return self._completed(job_id, step.name, index, started)
            summary, message = await self._explain_failure(
                docker, container_id, step.name, exit_code, stopped, limit
            )
            return fail(exit_code, summary=summary, job_message=message)
        except DaemonLostError as err:
            if run.cancel.is_set():
                return self._cancelled(job_id, step.name, index, started, None)
            return fail(None, summary=str(err), job_message=f"Step '{step.name}' failed: {err}")
        except ContainerStartError as err:
            return fail(
                None,
                summary=str(err),
                job_message=f"Step '{step.name}' container start failed: {err}",
            )
        finally:
            run.active_container = None
            if container_id is not None:
                await asyncio.to_thread(docker.remove, container_id)

    def _pump_logs(
        self,
        stream: Iterable[tuple[bytes | None, bytes | None]],
        job_id: str,
        name: str,
        index: int,
    ) -> asyncio.Future[None]:
        """Copy the container's output to the step's log file and the live buffer, in a thread
        of its own, redacting the injected secrets; done when the stream ends."""
        deliver = loop_deliverer(asyncio.get_running_loop(), self.buffer, job_id, name, index)
        return in_daemon_thread(
            functools.partial(
                pump_container_output,
                max_line_chars=self.settings.log_line_max_bytes,
                max_file_bytes=self.settings.log_file_max_bytes,
                generations=self.settings.log_file_generations,
                redact=injected_secrets(self.settings),
            ),
            stream,
            step_log_path(self.settings.jobs_dir, job_id, name),
            deliver,
            name=f"job-{job_id}-logs",
        )

    async def _explain_failure(
        self,
        docker: DockerJobs,
        container_id: str,
        name: str,
        exit_code: int,
        stopped: StopReason | None,
        limit: TimeLimit | None,
    ) -> tuple[str, str]:
        """The step's error summary (why, then its last stderr lines) and the job's message, for
        a step that exited non-zero or that the host stopped."""
        tail = await asyncio.to_thread(docker.stderr_tail, container_id, STDERR_SUMMARY_LINES)
        summary = "\n".join(tail)
        message = f"Step '{name}' failed with exit code {exit_code}"
        if stopped is not None and stopped.kind == "disk":
            message = f"Step '{name}' was stopped: {stopped.why} (exit code {exit_code})"
            summary = f"{stopped.why}\n{summary}".rstrip("\n")
        elif stopped is not None:
            assert limit is not None
            ran_past = (
                f"ran past its time limit of {limit.seconds:g} s ({limit.source}) and was stopped"
            )
            message = f"Step '{name}' {ran_past} (exit code {exit_code})"
            summary = f"timed out: the step {ran_past}\n{summary}".rstrip("\n")
        elif await asyncio.to_thread(docker.oom_killed, container_id):
            memory_gb = self.settings.job_memory_limit_gb
            why = (
                f"out of memory: the step reached JOB_MEMORY_LIMIT_GB ({memory_gb:g} GiB)"
                if memory_gb is not None
                else "out of memory: the machine ran out and the kernel killed the step"
            )
            message = f"{message} ({why})"
            summary = f"{why}\n{summary}".rstrip("\n")
        return summary, message

    async def _wait(
        self,
        docker: DockerJobs,
        job: JobDefinition,
        container_id: str,
        limit: TimeLimit | None,
    ) -> tuple[int, StopReason | None]:
        """The container's exit code, and why the host stopped it, if it did: it ran past
        `limit`, or JOBS_DIR's free space fell below the step's disk floor (SIGTERM, then
        SIGKILL after STOP_GRACE_S: the same stop a cancel gives)."""
        job_id = job.job_id
        waiter = in_daemon_thread(docker.wait, container_id, name=f"job-{job_id}-wait")
        try:
            reason = await self._watch(waiter, job, limit)
            if reason is None:
                return waiter.result(), None
            log.warning(
                "job %s: stopping step container %s: %s", job_id, container_id[:12], reason.why
            )
            # A thread of its own: the stop may wait out its whole grace (a step that ignores
            # SIGTERM), and a shared executor worker held that long made every submit, ping
            # and state write of the host wait behind it.
            await in_daemon_thread(docker.stop, container_id, STOP_GRACE_S, name="job-stop")
            return await waiter, reason
        finally:
            if not waiter.done():  # this task was cancelled (the host stopping)
                waiter.cancel()

    async def _watch(
        self, waiter: asyncio.Future[int], job: JobDefinition, limit: TimeLimit | None
    ) -> StopReason | None:
        """Wait for the container to exit, checking the disk every JOB_DISK_POLL_INTERVAL_S:
        the floor is checked before each step, but one step can fill the disk, and then
        every write of the job store fails (the job's true outcome is lost on a host kill)."""
        loop = asyncio.get_running_loop()
        deadline = None if limit is None else loop.time() + limit.seconds
        floor_gb = step_disk_floor_gb(self.settings, job)
        while True:
            wait_s = JOB_DISK_POLL_INTERVAL_S
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - loop.time()))
            # asyncio.wait, not wait_for: the waiter is never cancelled by a timeout here.
            done, _ = await asyncio.wait({waiter}, timeout=wait_s)
            if done:
                return None
            if limit is not None and deadline is not None and loop.time() >= deadline:
                why = f"ran past its time limit of {limit.seconds:g} s ({limit.source})"
                return StopReason("timeout", why)
            free = await asyncio.to_thread(self._free_bytes_below, floor_gb)
            if free is not None:
                return StopReason(
                    "disk",
                    f"{DISK_FLOOR_MESSAGE} ({free / GB:.2f} GB free on the filesystem of "
                    f"JOBS_DIR, floor {floor_gb:g} GB plus room for the job store)",
                )

    def _free_bytes_below(self, floor_gb: float) -> int | None:
        """Free bytes of JOBS_DIR's filesystem when below the floor (None: enough, or unknown).

        The floor keeps room for the job store's next atomic write (a new copy beside the old),
        so the step's failure can still be recorded."""
        jobs_dir = Path(self.settings.jobs_dir)
        usage = self.probe.disk(jobs_dir)
        if usage is None:
            return None
        try:
            store_bytes = (jobs_dir / STORE_FILE).stat().st_size
        except OSError:
            store_bytes = 0
        floor = int(floor_gb * GB) + 2 * store_bytes + STORE_HEADROOM_BYTES
        return usage.available_bytes if usage.available_bytes < floor else None

    # --- outcomes: one store change, then the marker and the event --------------------------

    def _completed(self, job_id: str, name: str, index: int, started: Any) -> Outcome:
        now = utc_now()
        duration = (now - started).total_seconds()
        self.store.update_step(
            job_id,
            index,
            status=StepStatus.completed,
            finished_at=now,
            duration_s=duration,
            exit_code=0,
        )
        self.buffer.mark_completed(job_id, name, index, 0)
        payload = self._step_payload(job_id, name, index, "completed", now)
        payload.update(duration_s=duration, exit_code=0)
        self._publish("step_completed", payload)
        return "completed"

    def _failed(
        self,
        job_id: str,
        name: str,
        index: int,
        started: Any,
        exit_code: int | None,
        *,
        summary: str,
        job_message: str,
    ) -> Outcome:
        now = utc_now()
        duration = (now - started).total_seconds()
        self.store.update_step(
            job_id,
            index,
            status=StepStatus.failed,
            finished_at=now,
            duration_s=duration,
            exit_code=exit_code,
            error_message=summary or job_message,
        )
        # The job's final status is written by the executor when the job ends (with
        # finished_at); the message is recorded now so GET shows why at once.
        self.store.update(job_id, error_message=job_message)
        self.buffer.mark_completed(job_id, name, index, exit_code)
        payload = self._step_payload(job_id, name, index, "failed", now)
        payload.update(
            duration_s=duration, exit_code=exit_code, error_summary=summary or job_message
        )
        self._publish("step_failed", payload)
        return "failed"

    def _cancelled(
        self, job_id: str, name: str, index: int, started: Any, exit_code: int | None
    ) -> Outcome:
        now = utc_now()
        self.store.update_step(
            job_id,
            index,
            status=StepStatus.cancelled,
            finished_at=now,
            duration_s=(now - started).total_seconds(),
            exit_code=exit_code,
            error_message="cancelled",
        )
        self.buffer.mark_completed(job_id, name, index, exit_code)
        return "cancelled"

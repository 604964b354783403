"""Running a whole job: its steps in order, then exactly one terminal status and event.

Terminal rules (reference section 13 item 21, fixed):
* cancel requested -> `cancelled`, whatever exit code `docker stop` produced;
* host shutting down -> `failed` ("Host shut down while the job was running");
* a step failed (or the disk ran short) -> `failed`, later steps `cancelled`;
* otherwise `completed`.
Every terminal job has finished_at, so retention always removes it.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

from solar_host.events import EventBus, JobLifecycle, utc_now
from solar_host.jobs.docker import DockerJobs
from solar_host.jobs.schemas import JobDefinition, JobStatus, StepStatus
from solar_host.jobs.steps import SHUTDOWN_MESSAGE, JobRun, Outcome, StepRunner
from solar_host.jobs.store import JobStore
from solar_host.jobs.workspace import InsufficientDiskError, check_disk
from solar_host.resources.probes import SystemProbe
from solar_host.settings import Settings

log = logging.getLogger(__name__)


def required_disk_gb(settings: Settings, job: JobDefinition) -> float:
    if job.min_free_disk_gb is not None:
        return job.min_free_disk_gb
    return settings.min_free_disk_gb


class JobExecutor:
    def __init__(
        self,
        settings: Settings,
        bus: EventBus,
        store: JobStore,
        steps: StepRunner,
        probe: SystemProbe,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.store = store
        self.steps = steps
        self.probe = probe

    def publish_started(self, job_id: str) -> None:
        job = self.store.get(job_id)
        assert job is not None
        self.bus.publish(
            JobLifecycle(
                "job_started",
                {
                    "job_id": job_id,
                    "name": job.name,
                    "status": "running",
                    "timestamp": (job.started_at or utc_now()).isoformat(),
                },
            )
        )

    async def run(self, docker: DockerJobs, run: JobRun, job: JobDefinition) -> None:
        """The job task's body; never raises (an unexpected error fails the job)."""
        failed_message: str | None = None
        try:
            for index in range(len(job.steps)):
                if run.cancel.is_set():
                    break
                try:
                    await asyncio.to_thread(
                        check_disk,
                        self.probe,
                        self.settings.jobs_dir,
                        required_disk_gb(self.settings, job),
                    )
                except InsufficientDiskError as err:
                    failed_message = self._fail_step_before_start(job, index, str(err))
                    break
                outcome: Outcome = await self.steps.run(docker, run, job, index)
                if outcome != "completed":
                    break
        except asyncio.CancelledError:
            self._finalise(job, run, f"{SHUTDOWN_MESSAGE} (job task cancelled)")
            raise
        except Exception as err:
            log.exception("job %s failed unexpectedly", job.job_id)
            failed_message = f"Internal error while running the job: {err}"
        self._finalise(job, run, failed_message)

    def _fail_step_before_start(self, job: JobDefinition, index: int, reason: str) -> str:
        now = utc_now()
        name = job.steps[index].name
        self.store.update_step(
            job.job_id, index, status=StepStatus.failed, finished_at=now, error_message=reason
        )
        self.bus.publish(
            JobLifecycle(
                "step_failed",
                {
                    "job_id": job.job_id,
                    "step_name": name,
                    "step_index": index,
                    "status": "failed",
                    "timestamp": now.isoformat(),
                    "duration_s": 0.0,
                    "exit_code": None,
                    "error_summary": reason,
                },
            )
        )
        return f"Step '{name}' could not start: {reason}"

    def finish(self, job: JobDefinition, run: JobRun) -> None:
        """Record the end of a job whose task has not ended (a cancel that waited long
        enough): its terminal state and event, once, as the task would have."""
        self._finalise(job, run, None)

    def _finalise(self, job: JobDefinition, run: JobRun, failed_message: str | None) -> None:
        state = self.store.get(job.job_id)
        if state is None or state.terminal:
            return
        now = utc_now()
        if run.shutdown:
            status, message = JobStatus.failed, SHUTDOWN_MESSAGE
        elif run.cancel.is_set():
            status, message = JobStatus.cancelled, state.error_message
        elif failed_message is not None:
            status, message = JobStatus.failed, failed_message
        elif any(s.status == StepStatus.failed for s in state.steps):
            status, message = JobStatus.failed, state.error_message or "A step failed"
        else:
            status, message = JobStatus.completed, None
        steps = []
        for s in state.steps:
            if s.status == StepStatus.running:  # interrupted by what ended the job
                interrupted = (
                    StepStatus.cancelled if status == JobStatus.cancelled else StepStatus.failed
                )
                s = s.model_copy(
                    update={"status": interrupted, "finished_at": now, "error_message": message}
                )
            elif s.status == StepStatus.pending:
                s = s.model_copy(update={"status": StepStatus.cancelled})
            steps.append(s)
        self.store.update(
            job.job_id, status=status, finished_at=now, error_message=message, steps=steps
        )
        payload: dict[str, Any] = {
            "job_id": job.job_id,
            "status": status.value,
            "timestamp": now.isoformat(),
        }
        if status == JobStatus.completed:
            payload["workspace_path"] = state.workspace_path
            payload["retention_deadline"] = (
                now + timedelta(hours=state.retention_hours)
            ).isoformat()
        elif status == JobStatus.failed:
            payload["error_message"] = message
        self.bus.publish(JobLifecycle(f"job_{status.value}", payload))

"""The job store: job states in memory, persisted to JOBS_DIR/jobs_store.json on every change.

Mutations happen on the event-loop thread only (the executor and the routes), so no lock is
needed; readers from other threads get the immutable snapshot objects (every update replaces
the JobState, never mutates it in place). Writes are atomic, so a crash leaves the old or the
new file. On load, jobs that were still running belong to a host that died: they are marked
failed with finished_at, so retention removes them later.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from solar_host.events import utc_now
from solar_host.instances.store import atomic_write_bytes
from solar_host.jobs.schemas import JobState, JobStatus, StepStatus

log = logging.getLogger(__name__)

STORE_FILE = "jobs_store.json"
RESTART_MESSAGE = "Host restarted while the job was running"


class JobStore:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._jobs: dict[str, JobState] = {}

    # --- reads -------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobState | None:
        return self._jobs.get(job_id)

    def all(self) -> list[JobState]:
        return list(self._jobs.values())

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    # --- writes ------------------------------------------------------------------------------

    def add(self, job: JobState) -> None:
        if job.job_id in self._jobs:
            raise KeyError(f"Job '{job.job_id}' already exists")
        self._jobs[job.job_id] = job
        self._save()

    def update(self, job_id: str, **fields: Any) -> JobState:
        job = self._jobs[job_id]
        new = job.model_copy(update=fields)
        self._jobs[job_id] = new
        self._save()
        return new

    def update_step(self, job_id: str, index: int, **fields: Any) -> JobState:
        job = self._jobs[job_id]
        if index < 0 or index >= len(job.steps):
            raise IndexError(f"job {job_id!r} has no step {index}")
        steps = list(job.steps)
        steps[index] = steps[index].model_copy(update=fields)
        new = job.model_copy(update={"steps": steps})
        self._jobs[job_id] = new
        self._save()
        return new

    def remove(self, job_id: str) -> None:
        if self._jobs.pop(job_id, None) is not None:
            self._save()

    # --- persistence -------------------------------------------------------------------------

    def load(self) -> list[str]:
        """Read the file; returns the ids of jobs that were interrupted (now marked failed)."""
        if self.path is None or not self.path.exists():
            return []
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            # Keep the unreadable file for inspection; start with an empty store.
            log.error("cannot read the job store %s (%s); starting empty", self.path, err)
            return []
        interrupted = []
        for item in raw.get("jobs", []) if isinstance(raw, dict) else []:
            try:
                job = JobState.model_validate(item)
            except ValueError as err:
                log.warning("dropping an unreadable job entry from %s: %s", self.path, err)
                continue
            if not job.terminal:
                job = _mark_interrupted(job)
                interrupted.append(job.job_id)
            self._jobs[job.job_id] = job
        if interrupted:
            self._save()
        return interrupted

    def _save(self) -> None:
        if self.path is None:
            return
        data = {"version": 1, "jobs": [j.model_dump(mode="json") for j in self._jobs.values()]}
        try:
            # 0600: step environments given by the caller may hold credentials.
            atomic_write_bytes(self.path, json.dumps(data, indent=1).encode(), mode=0o600)
        except OSError as err:
            # The in-memory state stays authoritative; the next change retries the write.
            log.error("cannot write the job store %s: %s", self.path, err)


def _mark_interrupted(job: JobState) -> JobState:
    now = utc_now()
    steps = []
    for step in job.steps:
        if step.status == StepStatus.running:
            step = step.model_copy(
                update={
                    "status": StepStatus.failed,
                    "finished_at": now,
                    "error_message": RESTART_MESSAGE,
                }
            )
        elif step.status == StepStatus.pending:
            step = step.model_copy(update={"status": StepStatus.cancelled})
        steps.append(step)
    return job.model_copy(
        update={
            "status": JobStatus.failed,
            "finished_at": now,
            "error_message": RESTART_MESSAGE,
            "steps": steps,
        }
    )

"""The job store: job states in memory, persisted to JOBS_DIR/jobs_store.json on every change.

Mutations happen on the event-loop thread only (the executor and the routes), so no lock is
needed; readers from other threads get the immutable snapshot objects (every update replaces
the JobState, never mutates it in place). The file follows statefiles' rules: atomic fsynced
writes (a crash leaves the old or the new file), the previous version kept as
jobs_store.json.prev, 0600 (step environments may hold credentials), and a file that cannot be
parsed stops the host at start-up instead of being replaced by the next submit. An entry that no
longer validates is kept verbatim in the file (and logged), never dropped. On load, jobs that
were still running belong to a host that died: they are marked failed with finished_at, so
retention removes them later (written at start, not at load).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from solar_host.events import utc_now
from solar_host.jobs.schemas import JobState, JobStatus, StepStatus
from solar_host.statefiles import (
    PRIVATE,
    StateFileError,
    atomic_write_bytes,
    last_good_path,
    parse_json,
    read_state_bytes,
    sweep_temp_files,
    tighten_mode,
)

log = logging.getLogger(__name__)

STORE_FILE = "jobs_store.json"
RESTART_MESSAGE = "Host restarted while the job was running"


class JobStore:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._jobs: dict[str, JobState] = {}
        # Entries that no longer validate, verbatim: written back by every save.
        self.unreadable: list[Any] = []
        # Top-level keys of the file this release does not know: written back as they were.
        self.extra: dict[str, Any] = {}
        self._loaded_from_disk = False

    # --- reads -------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobState | None:
        return self._jobs.get(job_id)

    def all(self) -> list[JobState]:
        return list(self._jobs.values())

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    # --- writes ------------------------------------------------------------------------------

    def add(self, job: JobState) -> None:
        """Record a new job; raises OSError (and records nothing) when the store cannot be
        written: a job the caller was told about must survive a restart."""
        if job.job_id in self._jobs:
            raise KeyError(f"Job '{job.job_id}' already exists")
        self._jobs[job.job_id] = job
        try:
            self._save(strict=True)
        except OSError:
            del self._jobs[job.job_id]
            raise

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
        """Read the file; returns the ids of jobs that were interrupted (now marked failed, in
        memory: `save_interrupted()` writes that once the host starts). Raises StateFileError
        for a file that is there but cannot be parsed."""
        if self.path is None:
            return []
        data = read_state_bytes(self.path)
        if data is None:
            return []
        raw = parse_store(self.path, data)
        sweep_temp_files(self.path)  # only once the file is known good
        self._loaded_from_disk = True
        tighten_mode(self.path)
        tighten_mode(last_good_path(self.path))
        interrupted = []
        self.extra = {k: v for k, v in raw.items() if k not in ("version", "jobs")}
        for item in raw["jobs"]:
            try:
                job = JobState.model_validate(item)
            except ValueError as err:
                log.error(
                    "job store %s: an entry that does not validate is kept unchanged "
                    "and not loaded: %s",
                    self.path,
                    str(err).replace("\n", " "),
                )
                self.unreadable.append(item)
                continue
            if job.job_id in self._jobs:
                log.error(
                    "job store %s: a second entry for job %s is kept unchanged and not loaded",
                    self.path,
                    job.job_id,
                )
                self.unreadable.append(item)
                continue
            if not job.terminal:
                job = _mark_interrupted(job)
                interrupted.append(job.job_id)
            self._jobs[job.job_id] = job
        return interrupted

    def save_interrupted(self, interrupted: list[str]) -> None:
        """Write the failed marks of jobs a dead host left running (after load)."""
        if interrupted:
            self._save()

    def _save(self, strict: bool = False) -> None:
        """Write the store. A failure raises with `strict`; otherwise it is logged and the
        in-memory state stays authoritative (the next change retries the write)."""
        if self.path is None:
            return
        jobs = [j.model_dump(mode="json") for j in self._jobs.values()]
        data = {**self.extra, "version": 1, "jobs": jobs + self.unreadable}
        try:
            # 0600: step environments given by the caller may hold credentials.
            atomic_write_bytes(
                self.path,
                json.dumps(data, indent=1).encode(),
                PRIVATE,
                keep_previous=self._loaded_from_disk,
            )
            self._loaded_from_disk = True
        except OSError as err:
            if strict:
                raise
            log.error("cannot write the job store %s: %s", self.path, err)


def parse_store(path: Path, data: bytes) -> dict[str, Any]:
    """The store document; raises StateFileError when it cannot be used."""
    raw = parse_json(path, data)
    # A document without the list is damage (every save writes it), not "no jobs".
    if not isinstance(raw, dict) or not isinstance(raw.get("jobs"), list):
        raise StateFileError(path, "expected an object with a 'jobs' list")
    return raw


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

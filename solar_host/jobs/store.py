"""The job store: job states in memory, persisted to JOBS_DIR/jobs_store.json on every change.

Mutations happen on the event-loop thread only (the executor and the routes), so no lock is
needed; readers from other threads get the immutable snapshot objects (every update replaces
the JobState, never mutates it in place). The file follows statefiles' rules: atomic fsynced
writes (a crash leaves the old or the new file), the previous version kept as
jobs_store.json.prev, 0600 (step environments may hold credentials), and a file that cannot be
parsed stops the host at start-up instead of being replaced by the next submit. Writes are
group-committed (statefiles.GroupCommit): the file is written in a worker thread, changes made
while a write runs share the next one, and each job's JSON is kept until the job changes, so a
change encodes one job, not every retained job's definition (a store of ten 7 MB definitions
held the event loop for seconds at every step of every job). An entry that no
longer validates is kept verbatim in the file (and logged), never dropped. On load, jobs that
were still running belong to a host that died: they are marked failed with finished_at, so
retention removes them later (written at start, not at load).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from solar_host.events import utc_now
from solar_host.jobs.schemas import JobState, JobStatus, StepStatus, validate_slug
from solar_host.platform.statefiles import (
    PRIVATE,
    GroupCommit,
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
        self._commits = GroupCommit(self._encode, self._write)
        self._encoded: dict[str, tuple[JobState, bytes]] = {}  # id -> (the state, its JSON)
        self._saves: set[asyncio.Task[None]] = set()

    # --- reads -------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobState | None:
        return self._jobs.get(job_id)

    def all(self) -> list[JobState]:
        return list(self._jobs.values())

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    # --- writes ------------------------------------------------------------------------------

    async def add(self, job: JobState) -> None:
        """Record a new job once it is on disk; raises OSError, or ValueError for a job that
        cannot be encoded, and records nothing, when the store cannot be written: a job the
        caller was told about must survive a restart."""
        if job.job_id in self._jobs:
            raise KeyError(f"Job '{job.job_id}' already exists")
        self._jobs[job.job_id] = job
        if self.path is None:
            return
        try:
            await self._commits.commit()
        except (OSError, ValueError, RecursionError):  # unwritable, or a job JSON cannot hold
            if self._jobs.get(job.job_id) is job:
                del self._jobs[job.job_id]
                self._save()  # a later write may already hold it: the next one must not
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
                # The id names the workspace that retention deletes: an entry whose id is not
                # a plain directory name ("..", "/") is damage, not a job.
                validate_slug(job.job_id, "job_id")
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

    async def save_interrupted(self, interrupted: list[str]) -> None:
        """Write the failed marks of jobs a dead host left running (after load)."""
        if interrupted:
            self._save()
        await self.drain()

    async def drain(self) -> None:
        """Wait until every change made so far is written (or its write failed)."""
        while self._saves:
            await asyncio.gather(*list(self._saves), return_exceptions=True)
        await self._commits.drain()

    def _save(self) -> None:
        """Write the store soon. A failure is logged and the in-memory state stays
        authoritative (the next change retries the write)."""
        if self.path is None:
            return
        task = asyncio.get_running_loop().create_task(self._commit_logged())
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)

    async def _commit_logged(self) -> None:
        try:
            await self._commits.commit()
        except OSError as err:
            log.error("cannot write the job store %s: %s", self.path, err)

    def _encode(self) -> bytes:
        """The store document, on the event loop (the states belong to it): the JSON of each
        job that did not change since the last write is reused."""
        parts = []
        encoded: dict[str, tuple[JobState, bytes]] = {}
        for job_id, job in self._jobs.items():
            cached = self._encoded.get(job_id)
            if cached is None or cached[0] is not job:
                cached = (job, json.dumps(job.model_dump(mode="json")).encode())
            encoded[job_id] = cached
            parts.append(cached[1])
        parts += [json.dumps(item).encode() for item in self.unreadable]
        self._encoded = encoded
        head = json.dumps({**self.extra, "version": 1})[:-1].encode()
        return head + b', "jobs": [\n' + b",\n".join(parts) + b"\n]}\n"

    def _write(self, data: bytes) -> None:
        # In a worker thread. 0600: step environments given by the caller may hold credentials.
        assert self.path is not None
        atomic_write_bytes(self.path, data, PRIVATE, keep_previous=self._loaded_from_disk)
        self._loaded_from_disk = True


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

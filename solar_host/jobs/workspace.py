"""Job workspaces: JOBS_DIR/<job_id>/{models,data,output,config,logs,hf_home}, the disk floor.

Blocking file work; the service calls these through a thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from solar_host.jobs.schemas import JobDefinition, validate_slug
from solar_host.resources.probes import GB, SystemProbe

log = logging.getLogger(__name__)

SUBDIRS = ("models", "data", "output", "config", "logs", "hf_home")
# Leftover workspaces of ids with no record go here; job ids cannot start with a dot.
ORPHANED_DIR = ".orphaned"


class WorkspaceError(RuntimeError):
    """The workspace could not be created (500 workspace_create_failed)."""


class InsufficientDiskError(RuntimeError):
    def __init__(self, required_gb: float, available_gb: float) -> None:
        super().__init__(
            f"insufficient disk space: {available_gb:.2f} GB free, {required_gb:.2f} GB required"
        )
        self.required_gb = float(required_gb)
        self.available_gb = float(available_gb)


def workspace_path(jobs_dir: Path, job_id: str) -> Path:
    return Path(jobs_dir).absolute() / job_id


def step_log_path(jobs_dir: Path, job_id: str, step_name: str) -> Path:
    return workspace_path(jobs_dir, job_id) / "logs" / f"{step_name}.log"


def check_disk(probe: SystemProbe, jobs_dir: Path, required_gb: float) -> None:
    """Raise InsufficientDiskError when the filesystem of JOBS_DIR has less than required."""
    usage = probe.disk(Path(jobs_dir))
    available_gb = (usage.available_bytes / GB) if usage is not None else 0.0
    if available_gb < required_gb:
        raise InsufficientDiskError(required_gb, round(available_gb, 2))


def create_workspace(jobs_dir: Path, job: JobDefinition, uid: int, gid: int) -> Path:
    """Create a fresh workspace with its directories and config/job.json. Raises WorkspaceError.

    A directory already there for this id belongs to no recorded job (the caller checked the
    store): its containers could write it, so it may hold links planted to make this host
    (often root) write elsewhere. It is moved aside, never reused, and every file is created
    with O_EXCL|O_NOFOLLOW in directories this call made.
    """
    base = Path(jobs_dir).absolute()
    root = workspace_path(base, job.job_id)
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(root):
            _move_aside(base, job.job_id)
        os.mkdir(root, 0o755)
        os.chmod(root, 0o755, follow_symlinks=False)
        for sub in SUBDIRS:
            _make_subdir(root / sub, uid, gid)
        _write_new(root / "config" / "job.json", _job_config(job))
        if job.training_config is not None:
            _write_new(root / "config" / "training.json", job.training_config)
    except OSError as err:
        raise WorkspaceError(str(err)) from err
    return root


def _job_config(job: JobDefinition) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "name": job.display_name,
        "pipeline": [s.name for s in job.steps],
        "base_model_uri": job.base_model_uri,
        "training_data_uri": job.training_data_uri,
        "model_selection": job.model_selection,
        "deployment": job.deployment,
        "retention_hours": job.retention_hours,
        "steps": {},
    }


def _move_aside(base: Path, job_id: str) -> Path:
    """Rename a leftover workspace into JOBS_DIR/.orphaned/ (a name no job id can take).

    Kept, not deleted: it may be the only copy of an earlier run's output (its record was lost
    to a damaged store); the operator decides. rename() moves a link itself, never its target.
    """
    aside = base / ORPHANED_DIR
    aside.mkdir(mode=0o700, exist_ok=True)
    stamp = f"{job_id}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    dest = aside / stamp
    n = 1
    while os.path.lexists(dest):  # rename() would replace an empty directory there
        dest, n = aside / f"{stamp}.{n}", n + 1
    os.rename(base / job_id, dest)
    log.warning("job %s: a workspace without a job record was there; moved it to %s", job_id, dest)
    return dest


def _make_subdir(path: Path, uid: int, gid: int) -> None:
    os.mkdir(path, 0o755)  # inside a directory made just now: nothing there to follow
    os.chmod(path, 0o755, follow_symlinks=False)
    # The container runs as uid:gid and writes output/ and config/; chown needs root,
    # and a non-root host runs containers as its own user anyway.
    with contextlib.suppress(PermissionError):
        os.chown(path, uid, gid, follow_symlinks=False)


def _write_new(path: Path, data: Any) -> None:
    """Write a new file; a name already there (or a link) fails instead of being followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2))


def delete_workspace(jobs_dir: Path, job_id: str) -> None:
    """Remove the workspace of `job_id` (missing is fine; errors are logged, never raised).

    The path is derived from JOBS_DIR and the id, never taken from the store: a stored path
    may name a JOBS_DIR the operator moved away from (its copy is a backup) or anything an
    edited file says, and this runs as the host's user.
    """
    try:
        validate_slug(job_id, "job_id")
    except ValueError as err:
        log.warning("not deleting a workspace for job id %r: %s", job_id, err)
        return
    path = workspace_path(jobs_dir, job_id)
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("cannot delete job workspace %s: %s", path, err)

"""Job workspaces: JOBS_DIR/<job_id>/{models,data,output,config,logs} and the disk floor.

Blocking file work; the service calls these through a thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

from solar_host.jobs.schemas import JobDefinition
from solar_host.resources.probes import GB, SystemProbe

log = logging.getLogger(__name__)

SUBDIRS = ("models", "data", "output", "config", "logs")


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
    """Create the directories and config/job.json (idempotent). Raises WorkspaceError."""
    root = workspace_path(jobs_dir, job.job_id)
    try:
        for sub in SUBDIRS:
            d = root / sub
            d.mkdir(parents=True, exist_ok=True, mode=0o755)
            d.chmod(0o755)
            # The container runs as uid:gid and writes output/ and config/; chown needs root,
            # and a non-root host runs containers as its own user anyway.
            with contextlib.suppress(PermissionError):
                os.chown(d, uid, gid)
        config = {
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
        (root / "config" / "job.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        if job.training_config is not None:
            (root / "config" / "training.json").write_text(
                json.dumps(job.training_config, indent=2), encoding="utf-8"
            )
        # Logs of a previous job with the same id must not be mixed into this one.
        for old in (root / "logs").glob("*.log"):
            old.unlink(missing_ok=True)
    except OSError as err:
        raise WorkspaceError(str(err)) from err
    return root


def delete_workspace(path: Path | str) -> None:
    """Remove a workspace (missing is fine; errors are logged, never raised)."""
    if not path:
        return
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("cannot delete job workspace %s: %s", path, err)

"""Actual use of a running job's container: RAM, VRAM and workspace disk.

All of it blocks (psutil, a directory walk, the Docker API behind JobView), so the service calls
`measure_jobs` in a worker thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from solar_host.resources.probes import GB, SystemProbe

log = logging.getLogger(__name__)


class JobView(Protocol):
    """What the ledger needs from the jobs service (set after construction; may be absent)."""

    def is_running(self, job_id: str) -> bool: ...

    def container_root_pid(self, job_id: str) -> int | None: ...

    def container_memory_bytes(self, job_id: str) -> int | None: ...


@dataclass(frozen=True, slots=True)
class JobUsage:
    vram_gb: float | None
    ram_gb: float | None
    disk_gb: float | None

    def as_tuple(self) -> tuple[float | None, float | None, float | None]:
        return (self.vram_gb, self.ram_gb, self.disk_gb)


def to_gb(n: int | None) -> float | None:
    return None if n is None else round(max(n, 0) / GB, 4)


def dir_size_bytes(path: Path) -> int | None:
    """Total size of the regular files under `path` (symlinks not followed); None if missing."""
    if not path.is_dir():
        return None
    total = 0
    stack = [str(path)]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:  # a file removed while we walk
                        continue
        except OSError:
            continue
    return total


def process_tree(root_pid: int) -> set[int]:
    """The pid and all its descendants; empty if it is gone."""
    if root_pid <= 0:
        return set()
    try:
        root = psutil.Process(root_pid)
        pids = {root_pid}
        pids.update(child.pid for child in root.children(recursive=True))
        return pids
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return set()


def tree_gpu_bytes(root_pid: int | None, gpu_memory: dict[int, int]) -> int | None:
    """GPU memory used by a process tree. None when unknown (no pid, or NVML saw nothing)."""
    if not root_pid or root_pid <= 0 or not gpu_memory:
        return None
    pids = process_tree(root_pid)
    if not pids:
        return None
    return sum(used for pid, used in gpu_memory.items() if pid in pids)


def workspace_dir(jobs_dir: Path, job_id: str) -> Path | None:
    """JOBS_DIR/<job_id>, refusing ids that would step outside JOBS_DIR."""
    if not job_id or "/" in job_id or "\\" in job_id or job_id in (".", "..") or "\0" in job_id:
        return None
    return Path(jobs_dir) / job_id


def measure_job(job_id: str, jobs: JobView, gpu_memory: dict[int, int], jobs_dir: Path) -> JobUsage:
    """One job's container: memory from the container, VRAM over its pid tree, workspace disk."""
    try:
        ram = jobs.container_memory_bytes(job_id)
    except Exception as err:
        log.debug("container memory of %s unavailable: %s", job_id, err)
        ram = None
    try:
        pid = jobs.container_root_pid(job_id)
    except Exception as err:
        log.debug("container pid of %s unavailable: %s", job_id, err)
        pid = None
    ws = workspace_dir(jobs_dir, job_id)
    disk = dir_size_bytes(ws) if ws is not None else None
    return JobUsage(
        vram_gb=to_gb(tree_gpu_bytes(pid, gpu_memory)), ram_gb=to_gb(ram), disk_gb=to_gb(disk)
    )


def measure_jobs(
    job_ids: Iterable[str], jobs: JobView, probe: SystemProbe, jobs_dir: Path
) -> dict[str, JobUsage]:
    """Measure several jobs with one NVML process query."""
    ids = list(dict.fromkeys(job_ids))
    if not ids:
        return {}
    try:
        gpu_memory = probe.gpu_process_memory()
    except Exception as err:
        log.warning("GPU process memory unavailable: %s", err)
        gpu_memory = {}
    return {job_id: measure_job(job_id, jobs, gpu_memory, jobs_dir) for job_id in ids}

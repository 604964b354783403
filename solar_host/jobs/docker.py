"""A thin synchronous layer over the `docker` SDK for job containers.

Every method blocks (HTTP to the daemon), so the async code calls them through a thread. Errors
are turned into a few exception types the executor understands. Containers are labelled with
the job id and the JOBS_DIR of the host that made them, so a host removes only its own leftovers
(several hosts, or test sessions, may share one daemon).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solar_host.jobs.schemas import GpuRequest

# The docker SDK (and requests under it) costs ~0.2 s and several MB at host start-up; it is
# imported on the first job operation instead (idle-memory / start-up targets, issue 10).

log = logging.getLogger(__name__)

LABEL_JOB = "solar-host.job"
LABEL_STEP = "solar-host.step"
LABEL_JOBS_DIR = "solar-host.jobs-dir"
API_TIMEOUT_S = 30
PING_TIMEOUT_S = 5
DEFAULT_SOCKET = "/var/run/docker.sock"
# The kernel's out-of-memory killer picks the process with the highest score: 1000 makes a
# job's processes the first chosen, ahead of the model servers (whose score is their size).
JOB_OOM_SCORE_ADJ = 1000


class DaemonUnavailableError(RuntimeError):
    """No Docker daemon answers."""


class ContainerStartError(RuntimeError):
    """The step's container could not be created or started."""


class DaemonLostError(ContainerStartError):
    """The daemon that created the container stopped answering before the start was known
    (killed, restarted): the container may even run, but nobody can say."""


def _after_create(what: str, err: Exception) -> ContainerStartError:
    """The error for a call on a container the daemon created: a broken connection is the
    daemon lost, whichever call it broke (the start's answer may never arrive even though the
    container runs and writes)."""
    import requests

    if isinstance(err, requests.exceptions.ConnectionError):
        return DaemonLostError(f"the connection to the Docker daemon was lost: {err}")
    return ContainerStartError(f"cannot {what} the container: {_explain(err)}")


def distinct_name(spec: ContainerSpec) -> str:
    """`spec.name` with a digest of the job and step: unique where the plain name is taken."""
    key = f"{spec.labels.get(LABEL_JOB)}\0{spec.labels.get(LABEL_STEP)}"
    return f"{spec.name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class ContainerSpec:
    image: str
    command: list[str] | str | None
    environment: dict[str, str]
    binds: dict[str, dict[str, str]]
    name: str
    labels: dict[str, str]
    user: str
    network_mode: str
    gpu: GpuRequest | None
    pids_limit: int | None = None  # None: no limit
    memory_bytes: int | None = None  # None: no limit


def device_requests(gpu: GpuRequest | None) -> list[Any] | None:
    if gpu is None:
        return None
    import docker.types

    if gpu.device_ids is not None:
        return [docker.types.DeviceRequest(device_ids=list(gpu.device_ids), capabilities=[["gpu"]])]
    return [docker.types.DeviceRequest(count=gpu.count, capabilities=[["gpu"]])]


class DockerJobs:
    """One client connection to the daemon named by DOCKER_HOST (or the default socket)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @classmethod
    def connect(cls, timeout: float = API_TIMEOUT_S) -> DockerJobs:
        """Connect and ping; raises DaemonUnavailableError."""
        if not os.environ.get("DOCKER_HOST") and not os.path.exists(DEFAULT_SOCKET):
            # Nothing to connect to: say so without importing the SDK (a host without Docker
            # never pays for it).
            raise DaemonUnavailableError(
                f"Docker daemon unavailable: DOCKER_HOST is unset and {DEFAULT_SOCKET} is missing"
            )
        import docker

        try:
            # A short timeout for the probe (an unreachable TCP host must not stall a submit),
            # the normal one for the calls that follow.
            client = docker.from_env(timeout=PING_TIMEOUT_S, max_pool_size=32)
            client.ping()
            client.api.timeout = timeout
        except Exception as err:  # DockerException, requests errors, bad DOCKER_HOST
            raise DaemonUnavailableError(f"Docker daemon unavailable: {err}") from err
        return cls(client)

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:
            return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()

    # --- containers ------------------------------------------------------------------------

    def create(self, spec: ContainerSpec) -> str:
        """Create the container (not started). Replaces a leftover of ours with the same name."""
        kwargs: dict[str, Any] = {
            "command": spec.command,
            "environment": spec.environment,
            "volumes": spec.binds,
            "name": spec.name,
            "labels": spec.labels,
            "user": spec.user,
            "network_mode": spec.network_mode,
            "privileged": False,
            # A setuid program in the image must not undo CONTAINER_UID/GID.
            "security_opt": ["no-new-privileges"],
            # The host keeps the durable (rotated) log; dockerd's own copy stays small.
            "log_config": {"Type": "json-file", "Config": {"max-size": "10m", "max-file": "1"}},
            # docker-init (tini) as PID 1 forwards SIGTERM: stop takes milliseconds, not the
            # whole grace period (sh or sleep as PID 1 ignore SIGTERM).
            "init": True,
            "device_requests": device_requests(spec.gpu),
            # When the machine runs out of memory, the kernel kills a job's processes before
            # any model server's: the models keep serving, the step fails (exit 137).
            "oom_score_adj": JOB_OOM_SCORE_ADJ,
            "pids_limit": spec.pids_limit,
            "mem_limit": spec.memory_bytes,
            # The same figure for memory and swap together: no swapping past the limit.
            "memswap_limit": spec.memory_bytes,
            "detach": True,
        }
        import docker.errors

        pulled = replaced = False
        while True:
            try:
                return self.client.containers.create(spec.image, **kwargs).id
            except docker.errors.ImageNotFound as err:
                if pulled:
                    raise ContainerStartError(f"image {spec.image!r} not found") from err
                self.pull(spec.image)
                pulled = True
            except docker.errors.APIError as err:
                if err.status_code == 409 and kwargs["name"] == spec.name:
                    if not replaced and self._remove_ours(spec):
                        replaced = True  # a leftover of this very job and step
                        continue
                    # Another job's container: job ids and step names both hold '-', so job
                    # 'a-b' step 'c' and job 'a' step 'b-c' share the name. Never remove it;
                    # this one takes a name of its own (containers are found by label).
                    kwargs["name"] = distinct_name(spec)
                    continue
                raise ContainerStartError(f"cannot create the container: {_explain(err)}") from err
            except Exception as err:
                raise ContainerStartError(f"cannot create the container: {err}") from err

    def pull(self, image: str) -> None:
        import docker.utils

        repo, tag = docker.utils.parse_repository_tag(image)
        try:
            self.client.images.pull(repo, tag=tag or "latest")
        except Exception as err:
            raise ContainerStartError(
                f"image {image!r} not found on this host and pull failed: {_explain(err)}"
            ) from err

    def _remove_ours(self, spec: ContainerSpec) -> bool:
        """Remove the container named like `spec` if it is a leftover of the same job and step
        of this host (a step whose container outlived a crash), never another job's."""
        try:
            old = self.client.containers.get(spec.name)
        except Exception:
            return False
        if any(
            old.labels.get(k) != spec.labels.get(k) for k in (LABEL_JOBS_DIR, LABEL_JOB, LABEL_STEP)
        ):
            return False
        self.remove(old.id)
        return True

    def attach(self, container_id: str) -> Iterator[tuple[bytes | None, bytes | None]]:
        """The demultiplexed output stream; attach BEFORE start so no output is missed."""
        try:
            return self.client.api.attach(
                container_id, stdout=True, stderr=True, stream=True, logs=True, demux=True
            )
        except Exception as err:
            raise _after_create("attach to", err) from err

    def start(self, container_id: str) -> None:
        try:
            self.client.api.start(container_id)
        except Exception as err:
            raise _after_create("start", err) from err

    def wait(self, container_id: str) -> int:
        """Block until the container exits; its exit code (-1 when Docker gives none)."""
        result = self.client.api.wait(container_id, timeout=None)
        code = result.get("StatusCode") if isinstance(result, dict) else None
        return int(code) if code is not None else -1

    def oom_killed(self, container_id: str) -> bool:
        """Whether the kernel killed a process of the container for memory (its limit, or
        the machine's)."""
        try:
            return bool(self.client.api.inspect_container(container_id)["State"]["OOMKilled"])
        except Exception:
            return False

    def stop(self, container_id: str, timeout: int = 10) -> None:
        import docker.errors

        try:
            self.client.api.stop(container_id, timeout=timeout)
        except docker.errors.NotFound:
            pass
        except Exception as err:
            log.warning("cannot stop container %s: %s", container_id[:12], _explain(err))

    def remove(self, container_id: str) -> None:
        import docker.errors

        try:
            self.client.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except Exception as err:
            log.warning("cannot remove container %s: %s", container_id[:12], _explain(err))

    def remove_leftovers(self, jobs_dir: Path, keep: Container[str] = frozenset()) -> int:
        """Remove containers of this JOBS_DIR whose job is not in `keep`. Returns the count."""
        try:
            found = self.client.containers.list(
                all=True, filters={"label": f"{LABEL_JOBS_DIR}={Path(jobs_dir).absolute()}"}
            )
        except Exception as err:
            log.warning("cannot list leftover job containers: %s", _explain(err))
            return 0
        n = 0
        for ct in found:
            if ct.labels.get(LABEL_JOB) in keep:
                continue
            log.info("removing leftover job container %s (%s)", ct.name, ct.labels.get(LABEL_JOB))
            self.remove(ct.id)
            n += 1
        return n

    def root_pid(self, container_id: str) -> int | None:
        try:
            pid = self.client.api.inspect_container(container_id)["State"]["Pid"]
        except Exception:
            return None
        return int(pid) if pid else None

    def memory_bytes(self, container_id: str) -> int | None:
        """Working-set memory (usage minus page cache, as `docker stats` shows)."""
        try:
            stats = self.client.api.stats(container_id, stream=False, one_shot=True)
        except Exception:
            return None
        mem = stats.get("memory_stats") or {}
        usage = mem.get("usage")
        if usage is None:
            return None
        inner = mem.get("stats") or {}
        cache = inner.get("inactive_file", inner.get("total_inactive_file", inner.get("cache", 0)))
        return max(int(usage) - int(cache or 0), 0)

    def stderr_tail(self, container_id: str, lines: int = 20) -> list[str]:
        try:
            raw = self.client.api.logs(container_id, stdout=False, stderr=True, tail=lines)
        except Exception:
            return []
        return raw.decode("utf-8", "replace").splitlines()[-lines:]


def _explain(err: Exception) -> str:
    import docker.errors

    if isinstance(err, docker.errors.APIError):
        return str(err.explanation or err)
    return str(err)

"""Job and step models: what control submits (definitions) and what the host reports (states).

Definitions are validated strictly at submit so a bad job is a 400 that changes nothing, rather
than a step that fails minutes later: ids and step names are slugs (they become paths and
container names), steps are unique and non-empty, and every GPU form either side uses is
normalised to one `GpuRequest` (ruling 13).
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from solar_host.events import utc_now

SLUG_RE = re.compile(r"^[A-Za-z0-9._-]+$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_SLUG_LEN = 128
# Names that would collide with the host's own files in JOBS_DIR (the store, its last good
# copy `.prev`, and anything else statefiles may name after it).
RESERVED_JOB_IDS = frozenset({"jobs_store.json"})
RESERVED_JOB_ID_PREFIX = "jobs_store.json"
# 100 years: larger values overflow datetime arithmetic (retention deadline, sweep).
MAX_RETENTION_HOURS = 100 * 365 * 24.0
# A step's time limit: one year at most (asyncio timers take any float, but a limit past that
# is a typo, and "no limit" is saying none).
MAX_STEP_TIMEOUT_S = 365 * 24 * 3600.0


def validate_slug(value: str, what: str) -> str:
    """A name usable as a path component and inside a container name; raises ValueError."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    if len(value) > MAX_SLUG_LEN:
        raise ValueError(f"{what} is longer than {MAX_SLUG_LEN} characters")
    if "/" in value:
        raise ValueError(f"{what} must not contain '/'")
    if ".." in value:
        raise ValueError(f"{what} must not contain '..'")
    if value.startswith("."):
        raise ValueError(f"{what} must not start with '.'")
    if not SLUG_RE.match(value):
        raise ValueError(f"{what} may contain only letters, digits, '.', '_' and '-'")
    return value


class JobStatus(StrEnum):
    pending = "pending"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


StepStatus = JobStatus
TERMINAL = frozenset({JobStatus.completed, JobStatus.failed, JobStatus.cancelled})


class GpuRequest(BaseModel):
    """Normalised GPU request: `device_ids` wins over `count`; count -1 means all GPUs."""

    model_config = ConfigDict(extra="forbid")

    count: int | None = None
    device_ids: list[str] | None = None

    @model_validator(mode="after")
    def _one_required(self) -> GpuRequest:
        if self.device_ids is not None:
            if not self.device_ids:
                raise ValueError("gpu.device_ids must not be empty")
            if any(not isinstance(d, str) or not d.strip() for d in self.device_ids):
                raise ValueError("gpu.device_ids must be non-empty strings")
        elif self.count is None:
            raise ValueError("gpu options require count or device_ids")
        elif self.count < -1 or self.count == 0:
            raise ValueError("gpu.count must be a positive number, or -1 for all GPUs")
        return self

    @property
    def all(self) -> bool:
        return self.device_ids is None and self.count == -1


def normalise_gpu(value: Any) -> GpuRequest | None:
    """Every accepted GPU form -> GpuRequest (None: no GPU). Raises ValueError for the rest."""
    if value is None or value is False:
        return None
    if value is True:  # legacy boolean: all GPUs
        return GpuRequest(count=-1)
    if isinstance(value, int):
        if value == 0:
            return None
        return GpuRequest(count=value)
    if isinstance(value, str):  # one id, e.g. "0" or a UUID
        return GpuRequest(device_ids=[value])
    if isinstance(value, list):
        return GpuRequest(device_ids=[str(v) if isinstance(v, int) else v for v in value])
    if isinstance(value, dict):
        if not value:
            raise ValueError("gpu: {} is not a GPU request; give count or device_ids")
        data = dict(value)
        ids = data.get("device_ids")
        if isinstance(ids, list):
            data["device_ids"] = [str(v) if isinstance(v, int) else v for v in ids]
        return GpuRequest.model_validate(data)
    raise ValueError("gpu must be {count}, {device_ids}, an int, a list of ids or true")


# Step fields that would widen what a job container may do on this machine: refused, with a
# message saying so (the host sets the mounts, network, user and devices itself).
PRIVILEGED_STEP_FIELDS = {
    "privileged": "runs the container with every privilege of the host",
    "volumes": "mounts host paths into the container",
    "binds": "mounts host paths into the container",
    "mounts": "mounts host paths into the container",
    "volumes_from": "mounts another container's volumes",
    "tmpfs": "adds mounts to the container",
    "network_mode": "changes the container's network (JOB_NETWORK_MODE is the operator's)",
    "network": "changes the container's network (JOB_NETWORK_MODE is the operator's)",
    "pid_mode": "shares a process namespace (e.g. the host's)",
    "ipc_mode": "shares an IPC namespace (e.g. the host's)",
    "uts_mode": "shares the host's UTS namespace",
    "userns_mode": "changes the container's user namespace",
    "devices": "adds host devices beyond the GPU request",
    "device_requests": "adds devices beyond the GPU request (use `gpu`)",
    "device_cgroup_rules": "opens host devices to the container",
    "cap_add": "adds Linux capabilities",
    "security_opt": "changes the container's security profile",
    "user": "changes the user the container runs as (CONTAINER_UID/GID are the operator's)",
    "group_add": "adds groups to the container's user",
    "sysctls": "changes kernel parameters",
    "runtime": "changes the container runtime",
    "cgroup_parent": "moves the container out of the host's cgroup",
    "host_config": "sets Docker host options directly",
}
STEP_FIELD_ERROR = "step_field_refused"


class StepDefinition(BaseModel):
    """One step. Only these fields are implemented; any other is refused (a 422 naming it),
    so a caller is never told 202 for a step the host would run differently."""

    model_config = ConfigDict(extra="ignore")

    name: str
    image: str = Field(min_length=1)
    command: list[str] | str | None = None
    environment: dict[str, str] = Field(default_factory=dict)
    gpu: GpuRequest | None = None
    is_preparation_step: bool = False
    hf_cache_write: bool | None = Field(
        default=None,
        description="Mount the host's HF hub cache (models and datasets, never the host's HF "
        "token) read-write. Default: only for preparation steps (they download the models the "
        "job uses); every other step reads it only.",
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_STEP_TIMEOUT_S,
        allow_inf_nan=False,
        description="Seconds the step may run, from its container's start; past it the "
        "container is stopped and the step fails. JOB_STEP_TIMEOUT_S, where set, is the most a "
        "step may ask for and the limit of those that give none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields)
        widening = [k for k in data if k in PRIVILEGED_STEP_FIELDS]
        if widening:
            reasons = "; ".join(f"'{k}' {PRIVILEGED_STEP_FIELDS[k]}" for k in widening)
            raise PydanticCustomError(
                STEP_FIELD_ERROR,
                "refused: {fields} would widen the container's privileges ({reasons})",
                {"fields": ", ".join(widening), "reasons": reasons},
            )
        unknown = [str(k) for k in data if k not in known]
        if unknown:
            raise PydanticCustomError(
                STEP_FIELD_ERROR,
                "not implemented by this host: {fields} (a step has {known})",
                {"fields": ", ".join(unknown), "known": ", ".join(sorted(known))},
            )
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return validate_slug(v, "step name")

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _timeout(cls, v: Any) -> Any:
        if isinstance(v, bool):  # pydantic would take true as 1 s
            raise ValueError("timeout_s must be a number of seconds")
        return v

    @property
    def writes_hf_cache(self) -> bool:
        if self.hf_cache_write is None:
            return self.is_preparation_step
        return self.hf_cache_write

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v.strip() or any(c.isspace() or not c.isprintable() for c in v):
            raise ValueError(
                "image must be a non-empty image reference without spaces or control characters"
            )
        return v

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str] | str | None) -> list[str] | str | None:
        if v is not None and not v:
            raise ValueError("command must not be empty (omit it to use the image's default)")
        # An argument is a C string: one holding NUL could only fail at the container's start.
        if v is not None and any("\x00" in a for a in ([v] if isinstance(v, str) else v)):
            raise ValueError("command must not contain NUL characters")
        return v

    @field_validator("environment", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for key, val in v.items():
            if not isinstance(key, str) or not ENV_NAME_RE.match(key):
                raise ValueError(f"environment name {key!r} is not a valid variable name")
            if isinstance(val, bool):
                val = "true" if val else "false"
            elif isinstance(val, int | float):
                val = str(val)
            if isinstance(val, str) and "\x00" in val:
                raise ValueError(f"environment {key} must not contain NUL characters")
            out[key] = val
        return out

    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu(cls, v: Any) -> GpuRequest | None:
        return normalise_gpu(v)

    @model_validator(mode="after")
    def _no_gpus_by_environment(self) -> StepDefinition:
        # Where nvidia is the daemon's default runtime, this variable alone hands a container
        # GPUs: a step without a gpu request would take GPUs no reservation or placement saw.
        # (With a gpu request the caller may override it, as control's jobs expect.)
        if self.gpu is None and "NVIDIA_VISIBLE_DEVICES" in self.environment:
            raise PydanticCustomError(
                STEP_FIELD_ERROR,
                "refused: environment.NVIDIA_VISIBLE_DEVICES would give a step without a gpu "
                "request this machine's GPUs (ask for them with `gpu`)",
            )
        return self


class JobDefinition(BaseModel):
    """The POST /jobs body (control-contract 2.6); unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore")

    job_id: str
    name: str | None = None
    steps: list[StepDefinition] = Field(min_length=1)
    retention_hours: float = Field(default=24.0, ge=0, le=MAX_RETENTION_HOURS, allow_inf_nan=False)
    # A pebibyte: more is a mistake (and infinity made the 507's own body unencodable).
    min_free_disk_gb: float | None = Field(
        default=None, ge=0, le=1024.0 * 1024.0, allow_inf_nan=False
    )
    base_model_uri: str | None = None
    training_data_uri: str | None = None
    training_config: dict[str, Any] | None = None
    model_selection: dict[str, Any] | None = None
    deployment: dict[str, Any] | None = None
    submission_id: str | None = None
    correlation_id: str | None = None

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, v: str) -> str:
        validate_slug(v, "job_id")
        if v in RESERVED_JOB_IDS or v.startswith(RESERVED_JOB_ID_PREFIX):
            raise ValueError(f"job_id {v!r} is reserved")
        return v

    @model_validator(mode="after")
    def _unique_steps(self) -> JobDefinition:
        seen: set[str] = set()
        for step in self.steps:
            if step.name in seen:
                raise ValueError(f"step name {step.name!r} is used twice")
            seen.add(step.name)
        return self

    @property
    def display_name(self) -> str:
        return self.name or self.job_id


class StepLogMessage(BaseModel):
    seq: int
    timestamp: str
    stream: str
    line: str
    completed: bool = False
    exit_code: int | None = None


class StepState(BaseModel):
    name: str
    status: StepStatus = StepStatus.pending
    container_id: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    duration_s: float | None = None
    exit_code: int | None = None
    error_message: str | None = None
    # The time limit the step runs under (timeout_s or JOB_STEP_TIMEOUT_S), set as it starts.
    time_limit_s: float | None = None


class JobState(BaseModel):
    """What the store keeps (and persists) about one job."""

    job_id: str
    name: str
    status: JobStatus = JobStatus.pending
    steps: list[StepState] = Field(default_factory=list)
    current_step_index: int = -1
    workspace_path: str = ""
    created_at: datetime = Field(default_factory=utc_now)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    retention_hours: float = 24.0
    error_message: str | None = None
    submission_id: str | None = None
    correlation_id: str | None = None
    # The definition is kept so a job can be inspected (and re-run by hand) after a restart.
    definition: JobDefinition | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


class StepStateResponse(StepState):
    log_file: str
    recent_logs: list[StepLogMessage] = Field(default_factory=list)


class JobStateResponse(BaseModel):
    job_id: str
    name: str
    status: JobStatus
    steps: list[StepStateResponse]
    current_step_index: int
    workspace_path: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    retention_hours: float
    error_message: str | None
    submission_id: str | None
    correlation_id: str | None


class JobSubmitted(BaseModel):
    job_id: str
    status: JobStatus
    workspace_path: str
    submission_id: str | None
    correlation_id: str | None

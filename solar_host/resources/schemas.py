"""Request and response shapes of the reservation ledger (control-contract 3.4).

The snapshot is built as a plain JSON-ready dict by `ResourceService.snapshot()` (the same dict
goes to `GET /resources` and to `host_health.resources`); the models below describe it for
OpenAPI and validate what callers send.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

WorkloadType = Literal["training", "inference", "other"]
ReservationStatus = Literal["pending", "running"]

# A TTL this long is a mistake, and a larger one would overflow datetime arithmetic (a 500).
# No machine has a pebibyte of memory; larger figures are mistakes (and summing two floats near
# the float limit gives inf, which JSON cannot carry).
MAX_RESERVATION_GB = 1024.0 * 1024.0
MAX_TTL_SECONDS = 10 * 365 * 86400.0


def as_utc(value: datetime) -> datetime:
    """A naive datetime is read as UTC (upstream compared naive and aware values and crashed)."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


class ReservationRequest(BaseModel):
    """Body of `POST /resources/reservations`. Unknown keys are ignored (control may add some)."""

    model_config = ConfigDict(extra="ignore")

    job_id: str = Field(min_length=1, max_length=256, description="Job (or intent) it is for.")
    requester: str | None = Field(default=None, max_length=256, description="Who asked.")
    workload_type: WorkloadType = "training"
    vram_gb: float = Field(
        ge=0, le=MAX_RESERVATION_GB, strict=True, allow_inf_nan=False, description="VRAM, GiB."
    )
    ram_gb: float = Field(
        ge=0, le=MAX_RESERVATION_GB, strict=True, allow_inf_nan=False, description="RAM, GiB."
    )
    disk_gb: float | None = Field(
        default=None,
        ge=0,
        le=MAX_RESERVATION_GB,
        strict=True,
        allow_inf_nan=False,
        description="Disk to hold, GiB.",
    )
    ttl_seconds: float | None = Field(
        default=None,
        gt=0,
        le=MAX_TTL_SECONDS,
        strict=True,
        allow_inf_nan=False,
        description="Lifetime; default DEFAULT_RESERVATION_TTL_SECONDS. Not with expires_at.",
    )
    expires_at: datetime | None = Field(
        default=None, description="Absolute expiry (no timezone: UTC). Not with ttl_seconds."
    )

    @field_validator("job_id")
    @classmethod
    def _job_id_printable(cls, v: str) -> str:
        if not v.strip() or not v.isprintable():
            raise ValueError("must be a non-empty printable string")
        return v

    @field_validator("expires_at")
    @classmethod
    def _future(cls, v: datetime | None) -> datetime | None:
        if v is None:
            return None
        try:
            v = as_utc(v)
        except OverflowError:  # year 9999 at -05:00 is past the last datetime in UTC
            raise ValueError("is outside the range of dates") from None
        now = datetime.now(UTC)
        if v <= now:
            raise ValueError("is in the past")
        if (v - now).total_seconds() > MAX_TTL_SECONDS:
            raise ValueError(
                f"is more than {MAX_TTL_SECONDS / (365 * 86400):g} years ahead, "
                "the longest a reservation may last"
            )
        return v

    @model_validator(mode="after")
    def _one_expiry(self) -> ReservationRequest:
        if self.ttl_seconds is not None and self.expires_at is not None:
            raise ValueError("give ttl_seconds or expires_at, not both")
        return self


class Dimension(BaseModel):
    """One capacity dimension; available = max(0, total - reported_used)."""

    total_gb: float
    system_used_gb: float
    reserved_headroom_gb: float
    reported_used_gb: float
    available_gb: float


class ReservationView(BaseModel):
    id: str
    job_id: str
    workload_type: WorkloadType
    requester: str | None = None
    status: ReservationStatus
    vram_gb: float
    ram_gb: float
    disk_gb: float | None = None
    actual_vram_gb: float | None = None
    actual_ram_gb: float | None = None
    actual_disk_gb: float | None = None
    expires_at: str | None = None
    created_at: str


class LoadingHold(BaseModel):
    """The memory estimate of an instance start in progress, held until it ends."""

    instance_id: str
    devices: dict[str, int] = Field(description="Bytes per device (cpu, cuda:N).")
    bytes: int


class ResourceSnapshot(BaseModel):
    memory_type: Literal["VRAM", "RAM"]
    vram: Dimension | None
    ram: Dimension | None
    disk: Dimension | None
    reservations: list[ReservationView]
    loading_instances: list[LoadingHold] = Field(
        default_factory=list,
        description="Starts in progress; their estimates count in reserved_headroom_gb.",
    )


class CapacityExceededBody(BaseModel):
    error: Literal["capacity_exceeded"] = "capacity_exceeded"
    dimension: Literal["vram", "ram", "disk"]
    requested_gb: float
    available_gb: float


class ReleasedBody(BaseModel):
    detail: Literal["released"] = "released"
    id: str

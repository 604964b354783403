"""The shape of an estimate: bytes per device, by kind, and the error a config can raise."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CPU = "cpu"


def gpu_name(index: int) -> str:
    return f"cuda:{index}"


@dataclass(frozen=True, slots=True)
class Device:
    """A place memory is taken from: `cpu` (system RAM) or `cuda:N` (GPU N as NVML counts)."""

    name: str
    index: int | None
    total_bytes: int
    free_bytes: int

    @property
    def is_gpu(self) -> bool:
        return self.index is not None


@dataclass(slots=True)
class DeviceEstimate:
    """Bytes a backend takes on one device. Every byte count is clamped at 0 when set: a
    negative hold would add free memory for other starts (a model file can be hostile)."""

    device: str
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    compute_bytes: int = 0
    extra_files_bytes: int = 0

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "device":
            value = max(int(value), 0)
        object.__setattr__(self, name, value)

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes + self.kv_cache_bytes + self.compute_bytes + self.extra_files_bytes
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "compute_bytes": self.compute_bytes,
            "extra_files_bytes": self.extra_files_bytes,
            "total_bytes": self.total_bytes,
        }


@dataclass(slots=True)
class Estimate:
    """Per-device breakdown, in the order the backend uses the devices."""

    backend_type: str
    devices: list[DeviceEstimate]
    notes: list[str] = field(default_factory=list)
    # Set when the backend cannot start on these devices whatever is free (SGLang weights
    # larger than its static fraction): the fit check refuses with this reason.
    refusal: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(d.total_bytes for d in self.devices)

    def by_device(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.devices:
            if d.total_bytes:
                out[d.device] = out.get(d.device, 0) + d.total_bytes
        return out

    def as_dict(self, available: dict[str, int] | None = None) -> dict[str, Any]:
        devices = []
        for d in self.devices:
            doc = d.as_dict()
            if available is not None:
                doc["available_bytes"] = available.get(d.device)
                doc["fits"] = (
                    doc["available_bytes"] is None or d.total_bytes <= doc["available_bytes"]
                )
            devices.append(doc)
        out: dict[str, Any] = {
            "backend_type": self.backend_type,
            "devices": devices,
            "total_bytes": self.total_bytes,
            "notes": list(self.notes),
        }
        if available is not None:
            out["fits"] = self.refusal is None and all(d["fits"] for d in devices)
        if self.refusal:
            out["refusal"] = self.refusal
        return out

    def gpu_indices(self) -> list[int]:
        return [int(d.device.split(":", 1)[1]) for d in self.devices if d.device != CPU]

    def device(self, name: str) -> DeviceEstimate:
        for d in self.devices:
            if d.device == name:
                return d
        d = DeviceEstimate(name)
        self.devices.append(d)
        return d


class EstimateError(ValueError):
    """The config cannot be estimated; `field` names the config field at fault (422)."""

    def __init__(self, field_name: str, msg: str):
        self.field = field_name
        self.msg = msg
        super().__init__(f"{field_name}: {msg}")

    def errors(self) -> list[dict[str, Any]]:
        return [{"loc": [self.field], "msg": self.msg, "type": "value_error"}]

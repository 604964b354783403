"""What the machine has: GPUs (nvidia-ml-py), memory (psutil), disk (the filesystem).

A `SystemProbe` is injectable, so tests exercise GPU-host arithmetic on a CPU machine.
nvidia-ml-py is optional; when it is missing or sees no device, the host is a CPU host
(or an Apple host on macOS).
"""

from __future__ import annotations

import logging
import platform
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

log = logging.getLogger(__name__)
GB = 1024**3


@dataclass(frozen=True, slots=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class Usage:
    total_bytes: int
    used_bytes: int
    available_bytes: int


class SystemProbe(Protocol):
    def gpu_type(self) -> str: ...

    def gpus(self) -> list[GpuDevice]: ...

    def ram(self) -> Usage: ...

    def disk(self, path: Path) -> Usage | None: ...

    def gpu_process_memory(self) -> dict[int, int]: ...


def disk_usage(path: Path) -> Usage | None:
    """Usage of the filesystem holding `path` (walking up to the nearest existing parent)."""
    try:
        p = Path(path).absolute()
        while not p.exists() and p != p.parent:
            p = p.parent
        du = shutil.disk_usage(p)
    except OSError:
        return None
    return Usage(total_bytes=du.total, used_bytes=du.total - du.free, available_bytes=du.free)


class LiveProbe:
    """The real machine. NVML is initialised once, lazily, and only if it is installed."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._nvml_tried = False
        self._lock = threading.Lock()
        self._gpu_type: str | None = None

    def _pynvml(self) -> Any:
        with self._lock:
            if not self._nvml_tried:
                self._nvml_tried = True
                try:
                    import pynvml  # type: ignore[import-not-found]

                    pynvml.nvmlInit()
                    self._nvml = pynvml
                except Exception as err:  # no library, no driver, no device
                    log.debug("NVML unavailable: %s", err)
                    self._nvml = None
            return self._nvml

    def gpus(self) -> list[GpuDevice]:
        nv = self._pynvml()
        if nv is None:
            return []
        out = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                name = nv.nvmlDeviceGetName(h)
                uuid = nv.nvmlDeviceGetUUID(h)
                out.append(
                    GpuDevice(
                        index=i,
                        uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                        name=name.decode() if isinstance(name, bytes) else str(name),
                        total_bytes=int(mem.total),
                        used_bytes=int(mem.used),
                    )
                )
        except Exception as err:
            log.warning("NVML query failed: %s", err)
            return []
        return out

    def gpu_type(self) -> str:
        if self._gpu_type is None:
            if self.gpus():
                self._gpu_type = "nvidia_cuda"
            elif platform.system() == "Darwin" and platform.machine() == "arm64":
                self._gpu_type = "apple_mps"
            else:
                self._gpu_type = "cpu"
        return self._gpu_type

    def ram(self) -> Usage:
        vm = psutil.virtual_memory()
        return Usage(
            total_bytes=int(vm.total),
            used_bytes=int(vm.total - vm.available),
            available_bytes=int(vm.available),
        )

    def disk(self, path: Path) -> Usage | None:
        return disk_usage(path)

    def gpu_process_memory(self) -> dict[int, int]:
        """Bytes of GPU memory per pid (compute and graphics), summed over devices."""
        out: dict[int, int] = {}
        for per_pid in self.gpu_process_memory_by_device().values():
            for pid, used in per_pid.items():
                out[pid] = out.get(pid, 0) + used
        return out

    def gpu_process_memory_by_device(self) -> dict[int, dict[int, int]]:
        """GPU index -> {pid: bytes} (compute and graphics processes), as NVML reports them."""
        nv = self._pynvml()
        if nv is None:
            return {}
        out: dict[int, dict[int, int]] = {}
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                per_pid = out.setdefault(i, {})
                procs = []
                for fn in (
                    "nvmlDeviceGetComputeRunningProcesses",
                    "nvmlDeviceGetGraphicsRunningProcesses",
                ):
                    try:
                        procs.extend(getattr(nv, fn)(h))
                    except Exception:
                        pass
                for p in procs:
                    used = getattr(p, "usedGpuMemory", None)
                    if used is None or used < 0 or used >= 2**63:
                        continue
                    per_pid[int(p.pid)] = per_pid.get(int(p.pid), 0) + int(used)
        except Exception as err:
            log.warning("NVML process query failed: %s", err)
        return out


def round2(x: float) -> float:
    return round(x, 2)


def memory_info(probe: SystemProbe) -> dict[str, Any] | None:
    """MemoryInfo (control-contract 3.5): VRAM summed over NVIDIA GPUs, else system RAM."""
    try:
        gpus = probe.gpus()
        if gpus:
            total = sum(g.total_bytes for g in gpus)
            used = sum(g.used_bytes for g in gpus)
            kind = "VRAM"
        else:
            ram = probe.ram()
            total, used, kind = ram.total_bytes, ram.used_bytes, "RAM"
    except Exception as err:
        log.warning("memory probe failed: %s", err)
        return None
    if total <= 0:
        return None
    return {
        "used_gb": round2(used / GB),
        "total_gb": round2(total / GB),
        "available_gb": round2((total - used) / GB),
        "percent": round2(used / total * 100.0),
        "memory_type": kind,
    }


def disk_info(probe: SystemProbe, path: Path) -> dict[str, float] | None:
    u = probe.disk(path)
    if u is None:
        return None
    return {
        "total_gb": round2(u.total_bytes / GB),
        "used_gb": round2(u.used_bytes / GB),
        "available_gb": round2(u.available_bytes / GB),
    }


class CachedValue:
    """A value recomputed at most every `ttl` seconds (probes are polled by several loops)."""

    def __init__(self, ttl: float):
        self.ttl = ttl
        self._at = 0.0
        self._value: Any = None

    def get(self, compute: Any) -> Any:
        now = time.monotonic()
        if now - self._at >= self.ttl or self._value is None:
            self._value = compute()
            self._at = now
        return self._value

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import psutil

log = logging.getLogger(__name__)
GB = 1024**3
T = TypeVar("T")


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

    def gpu_process_memory_by_device(self) -> dict[int, dict[int, int]]: ...


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


# An NVML call that has not answered in this long is a failed read. A GPU that fell off the bus
# can hang NVML for minutes; every reader (the fit check, GET /resources, /metrics) would wait
# with it.
NVML_TIMEOUT_S = 5.0
# NVML talks to the NVIDIA kernel driver through these: where neither exists (a CPU machine, a
# container given no GPU) there is nothing to ask, and pynvml is not even imported (15 ms of
# the host's start-up CPU, in a thread beside the first /health).
NVIDIA_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia")


class NvmlTimeout(RuntimeError):
    """NVML did not answer within NVML_TIMEOUT_S (or an earlier call is still stuck in it)."""


class LiveProbe:
    """The real machine. NVML is initialised once, lazily, and only if it is installed.

    Every NVML read runs in a worker thread and is given NVML_TIMEOUT_S: one that does not
    answer raises NvmlTimeout. While a stuck call has not returned, further reads fail at
    once rather than start another thread that would hang beside it."""

    def __init__(
        self, nvml_timeout_s: float = NVML_TIMEOUT_S, driver_paths: tuple[str, ...] | None = None
    ) -> None:
        self._driver_paths = NVIDIA_DRIVER_PATHS if driver_paths is None else driver_paths
        self._nvml: Any = None
        self._nvml_tried = False
        self._lock = threading.Lock()
        self._gpu_type: str | None = None
        self.nvml_timeout_s = nvml_timeout_s
        self._stuck: threading.Event | None = None  # set once the stuck call returns
        self._lost: set[int] = set()  # GPUs that could not be read last time (logged once)

    def _pynvml(self) -> Any:
        with self._lock:
            if not self._nvml_tried:
                self._nvml_tried = True
                if not any(Path(p).exists() for p in self._driver_paths):
                    log.debug("NVML not tried: none of %s exists", ", ".join(self._driver_paths))
                    return None
                try:
                    import pynvml  # type: ignore[import-not-found]

                    pynvml.nvmlInit()
                    self._nvml = pynvml
                except Exception as err:  # no library, no driver, no device
                    log.debug("NVML unavailable: %s", err)
                    self._nvml = None
            return self._nvml

    def _bounded(self, what: str, query: Callable[[Any], T], empty: T) -> T:
        """`query(pynvml)` (`empty` without NVML), given nvml_timeout_s. The init runs inside
        the bound too: nvmlInit itself hangs on a lost GPU."""
        stuck = self._stuck
        if stuck is not None and not stuck.is_set():
            raise NvmlTimeout(f"NVML still has not answered an earlier call; {what} not read")
        done = threading.Event()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                nv = self._pynvml()
                box["value"] = empty if nv is None else query(nv)
            except BaseException as err:  # handed to the caller, never lost in the thread
                box["error"] = err
            finally:
                done.set()

        # A daemon thread: a call that never returns must not keep the host from exiting.
        threading.Thread(target=work, name=f"nvml-{what}", daemon=True).start()
        if not done.wait(self.nvml_timeout_s):
            self._stuck = done
            log.error("NVML did not answer (%s) within %g s", what, self.nvml_timeout_s)
            raise NvmlTimeout(f"NVML did not answer within {self.nvml_timeout_s:g} s ({what})")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def gpus(self) -> list[GpuDevice]:
        """Every GPU NVML can read. A GPU that cannot be read (fallen off the bus) is left out
        and logged: the others are still there and must not vanish with it. Raises when NVML
        cannot be read at all (no count, or not one device answered): a failed read, which
        is not the same as a host without GPUs."""
        return self._bounded("the GPU list", lambda nv: _read_gpus(nv, self._lost), [])

    def gpu_type(self) -> str:
        """Decided once from a read that worked; a failed read raises and decides nothing
        (caching "cpu" from it made a GPU host a CPU host until restart)."""
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
        try:
            return self._bounded("GPU processes", _read_gpu_processes, {})
        except Exception as err:
            log.warning("NVML process query failed: %s", err)
            return {}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_gpus(nv: Any, lost: set[int]) -> list[GpuDevice]:
    """Every GPU that answers. `lost`: the GPUs that did not last time, updated; a GPU is
    logged when it is lost and when it is back, not at every read."""
    out = []
    count = nv.nvmlDeviceGetCount()
    for i in range(count):
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            name = nv.nvmlDeviceGetName(h)
            uuid = nv.nvmlDeviceGetUUID(h)
        except Exception as err:
            if i not in lost:
                log.error("GPU %d cannot be read, left out until it answers: %s", i, err)
                lost.add(i)
            continue
        if i in lost:
            log.warning("GPU %d answers again", i)
            lost.discard(i)
        out.append(
            GpuDevice(
                index=i,
                uuid=_text(uuid),
                name=_text(name),
                total_bytes=int(mem.total),
                used_bytes=int(mem.used),
            )
        )
    if count and not out:
        raise RuntimeError(f"none of the {count} GPUs could be read")
    return out


def _read_gpu_processes(nv: Any) -> dict[int, dict[int, int]]:
    out: dict[int, dict[int, int]] = {}
    for i in range(nv.nvmlDeviceGetCount()):
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
        except Exception as err:  # a lost GPU: the others are still measured
            log.warning("GPU %d cannot be read (left out): %s", i, err)
            continue
        per_pid = out.setdefault(i, {})
        procs = []
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs.extend(getattr(nv, fn)(h))
            except Exception:
                pass
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if used is None or used < 0 or used >= 2**63:
                continue
            per_pid[int(p.pid)] = per_pid.get(int(p.pid), 0) + int(used)
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


class BackgroundReading:
    """A reading answered at once from its last value and refreshed in a worker thread once
    it is `ttl` seconds old: for answers on the event loop (GET /health) of reads that can
    hang (statvfs of a hung network mount), which then hold one thread, never the loop, and
    never more than one (no refresh starts while one is under way).

    The very first call waits up to `first_wait` seconds for the first read, so a host that
    just started answers with a value; None until a read has succeeded."""

    def __init__(self, read: Callable[[], Any], ttl: float, first_wait: float = 1.0):
        self._read = read
        self.ttl = ttl
        self._first_wait: float | None = first_wait  # None once the first call waited
        self._lock = threading.Lock()
        self._value: Any = None
        self._at: float | None = None  # monotonic time the last refresh started
        self._busy = False
        self._done = threading.Event()  # set when the first refresh ended

    def get(self) -> Any:
        now = time.monotonic()
        with self._lock:
            due = not self._busy and (self._at is None or now - self._at >= self.ttl)
            if due:
                self._busy, self._at = True, now
            wait, self._first_wait = self._first_wait, None
        if due:
            threading.Thread(target=self._refresh, name="background-reading", daemon=True).start()
        if wait is not None:
            self._done.wait(wait)
        return self._value

    def _refresh(self) -> None:
        try:
            self._value = self._read()
        except Exception as err:
            log.warning("reading failed: %s", err)
        finally:
            with self._lock:
                self._busy = False
            self._done.set()

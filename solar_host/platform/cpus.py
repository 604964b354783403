"""How many physical cores this process may run on: its CPU affinity, with the hyperthreads of
one core counted once (a CPU-bound backend gains little from a core's second thread, and
threads beyond the cores it may use only queue)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (sched_getaffinity; every CPU where there is none)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def _core_of(cpu: int, sys_cpu: Path) -> str:
    """The CPUs that share `cpu`'s core, as the kernel lists them (the same text for each)."""
    topology = sys_cpu / f"cpu{cpu}" / "topology"
    for name in ("core_cpus_list", "thread_siblings_list"):  # the first is Linux >= 5.7
        try:
            return (topology / name).read_text().strip()
        except OSError:
            continue
    return f"cpu{cpu}"  # topology unreadable: the CPU counts as a core of its own


def physical_cores(cpus: Iterable[int] | None = None, sys_cpu: Path = SYS_CPU) -> int:
    """The physical cores among `cpus` (default: this process's affinity), at least 1."""
    chosen = allowed_cpus() if cpus is None else set(cpus)
    return max(1, len({_core_of(cpu, sys_cpu) for cpu in chosen}))

"""Per-instance memory accounting: what a backend's process tree uses on each device, measured
(NVML per-process figures on NVIDIA GPUs, RSS on the CPU), beside what was estimated for it.

Blocking (psutil, NVML): callers run it in a worker thread, or at scrape time.
"""

from __future__ import annotations

import logging
from typing import Any

from solar_host.estimates.model import CPU, gpu_name
from solar_host.instances import procfs
from solar_host.resources.probes import SystemProbe
from solar_host.resources.usage import process_tree

log = logging.getLogger(__name__)


def gpu_memory_by_device(probe: SystemProbe) -> dict[int, dict[int, int]]:
    """GPU index -> {pid: bytes} ({} when the probe cannot tell)."""
    try:
        return probe.gpu_process_memory_by_device()
    except Exception as err:
        log.debug("GPU process memory unavailable: %s", err)
        return {}


# Processes one tree may hold before the walk stops (a fork bomb must not stall the sampler).
MAX_TREE = 10_000


def tree_pids(root_pid: int) -> set[int]:
    """The pid and all its descendants; empty if it is gone. Reads only the tree's own
    /proc entries (procfs.children), falling back to psutil's scan where the kernel cannot
    list children."""
    if root_pid <= 0 or procfs.stat(root_pid) is None:
        return set()
    pids, todo = {root_pid}, [root_pid]
    while todo and len(pids) < MAX_TREE:
        kids = procfs.children(todo.pop())
        if kids is None:
            return process_tree(root_pid)
        for kid in kids:
            if kid not in pids:
                pids.add(kid)
                todo.append(kid)
    return pids


def measure_tree(root_pid: int | None, gpu_memory: dict[int, dict[int, int]]) -> dict[str, int]:
    """Bytes per device used by the process tree under `root_pid` ({} when it is gone): the
    RSS of its processes on the CPU (shared pages count in each), NVML's per-process figures
    summed over the tree per GPU."""
    if not root_pid:
        return {}
    pids = tree_pids(root_pid)
    if not pids:
        return {}
    out = {CPU: sum(procfs.rss_bytes(pid) for pid in pids)}
    for index, per_pid in sorted(gpu_memory.items()):
        used = sum(n for pid, n in per_pid.items() if pid in pids)
        if used:
            out[gpu_name(index)] = used
    return out


def estimated(gate: Any, inst: Any) -> dict[str, int]:
    """The estimate per device of an instance's last start ({} when none was made)."""
    if gate is None:
        return {}
    placement = gate.placements.get(inst.id)
    return dict(placement.needs) if placement is not None else {}


def memory_view(
    gate: Any, probe: Any, inst: Any, gpu_memory: Any = None, sampled: Any = None
) -> dict[str, Any] | None:
    """{devices: [{device, estimate_bytes, measured_bytes}], estimate_bytes, measured_bytes,
    source, admission, sampled} for a running instance; None when it has no process and no
    estimate. `estimate_bytes` is what its start admitted per device (the estimate, or the
    measured peak of an earlier load plus the margin: `source`); `admission` names both
    figures; `sampled` is the sampler's peak and steady figures of this process."""
    est = estimated(gate, inst)
    measured = {}
    if inst.pid:
        if gpu_memory is None:
            gpu_memory = gpu_memory_by_device(probe)
        measured = measure_tree(inst.pid, gpu_memory)
    if not est and not measured:
        return None
    names = sorted(set(est) | set(measured), key=lambda n: (n != CPU, n))
    return {
        "devices": [
            {
                "device": n,
                "estimate_bytes": est.get(n),
                "measured_bytes": measured.get(n) if inst.pid else None,
            }
            for n in names
        ],
        "estimate_bytes": sum(est.values()) if est else None,
        "measured_bytes": sum(measured.values()) if measured else None,
        **admission(gate, inst),
        "sampled": sampled,
    }


def admission(gate: Any, inst: Any) -> dict[str, Any]:
    """{source, admission: {source, admitted_bytes, estimated_bytes, measured_bytes}} of an
    instance's last start; source None when no start was admitted with a figure."""
    placement = gate.placements.get(inst.id) if gate is not None else None
    if placement is None:
        return {"source": None, "admission": None}
    figures = placement.figures()
    return {"source": figures["source"], "admission": figures}


def memory_families(host: Any) -> list[Any]:
    """Prometheus families: estimated and measured bytes per instance and device."""
    from solar_host.metrics.families import PREFIX, Family

    manager = host.instances
    gate = manager.capacity if manager is not None else None
    est = Family(
        f"{PREFIX}_instance_memory_estimate_bytes",
        "gauge",
        "Memory estimated for an instance's last start, per device (cpu, cuda:N).",
        ("instance_id", "device"),
    )
    used = Family(
        f"{PREFIX}_instance_memory_measured_bytes",
        "gauge",
        "Memory a running instance's backend processes use, per device (RSS; NVML on GPUs).",
        ("instance_id", "device"),
    )
    sups = list(manager.supervisors.values()) if manager is not None else []
    gpu_memory = gpu_memory_by_device(host.probe) if any(s.instance.pid for s in sups) else {}
    for sup in sups:
        inst = sup.instance
        for dev, n in estimated(gate, inst).items():
            est.add((inst.id, dev), n)
        if inst.pid:
            for dev, n in measure_tree(inst.pid, gpu_memory).items():
                used.add((inst.id, dev), n)
    drift = Family(
        f"{PREFIX}_instance_memory_drift",
        "counter",
        "Times a running instance was seen above its admitted memory on a device by more than "
        "MEMORY_DRIFT_SHARE for two samples in a row.",
        ("instance_id",),
    )
    sampler = host.memory
    if sampler is not None:
        for iid, n in sorted(sampler.drifts.items()):
            drift.add((iid,), n)
    return [est, used, drift]


def instance_memory(host: Any, inst: Any) -> dict[str, Any] | None:
    manager = host.instances
    sampler = host.memory
    sampled = sampler.view(inst.id) if sampler is not None else None
    gate = manager.capacity if manager is not None else None
    return memory_view(gate, host.probe, inst, sampled=sampled)

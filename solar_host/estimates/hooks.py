"""The calls the start path makes into the capacity gate (each one line there).

They take the supervisor and do nothing when the manager has no gate (a manager built
without one, as some tests do).
"""

from __future__ import annotations

from typing import Any


async def admit_start(sup: Any) -> None:
    """Before anything is spawned: place the instance and check it fits (InsufficientMemory)."""
    gate = getattr(sup.m, "capacity", None)
    if gate is None:
        return
    placement = await gate.admit(sup.id, sup.instance.config)
    sup.instance.placed_devices = placement.device_names if placement is not None else None


async def hold_adopted(sup: Any) -> None:
    """An adopted backend still loading: its estimate is held until its readiness (end_start)."""
    gate = getattr(sup.m, "capacity", None)
    if gate is not None:
        inst = sup.instance
        await gate.hold_adopted(sup.id, inst.config, inst.placed_devices)


def end_start(sup: Any) -> None:
    """The start ended (ready, failed or cancelled): its hold goes."""
    gate = getattr(sup.m, "capacity", None)
    if gate is not None:
        gate.release(sup.id)


def apply_placement(sup: Any, spec: Any) -> None:
    """Pin the backend to the GPUs the host chose (an explicit setting wins)."""
    gate = getattr(sup.m, "capacity", None)
    if gate is None:
        return
    for k, v in gate.env_for(sup.id).items():
        spec.env.setdefault(k, v)

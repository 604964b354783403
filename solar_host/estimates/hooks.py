"""The calls the start path makes into the capacity gate (each one line there).

They take what is starting (its id, its record and its context's gate) and do nothing when
the host has no gate (a manager built without one, as some tests do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from solar_host.backends.base import LaunchSpec
    from solar_host.estimates.capacity import CapacityGate


class _Context(Protocol):
    capacity: CapacityGate | None


class Starting(Protocol):
    """A supervisor as the gate sees it."""

    id: str
    ctx: _Context

    @property
    def instance(self) -> Any: ...


async def admit_start(sup: Starting) -> None:
    """Before anything is spawned: place the instance and check it fits (InsufficientMemory)."""
    gate = sup.ctx.capacity
    if gate is None:
        return
    placement = await gate.admit(sup.id, sup.instance.config)
    sup.instance.placed_devices = placement.device_names if placement is not None else None


async def hold_adopted(sup: Starting) -> None:
    """An adopted backend still loading: its estimate is held until its readiness (end_start)."""
    gate = sup.ctx.capacity
    if gate is not None:
        inst = sup.instance
        await gate.hold_adopted(sup.id, inst.config, inst.placed_devices)


def end_start(sup: Starting) -> None:
    """The start ended (ready, failed or cancelled): its hold goes."""
    gate = sup.ctx.capacity
    if gate is not None:
        gate.release(sup.id)


def apply_placement(sup: Starting, spec: LaunchSpec) -> None:
    """Pin the backend to the GPUs the host chose (an explicit setting wins)."""
    gate = sup.ctx.capacity
    if gate is None:
        return
    for k, v in gate.env_for(sup.id).items():
        spec.env.setdefault(k, v)

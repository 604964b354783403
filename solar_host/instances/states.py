"""Instance states and the one table of allowed transitions."""

from __future__ import annotations

from enum import StrEnum


class InstanceStatus(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    FAILED = "failed"


S = InstanceStatus

# from -> the states it may move to. Everything else is a bug and raises.
TRANSITIONS: dict[InstanceStatus, frozenset[InstanceStatus]] = {
    S.STOPPED: frozenset({S.STARTING, S.RUNNING}),  # RUNNING: re-adoption at boot
    S.STARTING: frozenset({S.RUNNING, S.FAILED, S.STOPPING, S.STOPPED, S.STARTING}),
    S.RUNNING: frozenset({S.STOPPING, S.FAILED, S.STARTING}),  # STARTING: crash restart
    S.STOPPING: frozenset({S.STOPPED, S.FAILED}),
    S.FAILED: frozenset({S.STARTING, S.STOPPED, S.RUNNING}),
}

# Edges only boot recovery and adoption take: what a previous host process recorded is not what
# runs now. A backend found running (by its record or its marker) is adopted as starting or
# running whatever was recorded; one whose stop was under way (or that is not wanted) is
# stopping; an active instance whose backend is gone is stopped.
RECOVERY: dict[InstanceStatus, frozenset[InstanceStatus]] = {
    S.STOPPED: frozenset({S.STARTING, S.RUNNING, S.STOPPING}),
    S.STARTING: frozenset({S.RUNNING, S.STARTING, S.STOPPING, S.STOPPED}),
    S.RUNNING: frozenset({S.RUNNING, S.STARTING, S.STOPPING, S.STOPPED}),
    S.STOPPING: frozenset({S.STARTING, S.RUNNING, S.STOPPING, S.STOPPED}),
    S.FAILED: frozenset({S.STARTING, S.RUNNING, S.STOPPING}),
}

# States in which a backend process may exist and model files are in use.
ACTIVE = frozenset({S.STARTING, S.RUNNING, S.STOPPING})


class IllegalTransition(RuntimeError):
    pass


def check_transition(
    current: InstanceStatus, new: InstanceStatus, *, recovery: bool = False
) -> None:
    """Raise IllegalTransition unless `current -> new` is in the table (`recovery`: or in
    RECOVERY, for boot recovery and adoption)."""
    if new not in TRANSITIONS[current] and not (recovery and new in RECOVERY[current]):
        raise IllegalTransition(f"instance cannot go from {current} to {new}")

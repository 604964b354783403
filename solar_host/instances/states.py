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

# States in which a backend process may exist and model files are in use.
ACTIVE = frozenset({S.STARTING, S.RUNNING, S.STOPPING})


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: InstanceStatus, new: InstanceStatus) -> None:
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(f"instance cannot go from {current} to {new}")

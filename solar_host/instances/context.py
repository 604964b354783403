"""What a supervisor may use of the host: a narrow, typed set of services and callbacks.

The instance service (manager.py) builds one and hands it to every supervisor. A supervisor
never holds the manager: it cannot reach the registry of other instances, nor the manager's
private state, and the two modules do not import each other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from solar_host.backends.base import HostFacts
    from solar_host.backends.registry import BackendRegistry
    from solar_host.estimates.capacity import CapacityGate
    from solar_host.events import EventBus
    from solar_host.instances.httpcheck import ProbePacer
    from solar_host.instances.logs import IdleLogBuffers, InotifyHub
    from solar_host.instances.ports import PortAllocator
    from solar_host.platform.logging_setup import Redactor
    from solar_host.settings import Settings


@dataclass(eq=False)
class SupervisorContext:
    settings: Settings
    bus: EventBus
    backends: BackendRegistry
    ports: PortAllocator
    idle_logs: IdleLogBuffers
    probe_pacer: ProbePacer  # readiness probes of every starting backend share one pace
    api_key: Callable[[], str]  # the host's key, read at each use (it can be rotated)
    facts: Callable[[], HostFacts]
    marker: Callable[[str], str]  # instance id -> MARKER_VAR's value for its backends
    key_hash: Callable[[str], str]  # key -> the fingerprint a process record keeps
    # (instance id, status or None when deleted, reason): the one notification of a change.
    changed: Callable[[str, str | None, str], None]
    persist: Callable[[], Awaitable[None]]  # save config.json; a failure is logged
    persist_or_raise: Callable[[], Awaitable[None]]  # save, or NotPersisted (507)
    persist_soon: Callable[[], None]  # save without waiting (saves coalesce)
    prune_logs_soon: Callable[[], None]
    backend_redactor: Callable[[str | None], Redactor]
    # instance id -> the ports other instances last served on (never handed to this one).
    ports_kept_by_others: Callable[[str], set[int]]
    # Set when the service starts (inotify) and by the composition root (the capacity gate;
    # None for a manager built without one, as some tests do).
    inotify: InotifyHub | None = None
    capacity: CapacityGate | None = None
    # instance id -> the peak memory (bytes) the sampler saw of its backend's tree, or None.
    peak_memory: Callable[[str], int | None] | None = None

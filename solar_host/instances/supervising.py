"""What the flows beside the state machine (adoption.py, crashes.py) use of an instance's
supervisor: its records, its one status writer, and the steps they hand over to.

A Protocol, so those modules are typed without importing supervisor.py (which imports them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from solar_host.backends.base import Backend
    from solar_host.instances import process as procs
    from solar_host.instances.context import SupervisorContext
    from solar_host.instances.lease import Lease
    from solar_host.instances.logs import LogFollower, LogRing
    from solar_host.instances.restarts import CrashLoop
    from solar_host.instances.states import InstanceStatus
    from solar_host.instances.store import StoredInstance
    from solar_host.instances.telemetry import Telemetry
    from solar_host.platform.logging_setup import Redactor


class Supervising(Protocol):
    """What the adoption flow uses of an instance's supervisor (supervisor.py): its records,
    its one status writer, and the start, stop and crash steps adoption hands over to."""

    id: str
    ctx: SupervisorContext
    stored: StoredInstance
    lease: Lease | None
    lock: asyncio.Lock
    deleted: bool
    counters: dict[str, int]
    ring: LogRing
    telemetry: Telemetry
    start_task: asyncio.Task[Any] | None
    stop_task: asyncio.Task[Any] | None
    adopt_task: asyncio.Task[Any] | None
    ready: asyncio.Event | None
    restart_task: asyncio.Task[None] | None
    crashes: CrashLoop
    crash_reason: str | None  # the failure a scheduled restart follows
    ended_why: str | None  # why the host ended a running backend itself (liveness)

    @property
    def instance(self) -> Any: ...
    @property
    def status(self) -> InstanceStatus: ...
    @property
    def proc(self) -> procs.BackendProcess | None: ...
    @property
    def follower(self) -> LogFollower | None: ...
    def backend(self) -> Backend: ...
    def set_status(
        self, new: InstanceStatus, *, reason: str = "", recovery: bool = False, **fields: Any
    ) -> None: ...
    def watch(self, proc: procs.BackendProcess) -> None: ...
    def follow(self, path: Path, offset: int, ready_check: Backend | None) -> None: ...
    def wait_ready(
        self, proc: procs.BackendProcess, backend: Backend, host: str, port: int, timeout: float
    ) -> Awaitable[None]: ...
    async def release(self) -> None: ...
    def after_stop_hook(self) -> None: ...
    def tail(self) -> list[str]: ...
    def bearer(self) -> str: ...
    def redactor(self) -> Redactor: ...
    async def run_start(
        self,
        *,
        restart: bool = False,
        attempts: int | None = None,
        deadline: float | None = None,
        undo_intent: bool = False,
    ) -> Any: ...
    async def record_crash(
        self, proc: procs.BackendProcess, reason: str, code: int | None
    ) -> None: ...
    async def record_stopped(self, left_behind: list[str] | None = None) -> None: ...
    async def nothing_due(self) -> None: ...
    async def begin_start(
        self, *, undo_intent: bool | None = None, restart_op: bool = False
    ) -> None: ...

"""A lease on one live backend of an instance: its process, its API port, the follower of its
log and the tasks that watch it.

Acquired by a spawn (a start attempt) or an adoption; the supervisor holds at most one, and
gives it back in one way whatever ended the backend (a stop, a crash, a failed attempt, an
adopted backend that never became ready): `stop_watching()` then `release_port()`.
"""

from __future__ import annotations

import asyncio

from solar_host.instances import process as procs
from solar_host.instances.logs import LogFollower
from solar_host.instances.ports import PortAllocator


class Lease:
    def __init__(self, proc: procs.BackendProcess, port: int, ports: PortAllocator) -> None:
        self.proc = proc
        self.port = port
        self._ports = ports
        self.follower: LogFollower | None = None
        self.watch_task: asyncio.Task[None] | None = None  # its exit (a crash)
        self.metrics_task: asyncio.Task[None] | None = None
        self.liveness_task: asyncio.Task[None] | None = None

    def follow(self, follower: LogFollower) -> None:
        self.follower = follower
        follower.start()

    def cancel_watchers(self) -> None:
        """Stop polling it (metrics, liveness); its exit is still watched."""
        for task in (self.metrics_task, self.liveness_task):
            if task is not None and not task.done():
                task.cancel()

    async def stop_watching(self) -> None:
        """Stop every watcher (the exit watch too, unless it is the caller: crash handling
        runs in it) and read the rest of its log."""
        self.cancel_watchers()
        task = self.watch_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        if self.follower is not None:
            await self.follower.stop(flush=True)
            self.follower = None

    def release_port(self) -> None:
        self._ports.release(self.port)

"""A lease on one live backend of an instance: its process, its API port, the follower of its
log and the tasks that watch it.

Acquired by a spawn (a start attempt) or an adoption; the supervisor holds at most one, and
gives it back in one way whatever ended the backend (a stop, a crash, a failed attempt, an
adopted backend that never became ready): `stop_watching()` then `release_port()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from solar_host.backends.base import Backend
from solar_host.events import EventBus, LogLine
from solar_host.instances import process as procs
from solar_host.instances import relays
from solar_host.instances.logs import InotifyHub, LogFollower, LogRing
from solar_host.instances.ports import PortAllocator
from solar_host.instances.telemetry import Telemetry
from solar_host.platform.logging_setup import Redactor
from solar_host.settings import Settings


class LineSink:
    """Where a backend's log lines go as they are read: redacted into the instance's ring and
    onto the bus, raw into its telemetry parser, and past the ready check of a start."""

    def __init__(
        self,
        ring: LogRing,
        bus: EventBus,
        instance_id: str,
        telemetry: Telemetry,
        redact: Redactor,
        ready_check: Backend | None,
        ready: Callable[[], asyncio.Event | None],
    ) -> None:
        self.ring, self.bus, self.instance_id = ring, bus, instance_id
        self.telemetry, self.redact = telemetry, redact
        self.ready_check, self.ready = ready_check, ready

    def __call__(self, lines: list[str]) -> None:
        ts = datetime.now(UTC).isoformat()
        entries = self.ring.append_many([self.redact(line) for line in lines], ts)
        for e in entries:
            self.bus.publish(LogLine(self.instance_id, e.seq, ts, e.line))
        self.telemetry.feed(lines)
        ready, check = self.ready(), self.ready_check
        if check is not None and ready is not None and not ready.is_set():
            if any(check.is_ready_line(line) for line in lines):
                ready.set()


class Lease:
    def __init__(self, proc: procs.BackendProcess, port: int, ports: PortAllocator) -> None:
        self.proc = proc
        self.port = port
        self._ports = ports
        # The cgroup's oom_kill counter when it began serving (crashes.watch; flight.py).
        self.oom_kills_at_start: int | None = None
        self.follower: LogFollower | None = None
        self.watch_task: asyncio.Task[None] | None = None  # its exit (a crash)
        self.metrics_task: asyncio.Task[None] | None = None
        self.liveness_task: asyncio.Task[None] | None = None
        self.canary_task: asyncio.Task[None] | None = None  # its known-answer probes
        self.relay_task: asyncio.Task[None] | None = None  # its log relay kept (relay_watch)

    def follow_log(
        self,
        path: Path,
        offset: int,
        on_lines: Callable[[list[str]], None],
        inotify: InotifyHub | None,
        settings: Settings,
        *,
        on_rotate: Callable[[int], None],
    ) -> None:
        """Follow the backend's log file from `offset`, within the log bounds of `settings`."""
        self.follower = LogFollower(
            path,
            on_lines,
            inotify,
            offset=offset,
            max_line_bytes=settings.log_line_max_bytes,
            max_file_bytes=settings.log_file_max_bytes,
            generations=settings.log_file_generations,
            on_rotate=on_rotate,
        )
        self.follower.start()

    def cancel_watchers(self) -> None:
        """Stop polling it (metrics, liveness, canary) and keeping its log relay; its exit is
        still watched."""
        for task in (self.metrics_task, self.liveness_task, self.canary_task, self.relay_task):
            if task is not None and not task.done():
                task.cancel()

    def stop_watchers(self) -> None:
        """Stop every watcher, the exit watch too (unless it is the caller: crash handling
        runs in it): what follows its end is the caller's, not a crash."""
        self.cancel_watchers()
        task = self.watch_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    async def stop_watching(self) -> None:
        """Stop every watcher and read the rest of its log."""
        self.stop_watchers()
        if self.follower is not None:
            relay = self.proc.relay
            if relay is not None and not self.proc.alive():
                # What the backend wrote last may still be in its pipe: the relay exits
                # once it has written it all (a failed start's log_tail is those lines).
                await relays.drained(relay)
            await self.follower.stop(flush=True)
            self.follower = None

    def release_port(self) -> None:
        self._ports.release(self.port)

"""Whether an instance is wanted running (config.json's want_running), on disk before it is
acted on: the next boot starts what is wanted, so a start or stop it would undo is refused.

A stop saves it before any signal. A start saves it while its fit check runs (one fsync less
in its time) and awaits that save before it goes further. A save that fails (NotPersisted,
507) puts it back as it was: nothing is started or stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from solar_host.instances.errors import NotPersisted
from solar_host.instances.store import StoredInstance


def _retrieved(task: asyncio.Task[Any]) -> None:
    """The error of a start's save is the start's to answer; a start cancelled before it
    asked leaves it unread (not "never retrieved" noise)."""
    if not task.cancelled():
        task.exception()


class Intent:
    """One instance's want_running and its save; used under the supervisor's lock."""

    def __init__(self, stored: StoredInstance, save: Callable[[], Awaitable[None]]):
        self.stored = stored
        self._save = save  # config.json, or NotPersisted
        self._pending: asyncio.Task[None] | None = None  # a start's save (record_soon)

    @property
    def wanted(self) -> bool:
        return self.stored.want_running

    async def record(self, wanted: bool) -> None:
        """Put `wanted` on disk before acting on it; NotPersisted leaves it as it was."""
        self.stored.want_running = wanted
        try:
            await self._save()
        except NotPersisted:
            self.stored.want_running = not wanted
            raise

    def record_soon(self, name: str) -> None:
        """A start's "wanted": saved in a task of its own, awaited by `on_disk`."""
        self._pending = asyncio.create_task(self.record(True), name=name)
        self._pending.add_done_callback(_retrieved)

    async def settled(self) -> None:
        """Before want_running is read under the lock: a start's save of it has ended (when
        it failed, want_running is back as it was), and is no later start's to await."""
        task = self._pending
        if task is not None:
            if not task.done():
                await asyncio.wait({task})
            if self._pending is task:
                self._pending = None

    async def on_disk(self) -> None:
        """The start's save awaited (nothing when it made none): NotPersisted if it failed.
        Once ended it is forgotten: a later start (a crash restart) has none of its own."""
        task = self._pending
        if task is None:
            return
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and self._pending is task:
                self._pending = None

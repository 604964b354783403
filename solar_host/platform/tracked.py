"""Models whose attribute assignments are noticed, so config.json re-encodes only what changed.

Every save of config.json used to encode every instance record (16 ms at 1,000 instances, on the
event loop): the 1,000th create cost far more than the 10th. Records are mutated in place by
many owners (the supervisor sets status and pid, the manager applies updates), so instead of
asking each of them to report changes, the record's models (StoredInstance, Instance, the
backend config, ProcessRecord) report their own: an assignment to any attribute adds the
object's id to the dirty set of every live `DirtySet` (one per InstanceStore).

A change made inside a list or dict in place is not an assignment and goes unseen here; the
store's idle check (a full encode once saves pause) catches that.
"""

from __future__ import annotations

import weakref
from typing import Any

from pydantic import BaseModel


class DirtySet:
    """Ids of tracked objects assigned to since the last `take()`."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        _watchers.add(self)

    def take(self) -> set[int]:
        ids, self.ids = self.ids, set()
        return ids


_watchers: weakref.WeakSet[DirtySet] = weakref.WeakSet()


class Tracked(BaseModel):
    """A pydantic model that reports attribute assignments to every DirtySet."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if _watchers:
            key = id(self)
            for watcher in _watchers:
                watcher.ids.add(key)

"""The in-process event bus and the event types the core publishes.

Events flow one way: services publish, adapters (WebSocket streams, the control link,
metrics) subscribe. Handlers are plain callables run inline by `publish`; they must be cheap
and must never block (a handler that needs to do I/O puts the event on its own bounded queue).
That keeps publishing a log line a few microseconds, whoever listens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar

log = logging.getLogger(__name__)


def utc_now() -> datetime:
    return datetime.now(UTC)


def iso_now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass(frozen=True, slots=True)
class Event:
    """Base of every event. `topic` names the kind for subscribers and metrics."""

    topic: ClassVar[str] = "event"


# --- instances --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InstancesChanged(Event):
    """An instance was created, updated, deleted or changed status.

    Carries only ids: the control link reads the full list itself (it always sends full lists).
    """

    topic: ClassVar[str] = "instances_changed"
    instance_id: str
    status: str | None = None  # None when deleted
    reason: str = ""


@dataclass(frozen=True, slots=True)
class LogLine(Event):
    topic: ClassVar[str] = "log_line"
    instance_id: str
    seq: int
    timestamp: str
    line: str


@dataclass(frozen=True, slots=True)
class RuntimeStateChanged(Event):
    topic: ClassVar[str] = "runtime_state"
    instance_id: str
    timestamp: str
    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class GenerationFinished(Event):
    topic: ClassVar[str] = "generation_finished"
    instance_id: str
    metrics: dict[str, Any]


@dataclass(frozen=True, slots=True)
class InstanceStartTimed(Event):
    """Phases of one successful start attempt, for the start-duration histogram."""

    topic: ClassVar[str] = "instance_start_timed"
    instance_id: str
    backend_type: str
    to_first_log_s: float | None
    to_ready_s: float


@dataclass(frozen=True, slots=True)
class InstanceCrashed(Event):
    topic: ClassVar[str] = "instance_crashed"
    instance_id: str
    exit_code: int | None


@dataclass(frozen=True, slots=True)
class BackendEnded(Event):
    """A flight record was made: a backend ended unasked or a start attempt failed."""

    topic: ClassVar[str] = "backend_ended"
    instance_id: str
    cause: str


@dataclass(frozen=True, slots=True)
class InstanceStartFinished(Event):
    topic: ClassVar[str] = "instance_start_finished"
    instance_id: str
    ok: bool
    restart: bool = False


# --- model store -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PullProgress(Event):
    """One progress report of a pull; `payload` is the contract's pull_progress data."""

    topic: ClassVar[str] = "pull_progress"
    payload: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.payload.get("phase") in ("completed", "failed")


# --- jobs ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepLog(Event):
    """A step log entry (a line, or the completion marker) in the contract's step_log shape."""

    topic: ClassVar[str] = "step_log"
    entry: dict[str, Any]

    @property
    def is_marker(self) -> bool:
        return bool(self.entry.get("completed"))


@dataclass(frozen=True, slots=True)
class JobLifecycle(Event):
    """`name` is the Socket.IO event name (job_started, step_failed, ...)."""

    topic: ClassVar[str] = "job_lifecycle"
    name: str
    payload: dict[str, Any]


# --- resources -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReservationsChanged(Event):
    """The ledger changed; the control link pushes host_health early so placement sees it."""

    topic: ClassVar[str] = "reservations_changed"
    reason: str = ""


# --- measured memory ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemoryDrift(Event):
    """A running instance took more than its admitted memory on a device, by more than
    MEMORY_DRIFT_SHARE, for two samples in a row (published once per drift)."""

    topic: ClassVar[str] = "instance_memory_drift"
    instance_id: str
    device: str
    admitted_bytes: int
    measured_bytes: int
    source: str  # what it was admitted from: "measured" | "estimated"


Handler = Callable[[Event], None]


class EventBus:
    """Synchronous publish/subscribe keyed by event class (subclasses match too).

    Handler lists are resolved once per event class and cached, so publishing costs one dict
    lookup plus the handler calls (log lines are published at hundreds of thousands a second).
    """

    def __init__(self) -> None:
        self._handlers: list[tuple[tuple[type[Event], ...], Handler]] = []
        self._by_class: dict[type[Event], tuple[Handler, ...]] = {}
        self.published: dict[str, int] = {}

    def subscribe(self, handler: Handler, *types: type[Event]) -> Callable[[], None]:
        """Call `handler` for every event of `types` (all events if none). Returns unsubscribe."""
        entry = (types or (Event,), handler)
        self._handlers.append(entry)
        self._by_class.clear()

        def unsubscribe() -> None:
            try:
                self._handlers.remove(entry)
            except ValueError:
                pass
            self._by_class.clear()

        return unsubscribe

    def _resolve(self, cls: type[Event]) -> tuple[Handler, ...]:
        handlers = tuple(h for types, h in self._handlers if issubclass(cls, types))
        self._by_class[cls] = handlers
        return handlers

    def publish(self, event: Event) -> None:
        cls = type(event)
        handlers = self._by_class.get(cls)
        if handlers is None:
            handlers = self._resolve(cls)
        topic = cls.topic
        self.published[topic] = self.published.get(topic, 0) + 1
        for handler in handlers:
            try:
                handler(event)
            except Exception:  # a broken subscriber must not break the publisher
                log.exception("event handler failed for %s", topic)

"""The bounded outbox between the event bus and the socket.

Bus handlers only append here (a few microseconds, never I/O); the link's flush loop drains it
every OUTBOX_FLUSH_INTERVAL_S into batched emits. When it is full, only log lines and
runtime-state entries (and non-terminal progress, which the next report supersedes) make room,
oldest first, and every drop is counted (ruling 4). Pull terminal events, job lifecycle events
and step completion markers are kept while connected. While disconnected nothing is kept:
control recovers state over REST, and a replay of stale telemetry would only mislead it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class _Item:
    """An ordered outbox entry: a step log entry or a whole event."""

    kind: str  # "step_log" | "step_marker" | "pull_progress" | "job_lifecycle"
    event: str  # the Socket.IO event name
    payload: dict[str, Any]
    droppable: bool
    key: str | None = None  # source_uri of a non-terminal pull report (coalesced)


class Outbox:
    """Log lines, runtime states, step logs, pull progress and job events waiting to be sent.

    `accepting` is False while the link is not registered: everything offered then is dropped
    and counted.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.accepting = False
        self.dropped: Counter[str] = Counter()
        self._logs: deque[dict[str, Any]] = deque()
        self._states: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Step logs and events share one queue so their relative order survives batching.
        self._ordered: deque[_Item] = deque()
        self._pending_pulls: dict[str, _Item] = {}

    def __len__(self) -> int:
        return len(self._logs) + len(self._states) + len(self._ordered)

    # --- offering -----------------------------------------------------------------------------

    def put_log(self, entry: dict[str, Any]) -> None:
        if self._refuse("log"):
            return
        if not self._make_room("log"):
            return
        self._logs.append(entry)

    def put_state(self, instance_id: str, entry: dict[str, Any]) -> None:
        """Keep only the latest state per instance until the next flush."""
        if self._refuse("state"):
            return
        if instance_id in self._states:
            self._states[instance_id] = entry
            self._states.move_to_end(instance_id)
            return
        if not self._make_room("state"):
            return
        self._states[instance_id] = entry

    def put_step_log(self, entry: dict[str, Any]) -> None:
        marker = bool(entry.get("completed"))
        kind = "step_marker" if marker else "step_log"
        if self._refuse(kind):
            return
        if not self._make_room(kind, droppable=not marker):
            return
        self._ordered.append(_Item(kind, "step_log", entry, droppable=not marker))

    def put_pull_progress(self, payload: dict[str, Any], *, timestamp: str) -> None:
        """A non-terminal report replaces the waiting one of the same source_uri."""
        terminal = payload.get("phase") in ("completed", "failed")
        kind = "pull_terminal" if terminal else "pull_progress"
        if self._refuse(kind):
            return
        body = {"timestamp": timestamp, "data": payload}
        uri = payload.get("source_uri")
        if not terminal and isinstance(uri, str):
            waiting = self._pending_pulls.get(uri)
            if waiting is not None:
                waiting.payload = body
                return
        if not self._make_room(kind, droppable=not terminal):
            return
        item = _Item(kind, "pull_progress", body, droppable=not terminal)
        if not terminal and isinstance(uri, str):
            item.key = uri
            self._pending_pulls[uri] = item
        elif isinstance(uri, str):
            # A terminal report ends that pull: later reports queue behind it, never into it.
            self._pending_pulls.pop(uri, None)
        self._ordered.append(item)

    def put_event(self, name: str, payload: dict[str, Any]) -> None:
        """A job lifecycle event: never dropped while accepting."""
        if self._refuse("job_lifecycle"):
            return
        self._make_room("job_lifecycle", droppable=False)
        self._ordered.append(_Item("job_lifecycle", name, payload, droppable=False))

    # --- draining -----------------------------------------------------------------------------

    def drain(self) -> list[tuple[str, dict[str, Any]]]:
        """Everything waiting, as (event, payload) emits in the order to send them."""
        out: list[tuple[str, dict[str, Any]]] = []
        if self._logs:
            out.append(("log_batch", {"entries": list(self._logs)}))
            self._logs.clear()
        if self._states:
            out.append(("instance_state_batch", {"entries": list(self._states.values())}))
            self._states.clear()
        steps: list[dict[str, Any]] = []
        for item in self._ordered:
            if item.event == "step_log":
                steps.append(item.payload)
                continue
            if steps:
                out.append(("step_log", {"entries": steps}))
                steps = []
            out.append((item.event, item.payload))
        if steps:
            out.append(("step_log", {"entries": steps}))
        self._ordered.clear()
        self._pending_pulls.clear()
        return out

    def set_accepting(self, accepting: bool) -> None:
        """Open or close the outbox; closing drops (and counts) what is waiting."""
        if not accepting:
            self._drop_all()
        self.accepting = accepting

    # --- internals ----------------------------------------------------------------------------

    def _refuse(self, kind: str) -> bool:
        if self.accepting:
            return False
        self.dropped[kind] += 1
        return True

    def _make_room(self, kind: str, *, droppable: bool = True) -> bool:
        """Free one slot if full. False means the new entry itself is dropped (and counted)."""
        if len(self) < self.max_entries:
            return True
        if self._logs:
            self._logs.popleft()
            self.dropped["log"] += 1
            return True
        if self._states:
            self._states.popitem(last=False)
            self.dropped["state"] += 1
            return True
        for i, item in enumerate(self._ordered):
            if item.droppable:
                del self._ordered[i]
                if item.key is not None:
                    self._pending_pulls.pop(item.key, None)
                self.dropped[item.kind] += 1
                return True
        if droppable:
            self.dropped[kind] += 1
            return False
        return True  # kept over the bound: these are rare and must not be lost

    def _drop_all(self) -> None:
        self.dropped["log"] += len(self._logs)
        self.dropped["state"] += len(self._states)
        for item in self._ordered:
            self.dropped[item.kind] += 1
        self._logs.clear()
        self._states.clear()
        self._ordered.clear()
        self._pending_pulls.clear()

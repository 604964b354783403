"""Runtime state and per-request generation metrics of one instance, fed by its log parser."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from solar_host.backends.base import GenerationMetrics, LogParser, ParseResult, RuntimeState
from solar_host.events import EventBus, GenerationFinished, RuntimeStateChanged, iso_now

RECENT_GENERATIONS = 100
# Series of a Prometheus client's own process (CPU seconds, memory, GC): they move while the
# engine is stuck, so they never count as its progress.
EXPORTER_PREFIXES = ("process_", "python_")


class Telemetry:
    """Owned by one supervisor; survives restarts of the backend (keeps last-generation)."""

    def __init__(self, instance_id: str, bus: EventBus, state_buffer: int = 1000):
        self.instance_id = instance_id
        self.bus = bus
        self.state = RuntimeState()
        self.state_at = iso_now()
        # When the state last changed (monotonic): the canary probes only a backend idle a while.
        self.state_changed = time.monotonic()
        # When the backend last showed progress (monotonic): a log line, a state change, a
        # finished request, or a /metrics scrape whose values moved. Requests in flight with
        # none for a whole canary interval are stuck, not busy (canary_watch.py).
        self.progress_at = self.state_changed
        self._last_metrics: dict[str, float] | None = None
        self.state_seq = 0
        self.state_events: deque[dict[str, Any]] = deque(maxlen=state_buffer)
        self.generations: deque[dict[str, Any]] = deque(maxlen=RECENT_GENERATIONS)
        self.parser: LogParser | None = None
        # Until when (monotonic) the next finished generation is the host's own (a canary
        # probe), not a user's: it is not kept. 0: none expected.
        self.own_until = 0.0
        # The probe's prompt in tokens, from its last answer (the probe never changes): a
        # generation of another length is a user's, even one that finished first.
        self.own_prompt_tokens: int | None = None
        self.usage: dict[str, Any] | None = None

    def reset(self, parser: LogParser | None) -> None:
        """A new backend process: fresh parser, idle state (generations are kept)."""
        self.parser = parser
        self._last_metrics = None
        self._set_state(RuntimeState())

    def feed(self, lines: list[str]) -> None:
        parser = self.parser
        if parser is None:
            return
        if lines:
            self.progress_at = time.monotonic()
        for line in lines:
            try:
                result = parser.feed(line)
            except Exception:  # a parser bug must never stop log delivery
                continue
            if result is not None:
                self._apply(result)

    def apply_metrics(
        self,
        metrics: Mapping[str, float],
        snapshot: Mapping[str, Any] | None = None,
        backend_type: str | None = None,
    ) -> None:
        """A /metrics scrape: `snapshot` is the backend's mapping of it to usage fields."""
        if snapshot is not None:
            self.usage = {"backend_type": backend_type, **snapshot, "timestamp": iso_now()}
        if self.parser is None:
            return
        self._metrics_progress(metrics)
        try:
            result = self.parser.apply_metrics(metrics)
        except Exception:
            return
        if result is not None:
            self._apply(result)

    def _apply(self, result: ParseResult) -> None:
        if result.generation is not None:
            self._add_generation(result.generation)
        if result.state is not None:
            self._set_state(result.state)

    def _metrics_progress(self, metrics: Mapping[str, float]) -> None:
        """A scrape whose engine values moved since the last one is progress (llama.cpp's
        decode and token counters, its KV cache use grow as a generation streams without a log
        line). The exporter's own process and Python series tick whatever the engine does."""
        engine = {
            name: value for name, value in metrics.items() if not name.startswith(EXPORTER_PREFIXES)
        }
        if self._last_metrics is not None and engine != self._last_metrics:
            self.progress_at = time.monotonic()
        self._last_metrics = engine

    def own_request(self, until: float) -> None:
        """The host's own request (a canary probe) runs, alone (the backend was idle): the
        first generation to finish before `until` (monotonic) is its own, and a user's last
        generation must not be replaced by it."""
        self.own_until = until

    def own_request_answered(self, grace_s: float, prompt_tokens: int | None = None) -> None:
        """Its answer came (its usage: `prompt_tokens`): its log lines may follow for up to
        `grace_s`."""
        if prompt_tokens is not None:
            self.own_prompt_tokens = prompt_tokens
        if self.own_until:
            self.own_until = time.monotonic() + grace_s

    def _may_be_own(self, g: GenerationMetrics) -> bool:
        """Whether `g` may be the probe's generation: its prompt is the probe's length (one
        token either way: backends count a BOS differently), or either is unknown."""
        known, prompt = self.own_prompt_tokens, g.prompt_tokens
        return known is None or prompt is None or abs(prompt - known) <= 1

    def _add_generation(self, g: GenerationMetrics) -> None:
        self.progress_at = time.monotonic()
        if self.own_until:
            if time.monotonic() > self.own_until:
                self.own_until = 0.0  # the probe's lines never came: this one is a user's
            elif self._may_be_own(g):
                self.own_until = 0.0
                return
            # else a user's request that finished beside the probe: kept, the probe's to come
        record = g.as_dict()
        record["finished_at"] = record.get("finished_at") or iso_now()
        record["instance_id"] = self.instance_id
        self.generations.append(record)
        self.bus.publish(GenerationFinished(self.instance_id, record))

    def _set_state(self, state: RuntimeState) -> None:
        self.state = state
        self.state_at = iso_now()
        self.state_changed = self.progress_at = time.monotonic()
        data = self.snapshot()
        self.state_events.append(
            {
                "seq": self.state_seq,
                "timestamp": self.state_at,
                "type": "instance_state",
                "data": data,
            }
        )
        self.state_seq += 1
        self.bus.publish(RuntimeStateChanged(self.instance_id, self.state_at, data))

    def snapshot(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, **self.state.as_dict(), "timestamp": self.state_at}

    def last_generation(
        self, after: datetime | None = None, within_s: float | None = None
    ) -> tuple[dict[str, Any] | None, str]:
        """The newest record, or (None, reason) matching the reference's 404 messages."""
        if not self.generations:
            return None, "No generation metrics available"
        record = self.generations[-1]
        finished = _parse_ts(record.get("finished_at"))
        if after is not None and (finished is None or finished < after):
            return None, "No generation metrics after the specified timestamp"
        if within_s is not None and within_s >= 0:
            if finished is None or finished < datetime.now(UTC) - timedelta(seconds=within_s):
                return None, "No recent generation metrics within the specified window"
        return record, ""


def _parse_ts(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt

"""Prometheus metrics of one host, in a registry of its own.

Most figures already live in the services (supervisor counters, the control link's counters, the
ledger, the job store), so they are read at scrape time instead of being kept a second time where
they could drift. Only what exists nowhere else is counted here, from the event bus: start
durations, log lines per instance and finished pulls. Bus handlers are a dict increment or a
histogram observation: they run on the publisher's path (every backend log line).

Two hosts in one process (tests) each have their own `CollectorRegistry`; nothing here touches
prometheus_client's global default registry. `registry` holds everything (for any standard
consumer); `render()` writes the scrape-time families itself, because prometheus_client's
generic writer validates and escapes every sample and costs ~15x more with 100 instances.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from solar_host import __version__
from solar_host.events import (
    BackendEnded,
    InstancesChanged,
    InstanceStartTimed,
    LogLine,
    PullProgress,
)
from solar_host.instances.causes import CAUSES
from solar_host.instances.states import InstanceStatus
from solar_host.metrics.families import PREFIX, Family, write_families

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from solar_host.events import EventBus
    from solar_host.resources.probes import SystemProbe
    from solar_host.settings import Settings


class MetricsSource(Protocol):
    """What the metrics read of a host: its bus, probe, settings and services, each None where
    the host has none (the composition root satisfies it; this package never imports it)."""

    bus: EventBus
    probe: SystemProbe
    settings: Settings
    instances: Any
    control: Any
    resources: Any
    jobs: Any


log = logging.getLogger(__name__)


# Start phases span a tiny model on a warm disk (< 1 s) to a large one from a cold disk (minutes,
# bounded by START_DEADLINE_S).
START_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 900)
INSTANCE_STATES = tuple(s.value for s in InstanceStatus)
JOB_STATES = ("pending", "running", "completed", "failed", "cancelled")
# The resource snapshot's GiB fields, exposed in base units (Prometheus: bytes) by their stem.
RESOURCE_FIELDS = ("total_gb", "system_used_gb", "reserved_headroom_gb", "available_gb")
GIB = 1024**3
INSTANCE_COUNTERS = {
    "starts": "Successful starts (including crash restarts).",
    "start_failures": "Starts that failed after all attempts.",
    "restarts": "Restarts after a crash.",
    "crashes": "Unexpected exits of a running backend.",
    "canary_probes": "Known-answer probes its backend answered right (the first records it).",
}


def _control_refusals(c: dict[str, Any]) -> Family:
    """What the link refused from control, by reason: a rise means control (or whatever
    answers at its address) misbehaves, which the connected/registered gauges do not show."""
    refused = Family(
        f"{PREFIX}_control_refused",
        "counter",
        "What the host refused from solar-control, by reason: commands while busy, too large or "
        "before registration; malformed packets; redirects of control's address; its own "
        "reports too large to send.",
        ("reason",),
    )
    for reason, count in sorted((c.get("commands_refused") or {}).items()):
        refused.add((f"command_{reason}",), count)
    for reason in ("refused_packets", "refused_redirects", "oversized_reports"):
        refused.add((reason.removeprefix("refused_"),), c.get(reason, 0))
    return refused


class HostMetrics:
    """The metrics service of a host: `render()` is the body of GET /metrics."""

    def __init__(self, host: MetricsSource) -> None:
        self.host = host
        # prometheus_client is imported at the first scrape, not at start-up (it costs the
        # idle host 1.3 MB and 30 ms); start durations observed before then wait here.
        self._prom: tuple[Any, Any, Any] | None = None
        self._start_obs: list[tuple[str, str, float]] = []
        # render() runs in a worker thread (GET /metrics): the lazy set-up and the bus handler
        # that feeds it must not both act on _start_obs at once.
        self._prom_lock = threading.Lock()

        self.log_lines: dict[str, int] = {}
        # Flight records by cause since the host started (every cause shown, from 0).
        self.backend_ends: dict[str, int] = dict.fromkeys(CAUSES, 0)
        self.pulls: dict[str, int] = {"completed": 0, "failed": 0}
        self.pull_bytes = 0
        # source_uri -> the latest progress payload of a pull still running
        self.pulls_in_flight: dict[str, dict[str, Any]] = {}
        bus = host.bus
        # Subscribed at construction (no I/O) so that lines of backends started or re-adopted
        # during boot, before this service's start(), are counted too.
        self._unsubscribe: list[Callable[[], None]] = [
            bus.subscribe(self._on_log_line, LogLine),
            bus.subscribe(self._on_start_timed, InstanceStartTimed),
            bus.subscribe(self._on_pull, PullProgress),
            bus.subscribe(self._on_instances_changed, InstancesChanged),
            bus.subscribe(self._on_backend_ended, BackendEnded),
        ]

    def _prometheus(self) -> tuple[Any, Any, Any]:
        """(registry of everything, registry of the histograms, the start histogram)."""
        with self._prom_lock:
            return self._prom or self._set_up_prometheus()

    def _set_up_prometheus(self) -> tuple[Any, Any, Any]:
        if self._prom is None:
            from prometheus_client import CollectorRegistry, Histogram

            start_duration = Histogram(
                f"{PREFIX}_instance_start_duration_seconds",
                "Seconds from spawning a backend to its first log line (phase=first_log) "
                "and to ready (phase=ready), per successful start attempt.",
                ("backend_type", "phase"),
                buckets=START_BUCKETS,
                registry=None,
            )
            # Everything, for standard consumers; render() writes the scrape-time part itself.
            registry = CollectorRegistry(auto_describe=False)
            registry.register(start_duration)
            registry.register(_HostCollector(self))
            histograms = CollectorRegistry(auto_describe=False)
            histograms.register(start_duration)
            for backend, phase, seconds in self._start_obs:
                start_duration.labels(backend, phase).observe(seconds)
            self._start_obs.clear()
            self._prom = (registry, histograms, start_duration)
        return self._prom

    @property
    def registry(self) -> Any:
        return self._prometheus()[0]

    @property
    def start_duration(self) -> Any:
        return self._prometheus()[2]

    # --- lifecycle (started last, stopped first) ---------------------------------------------

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()

    # --- bus handlers (cheap: they run on the publisher's path) ------------------------------

    def _on_log_line(self, event: Any) -> None:
        iid = event.instance_id
        self.log_lines[iid] = self.log_lines.get(iid, 0) + 1

    def _on_start_timed(self, event: Any) -> None:
        backend = event.backend_type
        obs = [(backend, "ready", event.to_ready_s)]
        if event.to_first_log_s is not None:
            obs.append((backend, "first_log", event.to_first_log_s))
        with self._prom_lock:
            if self._prom is None:
                if len(self._start_obs) < 10_000:
                    self._start_obs.extend(obs)
                return
        hist = self._prometheus()[2]
        for b, phase, seconds in obs:
            hist.labels(b, phase).observe(seconds)

    def _on_pull(self, event: Any) -> None:
        payload = event.payload
        uri = str(payload.get("source_uri") or "")
        phase = payload.get("phase")
        if phase in ("completed", "failed"):
            self.pulls[phase] = self.pulls.get(phase, 0) + 1
            if phase == "completed" and isinstance(payload.get("bytes_done"), int):
                self.pull_bytes += payload["bytes_done"]
            self.pulls_in_flight.pop(uri, None)
        else:
            self.pulls_in_flight[uri] = payload

    def _on_backend_ended(self, event: Any) -> None:
        self.backend_ends[event.cause] = self.backend_ends.get(event.cause, 0) + 1

    def _on_instances_changed(self, event: Any) -> None:
        if event.status is None:  # deleted: its series go with it
            self.log_lines.pop(event.instance_id, None)

    # --- exposition ---------------------------------------------------------------------------

    def families(self) -> Iterator[Family]:
        """Every scrape-time family; a failing service costs its own families only."""
        host = self.host
        for part in (
            self._host_families,
            self._instance_families,
            self._pull_families,
            self._control_families,
            self._resource_families,
            self._job_families,
            self._memory_families,
        ):
            try:
                yield from list(part(host))
            except Exception:
                log.exception("metrics: %s failed", part.__name__)

    def render(self) -> bytes:
        body = write_families(self.families())
        from prometheus_client.exposition import generate_latest

        return body.encode() + generate_latest(self._prometheus()[1])

    # --- families -------------------------------------------------------------------------------

    def _memory_families(self, host: MetricsSource) -> Iterator[Family]:
        from solar_host.estimates.accounting import memory_families

        yield from memory_families(host)

    def _host_families(self, host: MetricsSource) -> Iterator[Family]:
        info = Family(
            f"{PREFIX}_info",
            "gauge",
            "Host facts (always 1).",
            ("version", "gpu_type", "host_name"),
        )
        try:
            gpu_type = host.probe.gpu_type()
        except Exception:
            gpu_type = "unknown"
        info.add((__version__, gpu_type, host.settings.effective_host_name), 1)
        yield info

    def _instance_families(self, host: MetricsSource) -> Iterator[Family]:
        manager = host.instances
        sups = list(manager.supervisors.values()) if manager is not None else []
        by_state = dict.fromkeys(INSTANCE_STATES, 0)
        info = Family(
            f"{PREFIX}_instance_info",
            "gauge",
            "One series per instance (always 1): its backend, alias and status.",
            ("instance_id", "backend_type", "alias", "status"),
        )
        counters = [
            (n, Family(f"{PREFIX}_instance_{n}", "counter", h, ("instance_id",)))
            for n, h in INSTANCE_COUNTERS.items()
        ]
        lines = Family(
            f"{PREFIX}_instance_log_lines",
            "counter",
            "Backend log lines read since the host started.",
            ("instance_id",),
        )
        log_lines = self.log_lines
        for sup in sups:
            inst = sup.stored.instance
            status = str(inst.status)
            by_state[status] = by_state.get(status, 0) + 1
            iid = sup.id
            cfg = inst.config
            info.add((iid, str(cfg.backend_type), str(getattr(cfg, "alias", "") or ""), status), 1)
            c = sup.counters
            key = (iid,)
            for n, fam in counters:
                fam.samples.append((key, c.get(n, 0)))
            lines.samples.append((key, log_lines.get(iid, 0)))
        states = Family(f"{PREFIX}_instances", "gauge", "Instances by status.", ("status",))
        for status, count in by_state.items():
            states.add((status,), count)
        yield states
        yield info
        for _, fam in counters:
            yield fam
        yield lines
        ends = Family(
            f"{PREFIX}_backend_ends",
            "counter",
            "Flight records by cause: backends that ended unasked (a crash, a liveness kill) and "
            "failed start attempts, since the host started.",
            ("cause",),
        )
        for cause, count in sorted(self.backend_ends.items()):
            ends.add((cause,), count)
        yield ends

    def _pull_families(self, host: MetricsSource) -> Iterator[Family]:
        pulls = Family(
            f"{PREFIX}_model_pulls", "counter", "Finished model pulls by outcome.", ("phase",)
        )
        for phase, count in self.pulls.items():
            pulls.add((phase,), count)
        yield pulls
        total = Family(
            f"{PREFIX}_model_pull_bytes",
            "counter",
            "Bytes of completed pulls (as reported by their completion event).",
        )
        total.add((), self.pull_bytes)
        yield total
        in_flight = list(self.pulls_in_flight.items())
        running = Family(f"{PREFIX}_model_pulls_in_progress", "gauge", "Pulls running now.")
        running.add((), len(in_flight))
        yield running
        done = Family(
            f"{PREFIX}_model_pull_progress_bytes",
            "gauge",
            "Bytes downloaded so far by a running pull (updated every PULL_PROGRESS_INTERVAL_S).",
            ("source_uri", "phase"),
        )
        size = Family(
            f"{PREFIX}_model_pull_expected_bytes",
            "gauge",
            "Size of a running pull, where the source announced it.",
            ("source_uri",),
        )
        for uri, payload in in_flight:
            done.add((uri, str(payload.get("phase") or "")), payload.get("bytes_done") or 0)
            if isinstance(payload.get("bytes_total"), int):
                size.add((uri,), payload["bytes_total"])
        yield done
        yield size

    def _control_families(self, host: MetricsSource) -> Iterator[Family]:
        control = host.control
        if control is None or not hasattr(control, "metrics"):
            return
        c = control.metrics()

        def single(name: str, kind: str, help_text: str, value: float) -> Family:
            fam = Family(f"{PREFIX}_control_{name}", kind, help_text)
            fam.add((), value)
            return fam

        yield single(
            "connected",
            "gauge",
            "1 while the Socket.IO link to solar-control is connected.",
            int(bool(c.get("connected"))),
        )
        yield single(
            "registered",
            "gauge",
            "1 while this host is registered (approved) with solar-control.",
            int(bool(c.get("registered"))),
        )
        yield single(
            "reconnects", "counter", "Reconnections of the control link.", c.get("reconnects", 0)
        )
        yield single(
            "connect_failures",
            "counter",
            "Failed connection attempts to solar-control.",
            c.get("connect_failures", 0),
        )
        yield single(
            "emit_failures", "counter", "Events the link failed to send.", c.get("emit_failures", 0)
        )
        yield single(
            "outbox_size",
            "gauge",
            "Events waiting to be sent to solar-control.",
            c.get("outbox_size", 0),
        )
        sent = Family(
            f"{PREFIX}_control_sent", "counter", "Events sent to solar-control.", ("event",)
        )
        for name, count in sorted((c.get("sent") or {}).items()):
            sent.add((str(name),), count)
        yield sent
        dropped = Family(
            f"{PREFIX}_control_dropped",
            "counter",
            "Events dropped by the outbox (full, or not registered); kind=log are log lines.",
            ("kind",),
        )
        for kind, count in sorted((c.get("dropped") or {}).items()):
            dropped.add((str(kind),), count)
        yield dropped
        yield _control_refusals(c)

    def _resource_families(self, host: MetricsSource) -> Iterator[Family]:
        resources = host.resources
        if resources is None:
            return
        snap = resources.snapshot()
        gauges = {
            f: Family(
                f"{PREFIX}_resource_{f[:-3]}_bytes",
                "gauge",
                f"Per dimension (vram, ram, disk): {f[:-3].replace('_', ' ')}, bytes.",
                ("dimension",),
            )
            for f in RESOURCE_FIELDS
        }
        for dim in ("vram", "ram", "disk"):
            values = snap.get(dim)
            if not values:
                continue
            for f in RESOURCE_FIELDS:
                if values.get(f) is not None:
                    gauges[f].add((dim,), round(values[f] * GIB))
        yield from gauges.values()
        count = Family(f"{PREFIX}_reservations", "gauge", "Reservations by status.", ("status",))
        by_status: dict[str, int] = {}
        reserved = {"vram": 0.0, "ram": 0.0, "disk": 0.0}
        for r in snap.get("reservations") or []:
            st = str(r.get("status"))
            by_status[st] = by_status.get(st, 0) + 1
            for dim in reserved:
                reserved[dim] += float(r.get(f"{dim}_gb") or 0.0)
        for st, n in sorted(by_status.items()):
            count.add((st,), n)
        yield count
        held = Family(
            f"{PREFIX}_reserved_bytes",
            "gauge",
            "Capacity held by reservations, per dimension, bytes.",
            ("dimension",),
        )
        for dim, gib in reserved.items():
            held.add((dim,), round(gib * GIB))
        yield held

    def _job_families(self, host: MetricsSource) -> Iterator[Family]:
        jobs = host.jobs
        if jobs is None:
            return
        by_state = dict.fromkeys(JOB_STATES, 0)
        for job in jobs.list():
            st = str(job.status)
            by_state[st] = by_state.get(st, 0) + 1
        fam = Family(f"{PREFIX}_jobs", "gauge", "Jobs known to the host, by status.", ("status",))
        for st, n in by_state.items():
            fam.add((st,), n)
        yield fam


class _HostCollector:
    """The scrape-time families as a prometheus_client collector (for `HostMetrics.registry`)."""

    def __init__(self, metrics: HostMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: its series depend on the host's state

    def collect(self) -> Iterator[Metric]:
        for fam in self.m.families():
            yield fam.to_metric()

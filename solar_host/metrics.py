"""Prometheus metrics of one host, in a registry of its own.

Most figures already live in the services (supervisor counters, the control link's counters, the
ledger, the job store), so a custom collector reads them at scrape time instead of keeping a
second copy that could drift. Only what exists nowhere else is counted here, from the event bus:
start durations, log lines per instance and finished pulls. Bus handlers are a dict increment or
a histogram observation: they run on the publisher's path (every backend log line).

Two hosts in one process (tests) each have their own `CollectorRegistry`; nothing here touches
prometheus_client's global default registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from solar_host import __version__
from solar_host.events import InstancesChanged, InstanceStartTimed, LogLine, PullProgress
from solar_host.instances.states import InstanceStatus

if TYPE_CHECKING:
    from solar_host.app import Host

log = logging.getLogger(__name__)

# The classic text format: every name here is a legacy-valid name, so what generate_latest
# writes is exactly version 0.0.4, which every Prometheus version reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "solar_host"

# Start phases span a tiny model on a warm disk (< 1 s) to a large one from a cold disk (minutes,
# bounded by START_DEADLINE_S).
START_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 900)
JOB_STATES = ("pending", "running", "completed", "failed", "cancelled")
RESOURCE_FIELDS = ("total_gb", "system_used_gb", "reserved_headroom_gb", "available_gb")


class HostMetrics:
    """The metrics service of a host: `render()` is the body of GET /metrics."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.registry = CollectorRegistry(auto_describe=False)
        self.start_duration = Histogram(
            f"{PREFIX}_instance_start_duration_seconds",
            "Seconds from spawning a backend to its first log line (phase=first_log) "
            "and to ready (phase=ready), per successful start attempt.",
            ("backend_type", "phase"),
            buckets=START_BUCKETS,
            registry=self.registry,
        )
        self.log_lines: dict[str, int] = {}
        self.pulls: dict[str, int] = {"completed": 0, "failed": 0}
        self.pull_bytes = 0
        # source_uri -> the latest progress payload of a pull still running
        self.pulls_in_flight: dict[str, dict[str, Any]] = {}
        self.registry.register(_HostCollector(self))
        bus = host.bus
        # Subscribed at construction (no I/O) so that lines of backends started or re-adopted
        # during boot, before this service's start(), are counted too.
        self._unsubscribe: list[Callable[[], None]] = [
            bus.subscribe(self._on_log_line, LogLine),
            bus.subscribe(self._on_start_timed, InstanceStartTimed),
            bus.subscribe(self._on_pull, PullProgress),
            bus.subscribe(self._on_instances_changed, InstancesChanged),
        ]

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
        if event.to_first_log_s is not None:
            self.start_duration.labels(backend, "first_log").observe(event.to_first_log_s)
        self.start_duration.labels(backend, "ready").observe(event.to_ready_s)

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

    def _on_instances_changed(self, event: Any) -> None:
        if event.status is None:  # deleted: its series go with it
            self.log_lines.pop(event.instance_id, None)

    # --- exposition ---------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HostCollector:
    """Reads the services' own state at scrape time."""

    def __init__(self, metrics: HostMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: its series depend on the host's state

    def collect(self) -> Iterator[Metric]:
        host = self.m.host
        for part in (
            self._host,
            self._instances,
            self._pulls,
            self._control,
            self._resources,
            self._jobs,
        ):
            try:
                yield from part(host)
            except Exception:  # one broken service must not cost the whole scrape
                log.exception("metrics: %s failed", part.__name__)

    def _host(self, host: Host) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            f"{PREFIX}_info",
            "Host facts (always 1).",
            labels=("version", "gpu_type", "host_name"),
        )
        try:
            gpu_type = host.probe.gpu_type()
        except Exception:
            gpu_type = "unknown"
        info.add_metric((__version__, gpu_type, host.settings.effective_host_name), 1)
        yield info

    def _instances(self, host: Host) -> Iterator[Metric]:
        manager = host.services.get("instances")
        sups = list(getattr(manager, "supervisors", {}).values())
        by_state = dict.fromkeys((s.value for s in InstanceStatus), 0)
        info = GaugeMetricFamily(
            f"{PREFIX}_instance_info",
            "One series per instance (always 1): its backend, alias and status.",
            labels=("instance_id", "backend_type", "alias", "status"),
        )
        names = ("starts", "start_failures", "restarts", "crashes")
        helps = {
            "starts": "Successful starts (including crash restarts).",
            "start_failures": "Starts that failed after all attempts.",
            "restarts": "Restarts after a crash.",
            "crashes": "Unexpected exits of a running backend.",
        }
        counters = {
            n: CounterMetricFamily(f"{PREFIX}_instance_{n}", helps[n], labels=("instance_id",))
            for n in names
        }
        lines = CounterMetricFamily(
            f"{PREFIX}_instance_log_lines",
            "Backend log lines read since the host started.",
            labels=("instance_id",),
        )
        log_lines = self.m.log_lines
        for sup in sups:
            inst = sup.stored.instance
            status = str(inst.status.value if hasattr(inst.status, "value") else inst.status)
            by_state[status] = by_state.get(status, 0) + 1
            iid = sup.id
            cfg = inst.config
            info.add_metric(
                (iid, str(cfg.backend_type), str(getattr(cfg, "alias", "") or ""), status), 1
            )
            c = sup.counters
            for n in names:
                counters[n].add_metric((iid,), c.get(n, 0))
            lines.add_metric((iid,), log_lines.get(iid, 0))
        states = GaugeMetricFamily(
            f"{PREFIX}_instances", "Instances by status.", labels=("status",)
        )
        for status, count in by_state.items():
            states.add_metric((status,), count)
        yield states
        yield info
        yield from counters.values()
        yield lines

    def _pulls(self, host: Host) -> Iterator[Metric]:
        m = self.m
        pulls = CounterMetricFamily(
            f"{PREFIX}_model_pulls", "Finished model pulls by outcome.", labels=("phase",)
        )
        for phase, count in m.pulls.items():
            pulls.add_metric((phase,), count)
        yield pulls
        yield CounterMetricFamily(
            f"{PREFIX}_model_pull_bytes",
            "Bytes of completed pulls (as reported by their completion event).",
            value=m.pull_bytes,
        )
        in_flight = list(m.pulls_in_flight.items())
        yield GaugeMetricFamily(
            f"{PREFIX}_model_pulls_in_progress", "Pulls running now.", value=len(in_flight)
        )
        done = GaugeMetricFamily(
            f"{PREFIX}_model_pull_progress_bytes",
            "Bytes downloaded so far by a running pull (updated every PULL_PROGRESS_INTERVAL_S).",
            labels=("source_uri", "phase"),
        )
        size = GaugeMetricFamily(
            f"{PREFIX}_model_pull_expected_bytes",
            "Size of a running pull, where the source announced it.",
            labels=("source_uri",),
        )
        for uri, payload in in_flight:
            done.add_metric((uri, str(payload.get("phase") or "")), payload.get("bytes_done") or 0)
            if isinstance(payload.get("bytes_total"), int):
                size.add_metric((uri,), payload["bytes_total"])
        yield done
        yield size

    def _control(self, host: Host) -> Iterator[Metric]:
        control = host.services.get("control")
        if control is None or not hasattr(control, "metrics"):
            return
        c = control.metrics()
        yield GaugeMetricFamily(
            f"{PREFIX}_control_connected",
            "1 while the Socket.IO link to solar-control is connected.",
            value=int(bool(c.get("connected"))),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_control_registered",
            "1 while this host is registered (approved) with solar-control.",
            value=int(bool(c.get("registered"))),
        )
        for key, help_text in (
            ("reconnects", "Reconnections of the control link."),
            ("connect_failures", "Failed connection attempts to solar-control."),
            ("emit_failures", "Events the link failed to send."),
        ):
            yield CounterMetricFamily(f"{PREFIX}_control_{key}", help_text, value=c.get(key, 0))
        yield GaugeMetricFamily(
            f"{PREFIX}_control_outbox_size",
            "Events waiting to be sent to solar-control.",
            value=c.get("outbox_size", 0),
        )
        sent = CounterMetricFamily(
            f"{PREFIX}_control_sent", "Events sent to solar-control.", labels=("event",)
        )
        for name, count in sorted((c.get("sent") or {}).items()):
            sent.add_metric((str(name),), count)
        yield sent
        dropped = CounterMetricFamily(
            f"{PREFIX}_control_dropped",
            "Events dropped by the outbox (full, or not registered); kind=log are log lines.",
            labels=("kind",),
        )
        for kind, count in sorted((c.get("dropped") or {}).items()):
            dropped.add_metric((str(kind),), count)
        yield dropped

    def _resources(self, host: Host) -> Iterator[Metric]:
        resources = host.services.get("resources")
        if resources is None:
            return
        snap = resources.snapshot()
        gauges = {
            f: GaugeMetricFamily(
                f"{PREFIX}_resource_{f}",
                f"Per dimension (vram, ram, disk): {f.replace('_', ' ')[:-3]} in GiB.",
                labels=("dimension",),
            )
            for f in RESOURCE_FIELDS
        }
        for dim in ("vram", "ram", "disk"):
            values = snap.get(dim)
            if not values:
                continue
            for f in RESOURCE_FIELDS:
                if values.get(f) is not None:
                    gauges[f].add_metric((dim,), values[f])
        yield from gauges.values()
        reservations = snap.get("reservations") or []
        count = GaugeMetricFamily(
            f"{PREFIX}_reservations", "Reservations by status.", labels=("status",)
        )
        by_status: dict[str, int] = {}
        reserved = {"vram": 0.0, "ram": 0.0, "disk": 0.0}
        for r in reservations:
            st = str(r.get("status"))
            by_status[st] = by_status.get(st, 0) + 1
            for dim in reserved:
                reserved[dim] += float(r.get(f"{dim}_gb") or 0.0)
        for st, n in sorted(by_status.items()):
            count.add_metric((st,), n)
        yield count
        held = GaugeMetricFamily(
            f"{PREFIX}_reserved_gb",
            "Capacity held by reservations, per dimension, in GiB.",
            labels=("dimension",),
        )
        for dim, gb in reserved.items():
            held.add_metric((dim,), gb)
        yield held

    def _jobs(self, host: Host) -> Iterator[Metric]:
        jobs = host.services.get("jobs")
        if jobs is None:
            return
        by_state = dict.fromkeys(JOB_STATES, 0)
        for job in jobs.list():
            st = str(getattr(job.status, "value", job.status))
            by_state[st] = by_state.get(st, 0) + 1
        g = GaugeMetricFamily(
            f"{PREFIX}_jobs", "Jobs known to the host, by status.", labels=("status",)
        )
        for st, n in by_state.items():
            g.add_metric((st,), n)
        yield g

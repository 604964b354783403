"""The Prometheus text format (version 0.0.4) for families the host builds itself.

Shared by the host's metrics service and by the core's own figures (memory accounting), so
neither has to import the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.core import Metric

# The classic text format: every name here is a legacy-valid name, so what is written is exactly
# version 0.0.4, which every Prometheus version reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "solar_host"


@dataclass(slots=True)
class Family:
    """One metric family as plain data. A counter's `name` is without the `_total` suffix."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    labels: tuple[str, ...] = ()
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def add(self, labels: tuple[str, ...], value: float) -> None:
        self.samples.append((labels, value))

    def to_metric(self) -> Metric:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        m = cls(self.name, self.help, labels=self.labels)
        for labels, value in self.samples:
            m.add_metric(labels, value)
        return m


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def _number(value: float) -> str:
    if type(value) is int:  # most samples: counts
        return str(value)
    value = float(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def write_families(families: Iterable[Family]) -> str:
    """The text exposition (version 0.0.4) of `families`."""
    out: list[str] = []
    for f in families:
        name = f.name + "_total" if f.kind == "counter" else f.name
        help_text = f.help.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {name} {help_text}\n# TYPE {name} {f.kind}\n")
        keys = f.labels
        if len(keys) == 1:  # the per-instance families: the hot path
            prefix = f'{name}{{{keys[0]}="'
            out.extend(
                f'{prefix}{_escape(labels[0])}"}} {_number(value)}\n' for labels, value in f.samples
            )
            continue
        for labels, value in f.samples:
            if keys:
                pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in zip(keys, labels, strict=True))
                out.append(f"{name}{{{pairs}}} {_number(value)}\n")
            else:
                out.append(f"{name} {_number(value)}\n")
    return "".join(out)

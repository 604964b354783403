"""A tolerant reader of the Prometheus text format, as llama-server and SGLang print it.

Only names and values matter to us. Samples of one name with different label sets are summed:
SGLang splits its token counters by `is_streaming` and `cache_source`, and its gauges by
engine, and the total is what we want. A repeated identical series overrides the earlier one.
A line that does not parse is skipped rather than failing the whole scrape. The value is the token
after the name (and label block); a trailing timestamp, which the format allows, is ignored.
"""

from __future__ import annotations


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Metric name -> sum over its label sets. Names may contain ':'."""
    series: dict[tuple[str, str], float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            # A label value may hold spaces: the sample starts after the closing brace.
            close = line.rfind("}")
            if close < brace:
                continue
            name = line[:brace].strip()
            labels = line[brace : close + 1]
            rest = line[close + 1 :].split()
        else:
            parts = line.split()
            name, rest, labels = parts[0], parts[1:], ""
        if not name or not rest:
            continue
        try:
            value = float(rest[0])  # rest[1], when present, is the optional timestamp
        except ValueError:
            continue
        series[(name, labels)] = value
    out: dict[str, float] = {}
    for (name, _), value in series.items():
        out[name] = out.get(name, 0.0) + value
    return out

"""A tolerant reader of the Prometheus text format, as llama-server and SGLang print it.

Only names and values matter to us: labels are dropped (the backends we scrape label their
series with the model name only), later samples of a name override earlier ones, and a line
that does not parse is skipped rather than failing the whole scrape. The value is the token
after the name (and label block); a trailing timestamp, which the format allows, is ignored.
"""

from __future__ import annotations


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Metric name -> value of the last sample with that name. Names may contain ':'."""
    out: dict[str, float] = {}
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
            rest = line[close + 1 :].split()
        else:
            parts = line.split()
            name, rest = parts[0], parts[1:]
        if not name or not rest:
            continue
        try:
            value = float(rest[0])  # rest[1], when present, is the optional timestamp
        except ValueError:
            continue
        out[name] = value
    return out

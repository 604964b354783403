"""Why each backend type can or cannot run on this host, and with what (GET /, doctor, start log).

Each backend describes itself (`Backend.availability`), from the same facts its `is_available`
reads, so the answer and the reason never disagree.
"""

from __future__ import annotations

from solar_host.backends.base import Availability, Backend, HostFacts


def describe(backend: Backend, facts: HostFacts) -> Availability:
    """The availability of one registered backend (each backend says it: BackendBase)."""
    return backend.availability(facts)


def log_lines(table: dict[str, Availability]) -> list[str]:
    """One line per backend type, as the host logs them at start and doctor prints them."""
    out = []
    for bt, a in table.items():
        if a.available:
            out.append(f"backend {bt}: available, uses {a.uses}")
        else:
            out.append(f"backend {bt}: NOT available: {a.reason}")
    return out

"""Checks before a backend is spawned: what would make every attempt fail the same way.

A model file that is missing, unreadable or not what the backend reads, or a backend this host
cannot run, fails the start at once with a message naming the field and the file: nothing is
spawned and nothing is retried (retries are for what can pass on a second try). Pure apart from
reading a few bytes and stat calls; a backend adds its own checks with `preflight(config)`.
"""

from __future__ import annotations

from typing import Any

from solar_host.backends.base import HostFacts, LaunchError
from solar_host.backends.files import gguf_file, model_path, readable_file

__all__ = ["PreflightFailed", "check", "gguf_file", "model_path", "problems", "readable_file"]


class PreflightFailed(LaunchError):
    """A start that cannot succeed; the message names the field and the file."""


def problems(backend: Any, config: Any, facts: HostFacts) -> list[str]:
    """Everything that would make this start fail on every attempt."""
    found: list[str] = []
    available = backend.availability(facts)
    if not available.available:
        found.append(f"backend {config.backend_type} cannot run here: {available.reason}")
    found.extend(backend.preflight(config))
    return found


def check(backend: Any, config: Any, facts: HostFacts) -> None:
    """Raise PreflightFailed (not retried) when the start cannot succeed."""
    found = problems(backend, config, facts)
    if found:
        raise PreflightFailed("; ".join(found))

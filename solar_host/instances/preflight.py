"""Checks before a backend is spawned: what would make every attempt fail the same way.

A model file that is missing, unreadable or not what the backend reads, or a backend this host
cannot run, fails the start at once with a message naming the field and the file: nothing is
spawned and nothing is retried (retries are for what can pass on a second try). Pure apart from
reading a few bytes and stat calls; a backend adds its own checks with `preflight(config)`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from solar_host.backends.base import HostFacts, LaunchError
from solar_host.backends.files import gguf_file, readable_file

__all__ = ["PreflightFailed", "check", "gguf_file", "model_path", "problems", "readable_file"]


class PreflightFailed(LaunchError):
    """A start that cannot succeed; the message names the field and the file."""


def model_path(field: str, path: str | os.PathLike[str]) -> str | None:
    """Why a local model path (file or directory) cannot be read, or None."""
    p = Path(path)
    if not p.exists():
        return f"{field}: {p} does not exist"
    if not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
        return f"{field}: {p} is not readable by the host user (uid {os.getuid()})"
    return None


def problems(backend: Any, config: Any, facts: HostFacts) -> list[str]:
    """Everything that would make this start fail on every attempt."""
    from solar_host.backends import huggingface, sglang
    from solar_host.backends.availability import describe
    from solar_host.instances.schemas import model_field_of

    found: list[str] = []
    available = describe(backend, facts)
    if not available.available:
        found.append(f"backend {config.backend_type} cannot run here: {available.reason}")
    own = getattr(backend, "preflight", None)
    if own is not None:
        found.extend(own(config))
    elif backend is huggingface.BACKEND or backend is sglang.BACKEND:
        # Their model is a directory (or a Hub id, which is not a path): it must be there.
        field = model_field_of(config.backend_type)
        for path in backend.model_paths(config):
            if os.path.isabs(path):
                problem = model_path(field, path)
                if problem:
                    found.append(problem)
    return found


def check(backend: Any, config: Any, facts: HostFacts) -> None:
    """Raise PreflightFailed (not retried) when the start cannot succeed."""
    found = problems(backend, config, facts)
    if found:
        raise PreflightFailed("; ".join(found))

"""Unknown keys in an instance config: kept and echoed (control compares configs key by key),
but never silent. A key no backend knows gets a warning naming the nearest known field, or a
422 under STRICT_CONFIG. Keys control sends (control-contract 2.3) never warn.
"""

from __future__ import annotations

import functools
from typing import Any

from solar_host.platform.spelling import nearest

# What solar-control puts in or carries through a config (contract 2.3: intent backends and
# captured configs; the instance-level keys a migration copies or strips).
CONTROL_FIELDS = frozenset(
    {
        "backend_type", "alias", "model_source", "model", "model_id", "model_path",
        "model_file", "mmproj", "file_filters", "api_key", "ctx_size", "context_size", "n_ctx",
        "n_gpu_layers", "device", "dtype", "max_length", "labels", "extra_args", "extra_env",
        "priority", "managed_by", "intent_id", "id", "status", "port", "pid",
        "supported_endpoints", "served_model_name", "capabilities", "created_at", "started_at",
        "error_message", "retry_count", "busy", "prefill_progress", "active_slots",
    }
)  # fmt: skip


@functools.cache
def _fields_by_type() -> dict[str, frozenset[str]]:
    from solar_host.instances.schemas import config_models

    return {bt: frozenset(m.model_fields) for bt, m in config_models().items()}


def known_fields() -> frozenset[str]:
    """Every field of every backend config, and every key control sends."""
    out = set(CONTROL_FIELDS)
    for fields in _fields_by_type().values():
        out |= fields
    return frozenset(out)


def unknown_fields(raw: Any) -> list[tuple[str, str]]:
    """(key, message) for each key of config `raw` that no backend and no control field knows.

    The suggestion comes from the fields of the config's own backend first.
    """
    if not isinstance(raw, dict):
        return []
    known = known_fields()
    own = _fields_by_type().get(str(raw.get("backend_type") or "llamacpp"), frozenset())
    out = []
    for key in raw:
        if not isinstance(key, str) or key in known:
            continue
        guess = nearest(key, sorted(own)) or nearest(key, sorted(known))
        hint = f": did you mean {guess}?" if guess else ""
        out.append((key, f"unknown field {key}{hint}"))
    return out

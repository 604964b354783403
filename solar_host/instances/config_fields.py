"""Unknown keys in an instance config: never silent. A near miss of a known field (a case
change, or a small edit: `ctx_sise`) is a typo whose value would be dropped for a default, so it
is refused (ruling 25). Any other unknown key is kept and echoed (control compares configs key
by key, and may be newer than this host) with a warning, or refused under STRICT_CONFIG. Keys
control sends (control-contract 2.3) never warn.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

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


class UnknownField(NamedTuple):
    key: str
    message: str
    # The known field this key is a near miss of (refused), or None (a warning).
    near_miss: str | None


def near_miss_edits(key: str) -> int:
    """How many edits still make `key` a typo of a known field rather than a field of its own.

    One (a letter wrong, missing, extra or swapped with its neighbour): two would take
    `min_length` for `max_length` and `spec_draft_n_min` for `spec_draft_n_max`. None for a key
    under five letters (`type` is not `dtype`), where only case and `-` for `_` count."""
    return 0 if len(key) < 5 else 1


def unknown_fields(raw: Any) -> list[UnknownField]:
    """Each key of config `raw` that no backend and no control field knows.

    A near miss is looked for among the fields of the config's own backend first.
    """
    if not isinstance(raw, dict):
        return []
    known = known_fields()
    own = _fields_by_type().get(str(raw.get("backend_type") or "llamacpp"), frozenset())
    out = []
    for key in raw:
        if not isinstance(key, str) or key in known:
            continue
        edits = near_miss_edits(key)
        spelt = key.replace("-", "_")  # nearest() already ignores case
        guess = nearest(spelt, sorted(own), edits) or nearest(spelt, sorted(known), edits)
        hint = f": did you mean {guess}?" if guess else ""
        out.append(UnknownField(key, f"unknown field {key}{hint}", guess))
    return out

"""What decoding needs to know of a model beyond its weights: its config's parts, the rope
scalings that tie a row's output to the rest of its batch, and the width of its logits."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# Rope scalings whose factor transformers picks from the longest position in the whole batch
# (modeling_rope_utils: longrope's short/long factors, dynamic NTK): a long request in the batch
# changed every other row's rotary angles, so one user's text depended on another's request.
BATCH_WIDE_ROPE = frozenset({"longrope", "dynamic"})


def config_parts(config: Any) -> list[Any]:
    """`config` and, for a composite model (vision + text), its text part: where the
    language model's settings (context length, rope scaling) are."""
    parts = [config]
    text = getattr(config, "get_text_config", None)
    if callable(text):
        with contextlib.suppress(Exception):  # a config without a text part
            parts.append(text())
    return parts


def _rope_scalings(config: Any) -> list[tuple[Any, dict]]:
    """(config part, its rope scaling dict) for each part that has one."""
    found = []
    for c in config_parts(config):
        # rope_parameters in transformers 5 (reading rope_scaling there warns), else 4.x's.
        scaling = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None)
        if isinstance(scaling, dict):
            found.append((c, scaling))
    return found


def _rope_kind(scaling: dict) -> Any:
    return scaling.get("rope_type") or scaling.get("type")


def batch_changes_rows(config: Any) -> bool:
    """Whether sharing a batch would change a row's output (a batch-wide rope scaling)."""
    return any(_rope_kind(s) in BATCH_WIDE_ROPE for _c, s in _rope_scalings(config))


def rope_switch_length(config: Any) -> int | None:
    """The length past which a longrope model's rotary factors switch from short to long.

    Keys cached before the switch were rotated with the short factors and are wrong after it:
    `generate` (Phi-3's prepare_inputs_for_generation) drops the cache and prefills the whole
    sequence again at the first position past it, and so does the scheduler (_step)."""
    for c, scaling in _rope_scalings(config):
        if _rope_kind(scaling) == "longrope":
            length = scaling.get("original_max_position_embeddings")
            if length is None:
                length = getattr(c, "original_max_position_embeddings", None)
            if isinstance(length, int) and length > 0:
                return length
    return None


def vocab_size(model: Any) -> int | None:
    """The width of the model's logits: its output layer's rows (which may be more than the
    tokenizer's entries), else the vocab_size its config names."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    for part in config_parts(model.config):
        size = getattr(part, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return None

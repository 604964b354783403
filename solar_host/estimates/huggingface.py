"""HuggingFace estimates: safetensors weights at the dtype the server loads them in (`dtype`, or
for `auto` float16 on a GPU and float32 on the CPU, as servers/hf_runtime.pick_dtype), plus an
activation allowance at `max_length`.

The allowance (documented, not measured): for causal and vision models, the KV cache of one
sequence of `max_length` tokens (2 x layers x kv_heads x head_dim x max_length x dtype bytes;
a batch of shorter requests shares that room); for the encoder models (embedding,
classification), the activations of one full batch, 16 floats per hidden unit per token
(attention scores and the FFN intermediate dominate). On GPUs, 256 MiB more for the CUDA
context and the torch allocator's cache.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from solar_host.estimates.model import CPU, Device, DeviceEstimate, Estimate, EstimateError
from solar_host.estimates.safetensors import TARGET_BYTES, is_count, read_model

GPU_RUNTIME_BYTES = 256 * 1024**2
ENCODER_FLOATS_PER_UNIT = 16
CAUSAL = ("huggingface_causal", "huggingface_vision")


def model_dir_of(config: Any) -> Path:
    model = config.model_id
    p = Path(model) if model else None
    if p is None or not p.is_dir():
        raise EstimateError(
            "model_id", "estimates need a local model directory (pull the model first)"
        )
    return p


def config_count(cfg: dict[str, Any], *keys: str, default: int = 0) -> int:
    """The first of `keys` that config.json sets to a non-zero size, else `default`. Raises
    EstimateError naming the key when its value is not a non-negative integer."""
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)  # 4096.0: a size all the same
        if not is_count(value):
            text = repr(value)[:40]
            raise EstimateError(
                "model_id", f"config.json: {key} must be a non-negative integer, not {text}"
            )
        if value:
            return value
    return default


def device_of(config: Any, gpus: list[Device]) -> str:
    """Where the server puts the model: the first GPU for `cuda` and `auto` (hf_runtime's
    pick_device prefers CUDA), else the CPU (`mps` too: its memory is the system's)."""
    if config.device in ("cuda", "auto") and gpus:
        return gpus[0].name
    if config.device == "cuda":
        raise EstimateError("device", "device 'cuda' but this host has no NVIDIA GPU")
    return CPU


def load_dtype(config: Any, device: str) -> str:
    """The dtype the server loads floating weights in: servers/hf_runtime.pick_dtype's rule.
    An explicit `dtype` wins; `auto` is float16 on a GPU (CUDA or MPS) and float32 on the CPU,
    whatever config.json's torch_dtype says (a bf16 model on the CPU takes twice its file)."""
    if config.dtype != "auto":
        return str(config.dtype)
    return "float16" if device != CPU or config.device == "mps" else "float32"


def estimate_huggingface(config: Any, gpus: list[Device]) -> Estimate:
    facts_dir = model_dir_of(config)
    device = device_of(config, gpus)
    dtype = load_dtype(config, device)
    nbytes = TARGET_BYTES[dtype]
    try:
        facts = read_model(facts_dir, dtype)
    except (OSError, ValueError) as err:
        raise EstimateError("model_id", str(err)) from None
    cfg = facts.config
    hidden = config_count(cfg, "hidden_size", "d_model")
    layers = config_count(cfg, "num_hidden_layers", "n_layer")
    heads = config_count(cfg, "num_attention_heads", default=1)
    kv_heads = config_count(cfg, "num_key_value_heads", default=heads)
    head_dim = config_count(cfg, "head_dim", default=hidden // heads)
    batch = int(config.max_batch_size)
    if config.backend_type in CAUSAL:
        activations = 2 * layers * kv_heads * head_dim * config.max_length * nbytes
    else:
        activations = ENCODER_FLOATS_PER_UNIT * 4 * hidden * config.max_length * batch
    dev = DeviceEstimate(
        device,
        weights_bytes=facts.weight_bytes,
        kv_cache_bytes=activations if config.backend_type in CAUSAL else 0,
        compute_bytes=(0 if config.backend_type in CAUSAL else activations)
        + (GPU_RUNTIME_BYTES if device != CPU else 0),
    )
    return Estimate(config.backend_type, [dev], notes=[f"weights at {dtype}"])

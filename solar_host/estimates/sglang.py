"""SGLang estimates: it takes `mem_fraction_static` of each of its `tp_size` GPUs up front (the
weights plus a KV pool filling the rest of that fraction), so that is its need; the weights
(safetensors, split over tp_size) must fit inside the fraction, else it cannot start at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from solar_host.estimates.model import Device, DeviceEstimate, Estimate, EstimateError
from solar_host.estimates.safetensors import read_model

# SGLang's default on large GPUs when mem_fraction_static is not given (0.88 in 0.4-0.5).
DEFAULT_MEM_FRACTION = 0.88


def estimate_sglang(config: Any, gpus: list[Device]) -> Estimate:
    tp = int(config.tp_size or 1)
    if not config.model_path or not Path(config.model_path).is_dir():
        raise EstimateError("model_path", "estimates need a local model directory")
    dtype = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16"}.get(
        config.dtype or "", "auto"
    )
    try:
        facts = read_model(Path(config.model_path), dtype)
    except (OSError, ValueError) as err:
        raise EstimateError("model_path", str(err)) from None
    fraction = float(config.mem_fraction_static or DEFAULT_MEM_FRACTION)
    per_gpu_weights = -(-facts.weight_bytes // tp)
    est = Estimate("sglang", [])
    if len(gpus) < tp:
        raise EstimateError(
            "tp_size", f"tp_size {tp} needs {tp} GPUs; {len(gpus)} available for it"
        )
    for g in gpus[:tp]:
        pool = int(g.total_bytes * fraction)
        if per_gpu_weights > pool:
            est.refusal = (
                f"{g.name}: weights ({per_gpu_weights} bytes per GPU) exceed "
                f"mem_fraction_static x memory ({pool} bytes): SGLang cannot start"
            )
            est.notes.append(est.refusal)
        est.devices.append(
            DeviceEstimate(
                g.name,
                weights_bytes=per_gpu_weights,
                kv_cache_bytes=max(pool - per_gpu_weights, 0),
            )
        )
    return est

"""One entry point for every backend: `estimate_config(config, gpus)`."""

from __future__ import annotations

from typing import Any

from solar_host.estimates.model import Device, Estimate, EstimateError


def estimate_config(config: Any, gpus: list[Device]) -> Estimate:
    """The estimate of `config` on `gpus` (the devices it would use, in order).

    Raises EstimateError naming the config field that prevents an estimate.
    """
    bt = config.backend_type
    if bt == "llamacpp":
        from solar_host.estimates.gguf import estimate_llamacpp

        return estimate_llamacpp(config, gpus)
    if bt == "sglang":
        from solar_host.estimates.sglang import estimate_sglang

        return estimate_sglang(config, gpus)
    if bt.startswith("huggingface"):
        from solar_host.estimates.huggingface import estimate_huggingface

        return estimate_huggingface(config, gpus)
    raise EstimateError("backend_type", f"no estimate for backend_type {bt!r}")

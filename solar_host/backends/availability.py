"""Why each backend type can or cannot run on this host, and with what (GET /, doctor, start log).

A backend may describe itself (`availability(facts)`); the HF and SGLang backends are described
here from the same facts their `is_available` reads, so the answer and the reason never disagree.
"""

from __future__ import annotations

import sys
from typing import Any

from solar_host.backends.base import Availability, HostFacts


def _huggingface(facts: HostFacts) -> Availability:
    from solar_host.backends.huggingface import SERVER_MODULE

    if facts.hf_available:
        return Availability(True, f"python -m {SERVER_MODULE} ({sys.executable})")
    return Availability(
        False,
        reason="torch and transformers are not installed in this Python: "
        "install the huggingface extra (pip install '.[huggingface]' in the solar-host "
        "checkout; CPU-only torch: see the README)",
    )


def _sglang(facts: HostFacts) -> Availability:
    from solar_host.backends.sglang import resolve_executable

    argv = resolve_executable(facts.sglang_venv_path)
    if facts.gpu_type != "nvidia_cuda":
        return Availability(
            False,
            " ".join(argv) if argv else None,
            "SGLang backend requires an NVIDIA CUDA host "
            f"(this host reports gpu_type={facts.gpu_type!r})",
        )
    if argv is None:
        where = (
            f"SGLANG_VENV_PATH={facts.sglang_venv_path} has no bin/sglang or bin/python"
            if facts.sglang_venv_path
            else "no sglang on PATH and SGLANG_VENV_PATH is not set"
        )
        return Availability(False, None, f"{where}: install SGLang in a virtualenv and set it")
    return Availability(True, " ".join(argv))


def describe(backend: Any, facts: HostFacts) -> Availability:
    """The availability of one registered backend."""
    own = getattr(backend, "availability", None)
    if own is not None:
        return own(facts)
    from solar_host.backends import huggingface, sglang

    if backend is huggingface.BACKEND:
        return _huggingface(facts)
    if backend is sglang.BACKEND:
        return _sglang(facts)
    ok = bool(backend.is_available(facts))
    return Availability(ok, type(backend).__name__, None if ok else "not available on this host")


def log_lines(table: dict[str, Availability]) -> list[str]:
    """One line per backend type, as the host logs them at start and doctor prints them."""
    out = []
    for bt, a in table.items():
        if a.available:
            out.append(f"backend {bt}: available, uses {a.uses}")
        else:
            out.append(f"backend {bt}: NOT available: {a.reason}")
    return out

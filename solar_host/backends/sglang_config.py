"""The SGLang instance config: typed knobs, extra_args and extra_env with their guards."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from solar_host.backends.base import LOADER_ENV_VARS, BackendConfigBase

# Flags the host sets itself. SGLang's CLI is argparse with abbreviations allowed, so any
# unambiguous prefix of these (e.g. `--por`) would set them too: see `managed_flag_of`.
MANAGED_FLAGS = (
    "--host",
    "--port",
    "--api-key",
    "--model-path",
    "--served-model-name",
    "--enable-metrics",
)
# Variables the host manages for SGLang; extra_env must not override them.
MANAGED_ENV_VARS = frozenset(
    {
        "SGLANG_API_KEY",
        "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
        "PYTHONUNBUFFERED",
    }
)
# Every long option of `sglang serve` that starts like a managed flag. An abbreviation is
# only ambiguous (and so refused by argparse itself) when it prefixes two of these, so a
# prefix of a managed flag that prefixes nothing else here is what argparse would expand.
_KNOWN_FLAGS_SHARING_PREFIXES = (
    "--host",
    "--port",
    "--api-key",
    "--admin-api-key",
    "--model-path",
    "--model-impl",
    "--model-loader-extra-config",
    "--model-checksum",
    "--served-model-name",
    "--enable-metrics",
    "--enable-metrics-for-all-schedulers",
)


def managed_flag_of(arg: str) -> str | None:
    """The managed flag that `arg` would set in an argparse CLI, or None."""
    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0]
    if name in MANAGED_FLAGS:
        return name
    # argparse also accepts `--flag_name` spelled with underscores in SGLang (it defines both
    # spellings for some options); normalise before matching prefixes.
    norm = name.replace("_", "-")
    if norm in MANAGED_FLAGS:
        return norm
    if len(norm) < 3:
        return None
    candidates = [f for f in _KNOWN_FLAGS_SHARING_PREFIXES if f.startswith(norm)]
    managed = [f for f in candidates if f in MANAGED_FLAGS]
    if managed and len(candidates) == 1:
        return managed[0]
    # An exact managed flag that is also the prefix of a longer option still wins in argparse
    # only on an exact match, handled above; several candidates mean argparse refuses it.
    return None


class SglangConfig(BackendConfigBase):
    backend_type: Literal["sglang"] = "sglang"
    model_path: str | None = Field(default=None, description="Model weights directory.")
    tp_size: int | None = Field(default=None, ge=1, le=1024)
    dp_size: int | None = Field(default=None, ge=1, le=1024)
    context_length: int | None = Field(default=None, ge=1, le=100_000_000)
    mem_fraction_static: float | None = Field(default=None, gt=0, le=1)
    chunked_prefill_size: int | None = Field(default=None, ge=-1, le=100_000_000)
    max_running_requests: int | None = Field(default=None, ge=1, le=10_000_000)
    cuda_graph_max_bs: int | None = Field(default=None, ge=1, le=1_000_000)
    cuda_graph_max_bs_decode: int | None = Field(default=None, ge=1, le=1_000_000)
    swa_full_tokens_ratio: float | None = Field(default=None, ge=0, le=1)
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    moe_runner_backend: str | None = None
    speculative_algorithm: str | None = None
    trust_remote_code: bool = False
    enable_hierarchical_cache: bool = False
    hicache_ratio: float | None = Field(default=None, gt=0, le=1e6)
    hicache_mem_layout: str | None = None
    hicache_io_backend: str | None = None
    hicache_storage_backend: str | None = None
    hicache_storage_backend_extra_config: str | None = None
    hicache_storage_prefetch_policy: str | None = None
    extra_args: list[str] | None = None
    extra_env: dict[str, str] | None = None

    @field_validator(
        "model_path",
        "dtype",
        "quantization",
        "kv_cache_dtype",
        "moe_runner_backend",
        "speculative_algorithm",
        "hicache_mem_layout",
        "hicache_io_backend",
        "hicache_storage_backend",
        "hicache_storage_prefetch_policy",
        mode="before",
    )
    @classmethod
    def _text(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            if not v:
                return None
            if "\x00" in v:
                raise ValueError("must not contain NUL characters")
        return v

    @field_validator("hicache_storage_backend_extra_config", mode="before")
    @classmethod
    def _extra_config(cls, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, str):
            if not v.strip():
                return None
            try:
                v = json.loads(v)
            except ValueError:
                raise ValueError(
                    "hicache_storage_backend_extra_config is not valid JSON"
                ) from None
        if not isinstance(v, dict):
            raise ValueError("hicache_storage_backend_extra_config must be a JSON object")
        return json.dumps(v, separators=(",", ":"), sort_keys=True)

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        out = []
        for entry in v:
            s = entry.strip()
            if not s:
                raise ValueError("extra_args must not contain empty entries")
            if "\x00" in s:
                raise ValueError("extra_args must not contain NUL characters")
            flag = managed_flag_of(s)
            if flag:
                raise ValueError(
                    f"'{flag}' is managed by solar-host and must not be set through extra_args"
                    + (f" (got '{s.split('=', 1)[0]}')" if s.split("=", 1)[0] != flag else "")
                )
            out.append(s)
        return out or None

    @field_validator("extra_env")
    @classmethod
    def _extra_env(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return None
        for name, value in v.items():
            if not name.strip():
                raise ValueError("extra_env must not contain blank variable names")
            if "=" in name or "\x00" in name or "\x00" in value:
                raise ValueError(f"extra_env name '{name}' is not a valid variable name")
            upper = name.strip().upper()
            if upper in LOADER_ENV_VARS:
                raise ValueError(
                    f"extra_env must not set '{name}': it changes what code the backend loads"
                )
            if upper in MANAGED_ENV_VARS:
                raise ValueError(f"'{name}' is managed by solar-host and must not be set")
        return {k.strip(): val for k, val in v.items()} or None

    @model_validator(mode="after")
    def _needs_model(self) -> SglangConfig:
        if not self.model_path and not self.model_source:
            raise ValueError("Either 'model_path' or 'model_source' must be provided")
        return self

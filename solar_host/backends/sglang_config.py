"""The SGLang instance config: typed knobs, extra_args and extra_env with their guards."""

from __future__ import annotations

import fnmatch
import json
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from solar_host.backends.base import LOADER_ENV_VARS, BackendConfigBase

# Flags the host sets itself. extra_args come last on the command line and argparse keeps the
# last value it sees, so letting a caller repeat one of these would override the host's value.
MANAGED_FLAGS = (
    "--host",
    "--port",
    "--api-key",
    "--model-path",
    "--served-model-name",
    "--enable-metrics",
    # Names the host's key file (the key reaches SGLang through it, never argv).
    "--config",
)
# Other option strings of the same argparse actions (sglang 0.5.23: `--model` is an alias of
# `--model-path`); each maps to the managed flag named in errors.
_MANAGED_ALIASES = {"--model": "--model-path"}
_MANAGED_SPELLINGS = {**{f: f for f in MANAGED_FLAGS}, **_MANAGED_ALIASES}
# Variables the host manages for SGLang; extra_env must not override them. SGLang reads no
# environment variable for its API key (checked in sglang 0.5.23: only `--api-key`).
MANAGED_ENV_VARS = frozenset(
    {
        "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
        "PYTHONUNBUFFERED",
    }
)
# Variables beyond base.LOADER_ENV_VARS that make SGLang's process load or run code named by a
# path, and a caller can put files under the model roots (a pull): shell patterns, matched on
# the upper-cased name. A list of what is known, not a proof: the backend's Landlock confinement
# is what bounds the rest.
_LOADER_ENV_PATTERNS = (
    "LD_*",  # every dynamic-loader knob
    "DYLD_*",
    "GCONV_PATH",  # glibc's character-set modules
    "PYTHON*",  # PYTHONWARNINGS imports the module of a category; see _PYTHON_ENV_ALLOWED
    "HOME",  # Python's user site-packages (~/.local) and their .pth files
    "OPENSSL_CONF",  # an OpenSSL config loads providers and engines (ssl, hashlib)
    "OPENSSL_MODULES",
    "OPENSSL_ENGINES",
    "CUDA_INJECTION*",  # the CUDA driver loads this library into the process
    "NCCL_*PLUGIN*",  # NCCL's net, tuner and profiler plugins
    "OMP_TOOL*",  # OpenMP tool libraries
    "KMP_*LIB*",
    "VK_*",  # Vulkan layers and drivers
    "HSA_TOOLS_LIB",
    "OCL_ICD_*",
    "TRITON_*PATH",  # ptxas, cuobjdump, libcuda: programs and libraries Triton runs
    "TRITON_CACHE_DIR",  # compiled kernels, loaded as they are found
    "TRITON_HOME",
    "TRITON_OVERRIDE_DIR",
    "TORCH_EXTENSIONS_DIR",  # built extensions, imported from there
    "TORCHINDUCTOR_CACHE_DIR",
    "HF_MODULES_CACHE",  # remote-code modules
    "CC",  # compilers Triton and torch invoke
    "CXX",
    "NVCC*",
    "CUDA_HOME",
    "CUDA_PATH",
    "NODE_OPTIONS",
)
# Python variables that change only how the interpreter behaves, not what it loads.
_PYTHON_ENV_ALLOWED = frozenset(
    {
        "PYTHONHASHSEED",
        "PYTHONIOENCODING",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONFAULTHANDLER",
        "PYTHONUTF8",
        "PYTHONNOUSERSITE",
        "PYTHONMALLOC",
    }
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def managed_flag_of(arg: str) -> str | None:
    """The managed flag that `arg` would set on SGLang's argparse CLI, or None.

    argparse (allow_abbrev=True, SGLang's default) accepts `--flag value`, `--flag=value` and
    any unambiguous prefix of a long option, in both forms. An exact option string always
    wins; a prefix is expanded when it prefixes exactly one option and refused as ambiguous
    otherwise. So every prefix of a managed option string is refused here, whatever other
    options a given SGLang version has: argparse would either expand it to the managed flag
    or reject it as ambiguous, and no SGLang option is a strict prefix of a managed one except
    the alias `--model`. Underscore spellings are refused too (harmless if SGLang rejects
    them, safe if a version accepts them).

    Checked against sglang 0.5.23's own parser (`ServerArgs.add_cli_args`, 561 option
    strings): every option and every prefix of one, as `--x v`, `--x=v` and `--x` (25,203
    spellings), is refused here exactly when argparse would set a managed option or reject
    the spelling as ambiguous. tests/test_sglang_command.py repeats the check offline.
    """
    if not arg.startswith("--"):
        # Single-dash strings never expand to a `--long` option in argparse.
        return None
    name = arg.split("=", 1)[0].replace("_", "-")
    if len(name) <= 2:
        return None  # bare `--` ends option parsing; it sets nothing
    exact = _MANAGED_SPELLINGS.get(name)
    if exact:
        return exact
    for spelling, flag in _MANAGED_SPELLINGS.items():
        if spelling.startswith(name):
            return flag
    return None


def loader_env_reason(name: str) -> str | None:
    """Why `name` may not be set through extra_env, or None when it may."""
    upper = name.upper()
    if upper in MANAGED_ENV_VARS:
        return f"extra_env must not set '{name}': it is managed by solar-host"
    loads_code = upper in LOADER_ENV_VARS or any(
        fnmatch.fnmatchcase(upper, p) for p in _LOADER_ENV_PATTERNS
    )
    if loads_code and upper not in _PYTHON_ENV_ALLOWED:
        return f"extra_env must not set '{name}': it changes what code the backend loads"
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
                raise ValueError("hicache_storage_backend_extra_config is not valid JSON") from None
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
                given = s.split("=", 1)[0]
                raise ValueError(
                    f"'{flag}' is managed by solar-host and must not be set through extra_args"
                    + (f" (got '{given}')" if given != flag else "")
                )
            out.append(s)
        return out or None

    @field_validator("extra_env")
    @classmethod
    def _extra_env(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return None
        out: dict[str, str] = {}
        for raw_name, value in v.items():
            name = raw_name.strip()
            if not name:
                raise ValueError("extra_env must not contain blank variable names")
            if not _ENV_NAME.match(name):
                raise ValueError(f"extra_env name '{name}' is not a valid variable name")
            if "\x00" in value:
                raise ValueError(f"extra_env value of '{name}' must not contain NUL characters")
            reason = loader_env_reason(name)
            if reason:
                raise ValueError(reason)
            out[name] = value
        return out or None

    @model_validator(mode="after")
    def _needs_model(self) -> SglangConfig:
        if not self.model_path and not self.model_source:
            raise ValueError("Either 'model_path' or 'model_source' must be provided")
        return self

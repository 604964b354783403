"""What every backend provides, as data and pure functions.

A backend turns a validated config into a command line and environment (`LaunchSpec`), says
how readiness shows (a log line and/or an HTTP health path), parses its log lines into runtime
state and generation metrics, and lists its endpoints and capabilities. It never touches a
process, a socket or a file it was not handed: the supervisor does that.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import ConfigDict, Field, field_validator

from solar_host.platform.tracked import Tracked

# Variables that move a runtime's cache or scratch space elsewhere.
CACHE_VARS = (
    "TMPDIR",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "HF_MODULES_CACHE",
    "TORCH_HOME",
    "TORCH_EXTENSIONS_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_HOME",
    "TRITON_CACHE_DIR",
    "CUDA_CACHE_PATH",
    "FLASHINFER_WORKSPACE_BASE",
    "PROMETHEUS_MULTIPROC_DIR",
)
# Variables a caller may never set through `extra_env`: they change what code the backend
# loads (a way to run arbitrary code as the host user) or how Python starts.
LOADER_ENV_VARS = frozenset(
    {
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "PYTHONINSPECT",
        "PYTHONUSERBASE",
        "PATH",
        "VIRTUAL_ENV",
        "DYLD_INSERT_LIBRARIES",
        "DYLD_LIBRARY_PATH",
        "BASH_ENV",
        "ENV",
    }
)


class BackendConfigBase(Tracked):  # Tracked: config.json re-encodes only changed records
    """Fields common to every backend config.

    Unknown keys are kept and echoed back unchanged: solar-control compares configs key by
    key, and intents carry keys meant for other backends.
    """

    model_config = ConfigDict(extra="allow", protected_namespaces=(), validate_assignment=False)

    backend_type: str
    alias: str = Field(min_length=1, max_length=256, description="Routing name of the model.")
    host: str = Field(default="0.0.0.0", description="Address the backend binds to.")
    port: int | None = Field(
        default=None, ge=1, le=65535, description="Fixed port (default: allocated)."
    )
    model_source: str | None = Field(
        default=None, description="URI the model came from (local://, repo://, huggingface://)."
    )
    file_filters: list[str] | None = Field(
        default=None, description="HuggingFace allow-patterns used when the model was pulled."
    )
    api_key: str | None = Field(
        default=None,
        description="An additional key the backend accepts (the host key always works).",
    )
    skip_fit_check: bool = Field(
        default=False,
        description="Start even when the memory estimate exceeds what is free on its devices.",
    )

    @field_validator("alias")
    @classmethod
    def _alias_text(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("alias must not be blank")
        if any(c in v for c in "\x00\n\r\t"):
            raise ValueError("alias must not contain control characters")
        return v

    @field_validator("api_key")
    @classmethod
    def _blank_key_is_none(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            return None
        return v


@dataclass(frozen=True, slots=True)
class LaunchContext:
    """What the host hands a backend to build its command line."""

    instance_id: str
    port: int
    host_api_key: str
    models_dir: Path
    llama_server_bin: str = "llama-server"
    sglang_venv_path: str = ""
    sglang_prompt_cache_dir: str = ""
    gpu_type: str = "cpu"
    python_executable: str = ""
    # A directory only the host user can read, for files that carry secrets (SGLang's key).
    private_dir: Path | None = None


@dataclass(slots=True)
class LaunchSpec:
    """A command line, the variables the backend needs on top of the allowlisted host
    environment (instances/backend_env.py), private files (path -> text) the host writes
    0600 before the spawn, and the directories of its own it writes beyond its caches (see
    instances/confinement.py)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    env_remove: tuple[str, ...] = ()
    warnings: list[str] = field(default_factory=list)
    private_files: dict[str, str] = field(default_factory=dict)
    write_dirs: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CanaryAsk:
    """Which known-answer probe a backend answers through its real API (instances/canary.py
    holds the probes: the prompt, the text, what is compared): `kind` is "generation",
    "embedding" or "classification", `path` its endpoint, `extra` fields of the request body
    only this backend takes (llama-server's `cache_prompt`)."""

    kind: str
    path: str
    extra: Mapping[str, Any] = field(default_factory=dict)


class LaunchError(Exception):
    """The backend cannot be launched on this host (missing executable, wrong GPU, ...)."""


@dataclass(slots=True)
class RuntimeState:
    """What a backend is doing right now, parsed from its log (and metrics)."""

    busy: bool = False
    phase: str = "idle"  # idle | prefill | generating
    prefill_progress: float | None = None
    active_slots: int = 0
    slot_id: int | None = None
    task_id: int | None = None
    prefill_prompt_tokens: int | None = None
    generated_tokens: int | None = None
    decode_tps: float | None = None
    decode_ms_per_token: float | None = None
    checkpoint_index: int | None = None
    checkpoint_total: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class GenerationMetrics:
    """Token counts and speed of one finished request."""

    slot_id: int | None = None
    task_id: int | None = None
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_eval_tokens: int | None = None
    total_tokens: int | None = None
    decode_tps: float | None = None
    decode_ms_per_token: float | None = None
    source: str = "log"  # usage | metrics | log
    started_at: str | None = None
    finished_at: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class ParseResult:
    """What one log line (or metrics scrape) changed: a new state and/or a finished request."""

    state: RuntimeState | None = None
    generation: GenerationMetrics | None = None


class LogParser(Protocol):
    """Stateful parser of one backend process's log, fed line by line."""

    def feed(self, line: str) -> ParseResult | None: ...

    def apply_metrics(self, metrics: Mapping[str, float]) -> ParseResult | None: ...


class NullParser:
    """Parser for backends whose logs carry no runtime state."""

    def feed(self, line: str) -> ParseResult | None:
        return None

    def apply_metrics(self, metrics: Mapping[str, float]) -> ParseResult | None:
        return None


@dataclass(frozen=True, slots=True)
class Availability:
    """Whether this host can run a backend type, with what, and why not."""

    available: bool
    uses: str | None = None  # the executable or module it will run
    reason: str | None = None  # why it is not available (with the fix)

    def as_dict(self) -> dict[str, Any]:
        return {"available": self.available, "uses": self.uses, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the host knows about itself, for backend advertisement."""

    gpu_type: str  # nvidia_cuda | apple_mps | cpu
    llama_server_bin: str = "llama-server"
    sglang_venv_path: str = ""
    hf_available: bool = False


class Backend(Protocol):
    """One kind of backend. Implementations are modules or plain objects of pure functions."""

    backend_types: ClassVar[tuple[str, ...]]
    health_path: ClassVar[str | None]
    metrics_path: ClassVar[str | None]

    def config_model(self, backend_type: str) -> type[BackendConfigBase]: ...

    def launch(self, config: BackendConfigBase, ctx: LaunchContext) -> LaunchSpec: ...

    def is_ready_line(self, line: str) -> bool: ...

    def new_parser(self, config: BackendConfigBase) -> LogParser: ...

    def supported_endpoints(self, config: BackendConfigBase) -> list[str]: ...

    def capabilities(self, config: BackendConfigBase, models_dir: Path) -> list[str] | None: ...

    def served_model_name(self, config: BackendConfigBase) -> str: ...

    def model_paths(self, config: BackendConfigBase) -> list[str]: ...

    def is_available(self, facts: HostFacts) -> bool: ...

    def availability(self, facts: HostFacts) -> Availability: ...

    def preflight(self, config: BackendConfigBase) -> list[str]: ...

    def create_refusals(
        self, config: BackendConfigBase, facts: HostFacts
    ) -> list[dict[str, str]]: ...

    def before_start(self, config: BackendConfigBase, ctx: LaunchContext) -> list[str]: ...

    def after_stop(self, config: BackendConfigBase, cache_root: str, instance_id: str) -> None: ...

    def usage_snapshot(self, metrics: Mapping[str, float]) -> dict[str, Any] | None: ...

    def sweep_caches(self, root: str, keep: Iterable[tuple[str, str]] = ()) -> list[Path]: ...

    def canary_probe(self, config: BackendConfigBase) -> CanaryAsk | None: ...


class BackendBase:
    """What a backend may do beyond launching, with what a backend that does none of it says.

    Every backend class subclasses this and overrides what it does; the host calls these
    methods on any backend (never looks them up by name), so a capability a backend lacks is
    a default here, and one it has but misspells is a type error, not a silent no-op."""

    def is_available(self, facts: HostFacts) -> bool:
        return True

    def availability(self, facts: HostFacts) -> Availability:
        """Whether it can run on this host, with what, and why not (GET /, doctor, start log)."""
        ok = bool(self.is_available(facts))
        return Availability(ok, type(self).__name__, None if ok else "not available on this host")

    def preflight(self, config: BackendConfigBase) -> list[str]:
        """What about the config's files would fail every attempt (checked before a spawn)."""
        return []

    def create_refusals(self, config: BackendConfigBase, facts: HostFacts) -> list[dict[str, str]]:
        """Fields this host cannot honour, refused with 422 at create: {"field", "msg"}."""
        return []

    def before_start(self, config: BackendConfigBase, ctx: LaunchContext) -> list[str]:
        """Prepare what the launch needs on disk (a cache directory); returns warnings."""
        return []

    def after_stop(self, config: BackendConfigBase, cache_root: str, instance_id: str) -> None:
        """Clean up after the backend of `instance_id` ended (stopped, crashed, failed)."""
        return None

    def usage_snapshot(self, metrics: Mapping[str, float]) -> dict[str, Any] | None:
        """Its usage counters under our names from a /metrics scrape; None when it has none."""
        return None

    def sweep_caches(self, root: str, keep: Iterable[tuple[str, str]] = ()) -> list[Path]:
        """Remove leftover caches under `root` except those of (alias, instance id) in `keep`."""
        return []

    def canary_probe(self, config: BackendConfigBase) -> CanaryAsk | None:
        """The known-answer probe this backend answers for `config`; None: it has none (its
        answers are not checked, only its health)."""
        return None


VISION_CAPABILITIES = ["completion", "multimodal"]

_VISION_MODEL_TYPES = frozenset(
    {
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "llava",
        "llava_next",
        "idefics3",
        "internvl_chat",
        "minicpmv",
        "moondream2",
        "paligemma",
        "phi3_v",
        "pixtral",
        "smolvlm",
    }
)


def vision_capabilities_of_dir(model_dir: str | Path | None) -> list[str] | None:
    """["completion", "multimodal"] when the model directory's config.json is a vision model."""
    import json

    if not model_dir:
        return None
    cfg = Path(model_dir) / "config.json"
    try:
        if not Path(model_dir).is_dir():
            return None
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    mt = str(data.get("model_type") or "")
    if "vision_config" in data or mt in _VISION_MODEL_TYPES or mt.endswith("_vl"):
        return list(VISION_CAPABILITIES)
    return None


def utc_now_iso() -> str:
    """Timestamps in parsed metrics: ISO-8601 UTC, as control and the API expect."""
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat()


_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def alias_safe(alias: str) -> str:
    """Alias as a file-name fragment: `:` and `/` (and anything odd) become `-`."""
    return _SAFE.sub("-", alias).strip(".-") or "instance"

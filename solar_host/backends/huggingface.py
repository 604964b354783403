"""The HuggingFace backend: our own `solar_host.servers.hf_server`, one process per model.

The server takes its API keys from the environment (SOLAR_HF_API_KEYS), never argv, so
they do not show in `ps`. Its log carries `[REQUEST]`, `[COMPLETE]` and `[ERROR]` markers
with request ids; the parser counts requests in flight from them and turns each finished
chat/completion request into GenerationMetrics (embedding and classification requests only
move the runtime state: they generate nothing).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import ClassVar, cast

from solar_host.backends.base import (
    VISION_CAPABILITIES,
    Availability,
    BackendBase,
    BackendConfigBase,
    CanaryAsk,
    GenerationMetrics,
    HostFacts,
    LaunchContext,
    LaunchError,
    LaunchSpec,
    ParseResult,
    RuntimeState,
    vision_capabilities_of_dir,
)
from solar_host.backends.files import local_model_problems
from solar_host.backends.huggingface_config import (
    HuggingFaceCausalConfig,
    HuggingFaceClassificationConfig,
    HuggingFaceConfigBase,
    HuggingFaceEmbeddingConfig,
    HuggingFaceVisionConfig,
)
from solar_host.servers.log_lines import (
    GENERATION_ENDPOINTS,
    is_ready_line,
    is_started_line,
    parse_marker,
    timestamp,
)

API_KEYS_ENV = "SOLAR_HF_API_KEYS"  # same name as solar_host.servers.hf_server.API_KEYS_ENV
SERVER_MODULE = "solar_host.servers.hf_server"

CONFIGS: dict[str, type[HuggingFaceConfigBase]] = {
    "huggingface_causal": HuggingFaceCausalConfig,
    "huggingface_classification": HuggingFaceClassificationConfig,
    "huggingface_embedding": HuggingFaceEmbeddingConfig,
    "huggingface_vision": HuggingFaceVisionConfig,
}
MODEL_TYPES = {
    "huggingface_causal": "causal",
    "huggingface_classification": "classification",
    "huggingface_embedding": "embedding",
    "huggingface_vision": "vision",
}
ENDPOINTS = {
    "huggingface_causal": ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health"],
    "huggingface_classification": ["/v1/classify", "/v1/models", "/health"],
    "huggingface_embedding": ["/v1/embeddings", "/v1/models", "/health"],
    "huggingface_vision": ["/v1/chat/completions", "/v1/models", "/health"],
}

# The known-answer probes (instances/canary.py); a vision model has none yet (it would need an
# image to be a probe of what it does).
CANARY_PROBES = {
    "huggingface_causal": CanaryAsk("generation", "/v1/completions"),
    "huggingface_classification": CanaryAsk("classification", "/v1/classify"),
    "huggingface_embedding": CanaryAsk("embedding", "/v1/embeddings"),
}


def _now() -> datetime:
    return datetime.now(UTC)


HuggingFaceConfig = (
    HuggingFaceCausalConfig
    | HuggingFaceClassificationConfig
    | HuggingFaceEmbeddingConfig
    | HuggingFaceVisionConfig
)


def model_id_of(config: BackendConfigBase) -> str | None:
    """An HF config's model_id (None for a config of another backend)."""
    return config.model_id if isinstance(config, HuggingFaceConfigBase) else None


def model_dir_of(config: BackendConfigBase, models_dir: Path) -> Path | None:
    """The model directory when model_id names one (absolute, or relative to MODELS_DIR)."""
    raw = model_id_of(config)
    if not raw:
        return None
    path = Path(raw)
    if not path.is_absolute():
        path = models_dir / path
    return path if path.is_dir() else None


def _kind_flags(hf: HuggingFaceConfig) -> list[str]:
    """The flags that only one kind of model takes."""
    flags: list[str] = []
    if isinstance(hf, HuggingFaceCausalConfig | HuggingFaceVisionConfig) and hf.use_flash_attention:
        flags.append("--use-flash-attention")
    if isinstance(hf, HuggingFaceClassificationConfig) and hf.labels:
        flags += ["--labels-json", json.dumps(list(hf.labels), ensure_ascii=False)]
    if isinstance(hf, HuggingFaceEmbeddingConfig) and hf.normalize_embeddings:
        flags.append("--normalize-embeddings")
    if isinstance(hf, HuggingFaceVisionConfig):
        if hf.allow_image_urls:
            flags.append("--allow-image-urls")
        flags += ["--max-images", str(hf.max_images)]
        flags += ["--max-image-bytes", str(hf.max_image_bytes)]
    return flags


class HFLogParser:
    """Runtime state and finished-generation metrics from hf_server's log markers (their
    format: solar_host.servers.log_lines)."""

    def __init__(self, clock: Callable[[], datetime] = _now):
        self._clock = clock
        self._active: dict[str, tuple[str, datetime]] = {}  # id -> (endpoint, started)
        self._last: RuntimeState | None = None

    def _state(self) -> RuntimeState | None:
        n = len(self._active)
        state = RuntimeState(busy=n > 0, phase="generating" if n else "idle", active_slots=n)
        if state == self._last:
            return None
        self._last = state
        return state

    def feed(self, line: str) -> ParseResult | None:
        marker = parse_marker(line)
        if marker is not None:
            return self._mark(marker.kind, marker.rid, marker.fields)
        if is_started_line(line):
            self._active.clear()
            state = self._state()
            return ParseResult(state=state) if state else None
        return None

    def _mark(self, kind: str, rid: str, kv: dict[str, str]) -> ParseResult | None:
        now = self._clock()
        if kind == "REQUEST":
            self._active[rid] = (kv.get("endpoint", ""), now)
            state = self._state()
            return ParseResult(state=state) if state else None
        entry = self._active.pop(rid, None)
        state = self._state()
        gen = None
        endpoint = kv.get("endpoint") or (entry[0] if entry else "")
        if kind == "COMPLETE" and endpoint in GENERATION_ENDPOINTS:
            gen = self._metrics(kv, entry[1] if entry else None, now)
        if state is None and gen is None:
            return None
        return ParseResult(state=state, generation=gen)

    @staticmethod
    def _metrics(kv: dict[str, str], started: datetime | None, now: datetime) -> GenerationMetrics:
        def num(key: str) -> float | None:
            try:
                return float(kv[key])
            except (KeyError, ValueError):
                return None

        prompt, completion, ms = num("prompt_tokens"), num("completion_tokens"), num("time_ms")
        # The server's own times when the line carries them: the record is then the request's,
        # not the moment the host happened to read the line (which may be after the next
        # request began).
        own_end, own_start = timestamp(kv.get("finished_at")), timestamp(kv.get("started_at"))
        if own_end is not None:
            now = own_end
            started = own_start or (now - timedelta(milliseconds=ms) if ms is not None else None)
        if started is None and ms is not None:
            started = now - timedelta(milliseconds=ms)
        tps = mspt = None
        if completion and ms:
            tps = completion / ms * 1000
            mspt = ms / completion
        p = int(prompt) if prompt is not None else None
        c = int(completion) if completion is not None else None
        return GenerationMetrics(
            prompt_tokens=p,
            generated_tokens=c,
            total_tokens=(p or 0) + (c or 0) if p is not None or c is not None else None,
            decode_tps=tps,
            decode_ms_per_token=mspt,
            source="log",
            started_at=started.isoformat() if started else None,
            finished_at=now.isoformat(),
        )

    def apply_metrics(self, metrics: Mapping[str, float]) -> ParseResult | None:
        return None


class HuggingFaceBackend(BackendBase):
    backend_types: ClassVar[tuple[str, ...]] = tuple(CONFIGS)
    health_path: ClassVar[str | None] = "/health"
    metrics_path: ClassVar[str | None] = None

    def config_model(self, backend_type: str) -> type[BackendConfigBase]:
        try:
            return CONFIGS[backend_type]
        except KeyError:
            raise KeyError(f"Unknown HuggingFace backend_type: {backend_type!r}") from None

    def launch(self, config: BackendConfigBase, ctx: LaunchContext) -> LaunchSpec:
        if config.backend_type not in MODEL_TYPES or not isinstance(
            config, CONFIGS[config.backend_type]
        ):
            raise LaunchError(f"Unknown HuggingFace backend_type: {config.backend_type!r}")
        hf = cast(HuggingFaceConfig, config)  # CONFIGS[backend_type], checked above
        model_id = hf.model_id
        if not model_id:
            raise LaunchError(
                "HuggingFace instance has no model_id: pull the model first "
                "(model_source must be resolved to a local directory)"
            )
        argv = [
            ctx.python_executable or sys.executable,
            "-m",
            SERVER_MODULE,
            "--model-id",
            str(model_id),
            "--model-type",
            MODEL_TYPES[config.backend_type],
            "--alias",
            config.alias,
            "--host",
            config.host,
            "--port",
            str(ctx.port),
            "--device",
            str(hf.device),
            "--dtype",
            str(hf.dtype),
            "--max-length",
            str(hf.max_length),
            "--max-batch-size",
            str(hf.max_batch_size),
            "--batch-window-ms",
            str(hf.batch_window_ms),
        ]
        if hf.trust_remote_code:
            argv.append("--trust-remote-code")
        argv += _kind_flags(hf)
        keys = [k for k in (ctx.host_api_key, config.api_key) if k]
        if any("," in k for k in keys):
            raise LaunchError("API keys for the HuggingFace server must not contain commas")
        env = {API_KEYS_ENV: ",".join(dict.fromkeys(keys)), "PYTHONUNBUFFERED": "1"}
        return LaunchSpec(argv=argv, env=env)

    def is_ready_line(self, line: str) -> bool:
        return is_ready_line(line)

    def new_parser(self, config: BackendConfigBase) -> HFLogParser:
        return HFLogParser()

    def supported_endpoints(self, config: BackendConfigBase) -> list[str]:
        return list(ENDPOINTS.get(config.backend_type, ["/v1/models", "/health"]))

    def capabilities(self, config: BackendConfigBase, models_dir: Path) -> list[str] | None:
        if config.backend_type == "huggingface_vision":
            return list(VISION_CAPABILITIES)
        if config.backend_type == "huggingface_causal":
            return vision_capabilities_of_dir(model_dir_of(config, models_dir))
        return None

    def served_model_name(self, config: BackendConfigBase) -> str:
        return config.alias

    def model_paths(self, config: BackendConfigBase) -> list[str]:
        model_id = model_id_of(config)
        return [model_id] if model_id and Path(model_id).is_absolute() else []

    def is_available(self, facts: HostFacts) -> bool:
        return facts.hf_available

    def availability(self, facts: HostFacts) -> Availability:
        if facts.hf_available:
            return Availability(True, f"python -m {SERVER_MODULE} ({sys.executable})")
        return Availability(
            False,
            reason="torch and transformers are not installed in this Python: "
            "install the huggingface extra (pip install '.[huggingface]' in the solar-host "
            "checkout; CPU-only torch: see the README)",
        )

    def canary_probe(self, config: BackendConfigBase) -> CanaryAsk | None:
        return CANARY_PROBES.get(config.backend_type)

    def preflight(self, config: BackendConfigBase) -> list[str]:
        # Its model is a directory (or a Hub id, which is not a path): it must be there.
        return local_model_problems(self, config, "model_id")


BACKEND = HuggingFaceBackend()

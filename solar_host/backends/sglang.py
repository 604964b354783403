"""The SGLang backend: command line, environment, readiness and log/metrics parsing.

SGLang runs from its own virtualenv (SGLANG_VENV_PATH) on NVIDIA CUDA hosts only. It reads
`a:b` model names as base model + LoRA adapter, so it serves the alias with every `:` turned
into `-`; the alias stays the routing key everywhere else.

Its scheduler logs prefill and decode batches but never a request's end, so a request is
closed by the /metrics poll (`apply_metrics`: running requests back to 0), with token counts
from the counters' deltas and from the prefill lines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from solar_host.backends import sglang_cache
from solar_host.backends.base import (
    Availability,
    BackendBase,
    BackendConfigBase,
    GenerationMetrics,
    HostFacts,
    LaunchContext,
    LaunchError,
    LaunchSpec,
    ParseResult,
    RuntimeState,
    utc_now_iso,
    vision_capabilities_of_dir,
)
from solar_host.backends.files import local_model_problems
from solar_host.backends.sglang_config import SglangConfig

CACHE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"

# Value flags in command-line order: (config field, flag).
_VALUE_FLAGS = (
    "tp_size",
    "dp_size",
    "context_length",
    "mem_fraction_static",
    "chunked_prefill_size",
    "max_running_requests",
    "cuda_graph_max_bs",
    "cuda_graph_max_bs_decode",
    "swa_full_tokens_ratio",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "moe_runner_backend",
    "speculative_algorithm",
    "hicache_ratio",
    "hicache_mem_layout",
    "hicache_io_backend",
)
_BOOL_FLAGS = ("trust_remote_code", "enable_hierarchical_cache")
# The file storage tier needs a directory per instance; without a cache root they are dropped.
_STORAGE_FLAGS = (
    "hicache_storage_backend",
    "hicache_storage_backend_extra_config",
    "hicache_storage_prefetch_policy",
)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _joined(flag: str, value: object) -> str:
    """`--flag=value`, one argument: argparse reads a separate value that starts with '-' (an
    alias '-x', a host '-h') as an option and exits, so caller text never stands alone."""
    return f"{flag}={value}"


def _is_exe(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def resolve_executable(venv_path: str) -> list[str] | None:
    """The argv prefix that starts SGLang's server, or None when it cannot be found.

    With a venv configured only the venv counts (never a `sglang` elsewhere on PATH):
    `<venv>/bin/sglang serve`, else `<venv>/bin/python -m sglang.launch_server`.
    """
    venv = venv_path.strip()
    if venv:
        bin_dir = Path(venv) / "bin"
        if _is_exe(bin_dir / "sglang"):
            return [str(bin_dir / "sglang"), "serve"]
        if _is_exe(bin_dir / "python"):
            return [str(bin_dir / "python"), "-m", "sglang.launch_server"]
        return None
    found = shutil.which("sglang")
    return [found, "serve"] if found else None


def served_name_of(alias: str) -> str:
    """SGLang's served model name: `:` would read as base-model:LoRA-adapter."""
    return alias.replace(":", "-")


def model_dir_of(config: SglangConfig, models_dir: Path) -> Path | None:
    """The model directory: model_path, else a local:// source (relative to MODELS_DIR)."""
    raw = config.model_path
    if not raw and config.model_source and config.model_source.startswith("local://"):
        raw = config.model_source[len("local://") :]
    if not raw:
        return None
    path = Path(raw)
    return path if path.is_absolute() else models_dir / path


# --- Log parsing ------------------------------------------------------------------------------

_READY = re.compile(r"fired up and ready to roll", re.IGNORECASE)
# "Prefill batch, #new-seq: …" / "Prefill batch. …" / "Prefill batch [12], …" (iteration tag).
_BATCH = re.compile(r"\b(Prefill|Decode) batch(?: \[\d+\])?[,.]\s*(.*)$")


def _fields(rest: str) -> dict[str, str]:
    """`#new-token: 4096, full token usage: 0.01, …` -> {"#new-token": "4096", …}."""
    out = {}
    for part in rest.split(","):
        key, sep, value = part.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _int(fields: dict[str, str], key: str) -> int | None:
    try:
        return int(float(fields[key]))
    except (KeyError, ValueError):
        return None


def _float(fields: dict[str, str], key: str) -> float | None:
    try:
        return float(fields[key])
    except (KeyError, ValueError):
        return None


@dataclass(slots=True)
class _Prefill:
    """A prompt being prefilled, possibly over several chunks."""

    new_tokens: int
    cached_tokens: int
    pending_tokens: int
    started_at: str


@dataclass(slots=True)
class _Pending:
    """A prompt fully prefilled, waiting for the metrics poll to see its request end."""

    input_tokens: int
    prompt_eval_tokens: int
    cached_tokens: int
    started_at: str
    decode_tps: float | None = None
    decode_ms_per_token: float | None = None


# Prometheus names -> snapshot names (the names `/usage` reports for every backend).
METRIC_NAMES = {
    "sglang:prompt_tokens_total": "prompt_tokens_total",
    "sglang:generation_tokens_total": "generated_tokens_total",
    "sglang:cached_tokens_total": "cached_tokens_total",
    "sglang:num_running_reqs": "requests_processing",
    "sglang:num_queue_reqs": "requests_deferred",
    "sglang:token_usage": "kv_cache_usage_ratio",
}


def usage_snapshot(metrics: Mapping[str, float]) -> dict[str, float | None] | None:
    """Map a parsed /metrics body to snapshot fields; None when no SGLang metric is present."""
    if not any(name in metrics for name in METRIC_NAMES):
        return None
    return {field: metrics.get(name) for name, field in METRIC_NAMES.items()}


def _metric(metrics: Mapping[str, float], name: str) -> float | None:
    """A value by Prometheus name, or by snapshot name (callers may pass either form)."""
    value = metrics.get(name)
    if value is None:
        value = metrics.get(METRIC_NAMES[name])
    return value


class SglangLogParser:
    """Runtime state from SGLang's scheduler lines; request ends from /metrics.

    `feed` (log thread) and `apply_metrics` (metrics poll) may run on different threads: a
    lock keeps the shared request bookkeeping consistent.
    """

    def __init__(self, clock: Callable[[], str] = utc_now_iso, history: int = 100):
        self._clock = clock
        self._lock = threading.Lock()
        self._state = RuntimeState()
        self._prefill: _Prefill | None = None
        self._pending: _Pending | None = None
        self._open_counters: tuple[float | None, float | None, float | None] | None = None
        self.recent_generations: deque[GenerationMetrics] = deque(maxlen=history)

    # Read-only views for tests and the supervisor.
    @property
    def state(self) -> RuntimeState:
        return replace(self._state)

    @property
    def pending(self) -> _Pending | None:
        return self._pending

    @property
    def prefill_active(self) -> bool:
        return self._prefill is not None

    @property
    def last_generation(self) -> GenerationMetrics | None:
        return self.recent_generations[-1] if self.recent_generations else None

    def _emit(self, state: RuntimeState) -> RuntimeState | None:
        old = self._state
        key = ("busy", "phase", "active_slots", "decode_tps", "prefill_progress")
        changed = any(getattr(old, k) != getattr(state, k) for k in key)
        self._state = state
        return replace(state) if changed else None

    def feed(self, line: str) -> ParseResult | None:
        m = _BATCH.search(line)
        if not m:
            return None
        fields = _fields(m.group(2))
        with self._lock:
            state = self._prefill_line(fields) if m.group(1) == "Prefill" else self._decode(fields)
        return ParseResult(state=state) if state is not None else None

    def _prefill_line(self, f: dict[str, str]) -> RuntimeState | None:
        new = _int(f, "#new-token") or 0
        cached = _int(f, "#cached-token") or 0
        pending = _int(f, "#pending-token")
        group = self._prefill
        if group is None:
            # The first chunk carries the prefix-cache hit; later chunks report 0.
            group = _Prefill(0, cached, 0, self._clock())
            self._prefill = group
        group.new_tokens += new
        group.pending_tokens = pending or 0
        done = group.new_tokens + group.cached_tokens
        total = done + group.pending_tokens
        if not pending:
            # `#pending-token: 0` (or an older build without the field): the prompt is in.
            self._pending = _Pending(
                input_tokens=done,
                prompt_eval_tokens=group.new_tokens,
                cached_tokens=group.cached_tokens,
                started_at=group.started_at,
            )
            self._prefill = None
        running = _int(f, "#running-req")
        return self._emit(
            RuntimeState(
                busy=True,
                phase="prefill",
                prefill_progress=round(done / total, 4) if total else None,
                active_slots=running or 1,
                prefill_prompt_tokens=total or None,
            )
        )

    def _decode(self, f: dict[str, str]) -> RuntimeState | None:
        tps = _float(f, "gen throughput (token/s)")
        ms = round(1000.0 / tps, 3) if tps else None
        if self._pending is not None and tps is not None:
            self._pending.decode_tps = tps
            self._pending.decode_ms_per_token = ms
        running = _int(f, "#running-req")
        busy = running is None or running > 0
        return self._emit(
            RuntimeState(
                busy=busy,
                phase="generating" if busy else "idle",
                active_slots=(running if running is not None else 1) if busy else 0,
                decode_tps=tps,
                decode_ms_per_token=ms,
            )
        )

    def apply_metrics(self, metrics: Mapping[str, float]) -> ParseResult | None:
        """Close a request when /metrics shows no running request any more.

        The log never says when a request ends; the counters do. `num_running_reqs` is 0
        during prefill too, so a prefill in progress wins over an idle reading.
        """
        running = _metric(metrics, "sglang:num_running_reqs")
        if running is None:
            return None
        counters = (
            _metric(metrics, "sglang:prompt_tokens_total"),
            _metric(metrics, "sglang:generation_tokens_total"),
            _metric(metrics, "sglang:cached_tokens_total"),
        )
        with self._lock:
            if running > 0:
                if self._open_counters is None:
                    self._open_counters = counters
                if self._state.busy:
                    return None
                state = self._emit(
                    RuntimeState(busy=True, phase="generating", active_slots=int(running))
                )
                return ParseResult(state=state) if state else None
            generation = None
            if self._open_counters is not None:
                generation = self._finalize(self._open_counters, counters)
                self._open_counters = None
            state = None
            if self._prefill is None and self._state.busy:
                state = self._emit(RuntimeState())
        if generation is None and state is None:
            return None
        return ParseResult(state=state, generation=generation)

    def _finalize(
        self,
        opened: tuple[float | None, float | None, float | None],
        now: tuple[float | None, float | None, float | None],
    ) -> GenerationMetrics:
        def delta(i: int) -> int | None:
            if opened[i] is None or now[i] is None:
                return None
            return max(0, int(now[i] - opened[i]))

        pending = self._pending
        self._pending = None
        generated = delta(1)
        prompt = delta(0) or (pending.input_tokens if pending else None)
        cached = pending.cached_tokens if pending else delta(2)
        prompt_eval = max(0, prompt - (cached or 0)) if prompt is not None else None
        total = prompt + generated if prompt is not None and generated is not None else None
        record = GenerationMetrics(
            prompt_tokens=prompt,
            generated_tokens=generated,
            cached_tokens=cached,
            prompt_eval_tokens=prompt_eval,
            total_tokens=total,
            decode_tps=pending.decode_tps if pending else None,
            decode_ms_per_token=pending.decode_ms_per_token if pending else None,
            source="metrics",
            started_at=pending.started_at if pending else None,
            finished_at=self._clock(),
        )
        self.recent_generations.append(record)
        return record


# --- The backend ------------------------------------------------------------------------------


class SglangBackend(BackendBase):
    backend_types: ClassVar[tuple[str, ...]] = ("sglang",)
    # Readiness is the log line only. SGLang prints the uvicorn banner before its warmup
    # request, and older releases answer /health with 200 before warmup ends as well (0.5.23
    # answers 503 until then), so neither may promote an instance to running.
    health_path: ClassVar[str | None] = None
    metrics_path: ClassVar[str | None] = "/metrics"
    # /health still tells a live server from a dead one (re-adoption, liveness checks).
    liveness_path: ClassVar[str] = "/health"

    def config_model(self, backend_type: str) -> type[BackendConfigBase]:
        return SglangConfig

    def launch(self, config: BackendConfigBase, ctx: LaunchContext) -> LaunchSpec:
        """Command line and environment. Pure: reads the filesystem, writes nothing."""
        assert isinstance(config, SglangConfig)
        if ctx.gpu_type != "nvidia_cuda":
            raise LaunchError(
                "SGLang backend requires an NVIDIA CUDA host "
                f"(this host reports gpu_type={ctx.gpu_type!r})"
            )
        prefix = resolve_executable(ctx.sglang_venv_path)
        if prefix is None:
            where = (
                f"SGLANG_VENV_PATH={ctx.sglang_venv_path!r} has neither bin/sglang nor bin/python"
                if ctx.sglang_venv_path.strip()
                else "SGLANG_VENV_PATH is not set and no `sglang` is on PATH"
            )
            raise LaunchError(f"SGLang executable not found: {where}")
        if not config.model_path:
            raise LaunchError(
                "SGLang config has no model_path (resolve model_source before starting)"
            )
        warnings: list[str] = []
        # SGLang reads its key from no environment variable, and argv is readable by every
        # user of the machine (ps, /proc/<pid>/cmdline). So the key goes in a YAML file
        # only the host user can read, named by `--config`: SGLang merges the file's
        # `api-key` into its arguments in memory (server_args_config_parser).
        if ctx.private_dir is None:
            raise LaunchError("SGLang needs a private directory for its key file")
        if ctx.host_api_key.startswith("-"):
            # SGLang turns the file's `api-key` into `--api-key <key>` for argparse, which
            # reads a key starting with '-' as an option and exits.
            raise LaunchError(
                "SGLang cannot take an API key that starts with '-': change the host's API_KEY "
                "(for example to the output of python -c 'import secrets; "
                "print(secrets.token_hex(32))')"
            )
        key_file = ctx.private_dir / f"sglang-{ctx.instance_id}.yaml"
        argv = [
            *prefix,
            "--config",
            str(key_file),
            "--model-path",
            config.model_path,
            _joined("--served-model-name", served_name_of(config.alias)),
            _joined("--host", config.host),
            "--port",
            str(ctx.port),
        ]
        if config.api_key and config.api_key != ctx.host_api_key:
            warnings.append(
                "SGLang accepts a single API key: the instance's api_key is not applied "
                "(the host key is)"
            )
        for name in _VALUE_FLAGS:
            value = getattr(config, name)
            if value is not None:
                argv.append(_joined(_flag(name), value))
        argv += [_flag(name) for name in _BOOL_FLAGS if getattr(config, name)]
        env: dict[str, str] = dict(config.extra_env or {})
        try:
            cache_dir = sglang_cache.instance_cache_dir(
                ctx.sglang_prompt_cache_dir, config.alias, ctx.instance_id
            )
        except ValueError as err:
            raise LaunchError(f"SGLang prompt cache: {err}") from None
        storage = [(n, getattr(config, n)) for n in _STORAGE_FLAGS if getattr(config, n)]
        if cache_dir is not None:
            for name, value in storage:
                argv.append(_joined(_flag(name), value))
            env[CACHE_DIR_ENV] = str(cache_dir)
        elif storage:
            dropped = ", ".join(_flag(n) for n, _ in storage)
            warnings.append(
                f"SGLANG_PROMPT_CACHE_DIR is not set: dropped {dropped} "
                "(a file prompt cache needs a per-instance directory)"
            )
        argv.append("--enable-metrics")
        argv += config.extra_args or []

        env["PYTHONUNBUFFERED"] = "1"
        env_remove: tuple[str, ...] = ()
        venv = ctx.sglang_venv_path.strip()
        if venv:
            inherited = os.environ.get("PATH", os.defpath)
            env["VIRTUAL_ENV"] = venv
            env["PATH"] = f"{Path(venv) / 'bin'}{os.pathsep}{inherited}"
            env_remove = ("PYTHONHOME",)
        # JSON strings are YAML double-quoted scalars: any key text survives the round trip.
        private = {str(key_file): f"api-key: {json.dumps(ctx.host_api_key)}\n"}
        return LaunchSpec(
            argv=argv,
            env=env,
            env_remove=env_remove,
            warnings=warnings,
            private_files=private,
            # This instance's prompt cache, never the root: the other instances' caches hold
            # their users' prompts.
            write_dirs=[str(cache_dir)] if cache_dir is not None else [],
        )

    def is_ready_line(self, line: str) -> bool:
        return bool(_READY.search(line))

    def new_parser(self, config: BackendConfigBase) -> SglangLogParser:
        return SglangLogParser()

    def supported_endpoints(self, config: BackendConfigBase) -> list[str]:
        return ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health"]

    def capabilities(self, config: BackendConfigBase, models_dir: Path) -> list[str] | None:
        assert isinstance(config, SglangConfig)
        return vision_capabilities_of_dir(model_dir_of(config, models_dir))

    def served_model_name(self, config: BackendConfigBase) -> str:
        return served_name_of(config.alias)

    def model_paths(self, config: BackendConfigBase) -> list[str]:
        path = getattr(config, "model_path", None)
        return [path] if path else []

    def is_available(self, facts: HostFacts) -> bool:
        return facts.gpu_type == "nvidia_cuda" and (
            resolve_executable(facts.sglang_venv_path) is not None
        )

    def availability(self, facts: HostFacts) -> Availability:
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

    def preflight(self, config: BackendConfigBase) -> list[str]:
        # Its model is a directory (or a Hub id, which is not a path): it must be there.
        return local_model_problems(self, config, "model_path")

    def usage_snapshot(self, metrics: Mapping[str, float]) -> dict[str, Any] | None:
        return usage_snapshot(metrics)

    # --- Hooks the supervisor calls around the process (never raise) ---

    def before_start(self, config: BackendConfigBase, ctx: LaunchContext) -> list[str]:
        """Right before spawning: a fresh, empty prompt-cache directory (old one detached).

        Returns warnings for the instance log (e.g. the directory could not be created).
        """
        root = ctx.sglang_prompt_cache_dir
        if not root.strip():
            return []
        try:
            path = sglang_cache.prepare(root, config.alias, ctx.instance_id)
        except Exception as err:  # a cache problem must never fail a start
            return [f"prompt cache not prepared: {err}"]
        if path is None:
            return [f"prompt cache directory under {root} could not be created"]
        return []

    def after_stop(self, config: BackendConfigBase, ctx_root: str, instance_id: str) -> None:
        """After the process is gone (stop, crash, failed start, delete): detach and purge."""
        try:
            sglang_cache.discard(ctx_root, config.alias, instance_id)
        except Exception:  # pragma: no cover - discard itself never raises
            pass

    def sweep_caches(self, root: str, keep: Iterable[tuple[str, str]] = ()) -> list[Path]:
        """At boot, before any start: detach and purge every instance cache under `root`
        except those of re-adopted instances, given as (alias, instance_id) pairs."""
        names = []
        for alias, instance_id in keep:
            path = sglang_cache.instance_cache_dir(root, alias, instance_id)
            if path is not None:
                names.append(path.name)
        return sglang_cache.sweep(root, names)


BACKEND = SglangBackend()

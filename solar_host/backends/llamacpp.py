"""The llama.cpp backend: `llama-server` command line, readiness, log parser, endpoints.

Keys never go on the command line (anyone can read /proc/<pid>/cmdline): llama-server reads
a comma-separated key list from LLAMA_API_KEY, so the host key and the instance's own key
travel there.

The log parser follows llama-server's slot lines. It runs on every line a backend prints
(hundreds of thousands on a busy one), so each line is first tested with cheap substring
checks and only the few slot lines reach a regex.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from solar_host.backends import llamacpp_exec
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
    utc_now_iso,
)
from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.model_store.roots import anchor_relative
from solar_host.platform.cpus import physical_cores

API_KEY_ENV = "LLAMA_API_KEY"
# Would add keys or move the key file behind our back; the host's own LLAMA_API_KEY (if any)
# is replaced by ours anyway.
_ENV_REMOVE = ("LLAMA_ARG_API_KEY_FILE",)

ENDPOINTS = {
    "llm": ["/v1/chat/completions", "/v1/completions", "/v1/models"],
    "embedding": ["/v1/embeddings", "/v1/models"],
    "reranker": ["/v1/rerank", "/v1/models"],
}

# --- readiness -------------------------------------------------------------------------------

# Old builds: "main: server is listening on http://…"; b10434+: "srv  llama_server: listening
# on http://…" (after an "S.MM.SSS.mmm I " prefix); xllamacpp: "srv          init: listening on".
_READY = re.compile(
    r"(?:(?:llama_server|llama server|main)\s*:\s*(?:server is )?|\binit:\s*)listening on https?://",
    re.IGNORECASE,
)


def is_ready_line(line: str) -> bool:
    """True for the line llama-server prints once its HTTP server accepts requests."""
    if "istening" not in line and "ISTENING" not in line:
        return False
    return _READY.search(line) is not None


# --- prometheus ------------------------------------------------------------------------------

PROMETHEUS_NAMES = {
    "llamacpp:prompt_tokens_total": "prompt_tokens_total",
    "llamacpp:tokens_predicted_total": "generated_tokens_total",
    "llamacpp:requests_processing": "requests_processing",
    "llamacpp:requests_deferred": "requests_deferred",
    "llamacpp:kv_cache_usage_ratio": "kv_cache_usage_ratio",
}


def usage_snapshot(metrics: Mapping[str, float]) -> dict[str, float | None] | None:
    """The five llama.cpp counters under our names; None when the scrape has none of them."""
    snap = {ours: metrics.get(theirs) for theirs, ours in PROMETHEUS_NAMES.items()}
    if all(v is None for v in snap.values()):
        return None
    return snap


# --- log parser ------------------------------------------------------------------------------

_SLOT_HEAD = re.compile(r"id\s+(\d+)\s*\|\s*task\s+(-?\d+)\s*\|")
_NEW_PROMPT_TOKENS = re.compile(r"(?:task\.n_tokens|n_prompt_tokens)\s*=\s*(\d+)")
_PROGRESS = re.compile(r"progress\s*=\s*([0-9.]+)")
_CHECKPOINT = re.compile(r"created context checkpoint\s+(\d+)\s+of\s+(\d+)")
_DECODED = re.compile(r"n_decoded\s*=\s*(\d+),\s*tg\s*=\s*([0-9.]+)")
_PROMPT_EVAL = re.compile(r"prompt eval time\s*=\s*[0-9.]+\s*ms\s*/\s*(\d+)\s*tokens")
_EVAL = re.compile(
    r"(?<!prompt )eval time\s*=\s*[0-9.]+\s*ms\s*/\s*(\d+)\s*(?:tokens|runs)"
    r"\s*\(\s*([0-9.]+)\s*ms per token,\s*([0-9.]+)\s*tokens per second"
)
_N_TOKENS = re.compile(r"n_tokens\s*=\s*(\d+)")


@dataclass(slots=True)
class _Pending:
    """What is known so far about the request running on one slot."""

    slot_id: int
    task_id: int
    started_at: str
    prompt_eval_tokens: int | None = None
    generated_tokens: int | None = None
    decode_tps: float | None = None
    decode_ms_per_token: float | None = None


class LlamaCppLogParser:
    """Runtime state and finished-request metrics from one llama-server process's log.

    State changes are reported only when a field of RuntimeState really changed, so a
    stream of identical progress lines costs the rest of the host nothing.
    """

    # /metrics is scraped every few seconds: a reading of "0 processing" taken just before a
    # launch line must not cancel that launch.
    METRICS_IDLE_GRACE_S = 2.5

    def __init__(self, recent: int = 100, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_activity = float("-inf")
        self.active_slots: set[int] = set()
        self.pending: dict[int, _Pending] = {}
        self.recent_generations: deque[GenerationMetrics] = deque(maxlen=recent)
        self.last_state = RuntimeState()
        self._last_slot: int | None = None

    @property
    def last_generation(self) -> GenerationMetrics | None:
        return self.recent_generations[-1] if self.recent_generations else None

    # -- feeding --

    def feed(self, line: str) -> ParseResult | None:
        if "slot" in line:
            return self._slot_line(line)
        if "eval time" in line:  # legacy builds print timings on lines of their own
            return self._legacy_timing(line)
        if "progress" in line and "prompt processing progress" in line:
            return self._progress(line, None, None)
        return None

    def _slot_line(self, line: str) -> ParseResult | None:
        if "all slots are idle" in line:
            self.active_slots.clear()
            self.pending.clear()
            return self._emit(RuntimeState())
        m = _SLOT_HEAD.search(line)
        slot = task = None
        rest = line
        if m is not None:
            slot, task = int(m.group(1)), int(m.group(2))
            rest = line[m.end() :]
        if "launch_slot_" in line:
            if slot is None or task is None or "processing task" not in rest:
                return None
            self._ensure(slot, task, replace_other_task=True)
            return self._emit(self._busy("prefill", slot, task))
        if "print_timing" in line:
            if slot is None or task is None:
                return None
            return self._timing(rest, slot, task)
        if "release" in line:
            if slot is None or "stop processing" not in rest:
                return None
            return self._release(rest, slot, task)
        if "new prompt" in rest and slot is not None:
            m2 = _NEW_PROMPT_TOKENS.search(rest)
            self._ensure(slot, task, replace_other_task=False)
            state = self._busy("prefill", slot, task)
            state.prefill_progress = 0.0
            state.prefill_prompt_tokens = int(m2.group(1)) if m2 else None
            return self._emit(state)
        if "prompt processing progress" in rest:
            return self._progress(rest, slot, task)
        if "prompt done" in rest:
            if slot is not None:
                self._ensure(slot, task, replace_other_task=False)
            phase = "generating" if self.active_slots else "idle"
            if phase == "idle":
                return self._emit(RuntimeState())
            state = self._busy(phase, slot, task)
            state.prefill_progress = 1.0
            return self._emit(state)
        if "created context checkpoint" in rest:
            m2 = _CHECKPOINT.search(rest)
            if m2 is None:
                return None
            if slot is not None:
                self._ensure(slot, task, replace_other_task=False)
            state = self._busy("prefill", slot, task)
            state.prefill_progress = self.last_state.prefill_progress
            state.checkpoint_index, state.checkpoint_total = int(m2.group(1)), int(m2.group(2))
            return self._emit(state)
        return None

    def _progress(self, text: str, slot: int | None, task: int | None) -> ParseResult | None:
        m = _PROGRESS.search(text)
        if m is None:
            return None
        if slot is not None:
            self._ensure(slot, task, replace_other_task=False)
        state = self._busy("prefill", slot, task)
        state.prefill_progress = float(m.group(1))
        state.prefill_prompt_tokens = self.last_state.prefill_prompt_tokens
        return self._emit(state)

    def _timing(self, rest: str, slot: int, task: int) -> ParseResult | None:
        pending = self._ensure(slot, task, replace_other_task=True)
        if "n_decoded" in rest:
            m = _DECODED.search(rest)
            if m is None:
                return None
            tps = float(m.group(2))
            state = self._busy("generating", slot, task)
            state.prefill_progress = 1.0
            state.generated_tokens = int(m.group(1))
            state.decode_tps = tps
            state.decode_ms_per_token = round(1000.0 / tps, 2) if tps > 0 else None
            return self._emit(state)
        if "prompt processing" in rest:
            return self._progress(rest, slot, task)
        if "eval time" in rest:
            return self._eval_times(rest, pending)
        return None  # total time, graphs reused, ...

    def _legacy_timing(self, line: str) -> ParseResult | None:
        slot = self._last_slot
        if slot is None:
            return None
        pending = self.pending.get(slot)
        if pending is None:
            return None
        return self._eval_times(line, pending)

    def _eval_times(self, text: str, pending: _Pending) -> ParseResult | None:
        if "prompt eval time" in text:
            m = _PROMPT_EVAL.search(text)
            if m is not None:
                pending.prompt_eval_tokens = int(m.group(1))
            return None
        m = _EVAL.search(text)
        if m is None:
            return None
        pending.generated_tokens = int(m.group(1))
        pending.decode_ms_per_token = float(m.group(2))
        pending.decode_tps = float(m.group(3))
        state = self._busy("generating", pending.slot_id, pending.task_id)
        state.prefill_progress = 1.0
        state.generated_tokens = pending.generated_tokens
        state.decode_tps = pending.decode_tps
        state.decode_ms_per_token = pending.decode_ms_per_token
        return self._emit(state)

    def _release(self, rest: str, slot: int, task: int | None) -> ParseResult | None:
        self.active_slots.discard(slot)
        pending = self.pending.pop(slot, None)
        if pending is not None and task is not None and pending.task_id != task:
            pending = None  # a stale entry from a request whose release we never saw
        generation = None
        if pending is not None and (
            pending.generated_tokens is not None or pending.prompt_eval_tokens is not None
        ):
            m = _N_TOKENS.search(rest)
            generation = self._finalize(pending, int(m.group(1)) if m else None)
            self.recent_generations.append(generation)
        if self.active_slots:
            last = self.last_state
            state = replace(last, active_slots=len(self.active_slots))
            if last.slot_id == slot:
                state.slot_id = state.task_id = None
        else:
            state = RuntimeState()
        emitted = self._emit(state)
        if generation is None:
            return emitted
        return ParseResult(state=emitted.state if emitted else None, generation=generation)

    @staticmethod
    def _finalize(p: _Pending, n_tokens: int | None) -> GenerationMetrics:
        generated = p.generated_tokens
        prompt = n_tokens - generated if n_tokens is not None and generated is not None else None
        cached = None
        if prompt is not None and p.prompt_eval_tokens is not None:
            cached = max(0, prompt - p.prompt_eval_tokens)
        total = n_tokens
        if total is None and prompt is not None and generated is not None:
            total = prompt + generated
        return GenerationMetrics(
            slot_id=p.slot_id,
            task_id=p.task_id,
            prompt_tokens=prompt,
            generated_tokens=generated,
            cached_tokens=cached,
            prompt_eval_tokens=p.prompt_eval_tokens,
            total_tokens=total,
            decode_tps=p.decode_tps,
            decode_ms_per_token=p.decode_ms_per_token,
            source="log",
            started_at=p.started_at,
            finished_at=utc_now_iso(),
        )

    # -- metrics --

    def apply_metrics(self, metrics: Mapping[str, float]) -> ParseResult | None:
        """Correct the log-derived busy flag from /metrics (a missed release, a quiet log)."""
        snap = usage_snapshot(metrics)
        if snap is None:
            return None
        processing = snap["requests_processing"]
        if processing is None:
            return None
        busy = processing > 0
        if busy == self.last_state.busy:
            return None
        if busy:
            return self._emit(
                RuntimeState(busy=True, phase="generating", active_slots=int(processing))
            )
        if self._clock() - self._last_activity < self.METRICS_IDLE_GRACE_S:
            return None
        self.active_slots.clear()
        return self._emit(RuntimeState())

    # -- helpers --

    def _ensure(self, slot: int, task: int | None, replace_other_task: bool) -> _Pending:
        self.active_slots.add(slot)
        self._last_slot = slot
        self._last_activity = self._clock()
        pending = self.pending.get(slot)
        if pending is None or (
            replace_other_task and task is not None and task >= 0 and pending.task_id != task
        ):
            pending = _Pending(slot, task if task is not None else -1, utc_now_iso())
            self.pending[slot] = pending
        return pending

    def _busy(self, phase: str, slot: int | None, task: int | None) -> RuntimeState:
        return RuntimeState(
            busy=True,
            phase=phase,
            active_slots=max(1, len(self.active_slots)),
            slot_id=slot,
            task_id=task,
        )

    def _emit(self, state: RuntimeState) -> ParseResult | None:
        if state == self.last_state:
            return None
        self.last_state = state
        return ParseResult(state=state)


# --- the backend -----------------------------------------------------------------------------


def _num(value: float) -> str:
    return str(value)


class LlamaCppBackend(BackendBase):
    backend_types: ClassVar[tuple[str, ...]] = ("llamacpp",)
    health_path: ClassVar[str | None] = "/health"
    metrics_path: ClassVar[str | None] = "/metrics"

    def config_model(self, backend_type: str) -> type[BackendConfigBase]:
        if backend_type != "llamacpp":
            raise ValueError(f"Unknown backend_type: {backend_type!r}")
        return LlamaCppConfig

    def launch(self, config: BackendConfigBase, ctx: LaunchContext) -> LaunchSpec:
        c = _as_config(config).model_copy()
        # Relative file fields were checked against MODELS_DIR: open exactly those files, not
        # whatever the backend's working directory holds under that name.
        anchor_relative(c, ctx.models_dir)
        if not c.model:
            raise LaunchError(
                "llama.cpp instance has no model file: resolve model_source (POST /models/pull) "
                "or set 'model'"
            )
        for name in ("model", "mmproj", "spec_draft_model"):
            _require_gguf(name, getattr(c, name))
        # An executable that does not resolve is named as configured: preflight refuses the
        # start with the reason before anything is spawned.
        if c.threads is None:
            c.threads = default_threads(c, ctx.gpu_type)
        server = llamacpp_exec.resolve(ctx.llama_server_bin)
        prefix = server.argv or ((ctx.llama_server_bin or llamacpp_exec.DEFAULT_BIN).strip(),)
        argv = [*prefix, *command_args(c, ctx.port)]
        refused = refused_flags(argv[len(prefix) :], server)
        if refused:
            raise LaunchError("; ".join(refused))
        warnings: list[str] = []
        if c.pooling and c.model_type != "embedding":
            warnings.append(f"pooling is ignored for model_type {c.model_type!r}")
        keys = [k for k in (ctx.host_api_key, c.api_key) if k]
        keys = list(dict.fromkeys(keys))  # the host key first, no duplicates
        env = {API_KEY_ENV: ",".join(keys)} if keys else {}
        env_remove = _ENV_REMOVE if keys else (*_ENV_REMOVE, API_KEY_ENV)
        return LaunchSpec(argv=argv, env=env, env_remove=env_remove, warnings=warnings)

    def create_refusals(self, config: BackendConfigBase, facts: HostFacts) -> list[dict[str, str]]:
        """Config fields the llama-server this host runs cannot honour: {field, msg} each.

        Checked at create and update so a config is refused (422) instead of starting with a
        flag silently dropped.
        """
        server = llamacpp_exec.resolve(facts.llama_server_bin)
        if server.supported_flags is None:
            return []
        c = _as_config(config)
        if not c.model:
            return []
        out = []
        for flag in flags_of(command_args(c, 1)):
            if flag not in server.supported_flags:
                fld = FLAG_FIELDS.get(flag, flag)
                out.append(
                    {
                        "field": fld,
                        "msg": f"{fld} needs llama-server flag {flag}, which {server.uses} cannot "
                        f"honour; install a llama-server binary (LLAMA_SERVER_BIN) or drop {fld}",
                    }
                )
        return out

    def availability(self, facts: HostFacts) -> Availability:
        server = llamacpp_exec.resolve(facts.llama_server_bin)
        return Availability(server.available, server.uses or None, server.reason or None)

    def is_ready_line(self, line: str) -> bool:
        return is_ready_line(line)

    def new_parser(self, config: BackendConfigBase) -> LlamaCppLogParser:
        return LlamaCppLogParser()

    def supported_endpoints(self, config: BackendConfigBase) -> list[str]:
        model_type = getattr(config, "model_type", None) or "llm"
        return list(ENDPOINTS.get(model_type, ENDPOINTS["llm"]))

    def capabilities(self, config: BackendConfigBase, models_dir: Path) -> list[str] | None:
        return list(VISION_CAPABILITIES) if getattr(config, "mmproj", None) else None

    def served_model_name(self, config: BackendConfigBase) -> str:
        return config.alias

    def model_paths(self, config: BackendConfigBase) -> list[str]:
        names = ("model", "mmproj", "spec_draft_model", "chat_template_file")
        return [v for v in (getattr(config, n, None) for n in names) if v]

    def usage_snapshot(self, metrics: Mapping[str, float]) -> dict[str, Any] | None:
        return usage_snapshot(metrics)

    def canary_probe(self, config: BackendConfigBase) -> CanaryAsk | None:
        # No prompt cache: a prompt served from the cache of the previous probe is evaluated
        # in other batches than a fresh one, and its logits may differ in the last bits.
        model_type = _as_config(config).model_type or "llm"
        if model_type == "llm":
            return CanaryAsk("generation", "/v1/completions", {"cache_prompt": False})
        if model_type == "embedding":
            return CanaryAsk("embedding", "/v1/embeddings")
        return None  # a reranker: no probe yet

    def is_available(self, facts: HostFacts) -> bool:
        return llamacpp_exec.resolve(facts.llama_server_bin).available

    def preflight(self, config: BackendConfigBase) -> list[str]:
        """What makes every attempt fail: model files missing, unreadable or not GGUF."""
        from solar_host.backends import files as pf

        c = _as_config(config)
        found = []
        if not c.model:
            found.append("model: no model file (set model, model_file or a pulled model_source)")
        for name in ("model", "mmproj", "spec_draft_model"):
            value = getattr(c, name)
            if value and (c.model_type == "llm" or name != "spec_draft_model"):
                problem = pf.gguf_file(name, value)
                if problem:
                    found.append(problem)
        if c.chat_template_file:
            problem = pf.readable_file("chat_template_file", c.chat_template_file)
            if problem:
                found.append(problem)
        return found


# The config field behind each flag of the command line (for refusals that name the field).
FLAG_FIELDS = {
    "--device": "devices",
    "--split-mode": "split_mode",
    "--tensor-split": "tensor_split",
    "--main-gpu": "main_gpu",
    "--chat-template-file": "chat_template_file",
    "--chat-template-kwargs": "chat_template_kwargs",
    "--reasoning": "reasoning",
    "--reasoning-budget": "reasoning_budget",
    "--spec-type": "spec_type",
    "--spec-draft-model": "spec_draft_model",
    "--spec-draft-n-max": "spec_draft_n_max",
    "--spec-draft-conf-min": "spec_draft_conf_min",
    "-ctk": "cache_type_k",
    "-ctv": "cache_type_v",
    "--rope-scaling": "rope_scaling",
    "--rope-scale": "rope_scale",
    "--yarn-orig-ctx": "yarn_orig_ctx",
    "--special": "special",
    "-ot": "ot",
    "--mmproj": "mmproj",
    "--no-mmproj-offload": "mmproj_offload",
    "--pooling": "pooling",
    "--embedding": "model_type",
    "--rerank": "model_type",
}


# The flags command_args emits without a value; every other one takes exactly one.
_SWITCHES = frozenset(
    {"--no-warmup", "--jinja", "--special", "--no-mmproj-offload", "--embedding", "--rerank",
     "--metrics", "--slots"}
)  # fmt: skip


def flags_of(args: list[str]) -> list[str]:
    """The flags of a command_args list, values skipped (a value may well start with '-')."""
    out, i = [], 0
    while i < len(args):
        out.append(args[i])
        i += 1 if args[i] in _SWITCHES else 2
    return out


def refused_flags(args: list[str], server: llamacpp_exec.LlamaServer) -> list[str]:
    """Messages for the flags of `args` that `server` cannot honour (none for a binary)."""
    if server.supported_flags is None:
        return []
    return [
        f"{FLAG_FIELDS.get(a, a)}: llama-server flag {a} is not supported by {server.uses}"
        for a in flags_of(args)
        if a not in server.supported_flags
    ]


def runs_on_cpu(c: LlamaCppConfig, gpu_type: str) -> bool:
    """Whether llama-server computes the model's layers on the CPU: no GPU on this host, no
    layer offloaded, or no device offered."""
    return gpu_type == "cpu" or c.n_gpu_layers == 0 or (c.devices or "").lower() == "none"


def default_threads(c: LlamaCppConfig, gpu_type: str) -> int:
    """`threads` left unset: every physical core this process may use when the model runs on
    the CPU (one thread left a CPU-only host at one core's speed), 1 when a GPU computes it
    (more would only spin on the CPU beside it)."""
    return physical_cores() if runs_on_cpu(c, gpu_type) else 1


def command_args(c: LlamaCppConfig, port: int) -> list[str]:
    """llama-server's arguments for config `c` (everything after the executable)."""
    # `threads` is resolved by launch() (default_threads); unresolved, llama-server's own
    # default applies rather than a literal "None".
    threads = ["--threads", str(c.threads)] if c.threads is not None else []
    argv = [
        "--model", c.model or "",
        "--alias", c.alias,
        *threads,
        "--n_gpu_layers", str(c.n_gpu_layers),
        "--temp", _num(c.temp),
        "--top_p", _num(c.top_p),
        "--top_k", str(c.top_k),
        "--min_p", _num(c.min_p),
        "--ctx-size", str(c.ctx_size),
        "--host", c.host,
        "--port", str(port),
        "--no-warmup",
    ]  # fmt: skip
    if c.devices:
        argv += ["--device", c.devices]
    if c.split_mode:
        argv += ["--split-mode", c.split_mode]
    if c.tensor_split:
        argv += ["--tensor-split", c.tensor_split]
    if c.main_gpu is not None:
        argv += ["--main-gpu", str(c.main_gpu)]
    argv.append("--jinja")
    if c.chat_template_file:
        argv += ["--chat-template-file", c.chat_template_file]
    if c.chat_template_kwargs:
        argv += ["--chat-template-kwargs", c.chat_template_kwargs]
    if c.reasoning:
        argv += ["--reasoning", c.reasoning]
    if c.reasoning_budget is not None:
        argv += ["--reasoning-budget", str(c.reasoning_budget)]
    argv += speculative_args(c)
    if c.cache_type_k:
        argv += ["-ctk", c.cache_type_k]
    if c.cache_type_v:
        argv += ["-ctv", c.cache_type_v]
    if c.rope_scaling:
        argv += ["--rope-scaling", c.rope_scaling]
    if c.rope_scale is not None:
        argv += ["--rope-scale", _num(c.rope_scale)]
    if c.yarn_orig_ctx is not None:
        argv += ["--yarn-orig-ctx", str(c.yarn_orig_ctx)]
    if c.special:
        argv.append("--special")
    if c.ot:
        argv += ["-ot", c.ot]
    if c.mmproj:
        argv += ["--mmproj", c.mmproj]
        if not c.mmproj_offload:
            argv.append("--no-mmproj-offload")
    if c.model_type == "embedding":
        argv.append("--embedding")
        if c.pooling:
            argv += ["--pooling", c.pooling]
    elif c.model_type == "reranker":
        argv.append("--rerank")
    argv += ["--metrics", "--slots"]
    return argv


def speculative_args(c: LlamaCppConfig) -> list[str]:
    """Speculative-decoding flags: only for text generation, only when complete."""
    if c.model_type != "llm":
        return []
    if c.spec_type == "draft-mtp":
        if c.spec_draft_n_max is None:
            return []
        return ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(c.spec_draft_n_max)]
    if c.spec_type == "draft-dspark":
        if not c.spec_draft_model:
            return []
        out = ["--spec-type", "draft-dspark", "--spec-draft-model", c.spec_draft_model]
        if c.spec_draft_n_max is not None:
            out += ["--spec-draft-n-max", str(c.spec_draft_n_max)]
        if c.spec_draft_conf_min is not None:
            out += ["--spec-draft-conf-min", _num(c.spec_draft_conf_min)]
        return out
    return []


def _require_gguf(field: str, path: str | None) -> None:
    """Refuse a file that is not GGUF before llama-server opens it: its error quotes the
    file's first bytes ("invalid magic characters: 'root'"), which would reach the start
    error and the log of whoever asked. Directories are left to the backend."""
    if not path:
        return
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            return
        if not stat.S_ISREG(st.st_mode):
            raise LaunchError(f"{field} '{path}' is not a regular file")
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return  # missing or unreadable: llama-server says so without quoting anything
    if magic != b"GGUF":
        raise LaunchError(f"{field} '{path}' is not a GGUF file")


def _as_config(config: BackendConfigBase) -> LlamaCppConfig:
    if isinstance(config, LlamaCppConfig):
        return config
    return LlamaCppConfig.model_validate(config.model_dump())


BACKEND = LlamaCppBackend()

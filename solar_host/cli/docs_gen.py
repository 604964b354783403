"""Generate docs/configuration.md from the code, so the reference cannot drift from it.

Two sources: `Settings` (every host setting: its env var, type, default, constraints and
description) and the instance config models in `solar_host/backends/*_config.py`. Config fields
without a `description` in their model take one from CONFIG_NOTES below; `missing_descriptions()`
lists any field that has neither, and tests/test_docs.py fails on it.

    python -m solar_host.cli.docs_gen            # rewrite docs/configuration.md
    python -m solar_host.cli.docs_gen --check    # exit 1 when the file is out of date
"""

from __future__ import annotations

import argparse
import enum
import re
import sys
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

OUTPUT = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# Descriptions of config fields whose model has none. Key: "field" (every backend) or
# "backend_type.field" (one backend; wins over the plain key).
CONFIG_NOTES: dict[str, str] = {
    # llama.cpp
    "mmproj_offload": "Keep the projector on the GPU; false adds `--no-mmproj-offload`.",
    "threads": "CPU threads (`--threads`). Unset: the physical cores the host may use (its "
    "CPU affinity) when the model runs on the CPU (n_gpu_layers 0, devices `none`, or no GPU), "
    "1 when it is offloaded to a GPU.",
    "n_gpu_layers": "Layers offloaded to the GPU (`--n_gpu_layers`); 999 means all.",
    "devices": "Comma-separated devices to use (`--device`), e.g. `CUDA0,CUDA1`; "
    "empty offers every device.",
    "split_mode": "How the model is divided across GPUs (`--split-mode`).",
    "tensor_split": "Per-device proportions, comma-separated numbers (`--tensor-split`), "
    "e.g. `3,1`.",
    "main_gpu": "GPU that holds the model with split_mode none, or the KV cache with row "
    "(`--main-gpu`).",
    "temp": "Sampling temperature (`--temp`).",
    "top_p": "Top-p sampling (`--top_p`).",
    "top_k": "Top-k sampling (`--top_k`); 0 turns it off.",
    "min_p": "Min-p sampling (`--min_p`).",
    "ctx_size": "Context window in tokens (`--ctx-size`).",
    "chat_template_file": "Jinja chat template file (`--chat-template-file`).",
    "chat_template_kwargs": "JSON object for the chat template (`--chat-template-kwargs`); "
    '"true"/"false" strings are stored as booleans.',
    "reasoning": "Reasoning mode (`--reasoning`).",
    "reasoning_budget": "Thinking token budget (`--reasoning-budget`); -1 means unlimited.",
    "spec_type": "Speculative decoding: draft-mtp (the model's own MTP heads, needs "
    "spec_draft_n_max) or draft-dspark (a separate drafter); only for model_type llm.",
    "spec_draft_model": "Drafter GGUF for draft-dspark (a path, file name or glob, like "
    "model_file).",
    "spec_draft_n_max": "Largest drafted block (`--spec-draft-n-max`).",
    "spec_draft_conf_min": "draft-dspark only: cut a drafted block where its predicted "
    "acceptance falls below this (`--spec-draft-conf-min`).",
    "cache_type_k": "KV cache type of K (`-ctk`).",
    "cache_type_v": "KV cache type of V (`-ctv`).",
    "rope_scaling": "RoPE scaling method (`--rope-scaling`).",
    "rope_scale": "RoPE context scaling factor (`--rope-scale`).",
    "yarn_orig_ctx": "Original context of a YaRN model (`--yarn-orig-ctx`).",
    "special": "Show special tokens in the output (`--special`).",
    "ot": "Tensor override string (`-ot`).",
    "model_type": "llm, embedding (`--embedding`) or reranker (`--rerank`); decides the "
    "endpoints advertised.",
    "pooling": "Pooling of an embedding model (`--pooling`); ignored with a warning for "
    "other model types.",
    # HuggingFace
    "device": "Where the model runs: auto picks cuda, then mps, then cpu; an explicit device "
    "that is not there fails the start.",
    "dtype": "Weight dtype; auto means float16 on cuda/mps and float32 on cpu.",
    "trust_remote_code": "Allow the model repository's own Python code.",
    "max_length": "Longest input, in tokens.",
    "use_flash_attention": "Use Flash Attention 2 when the device is cuda and flash_attn is "
    "installed.",
    "labels": "Class names in output order (default: the model's own labels).",
    "normalize_embeddings": "L2-normalise every embedding.",
    # SGLang (each typed field is the SGLang flag of the same name, shown beside it)
    "sglang.trust_remote_code": "Allow the model repository's own Python code "
    "(`--trust-remote-code`).",
    "sglang.dtype": "Weight dtype, e.g. bfloat16 (`--dtype`).",
    "tp_size": "Tensor parallel size (`--tp-size`).",
    "dp_size": "Data parallel size (`--dp-size`).",
    "context_length": "Context length (`--context-length`).",
    "mem_fraction_static": "GPU memory share for weights and KV pool (`--mem-fraction-static`).",
    "chunked_prefill_size": "Prefill chunk in tokens (`--chunked-prefill-size`).",
    "max_running_requests": "Concurrent request cap (`--max-running-requests`).",
    "cuda_graph_max_bs": "Largest batch captured in a CUDA graph (`--cuda-graph-max-bs`).",
    "cuda_graph_max_bs_decode": "Largest decode batch captured (`--cuda-graph-max-bs-decode`).",
    "swa_full_tokens_ratio": "Full-attention share of hybrid sliding-window models "
    "(`--swa-full-tokens-ratio`).",
    "quantization": "Quantization method, e.g. fp8 (`--quantization`).",
    "kv_cache_dtype": "KV cache dtype (`--kv-cache-dtype`).",
    "moe_runner_backend": "MoE kernel backend (`--moe-runner-backend`).",
    "speculative_algorithm": "Speculative decoding algorithm (`--speculative-algorithm`).",
    "enable_hierarchical_cache": "Keep evicted prefixes in host memory "
    "(`--enable-hierarchical-cache`).",
    "hicache_ratio": "Host-to-device cache size ratio (`--hicache-ratio`).",
    "hicache_mem_layout": "Host cache layout (`--hicache-mem-layout`).",
    "hicache_io_backend": "Host cache transfer backend (`--hicache-io-backend`).",
    "hicache_storage_backend": "Persistent cache tier, e.g. file "
    "(`--hicache-storage-backend`); dropped with a warning when SGLANG_PROMPT_CACHE_DIR "
    "is empty.",
    "hicache_storage_backend_extra_config": "JSON object of storage options "
    "(`--hicache-storage-backend-extra-config`).",
    "hicache_storage_prefetch_policy": "Prefetch policy (`--hicache-storage-prefetch-policy`).",
    "extra_args": "Raw arguments appended after the typed flags (so they win over them); "
    "flags the host sets itself are refused.",
    "extra_env": "Extra environment variables; loader variables (LD_*, PYTHONPATH, ...) and "
    "host-managed ones are refused.",
}

# What the validators require beyond single fields, per config section.
SECTION_RULES: dict[str, str] = {
    "llamacpp": "Either `model` or `model_source` must be given. `spec_draft_model` and "
    "`spec_draft_conf_min` need `spec_type: draft-dspark`, which needs `spec_draft_model`.",
    "huggingface": "Either `model_id` or `model_source` must be given.",
    "sglang": "Either `model_path` or `model_source` must be given. SGLang is started only on "
    "an NVIDIA CUDA host, from `SGLANG_VENV_PATH` (or a `sglang` on PATH).",
}


def _section_of_settings() -> dict[str, str]:
    """Field name -> section title, read from the `# --- title ---` comments of the fields."""
    import solar_host.settings.schema as mod

    source = Path(mod.__file__).read_text(encoding="utf-8")
    section = "Other"
    out: dict[str, str] = {}
    for line in source.splitlines():
        m = re.match(r"\s+# --- (.+?) -+\s*$", line)
        if m:
            section = m.group(1).strip()
            continue
        m = re.match(r"    (\w+): ", line)
        if m:
            out.setdefault(m.group(1), section)
    return out


def type_name(ann: Any) -> str:
    """A short, readable name of a field's type (`"a" | "b"` for literals)."""
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(parts)
    if origin in (list, tuple, set):
        return f"list[{', '.join(type_name(a) for a in args)}]"
    if origin is dict:
        return f"object[{', '.join(type_name(a) for a in args)}]"
    if isinstance(ann, type):
        if issubclass(ann, enum.Enum):
            return " | ".join(f'"{m.value}"' for m in ann)
        if issubclass(ann, Path):
            return "path"
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            ann.__name__, ann.__name__
        )
    return str(ann)


def default_text(field: FieldInfo, *, env_style: bool) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if value is PydanticUndefined:
        value = field.default_factory() if field.default_factory else None  # type: ignore[call-arg]
    if value is None:
        return "(none)" if env_style else "null"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str) and value == "":
        return '`""` (empty)'
    if isinstance(value, str) and not env_style:
        return f'`"{value}"`'
    return f"`{value}`"


def constraints_text(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in (
            ("ge", ">="),
            ("gt", ">"),
            ("le", "<="),
            ("lt", "<"),
            ("min_length", "min length"),
            ("max_length", "max length"),
        ):
            value = getattr(meta, attr, None)
            if value is not None and isinstance(
                meta, annotated_types.BaseMetadata | annotated_types.GroupedMetadata
            ):
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def settings_lines() -> list[str]:
    from solar_host.settings import Settings

    sections = _section_of_settings()
    grouped: dict[str, list[list[str]]] = {}
    for name, field in Settings.model_fields.items():
        row = [
            f"`{name.upper()}`",
            type_name(field.annotation),
            default_text(field, env_style=True),
            constraints_text(field),
            field.description or "",
        ]
        grouped.setdefault(sections.get(name, "Other"), []).append(row)
    lines: list[str] = []
    for section, rows in grouped.items():
        lines += [f"### {section[:1].upper()}{section[1:]}", ""]
        lines += _table(["Variable", "Type", "Default", "Constraints", "Description"], rows)
        lines.append("")
    return lines


def _config_sections() -> list[tuple[str, str, list[type[BaseModel]], set[str]]]:
    """(title, rules key, models whose own fields are listed, fields listed elsewhere)."""
    from solar_host.backends.base import BackendConfigBase
    from solar_host.backends.huggingface_config import (
        HuggingFaceCausalConfig,
        HuggingFaceClassificationConfig,
        HuggingFaceConfigBase,
        HuggingFaceEmbeddingConfig,
        HuggingFaceVisionConfig,
    )
    from solar_host.backends.llamacpp_config import LlamaCppConfig
    from solar_host.backends.sglang_config import SglangConfig

    common = set(BackendConfigBase.model_fields) - {"backend_type"}
    hf_common = set(HuggingFaceConfigBase.model_fields) - {"backend_type"}
    return [
        ("llamacpp", "llamacpp", [LlamaCppConfig], common),
        ("huggingface_* (every HuggingFace type)", "huggingface", [HuggingFaceConfigBase], common),
        ("huggingface_causal", "", [HuggingFaceCausalConfig], hf_common),
        ("huggingface_vision", "", [HuggingFaceVisionConfig], hf_common),
        ("huggingface_classification", "", [HuggingFaceClassificationConfig], hf_common),
        ("huggingface_embedding", "", [HuggingFaceEmbeddingConfig], hf_common),
        ("sglang", "sglang", [SglangConfig], common),
    ]


def _backend_of(model: type[BaseModel]) -> str:
    field = model.model_fields.get("backend_type")
    if field is not None and isinstance(field.default, str):
        return field.default
    return ""


def config_description(backend: str, name: str, field: FieldInfo) -> str:
    if field.description:
        return field.description
    family = backend.split("_")[0]
    for key in (f"{backend}.{name}", f"{family}.{name}", name):
        if key in CONFIG_NOTES:
            return CONFIG_NOTES[key]
    return ""


def _config_rows(model: type[BaseModel], skip: set[str]) -> list[list[str]]:
    backend = _backend_of(model)
    rows = []
    for name, field in model.model_fields.items():
        if name in skip or name == "backend_type":
            continue
        rows.append(
            [
                f"`{name}`",
                type_name(field.annotation),
                default_text(field, env_style=False),
                constraints_text(field),
                config_description(backend, name, field),
            ]
        )
    return rows


def config_lines() -> list[str]:
    from solar_host.backends.base import BackendConfigBase

    lines = [
        "### Fields of every backend",
        "",
        "`backend_type` selects the backend: `llamacpp` (also assumed for old records "
        "without it), `huggingface_causal`, `huggingface_vision`, `huggingface_classification`, "
        "`huggingface_embedding`, `sglang`. Unknown keys are kept and returned unchanged.",
        "",
    ]
    header = ["Field", "Type", "Default", "Constraints", "Description"]
    lines += _table(header, _config_rows(BackendConfigBase, {"backend_type"}))
    lines.append("")
    for title, rules, models, skip in _config_sections():
        lines += [f"### {title}", ""]
        if rules:
            lines += [SECTION_RULES[rules], ""]
        rows = [row for model in models for row in _config_rows(model, skip)]
        lines += _table(header, rows) if rows else ["(no fields of its own)"]
        lines.append("")
    return lines


def missing_descriptions() -> list[str]:
    """`Model.field` for every documented field that has no description from any source."""
    from solar_host.settings import Settings

    out = [f"Settings.{n}" for n, f in Settings.model_fields.items() if not f.description]
    for _, _, models, skip in _config_sections():
        for model in models:
            for row in _config_rows(model, skip):
                if not row[4]:
                    out.append(f"{model.__name__}.{row[0].strip('`')}")
    return out


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m solar_host.cli.docs_gen` from "
        "solar_host/settings/schema.py and solar_host/backends/*_config.py. Do not edit by "
        "hand: tests/test_docs.py fails when this file differs from what the code produces. -->",
        "",
        "## Host settings",
        "",
        "Each setting is read from the environment variable of the same name (any case) or from "
        "`.env` in the working directory (`solar-host --env-file PATH` picks another file). "
        "An invalid value stops start-up with one line naming the variable.",
        "",
        *settings_lines(),
        "## Instance configs",
        "",
        "The `config` object of `POST /instances` and `PUT /instances/{id}`. A bad config is "
        "answered 422 with the path of the offending field (`body.config.<field>`) and "
        "changes nothing. Relative paths and `local://` URIs are resolved inside `MODELS_DIR`; "
        "every path, absolute ones too, must lie (after symlinks) inside `MODELS_DIR` or one "
        "of `MODEL_ROOTS`, else it is a 422 naming the field and the allowed roots.",
        "",
        *config_lines(),
    ]
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate docs/configuration.md")
    p.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    p.add_argument("--output", type=Path, default=OUTPUT)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(
                f"{args.output} is out of date: run python -m solar_host.cli.docs_gen",
                file=sys.stderr,
            )
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

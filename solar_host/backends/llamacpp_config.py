"""The llama.cpp instance config: every field, default and validation rule."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from solar_host.backends.base import BackendConfigBase


def coerce_bool_strings(value: Any) -> Any:
    """Recursively turn "true"/"false" strings (any case, padded) into booleans.

    solar-control canonicalizes chat_template_kwargs the same way; doing it here too keeps
    its drift check from seeing a difference that is only a spelling.
    """
    if isinstance(value, str):
        s = value.strip().lower()
        if s == "true":
            return True
        if s == "false":
            return False
        return value
    if isinstance(value, dict):
        return {k: coerce_bool_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [coerce_bool_strings(v) for v in value]
    return value


def normalize_csv(value: Any) -> Any:
    """Trim the parts of a comma-separated list and drop empty ones; nothing left -> None."""
    if value is None or not isinstance(value, str):
        return value
    parts = [p.strip() for p in value.split(",")]
    parts = [p for p in parts if p]
    return ",".join(parts) if parts else None


class LlamaCppConfig(BackendConfigBase):
    backend_type: Literal["llamacpp"] = "llamacpp"
    model: str | None = Field(default=None, description="GGUF file (or model directory).")
    model_file: str | None = Field(
        default=None, description="File name, relative path or glob of the GGUF in the dir."
    )
    mmproj: str | None = Field(default=None, description="Multimodal projector file or pattern.")
    mmproj_offload: bool = True
    # Unset: chosen at each start (llamacpp.default_threads), never stored.
    threads: int | None = Field(default=None, ge=1, le=4096)
    n_gpu_layers: int = Field(default=999, ge=-1, le=100_000)
    devices: str | None = None
    split_mode: Literal["none", "layer", "row", "tensor"] | None = None
    tensor_split: str | None = None
    main_gpu: int | None = Field(default=None, ge=0, le=1024)
    temp: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1_000_000)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    ctx_size: int = Field(default=131072, ge=0, le=16_777_216)
    chat_template_file: str | None = None
    chat_template_kwargs: str | None = None
    reasoning: Literal["on", "off", "auto"] | None = None
    reasoning_budget: int | None = Field(default=None, ge=-1, le=16_777_216)
    spec_type: Literal["draft-mtp", "draft-dspark"] | None = None
    spec_draft_model: str | None = None
    spec_draft_n_max: int | None = Field(default=None, ge=1, le=1024)
    spec_draft_conf_min: float | None = Field(default=None, ge=0.0, le=1.0)
    cache_type_k: (
        Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"] | None
    ) = None
    cache_type_v: (
        Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"] | None
    ) = None
    rope_scaling: Literal["none", "linear", "yarn"] | None = None
    rope_scale: float | None = Field(default=None, gt=0, le=1e6)
    yarn_orig_ctx: int | None = Field(default=None, ge=0, le=16_777_216)
    special: bool = False
    ot: str | None = None
    model_type: Literal["llm", "embedding", "reranker"] | None = "llm"
    pooling: Literal["none", "mean", "cls", "last", "rank"] | None = None

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, v: Any) -> Any:
        return normalize_csv(v)

    @field_validator("tensor_split", mode="before")
    @classmethod
    def _tensor_split(cls, v: Any) -> Any:
        v = normalize_csv(v)
        if v is None or not isinstance(v, str):
            return v
        for part in v.split(","):
            try:
                f = float(part)
            except ValueError:
                raise ValueError(
                    f"tensor_split must be comma-separated numbers, got '{part}'"
                ) from None
            if not math.isfinite(f):
                raise ValueError(f"tensor_split must be comma-separated numbers, got '{part}'")
            if f < 0:
                raise ValueError("tensor_split proportions must not be negative")
        return v

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _chat_template_kwargs(cls, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, str):
            if not v.strip():
                return None
            try:
                v = json.loads(v)
            except ValueError:
                raise ValueError("chat_template_kwargs is not valid JSON") from None
        if not isinstance(v, dict):
            raise ValueError("chat_template_kwargs must be a JSON object")
        return json.dumps(coerce_bool_strings(v), separators=(",", ":"), ensure_ascii=False)

    @field_validator(
        "model",
        "model_file",
        "mmproj",
        "spec_draft_model",
        "chat_template_file",
        "ot",
        mode="before",
    )
    @classmethod
    def _blank_is_none(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            return None
        if isinstance(v, str) and "\x00" in v:
            raise ValueError("must not contain NUL characters")
        return v

    @model_validator(mode="after")
    def _rules(self) -> LlamaCppConfig:
        if not self.model and not self.model_source:
            raise ValueError("Either 'model' or 'model_source' must be provided")
        if self.spec_type == "draft-dspark":
            if not self.spec_draft_model:
                raise ValueError("spec_type 'draft-dspark' requires 'spec_draft_model'")
        else:
            if self.spec_draft_model:
                raise ValueError(
                    "'spec_draft_model' is only supported with spec_type 'draft-dspark'"
                )
            if self.spec_draft_conf_min is not None:
                raise ValueError(
                    "'spec_draft_conf_min' is only supported with spec_type 'draft-dspark'"
                )
        return self

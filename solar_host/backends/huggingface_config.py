"""HuggingFace instance configs (causal LM, classification, embedding, vision)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from solar_host.backends.base import BackendConfigBase

Device = Literal["auto", "cuda", "mps", "cpu"]
Dtype = Literal["auto", "float16", "bfloat16", "float32"]


class HuggingFaceConfigBase(BackendConfigBase):
    model_id: str | None = Field(default=None, description="Hub id or local model directory.")
    device: Device = "auto"
    dtype: Dtype = "auto"
    trust_remote_code: bool = False
    max_batch_size: int = Field(
        default=32, ge=1, le=1024, description="Largest batch of one forward pass."
    )
    batch_window_ms: float = Field(
        default=2.0, ge=0, le=1000, description="How long a batch waits for more requests."
    )

    @field_validator("device", "dtype", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("model_id", mode="before")
    @classmethod
    def _blank_is_none(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            return None
        return v

    @model_validator(mode="after")
    def _needs_model(self) -> HuggingFaceConfigBase:
        if not self.model_id and not self.model_source:
            raise ValueError("Either 'model_id' or 'model_source' must be provided")
        return self


class HuggingFaceCausalConfig(HuggingFaceConfigBase):
    backend_type: Literal["huggingface_causal"] = "huggingface_causal"
    max_length: int = Field(default=4096, ge=1, le=10_000_000)
    use_flash_attention: bool = True


class HuggingFaceVisionConfig(HuggingFaceConfigBase):
    backend_type: Literal["huggingface_vision"] = "huggingface_vision"
    max_length: int = Field(default=4096, ge=1, le=10_000_000)
    use_flash_attention: bool = True
    allow_image_urls: bool = Field(
        default=False,
        description="Fetch http(s) image URLs (public addresses only, never private ranges; a "
        "request's fetches, side by side, within 10 s); off: images only as data: URIs.",
    )
    max_images: int = Field(default=8, ge=1, le=256, description="Images per request.")
    max_image_bytes: int = Field(
        default=10 * 1024 * 1024,
        ge=1024,
        le=1024 * 1024 * 1024,
        description="Largest image (decoded bytes); larger ones are a 413.",
    )


class HuggingFaceClassificationConfig(HuggingFaceConfigBase):
    backend_type: Literal["huggingface_classification"] = "huggingface_classification"
    max_length: int = Field(default=512, ge=1, le=10_000_000)
    labels: list[str] | None = None

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not s.strip() for s in v):
            raise ValueError("labels must not contain blank entries")
        return v or None


class HuggingFaceEmbeddingConfig(HuggingFaceConfigBase):
    backend_type: Literal["huggingface_embedding"] = "huggingface_embedding"
    max_length: int = Field(default=512, ge=1, le=10_000_000)
    normalize_embeddings: bool = True

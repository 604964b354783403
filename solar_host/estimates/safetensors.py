"""Weights from safetensors headers (shapes and dtypes; no tensor data read), for HF and SGLang.

A safetensors file starts with an 8-byte little-endian header length and a JSON header mapping
each tensor to {dtype, shape, data_offsets}. Floating tensors are counted at the dtype the
backend loads them in (`auto`: as stored); integer tensors (quantized weights) as stored.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1,
}  # fmt: skip
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
TARGET_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ModelFacts:
    weight_bytes: int
    files: int
    config: dict[str, Any]


def header_of(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path.name} is not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n <= 0 or n > MAX_HEADER:
            raise ValueError(f"{path.name} has an implausible safetensors header ({n} bytes)")
        try:
            doc = json.loads(f.read(n))
        except RecursionError:  # [[[[...: a header nested past Python's stack
            raise ValueError(f"{path.name}: safetensors header is nested too deeply") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path.name}: safetensors header is not an object")
    return doc


def is_count(value: Any) -> bool:
    """A non-negative integer (not a bool, not a float): a size a header may give."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def shape_of(name: str, info: dict[str, Any]) -> list[int]:
    """A tensor's shape; raises ValueError naming the tensor unless it is a list of sizes."""
    shape = info.get("shape", [])
    if not isinstance(shape, list) or not all(is_count(x) for x in shape):
        text = repr(shape)
        text = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(
            f"tensor {name!r}: shape must be a list of non-negative integers, not {text}"
        )
    return shape


def tensor_bytes(header: dict[str, Any], dtype: str) -> int:
    target = TARGET_BYTES.get(dtype)
    total = 0
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        stored = str(info.get("dtype", "F32"))
        n = math.prod(shape_of(name, info))
        per = (
            target
            if (target is not None and stored in FLOAT_DTYPES)
            else DTYPE_BYTES.get(stored, 4)
        )
        total += n * per
    return total


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json (its `text_config` for multimodal models); {} when absent or unreadable.
    Raises ValueError when `text_config` is there but not an object."""
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        return {}
    try:
        loaded = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(loaded, dict):
        return {}
    text_config = loaded.get("text_config")
    if text_config is None:
        return loaded
    if not isinstance(text_config, dict):
        raise ValueError("config.json: text_config must be an object")
    return text_config or loaded


def read_model(model_dir: Path, dtype: str) -> ModelFacts:
    """Weights of every *.safetensors file in `model_dir` at `dtype`, and its config.json.
    Raises OSError or ValueError (also for headers shaped in ways it does not expect)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    try:
        total = sum(tensor_bytes(header_of(p), dtype) for p in files)
    except (TypeError, RecursionError, OverflowError) as err:
        raise ValueError(f"cannot read the safetensors headers in {model_dir}: {err!r}") from None
    return ModelFacts(weight_bytes=total, files=len(files), config=read_config(model_dir))

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
        doc = json.loads(f.read(n))
    if not isinstance(doc, dict):
        raise ValueError(f"{path.name}: safetensors header is not an object")
    return doc


def tensor_bytes(header: dict[str, Any], dtype: str) -> int:
    target = TARGET_BYTES.get(dtype)
    total = 0
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        stored = str(info.get("dtype", "F32"))
        n = math.prod(int(x) for x in info.get("shape", []))
        per = (
            target
            if (target is not None and stored in FLOAT_DTYPES)
            else DTYPE_BYTES.get(stored, 4)
        )
        total += n * per
    return total


def read_model(model_dir: Path, dtype: str) -> ModelFacts:
    """Weights of every *.safetensors file in `model_dir` at `dtype`, and its config.json."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    total = sum(tensor_bytes(header_of(p), dtype) for p in files)
    config: dict[str, Any] = {}
    cfg = model_dir / "config.json"
    if cfg.is_file():
        try:
            loaded = json.loads(cfg.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                config = loaded.get("text_config") or loaded
        except (OSError, ValueError):
            config = {}
    return ModelFacts(weight_bytes=total, files=len(files), config=config)

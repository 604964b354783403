"""Weights from safetensors headers (shapes and dtypes; no tensor data read), for HF and SGLang.

A safetensors file starts with an 8-byte little-endian header length and a JSON header mapping
each tensor to {dtype, shape, data_offsets}. Floating tensors are counted at the dtype the
backend loads them in (`auto`: as stored); integer tensors (quantized weights) as stored.

The weights are those of the files the loaders open: with a `model.safetensors.index.json`,
the files its weight_map names (transformers and SGLang both follow it, so a Mistral-style
repository's `consolidated.safetensors` beside the shards is not counted twice); without one,
every *.safetensors file. Each file's header is parsed once and kept by (path, size, mtime).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1,
}  # fmt: skip
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
TARGET_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Real headers take about 120 bytes per tensor: a shard of 852 tensors (GLM-5) has a 100 kB
# header, a whole DeepSeek-V3 (~91k tensors, shipped as 163 shards) would need about 11 MB in
# one file. 16 MiB (~140k tensors in one file) refuses none of them, and parses in about 2 s
# and 200 MB once (json.loads costs ~10x the text); the safetensors library's own cap, 100 MB,
# cost 12-15 s and 1.1 GiB per parse.
MAX_HEADER = 16 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"
# The index lists every tensor once: DeepSeek-V3's is about 9 MB.
MAX_INDEX = 64 * 1024 * 1024


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


@dataclass(frozen=True, slots=True)
class FileWeights:
    """A safetensors file's tensors, summed so any load dtype can be priced."""

    float_elements: int  # elements of floating tensors (loaded at the backend's dtype)
    float_bytes: int  # their bytes as stored
    other_bytes: int  # integer and fp8 tensors (quantized weights): loaded as stored

    def bytes_at(self, dtype: str) -> int:
        target = TARGET_BYTES.get(dtype)
        floats = self.float_bytes if target is None else self.float_elements * target
        return floats + self.other_bytes


def weights_of(header: dict[str, Any]) -> FileWeights:
    float_elements = float_bytes = other = 0
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        stored = str(info.get("dtype", "F32"))
        n = math.prod(shape_of(name, info))
        if stored in FLOAT_DTYPES:
            float_elements += n
            float_bytes += n * DTYPE_BYTES[stored]
        else:
            other += n * DTYPE_BYTES.get(stored, 4)
    return FileWeights(float_elements, float_bytes, other)


def tensor_bytes(header: dict[str, Any], dtype: str) -> int:
    return weights_of(header).bytes_at(dtype)


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


T = TypeVar("T")
_cache: dict[tuple[str, int, int], Any] = {}
_cache_lock = threading.Lock()


def cached(path: Path, parse: Callable[[Path], T]) -> T:
    """`parse(path)`, kept by (path, size, mtime) of the file (as gguf.facts_of): a start
    estimates twice and every estimate reads every header."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    value = parse(path)
    with _cache_lock:
        if len(_cache) > 4096:  # a few hundred shards per model, a few models
            _cache.clear()
        _cache[key] = value
    return value


def file_weights(path: Path) -> FileWeights:
    return cached(path, lambda p: weights_of(header_of(p)))


def _inside(name: str) -> bool:
    """A relative path that stays in its directory (the loaders join it to the directory)."""
    path = PurePosixPath(name)
    return (
        bool(path.parts) and not path.is_absolute() and ".." not in path.parts and "\\" not in name
    )


def _index_names(index: Path) -> tuple[str, ...]:
    """The files an index's weight_map names, once each. Raises ValueError when it is not an
    index or names a file outside its directory."""
    if index.stat().st_size > MAX_INDEX:
        raise ValueError(f"{index.name} is larger than {MAX_INDEX} bytes")
    try:
        doc = json.loads(index.read_bytes())
    except (ValueError, RecursionError):
        raise ValueError(f"{index.name} is not JSON") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index.name} has no weight_map")
    names: set[str] = set()
    for name in weight_map.values():
        if not isinstance(name, str) or not _inside(name):
            raise ValueError(
                f"{index.name}: weight_map names {str(name)[:60]!r}, not a file of the model "
                "directory"
            )
        names.add(name)
    return tuple(sorted(names))


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files the backend loads: the index's, else every one. Raises ValueError
    when there are none or a file the index names is missing."""
    index = model_dir / INDEX_NAME
    if not index.is_file():
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_dir}")
        return files
    files = [model_dir / name for name in cached(index, _index_names)]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise ValueError(
            f"{INDEX_NAME} names {len(missing)} file(s) missing from {model_dir}: "
            f"{', '.join(missing[:3])}"
        )
    return files


def read_model(model_dir: Path, dtype: str) -> ModelFacts:
    """Weights of the safetensors files the backend loads from `model_dir` (weight_files) at
    `dtype`, and its config.json. Raises OSError or ValueError (also for headers shaped in
    ways it does not expect)."""
    try:
        files = weight_files(model_dir)
        total = sum(file_weights(p).bytes_at(dtype) for p in files)
    except (TypeError, RecursionError, OverflowError) as err:
        raise ValueError(f"cannot read the safetensors headers in {model_dir}: {err!r}") from None
    return ModelFacts(weight_bytes=total, files=len(files), config=read_config(model_dir))

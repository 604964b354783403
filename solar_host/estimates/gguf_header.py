"""A fast GGUF header reader: the metadata and tensor table, no tensor data.

gguf's own GGUFReader builds numpy views of every array element, which takes tens of seconds
on a 150k-token vocabulary; an estimate needs only the scalars, the per-layer arrays and the
tensor table, so this walks the header with struct and skips long arrays. Type sizes come from
the `gguf` library (GGML_QUANT_SIZES), so new quantization types are known when it is updated;
a built-in copy serves where it is not installed.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"GGUF"
# Arrays longer than this are kept as their length only (vocabularies, merges, scores).
MAX_DECODED_ARRAY = 4096
# Arrays of arrays nested deeper than this are refused: no real model nests them, and a few
# bytes per level would otherwise recurse until Python's stack gives out.
MAX_ARRAY_DEPTH = 8
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}  # fmt: skip
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class LongArray:
    """An array too long to be worth decoding: only its length is kept."""

    length: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    n_bytes: int


class _Cursor:
    def __init__(self, buf: Any):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str, size: int) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q", 8)
        if n > len(self.buf) - self.pos:
            raise ValueError("string runs past the end of the file")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", "replace")

    def skip_strings(self, count: int) -> None:
        # The hot loop of a 150k-token vocabulary: locals only.
        unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.unpack(fmt, size)
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ValueError(f"metadata arrays nested deeper than {MAX_ARRAY_DEPTH}")
            etype = self.unpack("<I", 4)
            count = self.unpack("<Q", 8)
            if count <= MAX_DECODED_ARRAY:
                return [self.value(etype, depth + 1) for _ in range(count)]
            if etype in _SCALARS:
                self.pos += count * _SCALARS[etype][1]
            elif etype == STRING:
                self.skip_strings(count)
            else:
                raise ValueError(f"unsupported nested array of type {etype}")
            return LongArray(count)
        raise ValueError(f"unknown GGUF value type {vtype}")


# ggml type -> (elements per block, bytes per block), as of gguf 0.19; the installed gguf
# library's table is preferred (it knows types added since), this one stands in without it.
BUILTIN_QUANT_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
    27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66),
    39: (32, 17), 40: (64, 36), 41: (128, 18),
}  # fmt: skip


@functools.cache
def quant_sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (elements per block, bytes per block)."""
    try:
        import gguf  # ~180 ms, and only needed once a model is estimated
    except ImportError:
        return dict(BUILTIN_QUANT_SIZES)
    return {**BUILTIN_QUANT_SIZES, **{int(t): v for t, v in gguf.GGML_QUANT_SIZES.items()}}


def tensor_nbytes(dims: list[int], ggml_type: int, sizes: dict[int, tuple[int, int]]) -> int:
    block, size = sizes[ggml_type]
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def read_header(path: str) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata, tensors) of a GGUF file. Raises ValueError when it is not a readable GGUF."""
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise ValueError("the file is empty") from None
    try:
        if mm[:4] != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        cur = _Cursor(mm)
        cur.pos = 4
        version = cur.unpack("<I", 4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors = cur.unpack("<Q", 8)
        n_kv = cur.unpack("<Q", 8)
        if n_tensors > 10_000_000 or n_kv > 10_000_000:
            raise ValueError("implausible GGUF header counts")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.unpack("<I", 4))
        tensors = []
        sizes = quant_sizes()
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I", 4)
            if n_dims > 8:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = [cur.unpack("<Q", 8) for _ in range(n_dims)]
            ggml_type = cur.unpack("<I", 4)
            cur.unpack("<Q", 8)  # data offset
            try:
                tensors.append(TensorInfo(name, tensor_nbytes(dims, ggml_type, sizes)))
            except KeyError:
                raise ValueError(f"tensor {name} has unknown type {ggml_type}") from None
        return meta, tensors
    except struct.error:
        raise ValueError("the GGUF header is truncated") from None
    finally:
        mm.close()

"""A fast GGUF header reader: the metadata and tensor table, no tensor data.

gguf's own GGUFReader builds numpy views of every array element, which takes tens of seconds
on a 150k-token vocabulary; an estimate needs only a few scalars, a few per-layer arrays and
the tensor table. So this decodes only the keys its caller asks for (`wanted`) and skips every
other string and array by its length: a skipped scalar array costs one addition whatever its
length, a skipped string array one step per string. Everything it does is bounded by the file
size and by the caps below, so a crafted header costs neither seconds nor memory (a 241 MiB
header of nested byte arrays took 113 s and 2.2 GiB when every array was decoded).

Type sizes come from the `gguf` library (GGML_QUANT_SIZES), so new quantization types are
known when it is updated; a built-in copy serves where it is not installed.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAGIC = b"GGUF"
# A wanted array longer than this is kept as its length only: per-layer arrays have one entry
# per layer (gguf.MAX_BLOCK_COUNT is 10_000 but no real model has 4096 layers).
MAX_DECODED_ARRAY = 4096
# All decoded array elements of one header together: a handful of per-layer arrays.
MAX_DECODED_TOTAL = 65_536
# Strings and nested arrays stepped over, one Python step each. The largest real vocabularies
# come to about 650k (gpt-oss: 201k tokens and 446k merges; Gemma 3: 262k tokens); 4M such
# steps take about a second.
MAX_WALKED = 4_000_000
# Arrays of arrays nested deeper than this are refused: no real model nests them, and a few
# bytes per level would otherwise recurse until Python's stack gives out.
MAX_ARRAY_DEPTH = 8
# The GGUF spec allows keys of 65535 bytes; real ones are under 100, and 1 KiB keeps the keys
# a header can make us hold (MAX_KV of them) to 64 MiB. The one string value an estimate
# decodes (general.architecture) is a word.
MAX_KEY = 1024
MAX_DECODED_STRING = 1024
# Real GGUFs have tens of metadata keys and at most a few thousand tensors (DeepSeek-V3: about
# 1100, experts stored as one tensor per layer; older per-expert files of 128-expert models
# about 13k). Beyond these, the header is refused rather than walked.
MAX_KV = 65_536
MAX_TENSORS = 262_144
# ggml's GGML_MAX_NAME is 64: llama.cpp refuses longer tensor names; some leeway for builds
# compiled with a larger one.
MAX_TENSOR_NAME = 256
_SCALARS = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}  # fmt: skip
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_ARRAY_HEAD = struct.Struct("<IQ")


@dataclass(frozen=True, slots=True)
class LongArray:
    """An array not decoded (not wanted, too long or nested): only its length is kept."""

    length: int


@dataclass(frozen=True, slots=True)
class SkippedString:
    """A string value not wanted: only its length in bytes is kept."""

    length: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    n_bytes: int


def _nothing(key: str) -> bool:
    return False


class _Cursor:
    """Reads a header front to back, within the file and the caps above."""

    def __init__(self, buf: Any):
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.walk_left = MAX_WALKED
        self.decode_left = MAX_DECODED_TOTAL

    def unpack(self, fmt: str, size: int) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise ValueError(f"{what} runs past the end of the file")
        self.pos += n

    def walk(self, steps: int) -> None:
        """Spend `steps` of the walking budget (checked before the steps are taken)."""
        self.walk_left -= steps
        if self.walk_left < 0:
            raise ValueError(f"more than {MAX_WALKED} strings and arrays in the GGUF metadata")

    def string(self, limit: int) -> str:
        n = self.unpack("<Q", 8)
        if n > limit:
            raise ValueError(f"a metadata string of {n} bytes (more than {limit})")
        start = self.pos
        self.skip(n, "a string")
        return bytes(self.buf[start : self.pos]).decode("utf-8", "replace")

    def skip_strings(self, count: int) -> None:
        self.walk(count)
        if count * 8 > self.end - self.pos:  # each string has its 8-byte length at least
            raise ValueError("a string array runs past the end of the file")
        # The hot loop of a 150k-token vocabulary: locals only.
        unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        if pos > self.end:
            raise ValueError("a string array runs past the end of the file")
        self.pos = pos

    def value(self, vtype: int, wanted: bool) -> Any:
        """One metadata value; strings and arrays decoded only when `wanted`."""
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.unpack("<" + fmt, size)
        if vtype == STRING:
            if wanted:
                return self.string(MAX_DECODED_STRING)
            n = self.unpack("<Q", 8)
            self.skip(n, "a string")
            return SkippedString(n)
        if vtype == ARRAY:
            etype, count = _ARRAY_HEAD.unpack_from(self.buf, self.pos)
            self.pos += _ARRAY_HEAD.size
            if wanted and etype in _SCALARS and count <= MAX_DECODED_ARRAY:
                return self.scalars(etype, count)
            self.skip_array(etype, count, 1)
            return LongArray(count)
        raise ValueError(f"unknown GGUF value type {vtype}")

    def scalars(self, etype: int, count: int) -> list[Any]:
        """A wanted array of numbers, decoded in one call."""
        self.decode_left -= count
        if self.decode_left < 0:
            raise ValueError(f"more than {MAX_DECODED_TOTAL} array elements to decode")
        fmt, size = _SCALARS[etype]
        start = self.pos
        self.skip(count * size, "an array")
        return list(struct.unpack_from(f"<{count}{fmt}", self.buf, start))

    def skip_array(self, etype: int, count: int, depth: int) -> None:
        """Step over `count` elements of type `etype` without decoding them."""
        if etype in _SCALARS:
            self.skip(count * _SCALARS[etype][1], "an array")
        elif etype == STRING:
            self.skip_strings(count)
        elif etype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ValueError(f"metadata arrays nested deeper than {MAX_ARRAY_DEPTH}")
            self.walk(count)
            if count * _ARRAY_HEAD.size > self.end - self.pos:
                raise ValueError("an array runs past the end of the file")
            for _ in range(count):
                inner, n = _ARRAY_HEAD.unpack_from(self.buf, self.pos)
                self.pos += _ARRAY_HEAD.size
                self.skip_array(inner, n, depth + 1)
        else:
            raise ValueError(f"unknown GGUF array element type {etype}")


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


def _metadata(cur: _Cursor, n_kv: int, wanted: Callable[[str], bool]) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string(MAX_KEY)
        if key in meta:  # llama.cpp refuses such a file too; a repeat could dodge the caps
            raise ValueError(f"duplicate metadata key {key[:60]!r}")
        meta[key] = cur.value(cur.unpack("<I", 4), wanted(key))
    return meta


def _tensors(cur: _Cursor, n_tensors: int) -> list[TensorInfo]:
    tensors = []
    sizes = quant_sizes()
    for _ in range(n_tensors):
        name = cur.string(MAX_TENSOR_NAME)
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
    return tensors


def read_header(
    path: str, wanted: Callable[[str], bool] = _nothing
) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata, tensors) of a GGUF file. Every key is in the metadata; the strings and arrays
    of keys `wanted` does not accept are SkippedString / LongArray (numbers are always
    decoded). Raises ValueError when it is not a readable GGUF or exceeds the caps above."""
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
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise ValueError(
                f"implausible GGUF header counts ({n_tensors} tensors, {n_kv} metadata keys)"
            )
        meta = _metadata(cur, n_kv, wanted)
        return meta, _tensors(cur, n_tensors)
    except struct.error:
        raise ValueError("the GGUF header is truncated") from None
    finally:
        mm.close()

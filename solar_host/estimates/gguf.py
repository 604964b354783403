"""llama.cpp estimates from a GGUF header (gguf_header.py; no tensor data read).

How llama-server lays memory out (checked against its own log lines, tests/test_estimates_real):

- weights: every tensor's bytes, of every shard of a split model (`<prefix>-00001-of-0000N.gguf`,
  the others found as llama.cpp finds them). `token_embd` stays on the CPU; the last `n_gpu_layers`
  repeating blocks go to the GPUs, split by `tensor_split` (default: by free memory, as
  llama.cpp does) in device order; the output layer goes with block n_layer when
  n_gpu_layers > n_layer. `split_mode: none` puts every offloaded block on `main_gpu`; `row`
  cuts the offloaded weights across the GPUs by the split and keeps KV and compute on
  `main_gpu`.
- KV cache: ctx_size cells (0: the training context), padded to 256, for every layer with
  attention, K and V rows at `cache_type_k`/`cache_type_v` (default f16), on the device of
  its layer. The server's slots share one unified cache, so parallel slots do not multiply it.
- compute: the scheduler's reserve with flash attention (llama-server's `auto` enables it on
  CPU and CUDA): the f16 KQ mask (ctx x ubatch) plus the FFN/embedding activations of one
  ubatch (512 tokens), with factors fitted to llama-server's "compute buffer size" lines
  (b10434; builds that keep every ubatch token's logits in the graph need n_vocab x 512 x 4
  bytes more, which this does not count); plus
  the output buffer (n_vocab floats per slot). On every GPU holding blocks (each computes
  its own layers), else the CPU.
- mmproj and spec_draft_model: their tensor bytes (the draft also gets its KV cache), on
  the main device (mmproj on the CPU when mmproj_offload is false).

Not modelled: sliding-window caches (counted as full), MLA caches (counted as plain K/V),
recurrent state, `-ot` overrides.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from solar_host.estimates.gguf_header import LongArray, TensorInfo, read_header
from solar_host.estimates.model import CPU, Device, DeviceEstimate, Estimate, EstimateError

UBATCH = 512
CTX_PAD = 256
N_SEQ = 4  # llama-server's default slots (n_parallel auto)
# Fitted to llama-server's compute buffer over models of n_embd 512-1024, n_ff 1024-4096.
COMPUTE_FF_FACTOR = 3.2
COMPUTE_EMBD_FACTOR = 2.7
# ggml type sizes (block elements, bytes per block) of the KV cache types a config may name.
CACHE_TYPES = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "iq4_nl": (32, 18),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
}
_BLOCK = re.compile(r"^blk\.(\d+)\.")
FileKey = tuple[str, int, int]  # (real path, size, mtime_ns): a file as the caches know it


@dataclass(frozen=True, slots=True)
class GgufFacts:
    """What an estimate needs from one GGUF file."""

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    kv_per_layer: tuple[tuple[int, int], ...]  # (n_embd_k_gqa, n_embd_v_gqa) per layer
    block_bytes: tuple[int, ...]  # tensor bytes of each repeating block
    embd_bytes: int  # token_embd (the input layer, always on the CPU)
    output_bytes: int  # output, output_norm and other tensors outside the blocks
    file_bytes: int  # all shards of a split model together
    # (path, size, mtime) of the shards after the first: the cache entry is stale when one
    # of them changes, not only when the first file does.
    shard_keys: tuple[FileKey, ...] = ()

    @property
    def tensor_bytes(self) -> int:
        return sum(self.block_bytes) + self.embd_bytes + self.output_bytes


# More layers than any model has: a header claiming more is refused before per-layer lists of
# that length are built (a 200-byte file could otherwise claim 4e9 of them).
MAX_BLOCK_COUNT = 10_000


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(meta: dict[str, Any], key: str) -> int:
    """A non-negative integer metadata value (0 when absent). Raises ValueError naming it."""
    value = meta.get(key)
    if value is None:
        return 0
    if not _is_count(value):
        raise ValueError(f"GGUF metadata {key} must be a non-negative integer, not {_show(value)}")
    return value


def _per_layer(meta: dict[str, Any], key: str, n_layer: int, default: int) -> list[int]:
    """A scalar or per-layer metadata value as one count per layer."""
    value = meta.get(key)
    if value is None:
        return [default] * n_layer
    if isinstance(value, list):
        if not all(_is_count(v) for v in value):
            raise ValueError(f"GGUF metadata {key} must hold non-negative integers")
        vals = value or [default]
        return (vals + [vals[-1]] * n_layer)[:n_layer]
    return [_count(meta, key)] * n_layer


# The strings and arrays an estimate reads (every number is read anyway): the architecture and
# the per-layer arrays of `<arch>.`; the vocabulary is counted from its length alone.
_ARCH_ARRAYS = frozenset({"feed_forward_length", "attention.head_count", "attention.head_count_kv"})


def estimate_reads(key: str) -> bool:
    return key == "general.architecture" or key.partition(".")[2] in _ARCH_ARRAYS


def _read(path: str) -> tuple[dict[str, Any], list[TensorInfo]]:
    try:
        return read_header(path, estimate_reads)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read GGUF header of {path}: {err}") from None


def _file_key(path: str) -> FileKey:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns)


def shard_paths(path: str, meta: dict[str, Any]) -> list[str]:
    """The other files of a split model (gguf-split's `<prefix>-00001-of-0000N.gguf`), named as
    llama.cpp names them (llama_split_prefix, llama_split_path); [] for a single file. Raises
    ValueError where llama.cpp refuses to load: not the first shard, a name off the rule."""
    n_split = _count(meta, "split.count")
    if n_split <= 1:
        return []
    split_no = _count(meta, "split.no")
    if split_no != 0:
        raise ValueError(
            f"{path} is shard {split_no + 1} of {n_split}: llama.cpp loads a split model "
            "from its first shard"
        )
    postfix = f"-00001-of-{n_split:05d}.gguf"
    if not path.endswith(postfix) or len(path) == len(postfix):
        raise ValueError(
            f"{path} is the first of {n_split} shards but its name does not end in {postfix}: "
            "llama.cpp cannot find the others"
        )
    prefix = path[: -len(postfix)]
    return [f"{prefix}-{i + 1:05d}-of-{n_split:05d}.gguf" for i in range(1, n_split)]


def _shard_tensors(shard: str, index: int, n_split: int) -> list[TensorInfo]:
    """The tensor table of shard `index` (0-based), checked as llama.cpp checks it."""
    meta, tensors = _read(shard)
    if meta.get("split.no") != index:
        raise ValueError(
            f"{shard}: split.no is {_show(meta.get('split.no'))}, not {index} "
            f"(shard {index + 1} of {n_split})"
        )
    return tensors


def _split_tensors(path: str, meta: dict[str, Any]) -> tuple[list[TensorInfo], list[FileKey]]:
    """The tensors of every other shard, and their (path, size, mtime) keys for the cache."""
    shards = shard_paths(path, meta)
    tensors: list[TensorInfo] = []
    keys = []
    for i, shard in enumerate(shards, start=1):
        try:
            keys.append(_file_key(shard))
        except OSError as err:
            raise ValueError(
                f"split model {path}: shard {i + 1} of {len(shards) + 1} ({shard}) is missing or "
                f"unreadable: {err.strerror or err}"
            ) from None
        tensors += _shard_tensors(shard, i, len(shards) + 1)
    return tensors, keys


def read_facts(path: str) -> GgufFacts:
    """Parse the header of a GGUF file (and of the other shards of a split model). Raises
    ValueError when it is not a readable GGUF, a shard is missing, or its metadata is not what
    llama.cpp could load (negative or non-integer sizes, an implausible layer count)."""
    meta, tensors = _read(path)
    more, shard_keys = _split_tensors(path, meta)
    tensors += more

    arch = meta.get("general.architecture") or "llama"
    if not isinstance(arch, str):
        raise ValueError(f"GGUF metadata general.architecture is not a string: {_show(arch)}")
    n_layer = _count(meta, f"{arch}.block_count")
    if n_layer > MAX_BLOCK_COUNT:
        raise ValueError(
            f"GGUF metadata {arch}.block_count {n_layer} is implausible "
            f"(more than {MAX_BLOCK_COUNT} layers)"
        )
    n_embd = _count(meta, f"{arch}.embedding_length")
    ff_key = f"{arch}.feed_forward_length"
    n_ff = max(_per_layer(meta, ff_key, max(n_layer, 1), 4 * n_embd)) if n_embd else 0
    blocks, embd, other = _tensor_parts(tensors, n_layer)
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = tokens.length if isinstance(tokens, LongArray) else 0
    return GgufFacts(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=n_ff,
        n_vocab=_count(meta, f"{arch}.vocab_size") or n_tokens,
        n_ctx_train=_count(meta, f"{arch}.context_length"),
        kv_per_layer=_kv_per_layer(meta, arch, n_layer, n_embd),
        block_bytes=tuple(blocks),
        embd_bytes=embd,
        output_bytes=other,
        file_bytes=os.path.getsize(path) + sum(k[1] for k in shard_keys),
        shard_keys=tuple(shard_keys),
    )


def _kv_per_layer(
    meta: dict[str, Any], arch: str, n_layer: int, n_embd: int
) -> tuple[tuple[int, int], ...]:
    """(n_embd_k_gqa, n_embd_v_gqa) of each layer."""
    n_head = _per_layer(meta, f"{arch}.attention.head_count", n_layer, 0)
    # Absent: one KV head per head (MHA). A 0 in a per-layer array is a layer without
    # attention (the recurrent layers of a hybrid model): it has no KV cache.
    kv_key = f"{arch}.attention.head_count_kv"
    n_head_kv = n_head if meta.get(kv_key) is None else _per_layer(meta, kv_key, n_layer, 0)
    key_length = _count(meta, f"{arch}.attention.key_length")
    value_length = _count(meta, f"{arch}.attention.value_length")
    out = []
    for h, hkv in zip(n_head, n_head_kv, strict=True):
        head_dim = n_embd // h if h else 0
        out.append(((key_length or head_dim) * hkv, (value_length or head_dim) * hkv))
    return tuple(out)


def _tensor_parts(tensors: list[TensorInfo], n_layer: int) -> tuple[list[int], int, int]:
    """(bytes of each repeating block, token_embd bytes, bytes of every other tensor)."""
    blocks = [0] * n_layer
    embd = other = 0
    for t in tensors:
        size = int(t.n_bytes)
        m = _BLOCK.match(t.name)
        if m and int(m.group(1)) < n_layer:
            blocks[int(m.group(1))] += size
        elif t.name.startswith("token_embd."):
            embd += size
        else:
            other += size
    return blocks, embd, other


_cache: dict[FileKey, GgufFacts] = {}
_cache_lock = threading.Lock()


def _unchanged(keys: tuple[FileKey, ...]) -> bool:
    """Whether every file behind `keys` still has its size and mtime."""
    try:
        return all(_file_key(k[0]) == k for k in keys)
    except OSError:
        return False


def facts_of(path: str) -> GgufFacts:
    """`read_facts`, cached by (path, size, mtime) of every file of the model (all shards of a
    split one): a big vocabulary takes a while to parse. Raises OSError or ValueError."""
    key = _file_key(path)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None and _unchanged(hit.shard_keys):
        return hit
    try:
        facts = read_facts(path)
    except (TypeError, RecursionError, OverflowError) as err:
        # A header shaped in a way the reader does not expect: an unreadable model (422, or a
        # start without a fit check), never a 500.
        raise ValueError(f"cannot read GGUF header of {path}: {err!r}") from None
    with _cache_lock:
        if len(_cache) > 256:
            _cache.clear()
        _cache[key] = facts
    return facts


def row_bytes(n: int, cache_type: str | None) -> int:
    block, size = CACHE_TYPES[cache_type or "f16"]
    return -(-n // block) * size


def padded_ctx(ctx_size: int, facts: GgufFacts) -> int:
    n = ctx_size or facts.n_ctx_train or 4096
    return -(-n // CTX_PAD) * CTX_PAD


def kv_bytes_per_layer(facts: GgufFacts, n_ctx: int, ctk: str | None, ctv: str | None) -> list[int]:
    return [n_ctx * (row_bytes(k, ctk) + row_bytes(v, ctv)) for k, v in facts.kv_per_layer]


def compute_bytes(facts: GgufFacts, n_ctx: int) -> int:
    ub = min(UBATCH, n_ctx)
    acts = ub * 4 * (COMPUTE_FF_FACTOR * facts.n_ff + COMPUTE_EMBD_FACTOR * facts.n_embd)
    mask = n_ctx * ub * 2
    output = facts.n_vocab * 4 * N_SEQ
    return int(acts + mask + output)


def parse_devices(devices: str | None) -> list[int] | None:
    """`devices` as GPU indices: None when not named, [] for `none` (CPU only)."""
    if not devices:
        return None
    out = []
    for part in devices.split(","):
        name = part.strip()
        if name.lower() == "none":
            return []
        m = re.search(r"(\d+)$", name)
        if m is None:
            raise EstimateError("devices", f"cannot tell which GPU '{name}' is (e.g. CUDA0)")
        out.append(int(m.group(1)))
    return out


def offloaded_layers(n_gpu_layers: int, n_layer: int) -> tuple[int, bool]:
    """(repeating blocks on GPUs, output layer on GPU) for llama.cpp's n_gpu_layers."""
    if n_gpu_layers < 0 or n_gpu_layers > n_layer:
        return n_layer, True
    return n_gpu_layers, False


def split_fractions(config: Any, gpus: list[Device]) -> list[float]:
    """Cumulative split points per GPU, as llama.cpp computes them."""
    n = len(gpus)
    if config.split_mode == "none":
        main = config.main_gpu or 0
        if main >= n:
            raise EstimateError("main_gpu", f"main_gpu {main} is not one of the {n} devices")
        weights = [1.0 if i == main else 0.0 for i in range(n)]
    elif config.tensor_split:
        weights = [float(x) for x in config.tensor_split.split(",")][:n]
        weights += [0.0] * (n - len(weights))
        if sum(weights) <= 0:
            raise EstimateError("tensor_split", "tensor_split proportions sum to zero")
    else:
        weights = [float(max(g.free_bytes, 1)) for g in gpus]
    total = sum(weights)
    cum, acc = [], 0.0
    for w in weights:
        acc += w / total
        cum.append(acc)
    return cum


def estimate_llamacpp(config: Any, gpus: list[Device]) -> Estimate:
    """Bytes per device for `config` on `gpus` (in order; empty: a CPU-only start)."""
    if not config.model:
        raise EstimateError("model", "no model file to estimate from")
    try:
        facts = facts_of(config.model)
    except (OSError, ValueError) as err:
        raise EstimateError("model", str(err)) from None
    est = Estimate("llamacpp", [DeviceEstimate(CPU)])
    cpu = est.devices[0]
    for g in gpus:
        est.device(g.name)
    n_off, output_on_gpu = (
        offloaded_layers(config.n_gpu_layers, facts.n_layer) if gpus else (0, False)
    )
    first_off = facts.n_layer - n_off
    cum = split_fractions(config, gpus) if gpus and n_off else []

    def device_of_layer(il: int) -> DeviceEstimate:
        if il < first_off or not cum:
            return cpu
        frac = (il - first_off) / max(n_off, 1)
        for i, c in enumerate(cum):
            if frac < c - 1e-9:
                return est.device(gpus[i].name)
        return est.device(gpus[len(cum) - 1].name)

    n_ctx = padded_ctx(config.ctx_size, facts)
    kv = kv_bytes_per_layer(facts, n_ctx, config.cache_type_k, config.cache_type_v)
    compute = compute_bytes(facts, n_ctx)
    cpu.weights_bytes += facts.embd_bytes
    main = cpu
    if config.split_mode == "row" and cum:
        # Row split: every offloaded matrix is cut by rows across the GPUs; KV and compute
        # live on the main GPU.
        main = est.device(gpus[min(config.main_gpu or 0, len(gpus) - 1)].name)
        offloaded = sum(facts.block_bytes[first_off:])
        if output_on_gpu:
            offloaded += facts.output_bytes
        else:
            cpu.weights_bytes += facts.output_bytes
        prev = 0.0
        for g, c in zip(gpus, cum, strict=True):
            est.device(g.name).weights_bytes += int(offloaded * (c - prev))
            prev = c
        cpu.weights_bytes += sum(facts.block_bytes[:first_off])
        cpu.kv_cache_bytes += sum(kv[:first_off])
        main.kv_cache_bytes += sum(kv[first_off:])
        main.compute_bytes += compute
    else:
        holding = []
        for il in range(facts.n_layer):
            dev = device_of_layer(il)
            dev.weights_bytes += facts.block_bytes[il]
            dev.kv_cache_bytes += kv[il]
            if dev is not cpu and dev not in holding:
                holding.append(dev)
        out_dev = device_of_layer(facts.n_layer) if output_on_gpu else cpu
        out_dev.weights_bytes += facts.output_bytes
        if out_dev is not cpu and out_dev not in holding:
            holding.append(out_dev)
        # Each device computes its own layers with the same ubatch shapes: a full compute
        # buffer on each (llama-server logs one per device).
        for dev in holding or [cpu]:
            dev.compute_bytes += compute
        main = holding[0] if holding else cpu

    for field_name in ("mmproj", "spec_draft_model"):
        path = getattr(config, field_name, None)
        if not path:
            continue
        try:
            extra = facts_of(path)
        except (OSError, ValueError) as err:
            raise EstimateError(field_name, str(err)) from None
        target = main
        if field_name == "mmproj" and not config.mmproj_offload:
            target = cpu
        target.extra_files_bytes += extra.tensor_bytes
        if field_name == "spec_draft_model":
            target.extra_files_bytes += sum(kv_bytes_per_layer(extra, n_ctx, None, None))
    if config.ot:
        est.notes.append("-ot tensor overrides are not modelled: the split may differ")
    return est

"""Estimates of model files as the backends really load them: split GGUFs, safetensors indexes,
the HF server's load dtype, and headers crafted to make an estimate expensive."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import tracemalloc
from pathlib import Path

import pytest

from solar_host.backends.huggingface_config import HuggingFaceCausalConfig
from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.backends.sglang_config import SglangConfig
from solar_host.estimates import safetensors as st
from solar_host.estimates.dispatch import estimate_config
from solar_host.estimates.gguf import facts_of
from solar_host.estimates.model import Device, EstimateError
from tests.fixtures.gguf_sized import Shape, write_sized_gguf
from tests.fixtures.safetensors_files import HF_CONFIG, write_safetensors

GB = 1024**3
INDEX = "model.safetensors.index.json"
SHAPE = Shape(n_embd=128, n_layer=6, n_head=4, n_head_kv=2, n_ff=256, n_ctx_train=2048)


def gpu(free_gb: float = 40.0) -> list[Device]:
    return [Device("cuda:0", 0, int(80 * GB), int(free_gb * GB))]


def llama(path: Path, **kw) -> LlamaCppConfig:
    return LlamaCppConfig(alias="m", model=str(path), **kw)


# --- split GGUF ----------------------------------------------------------------------------------


@pytest.fixture
def split_model(tmp_path: Path) -> tuple[Path, Path]:
    """(the whole model, the first of its 5 shards), the same tensors in both."""
    whole = write_sized_gguf(tmp_path / "whole" / "m.gguf", SHAPE)
    first = write_sized_gguf(tmp_path / "split" / "m.gguf", SHAPE, split_max_tensors=12)
    assert len(list(first.parent.glob("m-*-of-00005.gguf"))) == 5
    return whole, first


def test_split_gguf_counts_every_shard(split_model: tuple[Path, Path]) -> None:
    import gguf

    whole, first = split_model
    w, s = facts_of(str(whole)), facts_of(str(first))
    assert (s.block_bytes, s.embd_bytes, s.output_bytes) == (
        w.block_bytes,
        w.embd_bytes,
        w.output_bytes,
    )
    shards = sorted(first.parent.glob("*.gguf"))
    library = sum(int(t.n_bytes) for p in shards for t in gguf.GGUFReader(str(p)).tensors)
    assert s.tensor_bytes == library
    assert s.file_bytes == sum(p.stat().st_size for p in shards)
    for ctx in (512, 0):
        a = estimate_config(llama(whole, ctx_size=ctx), gpu()).as_dict()
        b = estimate_config(llama(first, ctx_size=ctx), gpu()).as_dict()
        assert a["devices"] == b["devices"]


def test_split_gguf_with_a_missing_or_changed_shard(split_model: tuple[Path, Path]) -> None:
    _, first = split_model
    assert estimate_config(llama(first), gpu()).total_bytes > 0  # cached now
    third = first.parent / "m-00003-of-00005.gguf"
    moved = third.with_suffix(".bak")
    third.rename(moved)
    with pytest.raises(EstimateError) as err:  # the cache entry of the set is stale
        estimate_config(llama(first), gpu())
    assert err.value.field == "model"
    assert "shard 3 of 5" in err.value.msg and "missing" in err.value.msg
    # A shard in the wrong place: llama.cpp checks split.no too.
    shutil.copy(first.parent / "m-00002-of-00005.gguf", third)
    with pytest.raises(EstimateError) as err:
        estimate_config(llama(first), gpu())
    assert "split.no is 1, not 2" in err.value.msg
    moved.replace(third)
    assert estimate_config(llama(first), gpu()).total_bytes > 0


def test_split_gguf_from_another_shard_or_renamed(split_model: tuple[Path, Path]) -> None:
    _, first = split_model
    with pytest.raises(EstimateError) as err:
        estimate_config(llama(first.parent / "m-00002-of-00005.gguf"), gpu())
    assert "shard 2 of 5" in err.value.msg and "first shard" in err.value.msg
    renamed = first.parent / "renamed.gguf"
    shutil.copy(first, renamed)
    with pytest.raises(EstimateError) as err:
        estimate_config(llama(renamed), gpu())
    assert "-00001-of-00005.gguf" in err.value.msg


# --- safetensors index ---------------------------------------------------------------------------


def save(folder: Path, name: str, shapes: dict[str, tuple[int, ...]]) -> int:
    """A real safetensors file (the library's writer) of f16 zeros; its tensor bytes."""
    import numpy as np
    from safetensors.numpy import save_file

    arrays = {k: np.zeros(v, dtype=np.float16) for k, v in shapes.items()}
    save_file(arrays, str(folder / name))
    return sum(a.nbytes for a in arrays.values())


@pytest.fixture
def mistral_repo(tmp_path: Path) -> tuple[Path, int]:
    """Shards with an index, and consolidated.safetensors holding the same weights again."""
    repo = tmp_path / "mistral"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({**HF_CONFIG, "torch_dtype": "float16"}))
    a = {"layers.0.w": (64, 64), "layers.1.w": (64, 64)}
    b = {"lm_head.w": (128, 64)}
    total = save(repo, "model-00001-of-00002.safetensors", a)
    total += save(repo, "model-00002-of-00002.safetensors", b)
    save(repo, "consolidated.safetensors", {**a, **b})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in a}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in b}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (repo / INDEX).write_text(json.dumps(index))
    return repo, total


def test_safetensors_index_names_the_weights(mistral_repo: tuple[Path, int]) -> None:
    from safetensors import safe_open

    repo, total = mistral_repo
    index = json.loads((repo / INDEX).read_text())
    loaded = 0  # what a loader following the index reads, by the library
    for name in set(index["weight_map"].values()):
        with safe_open(str(repo / name), framework="numpy") as f:
            loaded += sum(f.get_tensor(k).nbytes for k in f.keys())
    assert loaded == total == index["metadata"]["total_size"]
    hf = HuggingFaceCausalConfig(alias="a", model_id=str(repo), dtype="float16")
    assert estimate_config(hf, gpu()).devices[0].weights_bytes == total
    sg = SglangConfig(alias="s", model_path=str(repo))
    assert estimate_config(sg, gpu()).devices[0].weights_bytes == total


@pytest.mark.parametrize(
    ("weight_map", "named"),
    [
        ({"w": "../outside.safetensors"}, "not a file of the model directory"),
        ({"w": "/etc/outside.safetensors"}, "not a file of the model directory"),
        ({"w": ["model.safetensors"]}, "not a file of the model directory"),
        ({"w": "model-00003-of-00003.safetensors"}, "missing"),
        ({}, "no weight_map"),
    ],
)
def test_safetensors_index_naming_what_is_not_there(
    mistral_repo: tuple[Path, int], weight_map: dict, named: str
) -> None:
    repo, _ = mistral_repo
    (repo / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    for cfg, field in (
        (HuggingFaceCausalConfig(alias="a", model_id=str(repo)), "model_id"),
        (SglangConfig(alias="s", model_path=str(repo)), "model_path"),
    ):
        with pytest.raises(EstimateError) as err:
            estimate_config(cfg, gpu())
        assert err.value.field == field and named in err.value.msg


# --- the HF server's load dtype ------------------------------------------------------------------


@pytest.mark.parametrize("torch_dtype", ["bfloat16", "float32", None])
def test_hf_auto_dtype_is_what_the_server_loads(tmp_path: Path, torch_dtype: str | None) -> None:
    """Whatever config.json says, `auto` loads float16 on a GPU and float32 on the CPU."""
    extra = {"torch_dtype": torch_dtype} if torch_dtype else {}
    model = write_safetensors(tmp_path / "m", {"w": ("BF16", [256, 256])}, **HF_CONFIG | extra)
    n = 256 * 256

    def weights(device: str, dtype: str = "auto") -> tuple[str, int]:
        cfg = HuggingFaceCausalConfig(alias="a", model_id=str(model), device=device, dtype=dtype)
        d = estimate_config(cfg, gpu() if device in ("cuda", "auto") else []).devices[0]
        return d.device, d.weights_bytes

    assert weights("cuda") == weights("auto") == ("cuda:0", n * 2)
    assert weights("cpu") == ("cpu", n * 4)
    assert weights("mps") == ("cpu", n * 2)  # MPS shares system memory; pick_dtype: float16
    assert weights("cpu", "bfloat16") == ("cpu", n * 2)
    assert weights("cuda", "float32") == ("cuda:0", n * 4)


def test_hf_load_dtype_matches_pick_dtype() -> None:
    from solar_host.estimates.huggingface import load_dtype
    from solar_host.estimates.model import CPU
    from solar_host.servers.hf_runtime import pick_dtype

    for requested in ("auto", "float16", "bfloat16", "float32"):
        for device, placed in (("cuda", "cuda:0"), ("cpu", CPU), ("mps", CPU)):
            cfg = HuggingFaceCausalConfig(alias="a", model_id="x", device=device, dtype=requested)
            ours = load_dtype(cfg, placed)
            assert ours == str(pick_dtype(requested, device)).removeprefix("torch."), (
                requested,
                device,
            )


def test_hf_estimate_matches_a_real_load_on_cpu(tmp_path: Path) -> None:
    """A bf16 checkpoint loaded as hf_runtime loads it on the CPU: the parameters' bytes."""
    import torch
    import transformers as tf

    from solar_host.servers.hf_runtime import pick_dtype

    config = tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=pick_dtype("auto", "cpu"))
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = HuggingFaceCausalConfig(alias="a", model_id=str(tmp_path / "m"), device="cpu")
    assert estimate_config(cfg, []).devices[0].weights_bytes == loaded


# --- crafted headers -----------------------------------------------------------------------------


def _s(x: bytes) -> bytes:
    return struct.pack("<Q", len(x)) + x


def gguf_bomb(path: Path, mib: int) -> Path:
    """Keys holding 4096 arrays of 4096 bytes each (the review's r6): 48 MiB took 21 s and
    470 MiB when every array of up to 4096 elements was decoded."""
    inner = struct.pack("<IQ", 0, 4096) + b"\0" * 4096
    n_keys = (mib * 1024 * 1024) // (len(inner) * 4096) or 1
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, n_keys + 1))
        f.write(_s(b"general.architecture") + struct.pack("<I", 8) + _s(b"llama"))
        for k in range(n_keys):
            f.write(_s(f"junk.{k}".encode()) + struct.pack("<I", 9) + struct.pack("<IQ", 9, 4096))
            f.write(inner * 4096)
    return path


def test_gguf_header_bomb_is_cheap(tmp_path: Path) -> None:
    path = gguf_bomb(tmp_path / "bomb.gguf", 48)
    t0 = time.perf_counter()
    facts = facts_of(str(path))
    assert time.perf_counter() - t0 < 2.0
    assert facts.n_layer == 0
    os.utime(path, ns=(1, 1))  # a new mtime: parsed again, now measured
    tracemalloc.start()
    try:
        facts_of(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024**2


@pytest.mark.parametrize(
    ("body", "n_kv", "named"),
    [
        # MAX_WALKED + 1 strings, MAX_KV + 1 keys: refused before they are walked.
        (_s(b"x") + struct.pack("<IIQ", 9, 8, 4_000_001), 1, "strings and arrays"),
        (_s(b"x" * 2000) + struct.pack("<II", 4, 1), 1, "more than 1024"),
        ((_s(b"x") + struct.pack("<II", 4, 1)) * 2, 2, "duplicate metadata key"),
        (_s(b"x") + struct.pack("<IIQ", 9, 0, 2**40), 1, "past the end of the file"),
        (b"", 65_537, "implausible GGUF header counts"),
    ],
    ids=["walk-budget", "long-key", "duplicate-key", "array-past-end", "kv-count"],
)
def test_gguf_header_caps(tmp_path: Path, body: bytes, n_kv: int, named: str) -> None:
    path = tmp_path / "capped.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + body)
    t0 = time.perf_counter()
    with pytest.raises(EstimateError) as err:
        estimate_config(llama(path), [])
    assert time.perf_counter() - t0 < 1.0
    assert err.value.field == "model" and named in err.value.msg


def big_safetensors(folder: Path, header_bytes: int) -> Path:
    """One safetensors file whose header of tiny tensors is `header_bytes` long."""
    entry = '"t%07d":{"dtype":"F16","shape":[1,1],"data_offsets":[%d,%d]}'
    parts, size, i = [], 2, 0
    while size < header_bytes - 80:
        e = entry % (i, 2 * i, 2 * i + 2)
        parts.append(e)
        size += len(e) + 1
        i += 1
    raw = ("{" + ",".join(parts) + "}").encode().ljust(header_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 2 * i)
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    return folder


def test_safetensors_header_over_the_cap_is_refused_unread(tmp_path: Path) -> None:
    size = 16 * 1024**2 + 1024  # just over the cap: real headers are far smaller
    assert size > st.MAX_HEADER
    model = big_safetensors(tmp_path / "big", size)
    cfg = HuggingFaceCausalConfig(alias="a", model_id=str(model))
    t0 = time.perf_counter()
    with pytest.raises(EstimateError) as err:
        estimate_config(cfg, [])
    assert time.perf_counter() - t0 < 0.5
    assert "implausible safetensors header" in err.value.msg


def test_safetensors_headers_are_parsed_once(tmp_path: Path, monkeypatch) -> None:
    from safetensors import safe_open

    model = big_safetensors(tmp_path / "m", 1024 * 1024)
    with safe_open(str(model / "model.safetensors"), framework="numpy") as f:
        n = len(list(f.keys()))  # the library reads the same header
    calls: list[Path] = []
    real = st.header_of
    monkeypatch.setattr(st, "header_of", lambda p: calls.append(p) or real(p))
    hf = HuggingFaceCausalConfig(alias="a", model_id=str(model))
    sg = SglangConfig(alias="s", model_path=str(model))
    for cfg, devs in ((hf, []), (hf, []), (hf, gpu()), (sg, gpu())):
        assert estimate_config(cfg, devs).devices[0].weights_bytes == n * (4 if not devs else 2)
    assert len(calls) == 1
    os.utime(model / "model.safetensors", ns=(1, 1))  # changed: read again
    estimate_config(hf, [])
    assert len(calls) == 2

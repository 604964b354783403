"""Estimates from model files, per backend, with no process started."""

from __future__ import annotations

from pathlib import Path

import pytest

from solar_host.backends.huggingface_config import (
    HuggingFaceCausalConfig,
    HuggingFaceEmbeddingConfig,
)
from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.backends.sglang_config import SglangConfig
from solar_host.estimates.dispatch import estimate_config
from solar_host.estimates.gguf import facts_of
from solar_host.estimates.model import Device, EstimateError
from tests.fixtures.gguf_sized import Shape, write_sized_gguf
from tests.fixtures.safetensors_files import HF_CONFIG, write_safetensors

GB = 1024**3
SHAPE = Shape(n_embd=128, n_layer=4, n_head=4, n_head_kv=2, n_ff=256, n_ctx_train=2048)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    return write_sized_gguf(tmp_path_factory.mktemp("g") / "m.gguf", SHAPE)


def gpus(*free_gb: float, total_gb: float = 80.0) -> list[Device]:
    return [Device(f"cuda:{i}", i, int(total_gb * GB), int(f * GB)) for i, f in enumerate(free_gb)]


def llama(path: Path, **kw) -> LlamaCppConfig:
    return LlamaCppConfig(alias="m", model=str(path), **kw)


def test_gguf_facts(gguf_path: Path) -> None:
    f = facts_of(str(gguf_path))
    assert (f.arch, f.n_layer, f.n_embd, f.n_ff, f.n_ctx_train) == ("llama", 4, 128, 256, 2048)
    head_dim = 128 // 4
    assert f.kv_per_layer == ((2 * head_dim, 2 * head_dim),) * 4
    # Every tensor is counted once; the header and vocabulary are the rest of the file.
    assert 0 < f.file_bytes - f.tensor_bytes < 64 * 1024
    assert f.embd_bytes == f.n_vocab * 128 * 2  # f16


@pytest.mark.parametrize(
    ("cache_type", "row_bytes"),
    [(None, 2 * 2 * 64), ("f32", 2 * 4 * 64), ("q8_0", 2 * 2 * 34), ("q4_0", 2 * 2 * 18)],
)
def test_kv_cache_by_cache_type(gguf_path: Path, cache_type, row_bytes) -> None:
    est = estimate_config(llama(gguf_path, ctx_size=1000, cache_type_k=cache_type,
                                cache_type_v=cache_type), [])  # fmt: skip
    # 1000 cells are padded to 1024; a K and a V row of 64 values in each of 4 layers.
    assert est.devices[0].kv_cache_bytes == 1024 * 4 * row_bytes


def test_ctx_zero_is_the_training_context(gguf_path: Path) -> None:
    a = estimate_config(llama(gguf_path, ctx_size=0), [])
    b = estimate_config(llama(gguf_path, ctx_size=2048), [])
    assert a.devices[0].kv_cache_bytes == b.devices[0].kv_cache_bytes


def test_cpu_only_holds_everything(gguf_path: Path) -> None:
    f = facts_of(str(gguf_path))
    est = estimate_config(llama(gguf_path, ctx_size=512), [])
    [cpu] = est.devices
    assert cpu.device == "cpu" and cpu.weights_bytes == f.tensor_bytes
    assert cpu.compute_bytes > 512 * 512 * 2  # the KQ mask at least
    assert est.total_bytes == cpu.total_bytes


def test_full_offload_on_two_gpus_with_tensor_split(gguf_path: Path) -> None:
    f = facts_of(str(gguf_path))
    est = estimate_config(llama(gguf_path, ctx_size=512, tensor_split="1,3"), gpus(10, 10))
    by = {d.device: d for d in est.devices}
    assert by["cpu"].weights_bytes == f.embd_bytes  # the input layer stays on the CPU
    # 4 blocks split 1:3 -> block 0 on GPU 0, blocks 1-3 and the output layer on GPU 1.
    assert by["cuda:0"].weights_bytes == f.block_bytes[0]
    assert by["cuda:1"].weights_bytes == sum(f.block_bytes[1:]) + f.output_bytes
    assert by["cuda:1"].kv_cache_bytes == 3 * by["cuda:0"].kv_cache_bytes
    assert by["cuda:0"].compute_bytes == by["cuda:1"].compute_bytes > 0
    assert by["cpu"].kv_cache_bytes == 0 and by["cpu"].compute_bytes == 0


def test_row_split_cuts_weights_and_keeps_kv_on_main_gpu(gguf_path: Path) -> None:
    f = facts_of(str(gguf_path))
    est = estimate_config(
        llama(gguf_path, ctx_size=512, split_mode="row", tensor_split="1,1", main_gpu=1),
        gpus(10, 10),
    )
    by = {d.device: d for d in est.devices}
    offloaded = sum(f.block_bytes) + f.output_bytes
    assert by["cuda:0"].weights_bytes + by["cuda:1"].weights_bytes == pytest.approx(
        offloaded, abs=2
    )
    assert by["cuda:0"].weights_bytes == pytest.approx(offloaded / 2, abs=2)
    assert by["cuda:0"].kv_cache_bytes == 0 and by["cuda:1"].kv_cache_bytes > 0
    assert by["cuda:0"].compute_bytes == 0 and by["cuda:1"].compute_bytes > 0


def test_default_split_follows_free_memory(gguf_path: Path) -> None:
    est = estimate_config(llama(gguf_path, ctx_size=512), gpus(10, 30))
    by = {d.device: d for d in est.devices}
    assert by["cuda:1"].kv_cache_bytes == 3 * by["cuda:0"].kv_cache_bytes


def test_partial_offload_keeps_first_blocks_on_cpu(gguf_path: Path) -> None:
    f = facts_of(str(gguf_path))
    est = estimate_config(llama(gguf_path, ctx_size=512, n_gpu_layers=2), gpus(10))
    by = {d.device: d for d in est.devices}
    assert by["cpu"].weights_bytes == f.embd_bytes + sum(f.block_bytes[:2]) + f.output_bytes
    assert by["cuda:0"].weights_bytes == sum(f.block_bytes[2:])
    assert by["cpu"].kv_cache_bytes == by["cuda:0"].kv_cache_bytes


def test_split_mode_none_uses_main_gpu(gguf_path: Path) -> None:
    est = estimate_config(
        llama(gguf_path, ctx_size=512, split_mode="none", main_gpu=1), gpus(10, 10)
    )
    by = {d.device: d for d in est.devices}
    assert by["cuda:0"].total_bytes == 0 and by["cuda:1"].weights_bytes > 0
    with pytest.raises(EstimateError) as err:
        estimate_config(llama(gguf_path, split_mode="none", main_gpu=3), gpus(10, 10))
    assert err.value.field == "main_gpu"


def test_mmproj_and_draft_model_are_extra_files(gguf_path: Path, tmp_path: Path) -> None:
    draft = write_sized_gguf(tmp_path / "draft.gguf", Shape(n_embd=64, n_layer=2, n_head=2,
                                                            n_head_kv=1, n_ff=128))  # fmt: skip
    df = facts_of(str(draft))
    est = estimate_config(
        llama(gguf_path, ctx_size=256, mmproj=str(draft), spec_type="draft-dspark",
              spec_draft_model=str(draft)),
        gpus(10),
    )  # fmt: skip
    by = {d.device: d for d in est.devices}
    draft_kv = 256 * 2 * (32 * 2 + 32 * 2)  # 2 layers, 1 kv head of 32, f16 K and V
    assert by["cuda:0"].extra_files_bytes == 2 * df.tensor_bytes + draft_kv
    est = estimate_config(llama(gguf_path, ctx_size=256, mmproj=str(draft),
                                mmproj_offload=False), gpus(10))  # fmt: skip
    by = {d.device: d for d in est.devices}
    assert by["cpu"].extra_files_bytes == df.tensor_bytes


def test_unreadable_gguf_names_the_field(gguf_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF")
    with pytest.raises(EstimateError) as err:
        estimate_config(llama(bad), [])
    assert err.value.field == "model"
    with pytest.raises(EstimateError) as err:
        estimate_config(llama(gguf_path, mmproj=str(bad)), [])
    assert err.value.field == "mmproj"


# --- safetensors ---------------------------------------------------------------------------------


def test_huggingface_weights_at_dtype(tmp_path: Path) -> None:
    model = write_safetensors(
        tmp_path / "hf", {"w": ("F32", [64, 64]), "q": ("I8", [100])}, **HF_CONFIG
    )
    base = {"alias": "a", "model_id": str(model), "max_length": 128, "max_batch_size": 2}
    auto = estimate_config(HuggingFaceCausalConfig(**base), [])
    half = estimate_config(HuggingFaceCausalConfig(**base, dtype="float16"), [])
    assert auto.devices[0].weights_bytes == 64 * 64 * 4 + 100
    assert half.devices[0].weights_bytes == 64 * 64 * 2 + 100  # integer tensors as stored
    # KV allowance: 2 x layers x kv_heads x head_dim x max_length x bytes, one sequence.
    assert half.devices[0].kv_cache_bytes == 2 * 2 * 2 * 16 * 128 * 2
    assert auto.devices[0].device == "cpu"
    on_gpu = estimate_config(HuggingFaceEmbeddingConfig(alias="e", model_id=str(model),
                                                        device="cuda"), gpus(10))  # fmt: skip
    assert on_gpu.devices[0].device == "cuda:0"
    assert on_gpu.devices[0].compute_bytes > 256 * 1024**2  # runtime + encoder activations


def test_huggingface_needs_local_files(tmp_path: Path) -> None:
    with pytest.raises(EstimateError) as err:
        estimate_config(HuggingFaceCausalConfig(alias="a", model_id="org/not-here"), [])
    assert err.value.field == "model_id"
    with pytest.raises(EstimateError) as err:
        estimate_config(HuggingFaceCausalConfig(alias="a", model_id=str(tmp_path)), [])
    assert err.value.field == "model_id"


def test_sglang_takes_its_static_fraction(tmp_path: Path) -> None:
    model = write_safetensors(tmp_path / "sg", {"w": ("BF16", [1024, 1024])}, **HF_CONFIG)
    cfg = SglangConfig(alias="s", model_path=str(model), tp_size=2, mem_fraction_static=0.5)
    est = estimate_config(cfg, gpus(80, 80, 80))
    assert [d.device for d in est.devices] == ["cuda:0", "cuda:1"]
    for d in est.devices:
        assert d.total_bytes == int(80 * GB * 0.5)
        assert d.weights_bytes == 1024 * 1024  # half of 2 MiB per GPU
    assert est.refusal is None
    with pytest.raises(EstimateError) as err:
        estimate_config(cfg, gpus(80))
    assert err.value.field == "tp_size"
    tiny = [Device("cuda:0", 0, 1024 * 1024, 1024 * 1024)]
    est = estimate_config(SglangConfig(alias="s", model_path=str(model)), tiny)
    assert est.refusal and "mem_fraction_static" in est.refusal


def test_header_reader_agrees_with_gguf_reader(gguf_path: Path) -> None:
    import gguf

    from solar_host.estimates.gguf import estimate_reads
    from solar_host.estimates.gguf_header import read_header

    meta, tensors = read_header(str(gguf_path), estimate_reads)
    reader = gguf.GGUFReader(str(gguf_path), "r")
    assert {t.name: t.n_bytes for t in tensors} == {t.name: int(t.n_bytes) for t in reader.tensors}
    assert set(meta) == {k for k in reader.fields if not k.startswith("GGUF.")}
    assert meta["llama.block_count"] == 4 and meta["general.architecture"] == "llama"


def test_large_vocabulary_is_read_fast(tmp_path: Path) -> None:
    import time

    shape = Shape(n_embd=32, n_layer=1, n_head=2, n_head_kv=1, n_ff=64, n_vocab_extra=60_000)
    path = write_sized_gguf(tmp_path / "vocab.gguf", shape)
    from solar_host.estimates.gguf import read_facts

    read_facts(str(path))  # page the file in
    t0 = time.perf_counter()
    facts = read_facts(str(path))
    elapsed = time.perf_counter() - t0
    assert facts.n_vocab > 60_000
    assert elapsed < 2.0  # gguf.GGUFReader takes tens of seconds on such a vocabulary


def test_layers_without_attention_have_no_kv(tmp_path: Path) -> None:
    """A hybrid model's per-layer head_count_kv of 0 marks recurrent layers: no KV for them."""
    import gguf
    import numpy as np

    path = tmp_path / "hybrid.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_array("llama.attention.head_count_kv", [2, 0, 2, 0])
    w.add_context_length(256)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    facts = facts_of(str(path))
    assert facts.kv_per_layer == ((32, 32), (0, 0), (32, 32), (0, 0))
    est = estimate_config(llama(path, ctx_size=256), [])
    assert est.devices[0].kv_cache_bytes == 2 * 256 * (32 * 2 + 32 * 2)


def test_safetensors_header_matches_the_library(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from solar_host.estimates.safetensors import header_of, tensor_bytes

    arrays = {
        "a": np.zeros((3, 5), dtype=np.float32),
        "b": np.zeros((7,), dtype=np.float16),
        "c": np.zeros((2, 2, 2), dtype=np.int8),
    }
    save_file(arrays, str(tmp_path / "m.safetensors"))
    header = header_of(tmp_path / "m.safetensors")
    assert tensor_bytes(header, "auto") == sum(a.nbytes for a in arrays.values())
    assert tensor_bytes(header, "float16") == (15 + 7) * 2 + 8


def test_builtin_type_sizes_match_the_gguf_library() -> None:
    import gguf

    from solar_host.estimates.gguf_header import BUILTIN_QUANT_SIZES

    library = {int(t): v for t, v in gguf.GGML_QUANT_SIZES.items()}
    assert {k: library[k] for k in BUILTIN_QUANT_SIZES if k in library} == {
        k: v for k, v in BUILTIN_QUANT_SIZES.items() if k in library
    }
    assert set(BUILTIN_QUANT_SIZES) >= {0, 1, 2, 8, 12, 14, 30}


# --- hostile model files -------------------------------------------------------------------------


def raw_safetensors(folder: Path, header: bytes, config: str | None = None) -> Path:
    """A safetensors file whose header is `header` verbatim (no tensor data), and config.json."""
    import struct

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    if config is not None:
        (folder / "config.json").write_text(config)
    return folder


def tensor_header(shape: object) -> bytes:
    import json

    return json.dumps({"w": {"dtype": "F16", "shape": shape, "data_offsets": [0, 0]}}).encode()


GOOD_CONFIG = '{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}'


@pytest.mark.parametrize(
    ("header", "config", "named"),
    [
        (tensor_header([None, 4]), GOOD_CONFIG, "tensor 'w': shape"),
        (tensor_header(5), GOOD_CONFIG, "tensor 'w': shape"),
        (tensor_header([-(10**12), 1]), GOOD_CONFIG, "tensor 'w': shape"),
        (tensor_header([4.5, 2]), GOOD_CONFIG, "tensor 'w': shape"),
        (b"[" * 100_000 + b"]" * 100_000, GOOD_CONFIG, "nested too deeply"),
        (tensor_header([4, 4]), '{"text_config": "x"}', "text_config"),
        (tensor_header([4, 4]), '{"hidden_size": "abc"}', "hidden_size"),
        (tensor_header([4, 4]), '{"num_hidden_layers": 1e999}', "num_hidden_layers"),
        (tensor_header([4, 4]), '{"num_hidden_layers": -1000000}', "num_hidden_layers"),
        (tensor_header([4, 4]), '{"text_config": {"head_dim": true}}', "head_dim"),
    ],
)
def test_hostile_safetensors_and_config_name_the_field(
    tmp_path: Path, header: bytes, config: str, named: str
) -> None:
    model = raw_safetensors(tmp_path / "m", header, config)
    hf = HuggingFaceCausalConfig(alias="a", model_id=str(model), dtype="float16")
    with pytest.raises(EstimateError) as err:
        estimate_config(hf, gpus(24))
    assert err.value.field == "model_id" and named in err.value.msg
    if named.startswith(("tensor", "nested")):  # SGLang reads the same weights
        sg = SglangConfig(alias="s", model_path=str(model))
        with pytest.raises(EstimateError) as err:
            estimate_config(sg, gpus(24))
        assert err.value.field == "model_path"


def test_integral_float_sizes_in_config_are_sizes(tmp_path: Path) -> None:
    model = raw_safetensors(
        tmp_path / "m", tensor_header([4, 4]), '{"hidden_size": 64.0, "num_hidden_layers": 2}'
    )
    est = estimate_config(HuggingFaceCausalConfig(alias="a", model_id=str(model)), [])
    assert est.devices[0].kv_cache_bytes > 0


def gguf_file(path: Path, kv: list[tuple[str, int, bytes]], tensors=()) -> Path:
    """A minimal GGUF v3: kv = [(key, value type, packed value)], tensors = [(name, dims, type)]."""
    import struct

    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv) + 1)
    out += s("general.architecture") + struct.pack("<I", 8) + s("llama")
    for key, vtype, value in kv:
        out += s(key) + struct.pack("<I", vtype) + value
    for name, dims, ggml_type in tensors:
        out += s(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, 0)
    path.write_bytes(out)
    return path


def i32(v: int) -> tuple[int, bytes]:
    import struct

    return 5, struct.pack("<i", v)


def u32(v: int) -> tuple[int, bytes]:
    import struct

    return 4, struct.pack("<I", v)


def array(etype: int, *values: bytes) -> tuple[int, bytes]:
    import struct

    return 9, struct.pack("<IQ", etype, len(values)) + b"".join(values)


def sane(**over: tuple[int, bytes]) -> list[tuple[str, int, bytes]]:
    kv = {
        "llama.block_count": i32(2),
        "llama.embedding_length": i32(64),
        "llama.attention.head_count": i32(4),
        "llama.context_length": i32(4096),
        **{f"llama.{k}": v for k, v in over.items()},
    }
    return [(k, t, v) for k, (t, v) in kv.items()]


@pytest.mark.parametrize(
    ("kv", "named"),
    [
        (sane(context_length=i32(-(2**31))), "llama.context_length"),
        (sane(**{"attention.head_count": i32(-4)}), "llama.attention.head_count"),
        (sane(block_count=array(9, array(5, i32(2)[1])[1])), "llama.block_count"),
        (sane(**{"attention.head_count_kv": array(5, i32(2)[1], i32(-1)[1])}), "head_count_kv"),
        (sane(feed_forward_length=(6, b"\0\0\x80\x3f")), "llama.feed_forward_length"),  # 1.0f
        (sane(block_count=u32(20_000)), "block_count 20000 is implausible"),
        (sane(block_count=u32(10_001)), "more than 10000 layers"),
    ],
)
def test_hostile_gguf_metadata_names_the_key(tmp_path: Path, kv, named: str) -> None:
    path = gguf_file(tmp_path / "h.gguf", kv, [("blk.0.w", [64, 64], 1)])
    with pytest.raises(EstimateError) as err:
        estimate_config(llama(path, ctx_size=0), gpus(24))
    assert err.value.field == "model" and named in err.value.msg


def test_gguf_arrays_nested_without_end_are_refused(tmp_path: Path) -> None:
    import struct

    nest = b"".join(struct.pack("<IQ", 9, 1) for _ in range(5000)) + struct.pack("<IQ", 5, 0)
    path = gguf_file(tmp_path / "n.gguf", [*sane(), ("x", 9, nest)])
    with pytest.raises(EstimateError) as err:
        estimate_config(llama(path), [])
    assert err.value.field == "model" and "nested deeper" in err.value.msg
    shallow = b"".join(struct.pack("<IQ", 9, 1) for _ in range(3)) + struct.pack("<IQ", 5, 0)
    path = gguf_file(tmp_path / "ok.gguf", [*sane(), ("x", 9, shallow)])
    assert estimate_config(llama(path), []).total_bytes > 0


def test_device_estimates_are_never_negative() -> None:
    from solar_host.estimates.model import DeviceEstimate, Estimate

    d = DeviceEstimate("cuda:0", weights_bytes=-(10 * GB), kv_cache_bytes=5)
    d.compute_bytes -= 3
    d.extra_files_bytes = -1
    assert (d.weights_bytes, d.kv_cache_bytes, d.compute_bytes, d.extra_files_bytes) == (0, 5, 0, 0)
    assert Estimate("x", [d]).by_device() == {"cuda:0": 5}

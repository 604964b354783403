"""SGLang command line, environment, validation and advertisement, as pure functions."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from solar_host.backends.base import HostFacts, LaunchContext, LaunchError
from solar_host.backends.sglang import BACKEND, CACHE_DIR_ENV
from solar_host.backends.sglang_config import MANAGED_FLAGS, SglangConfig, managed_flag_of
from solar_host.instances.schemas import ConfigError, parse_config
from tests.fixtures.fake_sglang import make_fake_sglang_venv


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    return make_fake_sglang_venv(tmp_path)


def ctx(venv: Path | str, **kw) -> LaunchContext:
    base = dict(
        instance_id="inst-1",
        port=8080,
        host_api_key="test-key",
        models_dir=Path("/models"),
        sglang_venv_path=str(venv),
        gpu_type="nvidia_cuda",
        private_dir=Path("/run/solar-host/backend-keys"),
    )
    base.update(kw)
    return LaunchContext(**base)


KEY_FILE = "/run/solar-host/backend-keys/sglang-inst-1.yaml"


def cfg(**kw) -> SglangConfig:
    kw.setdefault("alias", "test")
    kw.setdefault("model_path", "/models/test")
    return SglangConfig(**kw)


def value_after(argv: list[str], flag: str) -> str:
    """The value of `flag`, given as `--flag value` or `--flag=value`."""
    joined = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    return joined[0] if joined else argv[argv.index(flag) + 1]


# --- Command line --------------------------------------------------------------------------------


def test_argv_managed_flags(venv: Path) -> None:
    spec = BACKEND.launch(cfg(), ctx(venv))
    argv = spec.argv
    assert argv[0] == str(venv / "bin" / "sglang")
    assert argv[1] == "serve"
    assert value_after(argv, "--model-path") == "/models/test"
    assert value_after(argv, "--served-model-name") == "test"
    assert value_after(argv, "--host") == "0.0.0.0"
    assert value_after(argv, "--port") == "8080"
    # SGLang reads its key from no environment variable: it gets it from a private YAML file
    # (`--config`), never on argv.
    assert "test-key" not in " ".join(argv) and "--api-key" not in argv
    assert value_after(argv, "--config") == KEY_FILE
    assert spec.private_files == {KEY_FILE: 'api-key: "test-key"\n'}
    assert argv.count("--enable-metrics") == 1
    assert argv[-1] == "--enable-metrics"
    assert spec.warnings == []


def test_colon_alias_is_served_with_dashes(venv: Path) -> None:
    config = cfg(alias="deepseek-v4-flash:284b")
    argv = BACKEND.launch(config, ctx(venv)).argv
    assert value_after(argv, "--served-model-name") == "deepseek-v4-flash-284b"
    assert BACKEND.served_model_name(config) == "deepseek-v4-flash-284b"
    assert config.alias == "deepseek-v4-flash:284b"  # the routing key is unchanged
    assert BACKEND.served_model_name(cfg(alias="a:b:c")) == "a-b-c"


def test_venv_with_only_python_uses_launch_server_module(tmp_path: Path) -> None:
    venv = make_fake_sglang_venv(tmp_path, style="python")
    argv = BACKEND.launch(cfg(), ctx(venv)).argv
    assert argv[:3] == [str(venv / "bin" / "python"), "-m", "sglang.launch_server"]


def test_missing_venv_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="SGLANG_VENV_PATH"):
        BACKEND.launch(cfg(), ctx(tmp_path / "nope"))
    empty = tmp_path / "empty-venv"
    (empty / "bin").mkdir(parents=True)
    with pytest.raises(LaunchError, match="SGLANG_VENV_PATH"):
        BACKEND.launch(cfg(), ctx(empty))


def test_cpu_host_is_refused_with_a_clear_message(venv: Path) -> None:
    with pytest.raises(LaunchError) as err:
        BACKEND.launch(cfg(), ctx(venv, gpu_type="cpu"))
    assert str(err.value) == (
        "SGLang backend requires an NVIDIA CUDA host (this host reports gpu_type='cpu')"
    )
    with pytest.raises(LaunchError, match="NVIDIA"):
        BACKEND.launch(cfg(), ctx(venv, gpu_type="apple_mps"))


def test_without_venv_setting_sglang_on_path_is_used(
    venv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    spec = BACKEND.launch(cfg(), ctx(""))
    assert spec.argv[:2] == [str(venv / "bin" / "sglang"), "serve"]
    assert "VIRTUAL_ENV" not in spec.env and "PATH" not in spec.env
    assert spec.env_remove == ()
    monkeypatch.setenv("PATH", str(venv.parent / "no-bin-here"))
    with pytest.raises(LaunchError, match="SGLANG_VENV_PATH"):
        BACKEND.launch(cfg(), ctx(""))


def test_missing_model_path_is_a_launch_error(venv: Path) -> None:
    config = SglangConfig(alias="x", model_source="repo://x:1")
    with pytest.raises(LaunchError, match="model_path"):
        BACKEND.launch(config, ctx(venv))


def test_omitted_knobs_add_no_flags_and_booleans_are_bare(venv: Path) -> None:
    argv = BACKEND.launch(cfg(), ctx(venv)).argv
    assert argv[2:] == [
        "--config", KEY_FILE, "--model-path", "/models/test", "--served-model-name=test",
        "--host=0.0.0.0", "--port", "8080", "--enable-metrics",
    ]  # fmt: skip
    argv = BACKEND.launch(
        cfg(trust_remote_code=True, enable_hierarchical_cache=True), ctx(venv)
    ).argv
    i = argv.index("--trust-remote-code")
    assert argv[i + 1] == "--enable-hierarchical-cache"
    assert argv[i + 2] == "--enable-metrics"


FULL = dict(
    tp_size=8,
    dp_size=2,
    context_length=131072,
    mem_fraction_static=0.85,
    chunked_prefill_size=4096,
    max_running_requests=64,
    cuda_graph_max_bs=32,
    cuda_graph_max_bs_decode=16,
    swa_full_tokens_ratio=0.5,
    dtype="bfloat16",
    quantization="fp8",
    kv_cache_dtype="fp8_e4m3",
    moe_runner_backend="flashinfer_trtllm",
    speculative_algorithm="EAGLE",
    hicache_ratio=30,
    hicache_mem_layout="page_first",
    hicache_io_backend="kernel",
    trust_remote_code=True,
    enable_hierarchical_cache=True,
    hicache_storage_backend="file",
    hicache_storage_backend_extra_config={"max_size": "256G"},
    hicache_storage_prefetch_policy="wait_complete",
)


def test_full_config_maps_flag_for_flag(venv: Path, tmp_path: Path) -> None:
    spec = BACKEND.launch(cfg(**FULL), ctx(venv, sglang_prompt_cache_dir=str(tmp_path / "cache")))
    assert spec.argv[10:] == [
        "--tp-size=8", "--dp-size=2", "--context-length=131072",
        "--mem-fraction-static=0.85", "--chunked-prefill-size=4096",
        "--max-running-requests=64", "--cuda-graph-max-bs=32",
        "--cuda-graph-max-bs-decode=16", "--swa-full-tokens-ratio=0.5",
        "--dtype=bfloat16", "--quantization=fp8", "--kv-cache-dtype=fp8_e4m3",
        "--moe-runner-backend=flashinfer_trtllm", "--speculative-algorithm=EAGLE",
        "--hicache-ratio=30.0", "--hicache-mem-layout=page_first",
        "--hicache-io-backend=kernel", "--trust-remote-code", "--enable-hierarchical-cache",
        "--hicache-storage-backend=file",
        '--hicache-storage-backend-extra-config={"max_size":"256G"}',
        "--hicache-storage-prefetch-policy=wait_complete", "--enable-metrics",
    ]  # fmt: skip
    assert spec.warnings == []
    assert spec.env[CACHE_DIR_ENV] == str(tmp_path / "cache" / "test-inst-1")


def test_storage_flags_dropped_with_a_warning_without_cache_root(venv: Path) -> None:
    spec = BACKEND.launch(cfg(**FULL), ctx(venv))
    assert not any(a.startswith("--hicache-storage") for a in spec.argv)
    assert "--enable-hierarchical-cache" in spec.argv
    assert value_after(spec.argv, "--hicache-ratio") == "30.0"
    assert CACHE_DIR_ENV not in spec.env
    assert len(spec.warnings) == 1
    assert "--hicache-storage-backend" in spec.warnings[0]
    assert "SGLANG_PROMPT_CACHE_DIR" in spec.warnings[0]


def test_extra_args_come_last_and_may_repeat_knobs(venv: Path) -> None:
    argv = BACKEND.launch(cfg(tp_size=2, extra_args=["--tp-size", "4"]), ctx(venv)).argv
    assert "--tp-size=2" in argv  # the typed knob, then the caller's own, which argparse keeps
    assert argv[-2:] == ["--tp-size", "4"]
    assert argv.count("--enable-metrics") == 1
    argv = BACKEND.launch(cfg(extra_args=["--schedule-policy"]), ctx(venv)).argv
    assert argv[-2:] == ["--enable-metrics", "--schedule-policy"]


def test_caller_text_starting_with_a_dash_stays_a_value(venv: Path) -> None:
    """argparse reads a separate argument starting with '-' as an option: an alias '-x' or a
    dtype '-1' given as `--flag value` would end SGLang with 'expected one argument'."""
    import argparse

    argv = BACKEND.launch(cfg(alias="-dash", dtype="-odd"), ctx(venv)).argv
    p = argparse.ArgumentParser()
    for flag in ("--config", "--model-path", "--served-model-name", "--host", "--dtype"):
        p.add_argument(flag)
    p.add_argument("--port", type=int)
    p.add_argument("--enable-metrics", action="store_true")
    ns = p.parse_args(argv[2:])
    assert (ns.served_model_name, ns.dtype) == ("-dash", "-odd")


def test_a_host_key_starting_with_a_dash_is_refused_with_the_way_out(venv: Path) -> None:
    # SGLang's config merger hands the file's key to argparse as `--api-key <key>`.
    with pytest.raises(LaunchError, match=r"starts with '-'.*token_hex"):
        BACKEND.launch(cfg(), ctx(venv, host_api_key="-Zk3"))


def test_instance_api_key_is_not_applied_and_says_so(venv: Path) -> None:
    spec = BACKEND.launch(cfg(api_key="other"), ctx(venv))
    assert spec.private_files == {KEY_FILE: 'api-key: "test-key"\n'}
    assert "other" not in " ".join(spec.argv)
    assert any("single API key" in w for w in spec.warnings)


# --- extra_args guard -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "flag"),
    [
        ("--port", "--port"),
        ("--port=9999", "--port"),
        ("--api-key=leaked", "--api-key"),
        ("--enable-metrics", "--enable-metrics"),
        ("--host", "--host"),
        ("--model-path=/etc", "--model-path"),
        ("--model", "--model-path"),  # SGLang's alias of --model-path
        ("--model=/etc", "--model-path"),
        ("--served-model-name", "--served-model-name"),
        ("--por", "--port"),
        ("--po=1", "--port"),
        ("--api-k=x", "--api-key"),
        ("--api", "--api-key"),
        ("--ho", "--host"),
        ("--serv=x", "--served-model-name"),
        ("--enable-metr", "--enable-metrics"),
        ("--model-pa", "--model-path"),
        ("--api_key", "--api-key"),
        ("--config=/tmp/mine.yaml", "--config"),
        ("--conf", "--config"),
        ("--served_model_name=x", "--served-model-name"),
    ],
)
def test_managed_flags_are_refused_in_every_spelling(entry: str, flag: str) -> None:
    assert managed_flag_of(entry) == flag
    with pytest.raises(ValidationError) as err:
        cfg(extra_args=["--tp-size", "2", entry])
    msg = str(err.value)
    assert f"'{flag}' is managed by solar-host and must not be set through extra_args" in msg
    if entry.split("=")[0] != flag:
        assert f"(got '{entry.split('=')[0]}')" in msg


@pytest.mark.parametrize(
    "entry",
    [
        "--model-impl",
        "--model-loader-extra-config={}",
        "--enable-metrics-for-all-schedulers",
        "--admin-api-key",
        "--schedule-policy",
        "--hicache-ratio=2",
        "-p",
        "--",
        "8080",
        "fcfs",
    ],
)
def test_other_options_pass(entry: str) -> None:
    assert managed_flag_of(entry) is None
    assert cfg(extra_args=[entry]).extra_args == [entry]


def test_extra_args_entries_are_trimmed_and_blank_refused() -> None:
    assert cfg(extra_args=["  --schedule-policy ", "lpm"]).extra_args == [
        "--schedule-policy",
        "lpm",
    ]
    assert cfg(extra_args=[]).extra_args is None
    with pytest.raises(ValidationError, match="extra_args must not contain empty entries"):
        cfg(extra_args=["--x", "  "])


def test_refusal_is_a_config_error_naming_the_field() -> None:
    raw = {
        "backend_type": "sglang",
        "alias": "a",
        "model_path": "/models/a",
        "extra_args": ["--por=1"],
    }
    with pytest.raises(ConfigError) as err:
        parse_config(raw, models_dir=Path("/models"))
    (e,) = err.value.errors
    assert e["loc"] == ("extra_args",)
    assert "'--port' is managed by solar-host" in e["msg"]


# SGLang 0.5.23's long options that start like a managed flag (--h…, --p…, --a…, --s…, --m…,
# --e…), extracted from its server_args field definitions. `--model` is an alias of
# `--model-path` (one argparse action).
SGLANG_0_5_23_OPTIONS = [
    *"""
--abort-on-priority-when-disabled --admin-api-key --allow-auto-truncate
--allowed-media-domains --api-key --asr-max-buffer-seconds --asr-max-concurrent-sessions
--attention-backend --attention-context-parallel-size --attention-data-parallel-size
--attn-cp-size --attn-dp-size --elastic-ep-backend --elastic-ep-initial-size
--elastic-ep-join-mode --elastic-ep-join-rank-offset --elastic-ep-scale-timeout
--enable-adaptive-dispatch-to-encoder --enable-aiter-allreduce-fusion --enable-amd-monokernel
--enable-attn-tp-input-scattered --enable-broadcast-mm-inputs-process --enable-cache-report
--enable-cp-decode-attn-tp --enable-cudagraph-gc --enable-custom-logit-processor
--enable-decoder-swa-bounded-replay --enable-deepseek-v4-fp4-indexer
--enable-dense-mlp-attn-tp --enable-deterministic-inference --enable-dp-attention
--enable-dp-attention-local-control-broadcast --enable-dp-lm-head
--enable-draft-weights-cpu-backup --enable-dsa-cache-layer-split --enable-dsa-fused-indexer
--enable-dynamic-batch-tokenizer --enable-dynamic-chunking --enable-elastic-expert-backup
--enable-encoder-swa-bounded-replay --enable-eplb --enable-flashinfer-allreduce-fusion
--enable-flexkv --enable-forward-pass-metrics --enable-fp32-lm-head
--enable-fused-moe-sum-all-reduce --enable-fused-qk-norm-rope --enable-hicache
--enable-hierarchical-cache --enable-hisparse --enable-http-worker-reuseport --enable-http2
--enable-int8-mamba-checkpoint --enable-kv-cache-sharding --enable-layernorm-sp
--enable-layerwise-nvtx-marker --enable-lean-attention --enable-linear-replayssm
--enable-linear-replayssm-spec --enable-linker-mla-dedup --enable-lmcache --enable-lora
--enable-lora-overlap-loading --enable-mamba-cache-stochastic-rounding
--enable-megamoe-for-layernorm-sp --enable-memory-saver --enable-metrics
--enable-metrics-for-all-schedulers --enable-mfu-metrics --enable-mis --enable-mixed-chunk
--enable-mm-global-cache --enable-mscclpp --enable-multi-layer-eagle --enable-multimodal
--enable-nccl-nvls --enable-nvidia-megakernel --enable-p2p-check --enable-page-major-kv-layout
--enable-paged-experts --enable-pd-role-switch --enable-pdmux
--enable-precise-embedding-interpolation --enable-prefill-cp --enable-prefill-delayer
--enable-prefix-mm-cache --enable-priority-scheduling --enable-profile-cuda-graph
--enable-quant-communications --enable-request-time-stats-logging --enable-response-store
--enable-return-aux-hidden-states --enable-return-hidden-states --enable-return-indexer-topk
--enable-return-routed-experts --enable-scattered-sconv --enable-session-radix-cache
--enable-shared-experts-attn-tp --enable-single-batch-overlap --enable-ssl-refresh
--enable-streaming-session --enable-strict-thinking --enable-symm-mem --enable-tf32-matmul
--enable-tokenizer-batch-encode --enable-torch-compile --enable-torch-compile-debug-mode
--enable-torch-symm-mem --enable-tp-lm-head-all-to-all --enable-trace
--enable-two-batch-overlap --enable-unified-cache-external-linker --enable-unified-memory
--enable-w4a4-mxfp4-megamoe --enable-waterfill --enable-watermark --enable-weights-cpu-backup
--encoder-bootstrap-port --encoder-only --encoder-register-urls --encoder-transfer-backend
--encoder-urls --enforce-disable-flashinfer-allreduce-fusion --enforce-shared-experts-fusion
--engine-info-bootstrap-port --ep --ep-dispatch-algorithm --ep-num-redundant-experts --ep-size
--eplb-algorithm --eplb-min-rebalancing-utilization-threshold
--eplb-rebalance-layers-per-chunk --eplb-rebalance-num-iterations
--expert-balancedness-report-mode --expert-distribution-recorder-buffer-size
--expert-distribution-recorder-mode --expert-parallel-size --experts-shared-outer-loras
--export-metrics-to-file --export-metrics-to-file-dir --extra-metric-labels
--hf-chat-template-name --hicache-host-memory-fraction --hicache-host-memory-mode
--hicache-io-backend --hicache-mem-layout --hicache-ratio --hicache-size
--hicache-storage-backend --hicache-storage-backend-extra-config
--hicache-storage-prefetch-policy --hicache-storage-prefetch-retry-max-attempts
--hicache-storage-prefetch-retry-poll-interval --hicache-write-policy
--hierarchical-sparse-attention-extra-config --hisparse-config --host
--http2-initial-connection-window-size --http2-max-concurrent-streams --mamba-backend
--mamba-cache-philox-rounds --mamba-full-memory-ratio --mamba-max-states-per-path
--mamba-radix-cache-strategy --mamba-ssm-dtype --mamba-track-interval --max-ep-size
--max-loaded-loras --max-lora-chunk-size --max-lora-rank --max-loras-per-batch
--max-mamba-cache-size --max-prefill-tokens --max-queued-requests --max-running-requests
--max-total-tokens --media-url-max-file-size-mb --mem-fraction-static --min-free-slots-delay
--mlx-enable-sampling --mm-attention-backend --mm-enable-dp-encoder --mm-feature-transport
--mm-global-cache-backend --mm-io-worker-num --mm-preprocess-cache-size-mb --mm-process-config
--mm-processor-worker-num --model --model-checksum --model-config-parser --model-impl
--model-loader-extra-config --model-path --modelexpress-config
--modelopt-checkpoint-restore-path --modelopt-checkpoint-save-path --modelopt-export-path
--modelopt-quant --moe-a2a-backend --moe-data-parallel-size --moe-dense-tp-size --moe-dp-size
--moe-runner-backend --monokernel-backend --mooncake-ib-device --msprobe-dump-config
--page-size --paged-experts-num-resident --pdmux-config-path --pipeline-parallel-size
--ple-offload-backend --ple-offload-dir --ple-offload-embedding --port --pp-async-batch-depth
--pp-max-micro-batch-size --pp-size --pre-warm-nccl --preferred-sampling-params
--prefill-attention-backend --prefill-decode-interval --prefill-decode-interval-min-bs
--prefill-delayer-forward-passes-buckets --prefill-delayer-max-delay-ms
--prefill-delayer-max-delay-passes --prefill-delayer-queue-min-ratio
--prefill-delayer-token-usage-low-watermark --prefill-delayer-wait-seconds-buckets
--prefill-kv-cache-dequant-dtype --prefill-max-requests --prefill-only-disable-kv-cache
--priority-scheduling-preemption-threshold --prompt-tokens-buckets --sampling-backend
--sampling-defaults --sampling-mask-max-tokens --schedule-conservativeness
--schedule-low-priority-values-first --schedule-policy --scheduler-recv-interval
--served-model-name --shared-experts-tp-size --show-time-cost --sidecar --sidecar-args
--skip-server-warmup --skip-tokenizer-init --sleep-on-idle --sm-group-num --smg-grpc-mode
--smg-http-sidecar-port --soft-watchdog-timeout --spec-trace-dir
--speculative-accept-threshold-acc --speculative-accept-threshold-single
--speculative-adaptive --speculative-adaptive-config --speculative-algorithm
--speculative-attention-mode --speculative-dflash-block-size
--speculative-domino-candidate-pool-size --speculative-draft-attention-backend
--speculative-draft-kv-cache-dtype --speculative-draft-load-format --speculative-draft-model
--speculative-draft-model-path --speculative-draft-model-quantization
--speculative-draft-model-revision --speculative-draft-sink-size
--speculative-draft-window-size --speculative-dsa-topk-backend
--speculative-dspark-align-verify-tokens-to-graph-tier --speculative-dspark-block-size
--speculative-dspark-confidence-sts-path --speculative-dspark-sps-table-path
--speculative-eagle-topk --speculative-enable-w4a4-mxfp4-megamoe --speculative-moe-a2a-backend
--speculative-moe-runner-backend --speculative-ngram-capacity
--speculative-ngram-external-corpus-max-tokens --speculative-ngram-external-corpus-path
--speculative-ngram-external-sam-budget --speculative-ngram-match-type
--speculative-ngram-max-bfs-breadth --speculative-ngram-max-trie-depth
--speculative-ngram-min-bfs-breadth --speculative-num-draft-tokens --speculative-num-steps
--speculative-token-map --speculative-use-block-verification
--speculative-use-rejection-sampling --ssl-ca-certs --ssl-certfile --ssl-keyfile
--ssl-keyfile-password --startup-weight-load-mode --stream-interval
--stream-response-default-include-usage --strip-thinking-cache --swa-full-tokens-ratio
--swa-prefix-tails
""".split(),
    "--config",  # read by prepare_server_args (ConfigArgumentMerger), a managed flag
]


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # ambiguity and unknown values raise instead of exiting
        raise _Refused(message)


def _sglang_like_parser() -> _Parser:
    parser = _Parser(prog="sglang serve", allow_abbrev=True, add_help=False)
    store_true = {"--enable-metrics", "--enable-metrics-for-all-schedulers", "--enable-hicache"}
    for option in SGLANG_0_5_23_OPTIONS:
        if option == "--model":
            continue
        names = [option, "--model"] if option == "--model-path" else [option]
        dest = option[2:].replace("-", "_")
        if option in store_true:
            parser.add_argument(*names, dest=dest, action="store_true")
        else:
            parser.add_argument(*names, dest=dest)
    return parser


def _managed_dest_set(parser: _Parser, argv: list[str]) -> str | None:
    """The managed flag `argv` sets through `parser`, None if none; _Refused if refused."""
    ns, _ = parser.parse_known_args(argv)
    for flag in MANAGED_FLAGS:
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value not in (None, False):
            return flag
    return None


def test_guard_agrees_with_a_real_argparse_parser() -> None:
    """Every prefix of a managed option string, and every SGLang option in full, as
    `--x v`, `--x=v` and bare: whenever argparse would set a managed option, the guard names
    it; whenever the guard refuses, argparse either sets that option or refuses the argument
    itself (ambiguous). Only a prefix of a managed option string can expand to one, so these
    candidates cover every way to reach a managed option."""
    parser = _sglang_like_parser()
    managed_spellings = [*MANAGED_FLAGS, "--model"]
    candidates = {o[:n] for o in managed_spellings for n in range(3, len(o) + 1)}
    candidates |= set(SGLANG_0_5_23_OPTIONS)
    candidates |= {o[: len(o) // 2 + 2] for o in SGLANG_0_5_23_OPTIONS}
    assert "--model" in candidates and "--por" in candidates
    checked = refused_by_both = 0
    for cand in sorted(candidates):
        guard = managed_flag_of(cand)
        for argv in ([cand, "v"], [cand + "=v"], [cand]):
            try:
                sets = _managed_dest_set(parser, argv)
            except _Refused:
                sets = "refused"
            checked += 1
            if sets not in (None, "refused"):
                assert guard == sets, (argv, sets, guard)
            if guard is not None:
                assert sets in (guard, "refused"), (argv, sets, guard)
                refused_by_both += sets == "refused"
    # The exact non-managed options never trip the guard.
    for option in SGLANG_0_5_23_OPTIONS:
        if option not in MANAGED_FLAGS and option != "--model":
            assert managed_flag_of(option) is None, option
    assert checked > 1_500 and refused_by_both > 0


def test_hicache_extra_config_validation() -> None:
    assert (
        cfg(hicache_storage_backend_extra_config='{"b": 1, "a": "x"}').model_dump()[
            "hicache_storage_backend_extra_config"
        ]
        == '{"a":"x","b":1}'
    )
    with pytest.raises(ValidationError, match="is not valid JSON"):
        cfg(hicache_storage_backend_extra_config="{nope")
    with pytest.raises(ValidationError, match="must be a JSON object"):
        cfg(hicache_storage_backend_extra_config="[1, 2]")
    assert (
        cfg(hicache_storage_backend_extra_config="  ").hicache_storage_backend_extra_config is None
    )


def test_model_path_or_source_is_required() -> None:
    with pytest.raises(ValidationError, match="model_path"):
        SglangConfig(alias="x")
    assert SglangConfig(alias="x", model_source="local://m").model_path is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tp_size", 0),
        ("mem_fraction_static", 0),
        ("mem_fraction_static", 1.5),
        ("swa_full_tokens_ratio", -0.1),
        ("hicache_ratio", 0),
        ("max_running_requests", 0),
        ("context_length", "lots"),
    ],
)
def test_typed_knobs_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as err:
        cfg(**{field: value})
    assert err.value.errors()[0]["loc"] == (field,)


# --- Environment ---------------------------------------------------------------------------------


def test_venv_environment(venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    spec = BACKEND.launch(cfg(), ctx(venv))
    assert spec.env["VIRTUAL_ENV"] == str(venv)
    assert spec.env["PATH"] == f"{venv / 'bin'}:/usr/bin:/bin"
    assert spec.env["PYTHONUNBUFFERED"] == "1"
    assert spec.env_remove == ("PYTHONHOME",)


def test_per_instance_cache_dirs_are_exported_not_created(venv: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    config = cfg(alias="deepseek:flash")
    one = BACKEND.launch(config, ctx(venv, sglang_prompt_cache_dir=str(root)))
    two = BACKEND.launch(config, ctx(venv, sglang_prompt_cache_dir=str(root), instance_id="inst-2"))
    assert one.env[CACHE_DIR_ENV] == str(root / "deepseek-flash-inst-1")
    assert two.env[CACHE_DIR_ENV] == str(root / "deepseek-flash-inst-2")
    assert not root.exists()  # launch() is pure: the supervisor's before_start creates it
    assert CACHE_DIR_ENV not in BACKEND.launch(config, ctx(venv)).env
    # A confined instance may write its own cache, not the root with the others' prompts.
    assert one.write_dirs == [str(root / "deepseek-flash-inst-1")]
    assert BACKEND.launch(config, ctx(venv)).write_dirs == []


def test_extra_env_is_passed(venv: Path) -> None:
    spec = BACKEND.launch(
        cfg(extra_env={"SGLANG_LOG_LEVEL": "debug", " NCCL_DEBUG ": "1"}), ctx(venv)
    )
    assert spec.env["SGLANG_LOG_LEVEL"] == "debug"
    assert spec.env["NCCL_DEBUG"] == "1"


@pytest.mark.parametrize(
    "name",
    [
        "LD_PRELOAD",
        "ld_preload",
        "LD_AUDIT",
        "LD_DEBUG_OUTPUT",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONPYCACHEPREFIX",
        "PATH",
        "VIRTUAL_ENV",
        "GCONV_PATH",
        "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
        "PYTHONUNBUFFERED",
        # Each makes the process load or run code named by a path (a pulled file, say).
        "OPENSSL_CONF",
        "openssl_modules",
        "CUDA_INJECTION64_PATH",
        "NCCL_NET_PLUGIN",
        "NCCL_TUNER_PLUGIN",
        "OMP_TOOL_LIBRARIES",
        "VK_ADD_LAYER_PATH",
        "PYTHONWARNINGS",
        "HOME",
        "TRITON_PTXAS_PATH",
        "TRITON_CACHE_DIR",
        "TORCH_EXTENSIONS_DIR",
        "HF_MODULES_CACHE",
        "CC",
    ],
)
def test_extra_env_may_not_touch_loader_or_managed_variables(name: str) -> None:
    with pytest.raises(ValidationError) as err:
        cfg(extra_env={name: "x"})
    assert err.value.errors()[0]["loc"] == ("extra_env",)
    assert f"'{name}'" in str(err.value)


@pytest.mark.parametrize(
    "name", ["NCCL_DEBUG", "PYTHONHASHSEED", "SGLANG_LOG_LEVEL", "CUDA_LAUNCH_BLOCKING", "HF_HOME"]
)
def test_extra_env_keeps_what_only_tunes_the_backend(name: str) -> None:
    assert cfg(extra_env={name: "1"}).extra_env == {name: "1"}


@pytest.mark.parametrize("name", ["A=B", "1ABC", "A B", "", "  "])
def test_extra_env_names_must_be_variable_names(name: str) -> None:
    with pytest.raises(ValidationError, match="extra_env"):
        cfg(extra_env={name: "x"})


# --- Advertisement, readiness, endpoints, capabilities ------------------------------------------


def test_advertised_only_on_nvidia_with_an_executable(tmp_path: Path, venv: Path) -> None:
    assert BACKEND.is_available(HostFacts(gpu_type="nvidia_cuda", sglang_venv_path=str(venv)))
    py_only = make_fake_sglang_venv(tmp_path, style="python")
    assert BACKEND.is_available(HostFacts(gpu_type="nvidia_cuda", sglang_venv_path=str(py_only)))
    assert not BACKEND.is_available(HostFacts(gpu_type="apple_mps", sglang_venv_path=str(venv)))
    assert not BACKEND.is_available(HostFacts(gpu_type="cpu", sglang_venv_path=str(venv)))
    assert not BACKEND.is_available(
        HostFacts(gpu_type="nvidia_cuda", sglang_venv_path=str(tmp_path / "missing"))
    )


@pytest.mark.parametrize(
    ("line", "ready"),
    [
        ("[2026-08-15 11:40:12] The server is fired up and ready to roll!", True),
        ("the server is FIRED UP AND READY TO ROLL", True),
        # The uvicorn banner comes before warmup: not ready yet (reference §13 item 10).
        ("[2026-08-15 11:40:02] INFO:     Uvicorn running on http://0.0.0.0:30000 (Press", False),
        ("[2026-08-15 11:40:01 TP0] Load weight end. elapsed=3.2 s, type=Qwen3", False),
        ("[2026-08-15 11:40:01 TP0] Capture cuda graph begin. This can take up to", False),
        ("[2026-08-15 13:17:19 TP0] Prefill batch, #new-seq: 1, #new-token: 1024", False),
    ],
)
def test_ready_line(line: str, ready: bool) -> None:
    assert BACKEND.is_ready_line(line) is ready


def test_readiness_is_the_log_line_only_and_metrics_are_scraped() -> None:
    assert BACKEND.health_path is None
    assert BACKEND.metrics_path == "/metrics"
    assert BACKEND.backend_types == ("sglang",)
    assert BACKEND.config_model("sglang") is SglangConfig


def test_endpoints_and_model_paths() -> None:
    assert BACKEND.supported_endpoints(cfg()) == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
    ]
    assert BACKEND.model_paths(cfg()) == ["/models/test"]
    assert BACKEND.model_paths(SglangConfig(alias="x", model_source="repo://x:1")) == []


def _model_dir(tmp_path: Path, config: dict | None) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize(
    ("config", "caps"),
    [
        ({"model_type": "qwen2", "vision_config": {}}, ["completion", "multimodal"]),
        ({"model_type": "qwen3_vl"}, ["completion", "multimodal"]),
        ({"model_type": "qwen3_moe"}, None),
        (None, None),
    ],
)
def test_capabilities(tmp_path: Path, config: dict | None, caps: list[str] | None) -> None:
    d = _model_dir(tmp_path, config)
    assert BACKEND.capabilities(cfg(model_path=str(d)), tmp_path) == caps


def test_capabilities_from_local_source(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, {"model_type": "llava"})
    by_abs = SglangConfig(alias="v", model_source=f"local://{d}")
    assert BACKEND.capabilities(by_abs, tmp_path / "elsewhere") == ["completion", "multimodal"]
    by_rel = SglangConfig(alias="v", model_source="local://model")
    assert BACKEND.capabilities(by_rel, tmp_path) == ["completion", "multimodal"]

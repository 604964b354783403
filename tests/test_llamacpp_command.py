"""llama-server command line: exact order, speculative rules, multi-GPU flags, keys in env."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from solar_host.backends.base import HostFacts, LaunchContext, LaunchError
from solar_host.backends.llamacpp import BACKEND, is_ready_line
from solar_host.backends.llamacpp_config import LlamaCppConfig, coerce_bool_strings, normalize_csv
from solar_host.platform.cpus import physical_cores

HOST_KEY = "host-key-123"


def ctx(**kw) -> LaunchContext:
    base = dict(
        instance_id="inst-1",
        port=18080,
        host_api_key=HOST_KEY,
        models_dir=Path("/models"),
        llama_server_bin="/opt/llama/llama-server",
    )
    base.update(kw)
    return LaunchContext(**base)


def cfg(**kw) -> LlamaCppConfig:
    base = {"alias": "m:1", "model": "/models/m.gguf"}
    base.update(kw)
    return LlamaCppConfig(**base)


def argv(**kw) -> list[str]:
    return BACKEND.launch(cfg(**kw), ctx()).argv


def contiguous(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def test_default_command_exact_order_and_key_in_env():
    spec = BACKEND.launch(cfg(), ctx(gpu_type="nvidia_cuda"))
    assert spec.argv == [
        "/opt/llama/llama-server",
        "--model", "/models/m.gguf",
        "--alias", "m:1",
        "--threads", "1",
        "--n_gpu_layers", "999",
        "--temp", "1.0",
        "--top_p", "1.0",
        "--top_k", "0",
        "--min_p", "0.0",
        "--ctx-size", "131072",
        "--host", "0.0.0.0",
        "--port", "18080",
        "--no-warmup",
        "--jinja",
        "--metrics", "--slots",
    ]  # fmt: skip
    assert spec.env == {"LLAMA_API_KEY": HOST_KEY}
    assert "--api-key" not in spec.argv
    assert all(HOST_KEY not in a for a in spec.argv)
    assert "LLAMA_ARG_API_KEY_FILE" in spec.env_remove


def threads_of(argv: list[str]) -> int:
    return int(argv[argv.index("--threads") + 1])


def test_threads_unset_is_the_usable_cores_on_the_cpu_and_one_on_a_gpu():
    cores = physical_cores()
    gpu = ctx(gpu_type="nvidia_cuda")
    assert threads_of(BACKEND.launch(cfg(), gpu).argv) == 1  # fully offloaded: as before
    assert threads_of(BACKEND.launch(cfg(n_gpu_layers=0), gpu).argv) == cores
    assert threads_of(BACKEND.launch(cfg(devices="none"), gpu).argv) == cores
    assert threads_of(BACKEND.launch(cfg(), ctx(gpu_type="cpu")).argv) == cores  # no GPU
    assert threads_of(BACKEND.launch(cfg(), ctx(gpu_type="apple_mps")).argv) == 1
    # a number is honoured either way, and unset stays unset in the config (chosen per start)
    for c in (gpu, ctx(gpu_type="cpu")):
        assert threads_of(BACKEND.launch(cfg(threads=3), c).argv) == 3
    config = cfg()
    BACKEND.launch(config, ctx())
    assert config.threads is None


def test_the_default_follows_the_cpu_affinity_of_the_host():
    """A host confined to one CPU (taskset, a cgroup cpuset) starts llama-server with one
    thread; with the machine's CPUs it gets the machine's physical cores."""
    code = (
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "from solar_host.backends.base import LaunchContext\n"
        "from solar_host.backends.llamacpp import BACKEND\n"
        "from solar_host.backends.llamacpp_config import LlamaCppConfig\n"
        "os.sched_setaffinity(0, json.loads(sys.argv[1]))\n"
        "c = LlamaCppConfig(alias='m', model='/models/m.gguf')\n"
        "ctx = LaunchContext(instance_id='i', port=1, host_api_key='', models_dir=Path('/m'))\n"
        "argv = BACKEND.launch(c, ctx).argv\n"
        "print(argv[argv.index('--threads') + 1])\n"
    )
    everything = sorted(os.sched_getaffinity(0))

    def threads_with(cpus: list[int]) -> int:
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(cpus)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return int(out.stdout)

    assert threads_with(everything[:1]) == 1
    assert threads_with(everything) == physical_cores(everything)
    cores = psutil.cpu_count(logical=False)  # None where the platform cannot tell
    if len(everything) == (os.cpu_count() or 0) and cores is not None:
        assert threads_with(everything) == cores


def test_physical_cores_counts_hyperthreads_once(tmp_path: Path):
    """A sysfs tree as the kernel writes it: 4 CPUs, two threads per core."""
    for cpu, siblings in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_cpus_list").write_text(siblings + "\n")
    assert physical_cores([0, 1, 2, 3], tmp_path) == 2
    assert physical_cores([0, 2], tmp_path) == 1  # both threads of one core
    assert physical_cores([0, 1], tmp_path) == 2
    # an older kernel names the file thread_siblings_list; none at all: each CPU is a core
    (tmp_path / "cpu3" / "topology" / "core_cpus_list").rename(
        tmp_path / "cpu3" / "topology" / "thread_siblings_list"
    )
    assert physical_cores([1, 3], tmp_path) == 1
    assert physical_cores([7, 8], tmp_path) == 2
    assert physical_cores([], tmp_path) == 1


def test_instance_key_is_added_after_host_key_never_instead():
    spec = BACKEND.launch(cfg(api_key="inst-key"), ctx())
    assert spec.env["LLAMA_API_KEY"] == f"{HOST_KEY},inst-key"
    assert all("inst-key" not in a for a in spec.argv)
    same = BACKEND.launch(cfg(api_key=HOST_KEY), ctx())
    assert same.env["LLAMA_API_KEY"] == HOST_KEY


def test_no_key_at_all_removes_inherited_variable():
    spec = BACKEND.launch(cfg(), ctx(host_api_key=""))
    assert spec.env == {}
    assert "LLAMA_API_KEY" in spec.env_remove


def test_host_and_floats_rendered_with_str():
    a = argv(host="127.0.0.1", temp=0.7, top_p=0.95, min_p=0.05, top_k=40, threads=8)
    assert contiguous(a, ["--host", "127.0.0.1", "--port", "18080"])
    assert contiguous(a, ["--temp", "0.7", "--top_p", "0.95", "--top_k", "40", "--min_p", "0.05"])
    assert contiguous(a, ["--threads", "8"])


def test_full_option_order():
    a = argv(
        devices="CUDA0,CUDA1",
        split_mode="row",
        tensor_split="3,1",
        main_gpu=1,
        chat_template_file="/t/tpl.jinja",
        chat_template_kwargs={"enable_thinking": False},
        reasoning="off",
        reasoning_budget=0,
        spec_type="draft-mtp",
        spec_draft_n_max=2,
        cache_type_k="q8_0",
        cache_type_v="f16",
        rope_scaling="yarn",
        rope_scale=4.0,
        yarn_orig_ctx=32768,
        special=True,
        ot="exps=CPU",
        mmproj="/models/mmproj.gguf",
        mmproj_offload=False,
    )
    assert a[a.index("--no-warmup") :] == [
        "--no-warmup",
        "--device", "CUDA0,CUDA1",
        "--split-mode", "row",
        "--tensor-split", "3,1",
        "--main-gpu", "1",
        "--jinja",
        "--chat-template-file", "/t/tpl.jinja",
        "--chat-template-kwargs", '{"enable_thinking":false}',
        "--reasoning", "off",
        "--reasoning-budget", "0",
        "--spec-type", "draft-mtp", "--spec-draft-n-max", "2",
        "-ctk", "q8_0",
        "-ctv", "f16",
        "--rope-scaling", "yarn",
        "--rope-scale", "4.0",
        "--yarn-orig-ctx", "32768",
        "--special",
        "-ot", "exps=CPU",
        "--mmproj", "/models/mmproj.gguf",
        "--no-mmproj-offload",
        "--metrics", "--slots",
    ]  # fmt: skip


# --- speculative decoding ----------------------------------------------------------------------


def test_no_spec_flags_by_default():
    assert not any(a.startswith("--spec") for a in argv())


def test_draft_mtp_contiguous_and_needs_n_max():
    assert contiguous(
        argv(spec_type="draft-mtp", spec_draft_n_max=2),
        ["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"],
    )
    assert "--spec-type" not in argv(spec_type="draft-mtp")


def test_dspark_six_contiguous_tokens():
    a = argv(spec_type="draft-dspark", spec_draft_model="/m/draft.gguf", spec_draft_n_max=7)
    assert contiguous(
        a,
        [
            "--spec-type",
            "draft-dspark",
            "--spec-draft-model",
            "/m/draft.gguf",
            "--spec-draft-n-max",
            "7",
        ],
    )
    assert a[-2:] == ["--metrics", "--slots"]


def test_dspark_omits_unset_and_renders_conf_min():
    a = argv(spec_type="draft-dspark", spec_draft_model="/m/d.gguf")
    assert "--spec-draft-n-max" not in a and "--spec-draft-conf-min" not in a
    a = argv(spec_type="draft-dspark", spec_draft_model="/m/d.gguf", spec_draft_conf_min=0.5)
    assert contiguous(a, ["--spec-draft-conf-min", "0.5"])


def test_spec_validation_errors():
    with pytest.raises(ValidationError, match="requires 'spec_draft_model'"):
        cfg(spec_type="draft-dspark")
    with pytest.raises(ValidationError, match="only supported with spec_type"):
        cfg(spec_type="draft-mtp", spec_draft_model="/m/d.gguf")
    with pytest.raises(ValidationError, match="only supported with spec_type"):
        cfg(spec_draft_conf_min=0.5)


@pytest.mark.parametrize("model_type", ["embedding", "reranker", None])
def test_spec_flags_dropped_unless_llm(model_type):
    for extra in (
        {"spec_type": "draft-mtp", "spec_draft_n_max": 2},
        {"spec_type": "draft-dspark", "spec_draft_model": "/m/d.gguf"},
    ):
        a = argv(model_type=model_type, **extra)
        assert not any(x.startswith("--spec") for x in a)
        assert a[-2:] == ["--metrics", "--slots"]


# --- model types -------------------------------------------------------------------------------


def test_embedding_and_reranker_flags():
    a = argv(model_type="embedding", pooling="mean")
    assert a[-5:] == ["--embedding", "--pooling", "mean", "--metrics", "--slots"]
    a = argv(model_type="reranker", pooling="rank")
    assert a[-3:] == ["--rerank", "--metrics", "--slots"]
    assert "--pooling" not in a
    spec = BACKEND.launch(cfg(model_type="llm", pooling="mean"), ctx())
    assert "--pooling" not in spec.argv and spec.warnings


def test_endpoints_by_model_type():
    assert BACKEND.supported_endpoints(cfg()) == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
    ]
    assert BACKEND.supported_endpoints(cfg(model_type=None))[0] == "/v1/chat/completions"
    assert BACKEND.supported_endpoints(cfg(model_type="embedding")) == [
        "/v1/embeddings",
        "/v1/models",
    ]
    assert BACKEND.supported_endpoints(cfg(model_type="reranker")) == ["/v1/rerank", "/v1/models"]
    assert BACKEND.health_path == "/health" and BACKEND.metrics_path == "/metrics"


# --- chat_template_kwargs ----------------------------------------------------------------------


def test_chat_template_kwargs():
    assert "--chat-template-kwargs" not in argv(chat_template_kwargs="")
    assert "--chat-template-kwargs" not in argv(chat_template_kwargs="   ")
    a = argv(chat_template_kwargs='{"enable_thinking": "false"}')
    assert contiguous(a, ["--chat-template-kwargs", '{"enable_thinking":false}'])
    a = argv(chat_template_kwargs={"outer": {"enable_thinking": "TRUE"}, "list": ["false"]})
    assert contiguous(
        a, ["--chat-template-kwargs", '{"outer":{"enable_thinking":true},"list":[false]}']
    )
    a = argv(chat_template_kwargs={"a": True, "b": 2, "c": "é"})
    assert contiguous(a, ["--chat-template-kwargs", '{"a":true,"b":2,"c":"é"}'])
    with pytest.raises(ValidationError, match="not valid JSON"):
        cfg(chat_template_kwargs="{nope")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"a": "true", "b": ["false", "x"]}, {"a": True, "b": [False, "x"]}),
        (" TRUE ", True),
        ("False", False),
        ("trueish", "trueish"),
        ("", ""),
        (1, 1),
        (1.5, 1.5),
        (True, True),
        (None, None),
    ],
)
def test_bool_string_coercion(value, expected):
    out = coerce_bool_strings(value)
    assert out == expected and type(out) is type(expected)


# --- multi-GPU ---------------------------------------------------------------------------------


def test_multi_gpu_flags():
    a = argv()
    for flag in ("--device", "--split-mode", "--tensor-split", "--main-gpu"):
        assert flag not in a
    a = argv(devices="CUDA0,CUDA1", split_mode="row", tensor_split="3,1", main_gpu=1)
    assert contiguous(
        a,
        [
            "--device",
            "CUDA0,CUDA1",
            "--split-mode",
            "row",
            "--tensor-split",
            "3,1",
            "--main-gpu",
            "1",
        ],
    )
    assert contiguous(argv(main_gpu=0), ["--main-gpu", "0"])
    a = argv(model_type="embedding", devices="CUDA1", tensor_split="1")
    assert contiguous(a, ["--device", "CUDA1", "--tensor-split", "1"])
    a = argv(devices=" CUDA0 , CUDA1 ", tensor_split="3, 1")
    assert contiguous(a, ["--device", "CUDA0,CUDA1"])
    assert contiguous(a, ["--tensor-split", "3,1"])
    assert "--device" not in argv(devices=" , ")


@pytest.mark.parametrize("bad", ["3,half", "3,inf", "3,nan"])
def test_tensor_split_must_be_numbers(bad):
    with pytest.raises(ValidationError, match="comma-separated numbers"):
        cfg(tensor_split=bad)


def test_tensor_split_not_negative():
    with pytest.raises(ValidationError, match="must not be negative"):
        cfg(tensor_split="3,-1")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("CUDA0,,CUDA1", "CUDA0,CUDA1"), ("  ", None), (",", None), ("", None), (None, None), (1, 1)],
)
def test_csv_normalization(value, expected):
    assert normalize_csv(value) == expected


# --- the rest of the protocol ------------------------------------------------------------------


def test_model_is_required_to_launch():
    c = LlamaCppConfig(alias="x", model_source="repo://a:1")
    with pytest.raises(LaunchError, match="no model file"):
        BACKEND.launch(c, ctx())


def test_capabilities_paths_and_name(tmp_path):
    assert BACKEND.capabilities(cfg(), tmp_path) is None
    assert BACKEND.capabilities(cfg(mmproj="/m/p.gguf"), tmp_path) == ["completion", "multimodal"]
    assert BACKEND.served_model_name(cfg()) == "m:1"
    c = cfg(
        mmproj="/m/p.gguf",
        spec_type="draft-dspark",
        spec_draft_model="/m/d.gguf",
        chat_template_file="/m/t.jinja",
    )
    assert BACKEND.model_paths(c) == ["/models/m.gguf", "/m/p.gguf", "/m/d.gguf", "/m/t.jinja"]
    assert BACKEND.model_paths(cfg()) == ["/models/m.gguf"]
    assert BACKEND.config_model("llamacpp") is LlamaCppConfig
    assert BACKEND.backend_types == ("llamacpp",)


def test_is_available(tmp_path):
    assert BACKEND.is_available(HostFacts(gpu_type="cpu", llama_server_bin="sh"))
    assert not BACKEND.is_available(HostFacts(gpu_type="cpu", llama_server_bin="no-such-bin-xyz"))
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    assert not BACKEND.is_available(HostFacts(gpu_type="cpu", llama_server_bin=str(exe)))
    exe.chmod(0o755)
    assert BACKEND.is_available(HostFacts(gpu_type="cpu", llama_server_bin=str(exe)))
    assert not BACKEND.is_available(HostFacts(gpu_type="cpu", llama_server_bin=str(tmp_path)))


@pytest.mark.parametrize(
    "line",
    [
        "llama_server: listening on http://127.0.0.1:8080",
        "main: server is listening on http://127.0.0.1:8080 - starting the main loop",
        "llama server: listening on https://0.0.0.0:443",
        "0.00.015.922 I srv  llama_server: listening on http://127.0.0.1:18091",
        "srv  llama_server: listening on http://127.0.0.1:18094",
        "0.00.060.001 I srv          init: listening on http://127.0.0.1:18097",
        "MAIN: Server Is Listening On HTTP://x",
    ],
)
def test_ready_line_accepts(line):
    assert is_ready_line(line) and BACKEND.is_ready_line(line)


@pytest.mark.parametrize(
    "line",
    [
        "load_model: loading model",
        "this process is listening carefully",
        "main: starting the main loop",
        "0.00.015.894 I srv  llama_server: model loaded",
        "",
    ],
)
def test_ready_line_rejects(line):
    assert not is_ready_line(line)

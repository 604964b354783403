"""The flight recorder's classifier (instances/causes.py): one table of ends, each with the
host's reason, the exit status and the backend's last log lines as the backends print them
(llama.cpp, torch, SGLang, uvicorn), and the cause it must get."""

from __future__ import annotations

import pytest

from solar_host.instances import causes as c
from solar_host.instances.flight import config_digest

CRASH = "Process exited unexpectedly (exit code: 1)"
EXITED_1 = "Process exited with code 1"
LLAMA_SYSTEM_INFO = (
    "system_info: n_threads = 4 (n_threads_batch = 4) / 8 | CPU : SSE3 = 1 | SSSE3 = 1 | "
    "AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 | LLAMAFILE = 1 | "
    "OPENMP = 1 | REPACK = 1 |"
)
LLAMA_BUILD = "build: 4567 (2af6880c) with cc (Ubuntu 13.2.0-23ubuntu4) 13.2.0 for x86_64-linux-gnu"
# A CPU with AVX2 but no AVX-512 (the flags /proc/cpuinfo lists).
CPU = {"fpu", "sse", "sse2", "pni", "ssse3", "avx", "avx2", "f16c", "fma"}

# (name, reason, exit code, log lines, cause)
TABLE = [
    (
        "sigill",
        CRASH.replace("1", "-4"),
        -4,
        [LLAMA_BUILD, LLAMA_SYSTEM_INFO],
        c.ILLEGAL_INSTRUCTION,
    ),
    ("exit 132 (shell)", "Process exited with code 132", 132, [], c.ILLEGAL_INSTRUCTION),
    ("sigkill not ours", "Process exited unexpectedly (exit code: -9)", -9, [], c.OOM_KILLED),
    ("exit 137 (shell)", "Process exited with code 137", 137, ["loading"], c.OOM_KILLED),
    (
        "llama.cpp cudaMalloc",
        EXITED_1,
        1,
        [
            "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 8583.59 MiB on device 0: "
            "cudaMalloc failed: out of memory",
            "alloc_tensor_range: failed to allocate CUDA0 buffer of size 9000574976",
            "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
            "main: error: unable to load model",
        ],
        c.GPU_OUT_OF_MEMORY,
    ),
    (
        "torch OOM",
        CRASH,
        1,
        [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has "
            "a total capacity of 79.19 GiB of which 6.75 MiB is free.",
        ],
        c.GPU_OUT_OF_MEMORY,
    ),
    (
        "sglang not enough memory",
        EXITED_1,
        1,
        ["RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."],
        c.GPU_OUT_OF_MEMORY,
    ),
    (
        "llama.cpp CUDA error",
        CRASH.replace("1", "-6"),
        -6,
        [
            "CUDA error: an illegal memory access was encountered",
            "  current device: 0, in function ggml_backend_cuda_synchronize at "
            "/app/ggml/src/ggml-cuda/ggml-cuda.cu:2415",
            "/app/ggml/src/ggml-cuda/ggml-cuda.cu:75: CUDA error",
        ],
        c.CUDA_ERROR,
    ),
    (
        "torch device-side assert",
        CRASH,
        1,
        ["RuntimeError: CUDA error: device-side assert triggered"],
        c.CUDA_ERROR,
    ),
    (
        "hf server: no cuda",
        EXITED_1,
        1,
        [
            "[FATAL] Model load failed: CUDA requested but not available (device 'cuda' on a "
            "host without CUDA)"
        ],
        c.CUDA_ERROR,
    ),
    (
        "preflight: missing",
        "model: /m/x.gguf does not exist",
        None,
        ["solar-host: the backend was not started: model: /m/x.gguf does not exist"],
        c.MODEL_MISSING,
    ),
    (
        "llama.cpp: no such file",
        EXITED_1,
        1,
        [
            "gguf_init_from_file: failed to open GGUF file '/m/x.gguf' (No such file or directory)",
            "llama_model_load: error loading model: llama_model_loader: failed to load model",
        ],
        c.MODEL_MISSING,
    ),
    (
        "preflight: not GGUF",
        "model: /m/x.gguf is not a GGUF file (no GGUF magic at its start); was it pulled whole?",
        None,
        [],
        c.MODEL_UNREADABLE,
    ),
    (
        "llama.cpp: bad magic",
        EXITED_1,
        1,
        [
            "gguf_init_from_file_impl: invalid magic characters: 'PK\\x03\\x04', expected 'GGUF'",
            "llama_model_load: error loading model: llama_model_loader: failed to load model",
        ],
        c.MODEL_UNREADABLE,
    ),
    (
        "safetensors header",
        CRASH,
        1,
        ["safetensors_rust.SafetensorError: Error while deserializing header: HeaderTooLarge"],
        c.MODEL_UNREADABLE,
    ),
    ("port: explicit taken", "Port 8080 is already in use by pid 12 (nc)", None, [], c.PORT_IN_USE),
    (
        "llama.cpp bind",
        EXITED_1,
        1,
        ["couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080"],
        c.PORT_IN_USE,
    ),
    (
        "uvicorn bind",
        EXITED_1,
        1,
        [
            "ERROR:    [Errno 98] error while attempting to bind on address "
            "('127.0.0.1', 30000): address already in use"
        ],
        c.PORT_IN_USE,
    ),
    ("load timeout", "Backend did not report readiness within 20s", None, [], c.LOAD_TIMEOUT),
    ("exited", "Process exited with code 3", 3, ["bye"], c.EXITED),
    ("exited 0", "Process exited unexpectedly (exit code: 0)", 0, [], c.EXITED),
    ("sigterm", "Process exited unexpectedly (exit code: -15)", -15, [], c.KILLED_BY_SIGNAL),
    ("segv via shell", "Process exited with code 139", 139, [], c.KILLED_BY_SIGNAL),
]


@pytest.mark.parametrize(
    ("reason", "code", "lines", "want"), [t[1:] for t in TABLE], ids=[t[0] for t in TABLE]
)
def test_classified(reason: str, code: int | None, lines: list[str], want: str) -> None:
    assert c.classify(reason=reason, exit_code=code, lines=lines, cpu_flags=CPU).kind == want


def test_every_cause_but_the_canary_is_in_the_table() -> None:
    covered = {t[-1] for t in TABLE} | {c.UNRESPONSIVE}  # liveness: a flag (below)
    assert set(c.CAUSES) - covered == {c.CANARY_MISMATCH}


def test_liveness_kill_is_unresponsive_not_oom() -> None:
    why = "Backend stopped answering /health for 6s (UNHEALTHY_AFTER_S=5); the host ended it"
    got = c.classify(reason=why, exit_code=-9, lines=[], host_killed=True)
    assert got.kind == c.UNRESPONSIVE and got.lead(why).startswith("unresponsive: Backend")


def test_sigill_names_the_missing_cpu_features() -> None:
    got = c.classify(
        reason="Process exited with code -4", exit_code=-4, lines=[LLAMA_SYSTEM_INFO], cpu_flags=CPU
    )
    assert got.detail == (
        "the build needs CPU features this machine lacks: it lacks AVX512, AVX512_VNNI"
    )
    plain = c.classify(reason="x", exit_code=132, lines=[])
    assert plain.detail == "the build needs CPU features this machine lacks"


def test_oom_kill_says_whose_sigkill() -> None:
    kernel = c.classify(reason="x", exit_code=-9, oom_kills=1)
    assert kernel.kind == c.OOM_KILLED and "OOM killer" in kernel.detail
    unknown = c.classify(reason="x", exit_code=-9, oom_kills=0)
    assert unknown.detail == "SIGKILL not sent by the host"


def test_a_log_error_before_an_exit_code_and_a_signal() -> None:
    lines = ["cudaMalloc failed: out of memory"]
    assert c.classify(reason=CRASH, exit_code=-9, lines=lines).kind == c.GPU_OUT_OF_MEMORY


def test_signal_helpers_and_version() -> None:
    assert c.exit_signal(-9) == 9 and c.exit_signal(137) == 9 and c.exit_signal(1) is None
    assert c.exit_signal(None) is None and c.signal_name(4) == "SIGILL"
    assert c.backend_version(["x", LLAMA_BUILD]) == "4567 (2af6880c)"
    assert c.backend_version(["version: 8123 (deadbeef)"]) == "8123 (deadbeef)"
    assert c.backend_version(["nothing here"]) is None


def test_config_digest_leaves_secrets_out() -> None:
    a = {"alias": "m", "model": "/m.gguf", "api_key": "one", "ctx_size": 4096}
    b = {"ctx_size": 4096, "model": "/m.gguf", "alias": "m", "api_key": "two"}
    assert config_digest(a) == config_digest(b)  # key order and the secret do not count
    assert config_digest(a) != config_digest({**a, "ctx_size": 8192})
    assert config_digest(a).startswith("sha256:") and "one" not in config_digest(a)


def test_model_missing_only_for_a_model_field() -> None:
    """Preflight's words for a missing model file; not any reason that says "does not exist"."""
    for reason in (
        "model: /m/x.gguf does not exist",
        "model_id: /m/tiny does not exist",
        "backend llamacpp cannot run here: x; mmproj: /m/p.gguf does not exist",
    ):
        assert c.classify(reason=reason, exit_code=None).kind == c.MODEL_MISSING, reason
    for reason in (
        "backend llamacpp cannot run here: LLAMA_SERVER_BIN /opt/llama-server does not exist",
        "Process exited with code 1; log directory /var/x does not exist",
    ):
        assert c.classify(reason=reason, exit_code=1).kind != c.MODEL_MISSING, reason

"""Why a backend ended or a start attempt failed, as one typed cause (the flight recorder's).

Pure: the host's own reason, the exit status, the backend's last log lines and what the
kernel said (cgroup OOM kills, the CPU's flags) are passed in; nothing is read here. The
rules are tried in order, the host's own verdicts first (it knows why it killed a backend or
refused a start), then what the backend's log says, then the exit status alone.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ILLEGAL_INSTRUCTION = "illegal_instruction"
OOM_KILLED = "oom_killed"
GPU_OUT_OF_MEMORY = "gpu_out_of_memory"
CUDA_ERROR = "cuda_error"
MODEL_MISSING = "model_missing"
MODEL_UNREADABLE = "model_unreadable"
PORT_IN_USE = "port_in_use"
LOAD_TIMEOUT = "load_timeout"
UNRESPONSIVE = "unresponsive"
CANARY_MISMATCH = "canary_mismatch"
EXITED = "exited"
KILLED_BY_SIGNAL = "killed_by_signal"
CAUSES = (
    ILLEGAL_INSTRUCTION,
    OOM_KILLED,
    GPU_OUT_OF_MEMORY,
    CUDA_ERROR,
    MODEL_MISSING,
    MODEL_UNREADABLE,
    PORT_IN_USE,
    LOAD_TIMEOUT,
    UNRESPONSIVE,
    CANARY_MISMATCH,
    EXITED,
    KILLED_BY_SIGNAL,
)

# A shell (or an exec wrapper) reports a child killed by signal N as exit code 128 + N.
SHELL_SIGNAL_BASE = 128


@dataclass(frozen=True)
class Cause:
    kind: str  # one of CAUSES
    detail: str  # for the operator: what shows it

    def lead(self, message: str) -> str:
        """`message` led by the cause, as error_message says it."""
        return f"{self.kind}: {message}"


# The host's own reasons (health.py, launch.py, preflight's messages in backends/files.py).
_REASON_RULES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    (LOAD_TIMEOUT, re.compile(r"did not report readiness within"), "no readiness in time"),
    (UNRESPONSIVE, re.compile(r"stopped answering .* the host ended it"), "liveness"),
    (PORT_IN_USE, re.compile(r"Port \d+ is (already in use|not the backend's)"), "port taken"),
    (
        MODEL_MISSING,
        # Preflight's "<field>: <path> does not exist" of a model field only (backends/files.py):
        # a missing executable or a log directory that does not exist is no missing model.
        re.compile(
            r"(?:^|; )(?:model\w*|mmproj|spec_draft_model|chat_template_file): [^;]* does not "
            r"exist|No file matching|with no \.gguf model file"
        ),
        "the model file is not there",
    ),
    (
        MODEL_UNREADABLE,
        re.compile(
            r"is not a GGUF file|is not readable|cannot read|is a directory, not a file|"
            r"safetensors|not a regular file"
        ),
        "the model file does not parse or cannot be read",
    ),
)

# canary_watch.py's reason for ending a backend.
_CANARY = re.compile(r"answer to the known-answer probe")

# The backends' own lines (llama.cpp, torch, SGLang, uvicorn), in order of precedence.
_LOG_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        GPU_OUT_OF_MEMORY,
        re.compile(
            r"cudaMalloc failed|CUDA out of memory|CUDA error: out of memory|"
            r"OutOfMemoryError|hipMalloc failed|failed to allocate .*buffer|"
            r"Not enough memory\. Please try to increase --mem-fraction-static|"
            r"out of memory",
            re.IGNORECASE,
        ),
    ),
    (
        CUDA_ERROR,
        re.compile(
            r"CUDA error|cudaError|CUDA_ERROR_|ggml_cuda_error|device-side assert|"
            r"illegal memory access|NCCL error|no CUDA-capable device|"
            r"CUDA requested but not available",
            re.IGNORECASE,
        ),
    ),
    (
        PORT_IN_USE,
        re.compile(
            r"address already in use|couldn't bind HTTP server socket|Errno 98", re.IGNORECASE
        ),
    ),
    (
        MODEL_MISSING,
        re.compile(
            r"failed to open GGUF file .*No such file|No such file or directory: .*model|"
            r"(model|file) .*not found|does not appear to have a file named|"
            r"is not a local folder and is not a valid model identifier|"
            r"Incorrect path_or_model_id",
            re.IGNORECASE,
        ),
    ),
    (
        MODEL_UNREADABLE,
        re.compile(
            r"failed to read magic|invalid magic|error loading model|failed to load model|"
            r"gguf_init_from_file.*failed|SafetensorError|Error while deserializing header|"
            r"HeaderTooLarge|invalid load key",
            re.IGNORECASE,
        ),
    ),
)

# llama.cpp's "system_info: ... | CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | ...":
# the features its build uses; the ones /proc/cpuinfo lacks are what SIGILL means.
_SYSTEM_INFO = re.compile(r"system_info:.*")
_FEATURE_ON = re.compile(r"\b([A-Z][A-Z0-9_]+)\s*=\s*1\b")
# The build's feature names as /proc/cpuinfo spells them (those not lower-cased alike).
_CPUINFO_NAME = {
    "SSE3": "pni",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
    "AVX_VNNI": "avx_vnni",
    "AMX_INT8": "amx_int8",
    "AMX_BF16": "amx_bf16",
    "FMA": "fma",
    "F16C": "f16c",
    "SSSE3": "ssse3",
}
# Not CPU instruction sets: build options llama.cpp lists beside them.
_NOT_CPU = {"LLAMAFILE", "OPENMP", "REPACK", "CUDA", "METAL", "BLAS", "KLEIDIAI", "NEON", "ARM_FMA"}
# Its version line: "build: 4567 (abcdef12) with cc ..." or "version: 4567 (abcdef12)".
_VERSION = re.compile(r"^(?:.*\s)?(?:build|version):\s+(\d+\s+\([0-9a-f]+\))")


def exit_signal(code: int | None) -> int | None:
    """The signal that ended a process, from its exit status: negative (Popen's), or
    128 + N (a shell or wrapper in front of it)."""
    if code is None:
        return None
    if code < 0:
        return -code
    if SHELL_SIGNAL_BASE < code <= SHELL_SIGNAL_BASE + 64:
        return code - SHELL_SIGNAL_BASE
    return None


def signal_name(sig: int | None) -> str | None:
    if sig is None:
        return None
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def missing_cpu_features(lines: Iterable[str], cpu_flags: set[str] | None) -> list[str]:
    """The CPU features llama.cpp's build says it uses that this CPU's flags lack."""
    if not cpu_flags:
        return []
    for line in lines:
        m = _SYSTEM_INFO.search(line)
        if m is None:
            continue
        wanted = [f for f in _FEATURE_ON.findall(m.group(0)) if f not in _NOT_CPU]
        return [f for f in wanted if _CPUINFO_NAME.get(f, f.lower()) not in cpu_flags]
    return []


def backend_version(lines: Iterable[str]) -> str | None:
    """llama.cpp's build (number and commit) from its log, where it printed one."""
    for line in lines:
        m = _VERSION.match(line.strip())
        if m:
            return m.group(1)
    return None


def _from_log(lines: Sequence[str]) -> Cause | None:
    """The first rule any line matches (newest line first): a failed CUDA allocation is
    followed by llama.cpp's "error loading model", and the allocation is the cause."""
    for kind, pattern in _LOG_RULES:
        for line in reversed(lines):
            if pattern.search(line):
                return Cause(kind, line.strip()[:300])
    return None


def classify(
    *,
    reason: str,
    exit_code: int | None,
    lines: Sequence[str] = (),
    host_killed: bool = False,
    oom_kills: int | None = None,
    cpu_flags: set[str] | None = None,
) -> Cause:
    """The cause of one end. `reason`: the host's own words (the attempt's failure, or the
    crash message); `exit_code`: the process's status (negative: a signal), None when none
    is known or no process ran; `lines`: the backend's last log lines, oldest first;
    `host_killed`: the host itself ended it (liveness); `oom_kills`: how many OOM kills the
    instance's cgroup counted while it ran (None: unreadable); `cpu_flags`: /proc/cpuinfo's."""
    if host_killed:
        # The host ended it: its known-answer probe failed (canary_watch.py), or liveness.
        return Cause(CANARY_MISMATCH if _CANARY.search(reason) else UNRESPONSIVE, reason)
    sig = exit_signal(exit_code)
    if sig == signal.SIGILL:
        missing = missing_cpu_features(lines, cpu_flags)
        lacks = ": it lacks " + ", ".join(missing) if missing else ""
        return Cause(ILLEGAL_INSTRUCTION, f"the build needs CPU features this machine lacks{lacks}")
    for kind, pattern, detail in _REASON_RULES:
        if pattern.search(reason):
            return Cause(kind, detail)
    found = _from_log(lines)
    if found is not None:
        return found
    if sig == signal.SIGKILL:
        if oom_kills:
            return Cause(OOM_KILLED, f"the kernel's OOM killer (cgroup oom_kill +{oom_kills})")
        return Cause(OOM_KILLED, "SIGKILL not sent by the host")
    if sig is not None:
        return Cause(KILLED_BY_SIGNAL, f"killed by {signal_name(sig)}")
    if exit_code is not None:
        return Cause(EXITED, f"exited with code {exit_code}")
    return Cause(EXITED, reason or "exited")

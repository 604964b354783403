"""What a backend process is handed besides its command line: an environment built for it and
its private files (an SGLang key file).

A backend must not inherit the host's environment: the host holds API_KEY, the control key,
HF_TOKEN and registry passwords, and a backend is third-party code that logs, crashes with
dumps and answers /props. So the environment is an allowlist of what runtimes need (paths,
locale, GPU and threading libraries, proxies, caches), plus the names the operator lists in
BACKEND_ENV_PASSTHROUGH, plus what the backend itself asks for (its key variable, extra_env).
Anything that looks like a credential is dropped unless the operator lists it by name.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from solar_host.backends.base import LaunchSpec

# Exact names passed through from the host's environment.
ALLOWED_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TERM",
        "LD_LIBRARY_PATH",
        # Our HF server and the test backends are Python modules found through it.
        "PYTHONPATH",
        "XDG_CACHE_HOME",
        # Proxies, both spellings (curl and Python read the lower case, others the upper).
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "all_proxy",
        # HuggingFace caches and offline switches (the HF server and SGLang load from them).
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "HF_ENDPOINT",
        "HF_DATASETS_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY",
        "TRANSFORMERS_OFFLINE",
        "TRANSFORMERS_CACHE",
        "TORCH_HOME",
    }
)
# Prefixes passed through: locale, GPU runtimes (CUDA, ROCm, Vulkan), collective and
# threading libraries, and the backends' own tuning variables.
ALLOWED_PREFIXES = (
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "HIP_",
    "ROCR_",
    "ROCM_",
    "HSA_",
    "VK_",
    "VULKAN_",
    "NCCL_",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "GGML_",
    "PYTORCH_",
    "TORCHINDUCTOR_",
    "TRITON_",
    "SGLANG_",
)
# Never passed on from the host unless the operator names the variable in
# BACKEND_ENV_PASSTHROUGH (a pattern there does not count: it must be the exact name).
SECRET_NAMES = frozenset({"API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})
SECRET_PREFIXES = ("SOLAR_CONTROL_", "HARBOR_")
SECRET_SUFFIXES = ("_KEY", "_KEYS", "_TOKEN", "_PASSWORD", "_PASSWD", "_SECRET", "_CREDENTIALS")


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return (
        upper in SECRET_NAMES
        or upper.startswith(SECRET_PREFIXES)
        or upper.endswith(SECRET_SUFFIXES)
        or "SECRET" in upper
        or "PASSWORD" in upper
    )


def parse_passthrough(text: str) -> tuple[str, ...]:
    """BACKEND_ENV_PASSTHROUGH: comma-separated names or shell patterns (`MY_*`)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _allowed(name: str, passthrough: Iterable[str]) -> bool:
    patterns = tuple(passthrough)
    if name in patterns:
        return True  # listed by name: the operator's explicit choice, secrets included
    if is_secret_name(name):
        return False
    if name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES):
        return True
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def backend_environment(
    spec: LaunchSpec,
    *,
    passthrough: Iterable[str] = (),
    host_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a backend: allowlisted host variables, then the backend's own."""
    source = os.environ if host_env is None else host_env
    patterns = tuple(passthrough)
    env = {k: v for k, v in source.items() if _allowed(k, patterns)}
    env["PYTHONUNBUFFERED"] = "1"
    for k in spec.env_remove:
        env.pop(k, None)
    env.update(spec.env)
    return env


def write_private_files(files: Mapping[str, str]) -> None:
    """Write the files a backend reads its secrets from, readable by the host user only.

    The directory is made 0700 and each file is created 0600 before anything is written to
    it (never a window where another user could open it), replacing an older one atomically.
    """
    for path_text, content in files.items():
        path = Path(path_text)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, stat.S_IRWXU)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, content.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

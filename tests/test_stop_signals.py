"""Ctrl-C and SIGTERM on the `solar-host` command itself (the venv's console script): exit 0,
no traceback, and one line saying what became of the backends and how to get the other outcome.

uvicorn re-raises the signal after a clean shutdown: the command died by SIGINT with a 30-line
KeyboardInterrupt traceback. A real llama-server instance runs in each test, so the line has a
backend to speak of.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf
from tests.fixtures.hostproc import HostProc

SOLAR_HOST = Path(sys.executable).with_name("solar-host")


class CommandHost(HostProc):
    """The host run by the `solar-host` console script, as an operator runs it."""

    def argv(self) -> list[str]:
        return [str(SOLAR_HOST), "--env-file", os.devnull]


@pytest.fixture(scope="module")
def llama_bin() -> str:
    return llama_server_binary()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f16.gguf")


def start_one_backend(host: HostProc, model: Path) -> int:
    """Create and start a llama.cpp instance: its backend's pid."""
    config = {"alias": "tiny:1b", "model": str(model), "ctx_size": 512, "host": "127.0.0.1"}
    with host.client() as c:
        r = c.post("/instances", json={"config": config})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        r = c.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        return int(r.json()["instance"]["pid"])


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def command_host(tmp: Path, llama_bin: str, model: Path, **env: str) -> CommandHost:
    assert SOLAR_HOST.exists(), f"no console script at {SOLAR_HOST}"
    settings = {"LLAMA_SERVER_BIN": llama_bin, "MODEL_ROOTS": str(model.parent), **env}
    return CommandHost(tmp, backend="real", env=settings)


def test_ctrl_c_stops_the_backends_exits_0_and_says_so(
    tmp_path: Path, llama_bin: str, tiny_gguf: Path
) -> None:
    with command_host(tmp_path / "host", llama_bin, tiny_gguf) as host:
        host.start()
        pid = start_one_backend(host, tiny_gguf)
        host.kill(signal.SIGINT)
        assert host.proc is not None and host.proc.returncode == 0, host.log()
        log = host.log()
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
        assert (
            "solar-host: stopped by SIGINT; its 1 backend(s) were stopped (to leave them "
            "serving across a restart: `solar-host handover`, or KEEP_BACKENDS_ON_SHUTDOWN=true)"
        ) in log, log
        assert not alive(pid)


def test_sigterm_with_backends_kept_leaves_them_serving_exits_0_and_says_so(
    tmp_path: Path, llama_bin: str, tiny_gguf: Path
) -> None:
    env = {"KEEP_BACKENDS_ON_SHUTDOWN": "true"}
    with command_host(tmp_path / "host", llama_bin, tiny_gguf, **env) as host:
        host.start()
        pid = start_one_backend(host, tiny_gguf)
        assert host.stop() == 0, host.log()
        log = host.log()
        assert "Traceback" not in log, log
        assert (
            "solar-host: stopped by SIGTERM; 1 backend(s) left serving, for the next host on "
            "this state directory to adopt"
        ) in log, log
        assert alive(pid)  # the context's reap() ends it

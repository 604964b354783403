"""The README's five-minute path, run as written on a fresh virtualenv with no llama-server on
PATH: install, doctor, start the host, start a GGUF file placed under MODELS_DIR (no Hub), pull
a GGUF from the Hub (a loopback stand-in), create it by name, start it, chat, stop.

The default variant installs this checkout into the new virtualenv without its dependencies and
lets that virtualenv see the dependencies already installed for the tests (a .pth file), so it
runs in CI in seconds; SOLAR_LONG_TESTS=1 also runs the README's install line itself, resolving
every dependency from the package index.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import site
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tests.fixtures.fakehub import FakeHub
from tests.fixtures.gguf import write_tiny_gguf
from tests.fixtures.host import free_port
from tests.fixtures.ports import backend_start_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARKER = "# five-minutes: "
INSTALL_LINE = "python3 -m venv .venv && .venv/bin/pip install -q '.[llamacpp]'"
TAG_VAR = "SOLAR_FIVE_MINUTES_TAG"

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
    pytest.mark.timeout(600),
]


def five_minute_blocks() -> list[tuple[str, str]]:
    out = []
    for lang, body in FENCE.findall(README.read_text(encoding="utf-8")):
        first = body.splitlines()[0] if body.strip() else ""
        if first.startswith(MARKER):
            assert lang == "bash", first
            out.append((first[len(MARKER) :].strip(), body))
    return out


def test_readme_has_the_five_minute_path() -> None:
    titles = [t for t, _ in five_minute_blocks()]
    assert titles == [
        "install",
        "start the host",
        "a GGUF file you have",
        "or pull one from the Hub",
        "chat",
        "stop",
    ]
    assert INSTALL_LINE in five_minute_blocks()[0][1]


def test_readme_installs_from_the_checkout_not_the_unrelated_pypi_package() -> None:
    """`solar-host` on PyPI is another author's program: no README command may install it, and
    the README says so where it shows the install."""
    text = README.read_text(encoding="utf-8")
    assert not re.search(r"pip install[^\n`]*'solar-host\[", text), "installs the PyPI package"
    assert "not published\non PyPI" in text or "not published on PyPI" in text


def test_readme_examples_name_the_url_solar_host_url_not_host() -> None:
    """HOST is the bind address the host reads: a URL in it (as `HOST=http://...` examples
    had operators export) stops the host. The examples use SOLAR_HOST_URL, which the command
    line reads too, and the wait for the host is bounded."""
    text = README.read_text(encoding="utf-8")
    assert not re.search(r"\$\{?HOST\b", text)
    assert not re.search(r"^\s*(export\s+)?HOST=http", text, re.M)
    start = dict(five_minute_blocks())["start the host"]
    assert "SOLAR_HOST_URL=" in start
    assert all(
        line.lstrip().startswith("timeout ") for line in start.splitlines() if "until " in line
    )


@pytest.fixture
def hub(tmp_path: Path):
    repo = tmp_path / "hub" / "Qwen" / "Qwen2.5-0.5B-Instruct-GGUF"
    repo.mkdir(parents=True)
    write_tiny_gguf(repo / "qwen2.5-0.5b-instruct-q4_k_m.gguf")
    (repo / "qwen2.5-0.5b-instruct-fp16.gguf").write_bytes(b"GGUF" + os.urandom(2000))
    (repo / "README.md").write_text("tiny stand-in\n")
    h = FakeHub(tmp_path / "hub").start()
    yield h
    h.stop()


def _reap(tag: str) -> None:
    """Stop whatever the script left running (found by the tag in its environment)."""
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(TAG_VAR) == tag:
                p.send_signal(signal.SIGKILL)
        except (psutil.Error, OSError):
            continue


# Blocks that start an instance: each must leave the port of a started backend in $BACKEND.
STARTS = ("a GGUF file you have", "or pull one from the Hub")


def _run_path(tmp_path: Path, hub: FakeHub, install: str) -> subprocess.CompletedProcess[str]:
    work = tmp_path / "work"
    work.mkdir()
    gguf = tmp_path / "downloads" / "tiny-chat.gguf"  # "a GGUF file you have", outside models/
    write_tiny_gguf(gguf)
    bin_dir = tmp_path / "bin"  # the machine's python3 and nothing else of ours
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys._base_executable)  # type: ignore[attr-defined]
    path = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    assert shutil.which("llama-server", path=path) is None
    blocks = five_minute_blocks()
    script = ["set -euo pipefail"]
    for i, (title, body) in enumerate(blocks):
        if title == "install":
            assert INSTALL_LINE in body
            body = body.replace(INSTALL_LINE, install)
        script += [
            f"echo '@@BLOCK {i} {title}'; date +%s.%N >&2",
            body.rstrip("\n"),
            *([f'echo "@@STARTED {i} port=$BACKEND"'] if title in STARTS else []),
            f"echo '@@DONE {i}'; date +%s.%N >&2",
        ]
    tag = uuid.uuid4().hex
    env = {
        "PATH": path,
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "PORT": str(free_port()),
        "START_PORT": str(backend_start_port(str(tmp_path))),
        "HF_ENDPOINT": hub.url,
        "GGUF": str(gguf),
        TAG_VAR: tag,
    }
    for var in ("PIP_FIND_LINKS", "PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_INDEX_URL"):
        if var in os.environ:  # how this machine reaches its package index
            env[var] = os.environ[var]
    try:
        return subprocess.run(
            ["bash", "-c", "\n".join(script) + "\n"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=540,
        )
    finally:
        _reap(tag)


def _check(result: subprocess.CompletedProcess[str], work: Path) -> None:
    host_log = work / "host.log"
    report = (
        f"\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
        f"\n--- host.log ---\n{host_log.read_text() if host_log.exists() else '(none)'}"
    )
    assert result.returncode == 0, report
    out = result.stdout
    blocks = five_minute_blocks()
    for i in range(len(blocks)):
        assert f"@@DONE {i}" in out, report
    # both routes to a model started a backend on a port of its own
    ports = {i: re.search(rf"^@@STARTED {i} port=(\d+)$", out, re.M) for i in range(len(blocks))}
    started = [m.group(1) for (i, m) in ports.items() if blocks[i][0] in STARTS and m]
    assert len(started) == len(STARTS) and len(set(started)) == len(STARTS), report
    # the installed package ran, not this checkout
    site_dirs = list((work / ".venv" / "lib").glob("python3*/site-packages/solar_host"))
    assert site_dirs, report
    # GET / said llama.cpp runs through xllamacpp; doctor printed its table
    assert '"available":true' in out and "xllamacpp" in out, report
    assert "Checks:" in out, report
    # the chat answered (jq prints "null" for an error's JSON, which has no choices), the stop
    # with "stopped". The answer's text may be empty: the tiny model has random weights and
    # the README's request samples, so its first token is now and then its end of text.
    chat_i = [t for t, _ in blocks].index("chat")
    chat = out.split(f"@@BLOCK {chat_i} chat", 1)[1].split(f"@@DONE {chat_i}", 1)[0].strip()
    assert chat != "null", report
    stop_i = [t for t, _ in blocks].index("stop")
    assert "stopped" in out.split(f"@@BLOCK {stop_i} stop", 1)[1], report


def test_five_minute_path_on_a_fresh_virtualenv(tmp_path: Path, hub: FakeHub) -> None:
    deps = site.getsitepackages()[0]  # what is installed for the tests, seen through a .pth
    install = (
        "python3 -m venv .venv && "
        f"echo '{deps}' > \"$(echo .venv/lib/python3*/site-packages)/_test_deps.pth\" && "
        f".venv/bin/pip install -q --no-deps '{ROOT}'"
    )
    _check(_run_path(tmp_path, hub, install), tmp_path / "work")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SOLAR_LONG_TESTS"), reason="SOLAR_LONG_TESTS=1 only")
def test_five_minute_path_with_the_full_install(tmp_path: Path, hub: FakeHub) -> None:
    install = f"python3 -m venv .venv && .venv/bin/pip install -q '{ROOT}[llamacpp]'"
    _check(_run_path(tmp_path, hub, install), tmp_path / "work")

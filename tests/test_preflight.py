"""Preflight: a start that cannot succeed fails at once, naming field and file; no spawn, no
retries. And a start with no free port is a 503 naming the range."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from solar_host.instances import preflight
from solar_host.instances.errors import PortsExhausted
from solar_host.instances.ports import PortAllocator
from tests.fixtures.gguf import write_tiny_gguf
from tests.fixtures.host import host_settings, running_host


def test_file_checks(tmp_path: Path) -> None:
    good = write_tiny_gguf(tmp_path / "good.gguf")
    assert preflight.gguf_file("model", good) is None
    assert "does not exist" in preflight.gguf_file("model", tmp_path / "nope.gguf")
    assert "is a directory" in preflight.gguf_file("mmproj", tmp_path)
    assert preflight.readable_file("chat_template_file", good) is None
    text = tmp_path / "model.safetensors"
    text.write_bytes(b'{"__metadata__"')
    msg = preflight.gguf_file("model", text)
    assert msg.startswith("model: ") and str(text) in msg and "not a GGUF file" in msg
    if os.getuid() != 0:  # root reads anything
        good.chmod(0)
        assert "not readable" in preflight.gguf_file("model", good)


def _cfg(model: Path, **extra: object) -> dict:
    return {
        "backend_type": "llamacpp",
        "alias": "pf",
        "model": str(model),
        "ctx_size": 256,
        "host": "127.0.0.1",
        **extra,
    }


async def _start_fails(h, cfg: dict) -> tuple[dict, float, str]:
    iid = (await h.client.post("/instances", json={"config": cfg})).json()["instance"]["id"]
    t0 = time.monotonic()
    r = await h.client.post(f"/instances/{iid}/start")
    took = time.monotonic() - t0
    assert r.status_code == 500, r.text
    return r.json(), took, iid


@pytest.mark.parametrize(
    "case",
    ["missing", "not_gguf", "not_gguf_mmproj", "missing_template"],
)
async def test_start_fails_at_once_naming_field_and_file(tmp_path: Path, case: str) -> None:
    good = write_tiny_gguf(tmp_path / "models" / "good.gguf")
    bad = tmp_path / "models" / "weights.bin"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    cfg, field, path = {
        "missing": (_cfg(tmp_path / "models" / "gone.gguf"), "model", "gone.gguf"),
        "not_gguf": (_cfg(bad), "model", "weights.bin"),
        "not_gguf_mmproj": (_cfg(good, mmproj=str(bad)), "mmproj", "weights.bin"),
        "missing_template": (
            _cfg(good, chat_template_file=str(tmp_path / "models" / "t.jinja")),
            "chat_template_file",
            "t.jinja",
        ),
    }[case]
    # Retries allowed: preflight failures must not use them.
    s = host_settings(tmp_path, max_retries=3, llama_server_bin="/bin/true")
    async with running_host(s) as h:
        body, took, iid = await _start_fails(h, cfg)
        assert f"{field}: " in body["detail"] and path in body["detail"], body
        assert took < 5
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "failed" and inst["retry_count"] == 1 and inst["pid"] is None
        assert body["exit_code"] is None
        # Nothing was spawned: the instance's log holds only the host's word of why (issue
        # 40: a start that failed before any process existed left its log empty).
        logged = [
            line
            for f in (tmp_path / "logs").glob(f"*{iid}*")
            for line in f.read_text().splitlines()
        ]
        assert logged and all(line.startswith("solar-host: ") for line in logged), logged
        assert any(path in line for line in logged), logged


async def test_backend_that_cannot_run_fails_before_spawn(tmp_path: Path) -> None:
    good = write_tiny_gguf(tmp_path / "models" / "good.gguf")
    s = host_settings(tmp_path, max_retries=3, llama_server_bin="/nowhere/llama-server")
    async with running_host(s) as h:
        root = (await h.client.get("/")).json()
        assert "llamacpp" not in root["supported_backends"]
        assert "LLAMA_SERVER_BIN=/nowhere/llama-server" in root["backends"]["llamacpp"]["reason"]
        r = await h.client.post("/instances", json={"config": _cfg(good)})
        assert r.status_code == 200  # accepted: it may be installed before the start
        assert "LLAMA_SERVER_BIN=/nowhere/llama-server" in r.json()["warnings"][0]
        body, _, iid = await _start_fails(h, _cfg(good))
        assert "LLAMA_SERVER_BIN=/nowhere/llama-server" in body["detail"]
        assert (await h.client.get(f"/instances/{iid}")).json()["retry_count"] == 1


def test_port_exhaustion_names_the_range() -> None:
    blocker = socket.socket()
    blocker.bind(("0.0.0.0", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    try:
        alloc = PortAllocator(port - 1, lambda: {port - 1}, end_port=port)
        with pytest.raises(PortsExhausted) as err:
            alloc.allocate("127.0.0.1")
        assert err.value.status == 503
        msg = str(err.value)
        assert f"{port - 1}-{port} (2 ports)" in msg
        assert "1 held by instances" in msg and "1 bound by other processes" in msg
        assert "START_PORT" in msg
    finally:
        blocker.close()


async def test_start_with_no_free_port_is_503(tmp_path: Path) -> None:
    good = write_tiny_gguf(tmp_path / "models" / "good.gguf")
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        blocker.bind(("0.0.0.0", 65535))
    except OSError:
        pytest.skip("port 65535 is taken on this machine")
    blocker.listen(1)
    try:
        async with running_host(host_settings(tmp_path, start_port=65535)) as h:
            iid = (await h.client.post("/instances", json={"config": _cfg(good)})).json()[
                "instance"
            ]["id"]
            r = await h.client.post(f"/instances/{iid}/start")
            assert r.status_code == 503, r.text
            assert "65535-65535" in r.json()["detail"]
    finally:
        blocker.close()

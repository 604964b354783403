"""`python -m solar_host <command>` as a subprocess against a whole host on a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.cli import PullProgressLine, read_pull_progress
from solar_host.client import HostClient
from solar_host.events import PullProgress
from tests.fixtures.fakehub import FakeHub
from tests.fixtures.host import API_KEY, free_port, host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config

REPO = Path(__file__).resolve().parents[1]
# What the CLI reads from the environment: a test sets what it needs, nothing leaks in.
CLEARED = ("API_KEY", "SOLAR_HOST_URL", "PORT", "CONFIG_FILE", "LOG_FORMAT")


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


async def cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "solar_host",
        *args,
        cwd=cwd,
        env=env or cli_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def model_cfg(tmp_path: Path, *fake_args: str) -> dict[str, Any]:
    return script_config(tmp_path, *fake_args)


async def test_commands_and_exit_codes(tmp_path: Path) -> None:
    reg = BackendRegistry([ScriptBackend()])
    async with running_host(host_settings(tmp_path), backends=reg) as h:
        r = await h.client.post(
            "/instances", json={"config": model_cfg(tmp_path, "--lines", "hello,world")}
        )
        iid = r.json()["instance"]["id"]
        conn = ("--url", h.url, "--api-key", API_KEY)
        dead = f"http://127.0.0.1:{free_port()}"
        (
            status_h,
            status_j,
            instances_j,
            start,
            bad_key,
            unreachable,
            unknown,
            unknown_j,
            no_id,
            bad_uri,
        ) = await asyncio.gather(
            cli("status", *conn, cwd=tmp_path),
            cli("status", "--json", *conn, cwd=tmp_path),
            cli("instances", "--json", *conn, cwd=tmp_path),
            cli("start", iid, *conn, cwd=tmp_path),
            cli("instances", "--url", h.url, "--api-key", "wrong-key", cwd=tmp_path),
            cli("status", "--url", dead, "--api-key", API_KEY, cwd=tmp_path),
            cli("start", "no-such-instance", *conn, cwd=tmp_path),
            cli("stop", "no-such-instance", "--json", *conn, cwd=tmp_path),
            cli("start", *conn, cwd=tmp_path),
            cli("pull", "s3://bucket/model", *conn, cwd=tmp_path),
        )
        assert status_h[0] == 0, status_h
        assert "healthy" in status_h[1] and "llamacpp" in status_h[1]
        assert status_j[0] == 0
        doc = json.loads(status_j[1])
        assert doc["status"] == "healthy" and doc["url"] == h.url
        assert sum(doc["instances"].values()) == 1
        assert instances_j[0] == 0 and [i["id"] for i in json.loads(instances_j[1])] == [iid]
        assert start[0] == 0, start
        assert f"{iid}: running" in start[1]
        assert bad_key[0] == 4 and "refused the API key" in bad_key[2]
        assert unreachable[0] == 3 and "cannot reach" in unreachable[2]
        assert unknown[0] == 1 and "Instance not found" in unknown[2]
        assert unknown_j[0] == 1
        assert json.loads(unknown_j[1]) == {"status_code": 404, "detail": "Instance not found"}
        assert no_id[0] == 2 and "ID" in no_id[2]
        assert bad_uri[0] == 2 and "huggingface://" in bad_uri[2]

        # the human table and the log lines, then stop
        rc, out, err = await cli("instances", *conn, cwd=tmp_path)
        assert rc == 0, err
        header, row = out.splitlines()[:2]
        assert header.split() == ["ID", "ALIAS", "BACKEND", "STATUS", "PORT", "PID"]
        assert row.split()[:4] == [iid, "fake:1b", "llamacpp", "running"]
        rc, out, err = await cli("logs", iid, "--tail", "50", *conn, cwd=tmp_path)
        assert rc == 0 and out.splitlines()[:2] == ["hello", "world"], (out, err)
        rc, out, err = await cli("stop", iid, "--json", *conn, cwd=tmp_path)
        assert rc == 0 and json.loads(out)["instance"]["status"] == "stopped"


async def test_settings_from_env_file_and_generated_key(tmp_path: Path) -> None:
    """No flags: the URL from .env, the key the host generated beside CONFIG_FILE."""
    settings = host_settings(tmp_path, api_key="")
    async with running_host(settings) as h:
        key_file = settings.config_file.parent / "api_key"
        assert key_file.read_text().strip() == h.host.api_key
        work = tmp_path / "work"
        work.mkdir()
        (work / ".env").write_text(
            f"SOLAR_HOST_URL={h.url}\nCONFIG_FILE={settings.config_file}\n", encoding="utf-8"
        )
        rc, out, err = await cli("models", "--json", cwd=work)
        assert rc == 0, err
        assert json.loads(out) == []
        rc, out, err = await cli("models", cwd=work)
        assert rc == 0 and out.strip() == "no models"
        # the environment wins over the file; --env-file names another file
        env = cli_env(API_KEY="not-the-key")
        rc, _, err = await cli("instances", cwd=work, env=env)
        assert rc == 4, err
        (work / "other.env").write_text("SOLAR_HOST_URL=http://127.0.0.1:1\nAPI_KEY=k\n")
        rc, _, err = await cli("instances", "--env-file", "other.env", cwd=work)
        assert rc == 3, err
        # nothing to find a key in: a config error
        rc, _, err = await cli("instances", "--url", h.url, cwd=tmp_path / "models")
        assert rc == 2 and "no API key" in err


async def test_logs_follow_streams_over_the_websocket(tmp_path: Path) -> None:
    reg = BackendRegistry([ScriptBackend()])
    async with running_host(host_settings(tmp_path), backends=reg) as h:
        r = await h.client.post(
            "/instances", json={"config": model_cfg(tmp_path, "--lines", "first-run")}
        )
        iid = r.json()["instance"]["id"]
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "solar_host",
            "logs",
            iid,
            "--follow",
            "--json",
            "--url",
            h.url,
            "--api-key",
            API_KEY,
            cwd=tmp_path,
            env=cli_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

        async def read_until(pattern: str) -> list[dict[str, Any]]:
            seen: list[dict[str, Any]] = []
            while not any(pattern in e.get("line", "") for e in seen):
                raw = await asyncio.wait_for(proc.stdout.readline(), 20)  # type: ignore[union-attr]
                assert raw, (await proc.stderr.read()).decode()  # type: ignore[union-attr]
                seen.append(json.loads(raw))
            return seen

        try:
            # the lines already there come from GET .../logs ...
            before = await read_until("listening on")
            assert "first-run" in before[0]["line"]
            # ... so the lines of a restart can only come over the WebSocket
            assert (await h.client.post(f"/instances/{iid}/restart")).status_code == 200
            after = await read_until("listening on")
            assert "first-run" in after[0]["line"]
            assert all({"seq", "timestamp", "line"} <= set(e) for e in before + after)
            seqs = [e["seq"] for e in before + after]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            # Ctrl-C is how a follow ends: quietly, with 0
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
            assert b"Traceback" not in await proc.stderr.read()  # type: ignore[union-attr]
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_pull_with_live_progress_on_a_terminal(tmp_path: Path) -> None:
    hub_root = tmp_path / "hub"
    (hub_root / "acme" / "big").mkdir(parents=True)
    (hub_root / "acme" / "big" / "weights.bin").write_bytes(os.urandom(1_000_000))
    hub = FakeHub(hub_root).start()
    hub.bytes_per_s = 400_000
    try:
        settings = host_settings(
            tmp_path, hf_endpoint=hub.url, pull_progress_interval_s=0.1, min_free_disk_gb=0
        )
        async with running_host(settings) as h:
            uri = "huggingface://acme/big"
            # stderr on a pseudo-terminal: the command draws its progress line there
            master, slave = pty.openpty()
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "solar_host",
                    "pull",
                    uri,
                    "--backend-type",
                    "huggingface",
                    "--url",
                    h.url,
                    "--api-key",
                    API_KEY,
                    cwd=tmp_path,
                    env=cli_env(),
                    stdout=asyncio.subprocess.PIPE,
                    stderr=slave,
                )
                os.close(slave)
                out = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
                drawn = _drain(master)
            finally:
                os.close(master)
            assert proc.returncode == 0, drawn
            assert out.startswith(f"{uri}: ") and "hf--acme--big" in out
            assert f"pulling {uri}" in drawn
            # the phase comes from the host's /metrics (bytes too, where the source reports them
            # during the download: the HF path counts a file when it is complete)
            assert "resolving" in drawn or "downloading" in drawn, drawn
            # pulled again: already present, and --json for scripts
            rc, out, err = await cli(
                "pull", uri, "--json", "--url", h.url, "--api-key", API_KEY, cwd=tmp_path
            )
            assert rc == 0, err
            assert json.loads(out)["cached"] is True
            rc, out, _ = await cli("models", "--url", h.url, "--api-key", API_KEY, cwd=tmp_path)
            assert rc == 0 and "hf--acme--big" in out and "976.6 KiB" in out
    finally:
        hub.stop()


def _drain(fd: int) -> str:
    chunks = []
    with contextlib.suppress(OSError):  # EIO once the child's side is closed
        while True:
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


async def test_progress_line_reads_the_hosts_metrics(tmp_path: Path) -> None:
    """The display's text from a host's real /metrics while a pull reports progress."""
    async with running_host(host_settings(tmp_path)) as h:
        uri = "repo://llama:v1/q4.gguf"
        h.host.bus.publish(
            PullProgress(
                payload={
                    "source_uri": uri,
                    "phase": "downloading",
                    "bytes_done": 3 * 1024**3,
                    "bytes_total": 4 * 1024**3,
                }
            )
        )
        with HostClient(h.url, API_KEY) as c:
            display = PullProgressLine(c, uri)
            await asyncio.to_thread(display.poll)
            assert display.metrics_ok
            text = display.text(0)
            assert f"pulling {uri}" in text and "3.0 GiB / 4.0 GiB (75%)" in text
            # another pull's progress is not shown
            assert read_pull_progress(
                await asyncio.to_thread(c.metrics_text), "repo://other:v1"
            ) == (None, None, None)
        with HostClient(h.url, "wrong") as c:
            display = PullProgressLine(c, uri)
            await asyncio.to_thread(
                display.poll
            )  # metrics refused: spinner and clock only, no error
            assert not display.metrics_ok and "pulling" in display.text(1)


async def test_serve_refuses_invalid_settings_in_one_line(tmp_path: Path) -> None:
    rc, _, err = await cli("--port", "70000", cwd=tmp_path)
    assert rc == 2
    assert err.strip().count("\n") == 0 and "PORT" in err
    rc, _, err = await cli(cwd=tmp_path, env=cli_env(LOG_FORMAT="xml"))
    assert rc == 2 and "LOG_FORMAT" in err


async def test_log_stream_errors_map_to_exit_code_classes(tmp_path: Path) -> None:
    from solar_host.client import AuthFailed, HostUnreachable, OperationFailed

    async def drain(c: HostClient, iid: str) -> None:
        async for _ in c.follow_logs(iid):
            pass

    async with running_host(host_settings(tmp_path)) as h:
        with HostClient(h.url, API_KEY) as c:
            with pytest.raises(OperationFailed, match="Instance not found"):
                await drain(c, "nope")
        with HostClient(h.url, "wrong") as c:
            with pytest.raises(AuthFailed):
                await drain(c, "nope")
    with HostClient(f"http://127.0.0.1:{free_port()}", API_KEY) as c:
        with pytest.raises(HostUnreachable):
            await drain(c, "nope")

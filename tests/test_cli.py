"""`python -m solar_host <command>` as a subprocess against a whole host on a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.cli_pull import PlainPullLines, read_pull_progress
from solar_host.client import HostClient
from solar_host.events import PullProgress
from tests.fixtures.fakehub import FakeHub
from tests.fixtures.host import API_KEY, free_port, host_settings, running_host
from tests.fixtures.registry import Registry, StallProxy
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
        # instances are looked up by alias, id or id prefix before the host is asked
        assert unknown[0] == 1 and "no instance matches 'no-such-instance'" in unknown[2]
        assert unknown_j[0] == 1
        assert json.loads(unknown_j[1])["error"] == "not_found"
        assert no_id[0] == 2 and "INSTANCE" in no_id[2]
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
            # (the old attempt may say something as it stops: the new one's lines follow it)
            assert any("first-run" in e["line"] for e in after), after
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


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory):
    r = Registry(tmp_path_factory.mktemp("reg")).start()
    yield r
    r.stop()


def _push(registry: Registry, tmp_path: Path, ref: str, size: int) -> None:
    art = tmp_path / "art" / ref.replace("/", "_").replace(":", "_")
    art.mkdir(parents=True)
    (art / "model.gguf").write_bytes(os.urandom(size))
    registry.push(ref, [Path("model.gguf")], art)


def _pty_with_size(cols: int = 160, rows: int = 40) -> tuple[int, int]:
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    return master, slave


async def test_pull_shows_a_progress_bar_on_a_terminal_and_lines_elsewhere(
    registry: Registry, tmp_path: Path
) -> None:
    """A slow link (a relay at 400 KB/s) to a real OCI registry: the size is known from the
    manifest, so the bar shows bytes of the size, the rate and an ETA; without a terminal, one
    line per 10%."""
    _push(registry, tmp_path, "proj/bar:v1", 1_200_000)
    _push(registry, tmp_path, "proj/lines:v1", 1_200_000)
    proxy = StallProxy(registry.host)
    proxy.bytes_per_s = 400_000
    try:
        settings = host_settings(
            tmp_path,
            harbor_url=f"http://{proxy.host}",
            harbor_username="u",
            harbor_password="p",
            pull_progress_interval_s=0.1,
            min_free_disk_gb=0,
        )
        async with running_host(settings) as h:
            conn = ("--url", h.url, "--api-key", API_KEY)
            # stdout on a pseudo-terminal: rich draws the bar there
            master, slave = _pty_with_size()
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "solar_host",
                    "pull",
                    "repo://bar:v1",
                    "--harbor-ref",
                    "proj/bar:v1",
                    *conn,
                    cwd=tmp_path,
                    env=cli_env(TERM="xterm-256color", COLUMNS="160"),
                    stdout=slave,
                    stderr=asyncio.subprocess.PIPE,
                )
                os.close(slave)
                drawn_parts: list[str] = []
                reader = asyncio.create_task(asyncio.to_thread(_drain, master, drawn_parts))
                err = (await asyncio.wait_for(proc.communicate(), 90))[1].decode()
                await asyncio.wait_for(reader, 10)
            finally:
                os.close(master)
            drawn = "".join(drawn_parts)
            assert proc.returncode == 0, (drawn, err)
            screen = _strip_ansi(drawn)
            assert "pulling repo://bar:v1" in screen
            assert "downloading" in screen
            # size (binary units, of the known total), rate, ETA, and the bar redrawn in place
            assert "/1.1 MiB" in screen, screen
            assert "KiB/s" in screen, screen
            assert re.search(r"ETA\s+\d+:\d\d:\d\d", screen), screen
            partial = re.findall(r"(\d+\.\d) ?/1\.1 MiB", screen)
            assert any(0 < float(x) < 1.1 for x in partial), screen
            assert "\r" in drawn or "\x1b[" in drawn
            assert "repo://bar:v1: " in screen and "(in " in screen

            # not a terminal: plain lines, one per 10%, each with size, rate and ETA
            rc, out, err = await cli(
                "pull", "repo://lines:v1", "--harbor-ref", "proj/lines:v1", *conn, cwd=tmp_path
            )
            assert rc == 0, err
            lines = out.splitlines()
            progress = [ln for ln in lines if re.match(r"repo://lines:v1: +\d+% ", ln)]
            pcts = [int(ln.split()[1].rstrip("%")) for ln in progress]
            assert pcts == sorted(set(pcts)) and pcts[-1] == 100, out
            assert len(pcts) >= 4, out  # several tenths at 400 KB/s, never two per tenth
            assert all(" / 1.1 MiB" in ln for ln in progress)
            assert any("KiB/s" in ln and "ETA " in ln for ln in progress), out
            assert "\x1b" not in out and "\r" not in out
            assert lines[-1].startswith("repo://lines:v1: ") and "(in " in lines[-1]

            # pulled again: already present, and --json for scripts
            rc, out, err = await cli(
                "pull",
                "repo://lines:v1",
                "--harbor-ref",
                "proj/lines:v1",
                "--json",
                *conn,
                cwd=tmp_path,
            )
            assert rc == 0, err
            assert json.loads(out)["cached"] is True
    finally:
        proxy.close()


async def test_pull_from_the_hub_without_a_size(tmp_path: Path) -> None:
    """A source that does not announce the size: bytes and phases only, then the models table."""
    hub_root = tmp_path / "hub"
    (hub_root / "acme" / "big").mkdir(parents=True)
    (hub_root / "acme" / "big" / "weights.bin").write_bytes(os.urandom(1_000_000))
    hub = FakeHub(hub_root).start()
    hub.bytes_per_s = 1_000_000
    try:
        settings = host_settings(
            tmp_path, hf_endpoint=hub.url, pull_progress_interval_s=0.1, min_free_disk_gb=0
        )
        async with running_host(settings) as h:
            uri = "huggingface://acme/big"
            conn = ("--url", h.url, "--api-key", API_KEY)
            rc, out, err = await cli(
                "pull", uri, "--backend-type", "huggingface", *conn, cwd=tmp_path
            )
            assert rc == 0, err
            lines = out.splitlines()
            assert lines[-1].startswith(f"{uri}: ") and "hf--acme--big" in lines[-1]
            assert any(
                ln.startswith(f"{uri}: resolving") or ln.startswith(f"{uri}: downloading")
                for ln in lines[:-1]
            ), out
            rc, out, _ = await cli("models", *conn, cwd=tmp_path)
            assert rc == 0 and "hf--acme--big" in out and "976.6 KiB" in out
    finally:
        hub.stop()


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _drain(fd: int, into: list[str]) -> None:
    """Read the terminal's output until the child's side is closed (EIO)."""
    chunks = []
    with contextlib.suppress(OSError):
        while True:
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
    into.append(b"".join(chunks).decode(errors="replace"))


async def test_plain_progress_lines_from_the_hosts_metrics(tmp_path: Path) -> None:
    """The non-terminal display fed from a host's real /metrics while a pull reports progress."""
    import io

    async with running_host(host_settings(tmp_path)) as h:
        uri = "repo://llama:v1/q4.gguf"
        out = io.StringIO()
        lines = PlainPullLines(uri, out)
        with HostClient(h.url, API_KEY) as c:
            for done in (1, 3, 3, 4):
                h.host.bus.publish(
                    PullProgress(
                        payload={
                            "source_uri": uri,
                            "phase": "downloading",
                            "bytes_done": done * 1024**3,
                            "bytes_total": 4 * 1024**3,
                        }
                    )
                )
                text = await asyncio.to_thread(c.metrics_text)
                lines.update(*read_pull_progress(text, uri))
            # another pull's progress is not read
            assert read_pull_progress(text, "repo://other:v1") == (None, None, None)
    shown = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in shown] == ["25%", "75%", "100%"]  # one line per new tenth
    assert shown[1].startswith(f"{uri}:  75%  3.0 GiB / 4.0 GiB")


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


async def test_state_stream_carries_lifecycle_status(tmp_path: Path) -> None:
    """WS /instances/{id}/state: after the runtime snapshot, an instance_status message at each
    lifecycle step of a start and a stop, with pid and port once spawned."""
    from websockets.asyncio.client import connect

    reg = BackendRegistry([ScriptBackend()])
    async with running_host(host_settings(tmp_path), backends=reg) as h:
        r = await h.client.post("/instances", json={"config": model_cfg(tmp_path)})
        iid = r.json()["instance"]["id"]
        url = h.url.replace("http", "ws") + f"/instances/{iid}/state"
        async with connect(url, additional_headers={"X-API-Key": API_KEY}) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), 20))
            assert first["type"] == "instance_state" and first["data"]["instance_id"] == iid
            assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
            assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200
            seen: list[dict[str, Any]] = []
            while not seen or seen[-1]["reason"] != "stopped":
                msg = json.loads(await asyncio.wait_for(ws.recv(), 20))
                if msg["type"] == "instance_status":
                    assert msg["timestamp"]
                    seen.append(msg["data"])
    reasons = [m["reason"] for m in seen]
    assert reasons == ["starting", "spawned", "ready", "stopping", "stopped"], reasons
    spawned = seen[1]
    assert spawned["status"] == "starting" and spawned["pid"] > 0 and spawned["port"] > 0
    assert seen[2]["status"] == "running" and seen[2]["pid"] == spawned["pid"]
    assert seen[-1]["status"] == "stopped" and seen[-1]["pid"] is None


@pytest.mark.parametrize(
    ("line", "percent"),
    [
        ("Loading checkpoint shards:  50%|#####     | 1/2 [00:01<00:01,  1.2s/it]", 50.0),
        # a tqdm bar redrawn with \r reaches the log as one line: its last state counts
        ("Loading weights:   0%|    | 0/103 [00:00<?]\rLoading weights: 100%|####| 103/103", 100.0),
        ("[2026-11-30 10:00:01] Loading safetensors checkpoint shards:  50% Completed | 1/2", 50.0),
        ("Loading model with 90% of GPU memory reserved", None),  # no bar: not progress
        ("load_tensors: offloaded 33/33 layers to GPU", None),
        ("slot update_slots: id 0 | task 1 | prompt processing progress, progress = 0.5", None),
    ],
)
def test_loading_progress_is_read_from_progress_bars_only(line: str, percent: float | None) -> None:
    from solar_host.cli_phases import load_percent

    assert load_percent(line) == percent

"""`python -m solar_host <command>` as a subprocess against a whole host on a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pty
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.cli.client import HostClient
from solar_host.cli.pull_display import PlainPullLines, read_pull_progress
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


async def test_pull_from_the_hub_shows_its_size(tmp_path: Path) -> None:
    """The Hub's file listing gives the snapshot's size (issue 42: pulls list files with their
    digests and sizes before fetching): the plain lines show percentages, then the models
    table. (Before, a Hub pull had no size: bytes and phases only.)"""
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
            # Which samples the 0.25 s polls catch varies; the size, once seen, ends at 100%.
            assert any(ln.startswith(f"{uri}: 100%  976.6 KiB / 976.6 KiB") for ln in lines), out
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


async def test_create_says_no_empty_warning_and_delete_stops_a_running_instance(
    tmp_path: Path,
) -> None:
    """`create` with no warnings prints none (it printed `warning: ()`); `delete` of a running
    instance stops it first, as its help says, and shows both steps."""
    reg = BackendRegistry([ScriptBackend()])
    async with running_host(host_settings(tmp_path), backends=reg) as h:
        conn = ("--url", h.url, "--api-key", API_KEY)
        spec = tmp_path / "spec.json"
        cfg = model_cfg(tmp_path)
        del cfg["fake_args"]  # the host warns of it as an unknown field: here, no warning at all
        spec.write_text(json.dumps(cfg))
        rc, out, err = await cli("create", "--file", str(spec), "--start", *conn, cwd=tmp_path)
        assert rc == 0 and err == "", (out, err)
        iid = out.split()[1]
        rc, out, err = await cli("delete", "fake:1b", *conn, cwd=tmp_path)
        assert rc == 0, (out, err)
        assert out.splitlines() == [f"{iid}: stopped", f"deleted {iid} (fake:1b)"], out
        assert (await h.client.get("/instances")).json() == []
        # --json: the delete's answer, with the stop's under "stopped"
        rc, out, err = await cli("create", "--file", str(spec), "--start", *conn, cwd=tmp_path)
        assert rc == 0 and err == "", err
        rc, out, err = await cli("delete", "fake:1b", "--json", *conn, cwd=tmp_path)
        assert rc == 0, err
        assert json.loads(out)["stopped"]["instance"]["status"] == "stopped"
        # a stopped one is deleted without a stop
        rc, out, err = await cli("create", "--file", str(spec), *conn, cwd=tmp_path)
        assert rc == 0 and err == "", err
        rc, out, err = await cli("delete", "fake:1b", *conn, cwd=tmp_path)
        assert rc == 0 and out.startswith("deleted ") and len(out.splitlines()) == 1, out


async def test_log_stream_errors_map_to_exit_code_classes(tmp_path: Path) -> None:
    from solar_host.cli.client import AuthFailed, HostUnreachable, OperationFailed

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
    from solar_host.cli.phases import load_percent

    assert load_percent(line) == percent


# --- what a fake host (a proxy, another service, a broken host) answers -----------------------

Route = tuple[int, str, bytes]  # status, content type, body


@contextlib.contextmanager
def fake_host(routes: dict[str, Route], bind: str = "127.0.0.1") -> Iterator[FakeHost]:
    """A loopback HTTP server answering "GET /path" with `routes` (404 otherwise), recording
    the X-API-Key of each request: a proxy's page, another service on the port, JSON of another
    shape. Yields it; `.url` is where it listens."""
    import http.server
    import socket
    import threading

    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            seen.append(self.headers.get("X-API-Key"))
            status, ctype, body = routes.get(
                f"{self.command} {self.path.split('?')[0]}",
                (404, "application/json", b'{"detail": "Not Found"}'),
            )
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):  # a client that stopped reading
                self.wfile.write(body)

        do_GET = do_POST = do_DELETE = _answer

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        daemon_threads = True

    server = Server((bind, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host = f"[{bind}]" if ":" in bind else bind
    try:
        yield FakeHost(f"http://{host}:{server.server_address[1]}", seen)
    finally:
        server.shutdown()
        server.server_close()


@dataclasses.dataclass
class FakeHost:
    url: str
    keys: list[str | None]


def jsn(value: Any, status: int = 200) -> Route:
    return status, "application/json", json.dumps(value).encode()


def one_line(err: str) -> bool:
    return "Traceback" not in err and err.count("\n") == 1


DEEP = ("[" * 100_000 + "]" * 100_000).encode()


async def test_answers_that_are_not_a_hosts_json_are_one_line_exit_3(tmp_path: Path) -> None:
    html = (200, "text/html", b"<html>proxy login</html>")
    routes = {
        "GET /health": html,
        "GET /instances": jsn({"instances": []}),
        "GET /models": jsn(None),
        "GET /jobs": (200, "application/json", DEEP),
        "GET /jobs/deep": (500, "application/json", DEEP),
        "GET /jobs/page": (502, "text/plain", b"x" * 2_000_000),
    }
    with fake_host(routes) as fake:
        conn = ("--url", fake.url, "--api-key", "k" * 20)
        status, instances, models, jobs, deep, page = await asyncio.gather(
            cli("status", *conn, cwd=tmp_path),
            cli("instances", *conn, cwd=tmp_path),
            cli("models", "--json", *conn, cwd=tmp_path),
            cli("jobs", *conn, cwd=tmp_path),
            cli("jobs", "show", "deep", *conn, cwd=tmp_path),
            cli("jobs", "show", "page", *conn, cwd=tmp_path),
        )
    assert status[0] == 3 and one_line(status[2]), status
    assert f"the host at {fake.url} answered 200 but not JSON: text/html" in status[2]
    for rc, out, err in (instances, models):
        assert rc == 3 and one_line(err) and out == "", err
        assert "where a list of objects was expected" in err
    assert jobs[0] == 3 and one_line(jobs[2]) and "not JSON" in jobs[2], jobs
    # error bodies too big or too deep for a terminal: one line, the detail clipped
    for rc, _, err in (deep, page):
        assert rc == 1 and one_line(err), err[:300]
        assert len(err) < 2200 and "more characters not shown" in err, err[-200:]


async def test_log_stream_message_that_is_not_json_exits_3(tmp_path: Path) -> None:
    """`logs -f` when the stream sends a proxy's banner instead of a JSON message."""
    from websockets.asyncio.server import serve

    async def stream(ws: Any) -> None:
        await ws.send(json.dumps({"seq": 1, "timestamp": 0, "line": "ok"}))
        await ws.send("<html>502</html>")
        await ws.wait_closed()  # the client gives up on the stream

    def rest(conn: Any, request: Any) -> Any:
        if request.headers.get("Upgrade") is not None:
            return None  # the WebSocket
        if request.path == "/instances":
            return conn.respond(200, json.dumps([{"id": "abc", "config": {"alias": "m"}}]))
        return conn.respond(200, "[]")

    async with serve(stream, "127.0.0.1", 0, process_request=rest) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        conn = ("--url", f"http://127.0.0.1:{port}", "--api-key", "k" * 20)
        rc, out, err = await cli("logs", "m", "-f", *conn, cwd=tmp_path)
    assert out == "ok\n"
    assert rc == 3 and one_line(err), err
    assert "sent a stream message that is not a JSON object" in err


def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`solar-host instances | head -1`: the reader goes away; no traceback, exit 141."""
    import subprocess

    many = [
        {"id": f"id-{i:06d}", "config": {"alias": f"m{i}"}, "status": "stopped"}
        for i in range(20_000)
    ]
    lines = [{"seq": i, "timestamp": 0, "line": f"line {i}"} for i in range(50_000)]
    routes = {"GET /instances": jsn(many), "GET /instances/id-000001/logs": jsn(lines)}
    with fake_host(routes) as fake:
        conn = ["--url", fake.url, "--api-key", "k" * 20]
        for args in (["instances"], ["instances", "--json"], ["logs", "m1"]):
            proc = subprocess.Popen(
                [sys.executable, "-m", "solar_host", *args, *conn],
                cwd=tmp_path,
                env=cli_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            assert proc.stdout is not None and proc.stderr is not None
            assert proc.stdout.readline()
            proc.stdout.close()  # as `head -1` does
            err = proc.stderr.read().decode()
            assert proc.wait(timeout=60) == 141, (args, err)
            assert err == "", (args, err)


async def cli_killed_after(
    *args: str, cwd: Path, env: dict[str, str], timeout: float = 30
) -> tuple[int, str, str]:
    """`cli` for a command that might serve (and so never end): killed after `timeout`."""
    import subprocess

    try:
        p = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "solar_host", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as err:  # it served: what the test is there to refuse
        return -1, str(err.stdout), str(err.stderr)
    return p.returncode, p.stdout, p.stderr


async def test_named_env_file_must_exist_and_be_utf8(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    latin1 = tmp_path / "latin1.env"
    latin1.write_bytes("API_KEY=abcdefghijklmnop1234\nHOST_NAME=b\xe4r\n".encode("latin-1"))
    missing = str(tmp_path / "hots.env")  # a typo in a unit file
    env = cli_env(PORT=str(free_port()), HOST="127.0.0.1")
    runs = await asyncio.gather(
        cli_killed_after("--env-file", missing, "serve", cwd=work, env=env),
        cli_killed_after("--env-file", missing, cwd=work, env=env),
        cli("instances", "--env-file", missing, cwd=work),
        cli("doctor", "--env-file", missing, "--json", cwd=work),
        cli("instances", "--env-file", str(tmp_path), cwd=work),
        cli("instances", "--env-file", str(latin1), cwd=work),
        cli_killed_after("--env-file", str(latin1), "serve", cwd=work, env=env),
    )
    for rc, out, err in runs:
        assert rc == 2 and one_line(err), (rc, out, err)
    for _, _, err in runs[:4]:
        assert f"env file {missing} does not exist" in err, err
    assert "is not a regular file" in runs[4][2]
    for _, _, err in runs[5:]:
        assert f"env file {latin1} is not UTF-8 text (line 2" in err, err
    # the host did not start on defaults in the working directory
    assert list(work.iterdir()) == []


async def test_env_file_values_are_kept_as_written(tmp_path: Path) -> None:
    """A secret holding `$` is sent as written (no ${VAR} expansion), and /dev/null is an
    empty env file."""
    with fake_host({"GET /instances": jsn([])}) as fake:
        (tmp_path / ".env").write_text(
            f"SOLAR_HOST_URL={fake.url}\nAPI_KEY=abc${{HOME}}def$PATH-1234\n"
        )
        rc, out, err = await cli("instances", cwd=tmp_path)
        assert rc == 0 and out.strip() == "no instances", err
        assert fake.keys == ["abc${HOME}def$PATH-1234"]
        rc, _, err = await cli("instances", "--env-file", os.devnull, cwd=tmp_path)
        assert rc == 2 and "no API key" in err  # the ./.env was not read


async def test_bad_client_input_is_a_usage_error(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    infinite = tmp_path / "inf.json"
    infinite.write_text(
        '{"backend_type": "llamacpp", "alias": "a", "model": "m", "rope_freq_scale": Infinity}'
    )
    create = ("create", "--backend-type", "llamacpp", "--alias", "a", "--model", "m")
    cases = [
        ("status", "--url", "http://127.0.0.1:80a"),
        ("status", "--url", "http://[::1"),
        ("status", "--url", "http://127.0.0.1:99999"),
        ("status", "--url", "http://:8001"),
        ("status", "--url", dead, "--timeout", "-1"),
        ("status", "--url", dead, "--timeout", "nan"),
        ("status", "--url", dead, "--timeout", "0"),
        (*create, "--url", dead, "--set", "temperature=NaN"),
        (*create, "--url", dead, "--set", "ctx_size=1e999"),
        ("create", "--file", str(infinite), "--url", dead),
    ]
    runs = await asyncio.gather(*(cli(*c, "--api-key", "k" * 20, cwd=tmp_path) for c in cases))
    for case, (rc, _, err) in zip(cases, runs, strict=True):
        assert rc == 2 and one_line(err), (case, err)
    assert "invalid host URL" in runs[0][2] and "timeout must be" in runs[4][2]
    assert "NaN is not a JSON number" in runs[7][2] and "1e999" in runs[8][2]
    assert "Infinity is not a JSON number" in runs[9][2]


async def test_api_key_no_client_can_send_is_refused(tmp_path: Path) -> None:
    with fake_host({"GET /instances": jsn([])}) as fake:
        keys = ["clé-secret-1234567890", "abcdefgh\nijklmnop", "abcdefgh\tijklmnop"]
        runs = await asyncio.gather(
            *(cli("instances", "--url", fake.url, "--api-key", k, cwd=tmp_path) for k in keys)
        )
        # dotenv turns \n in double quotes into a newline
        (tmp_path / ".env").write_text(f'SOLAR_HOST_URL={fake.url}\nAPI_KEY="abcdefgh\\nijklm"\n')
        runs.append(await cli("instances", cwd=tmp_path))
        assert fake.keys == []  # nothing was sent
    for rc, _, err in runs:
        assert rc == 2 and one_line(err) and "API key must be printable ASCII" in err, err
    # the host refuses such a key at start-up, naming API_KEY
    env = cli_env(API_KEY="clé-secret-1234567890", PORT=str(free_port()), HOST="127.0.0.1")
    rc, _, err = await cli_killed_after("--env-file", os.devnull, cwd=tmp_path, env=env)
    assert rc == 2 and one_line(err) and "API_KEY" in err and "printable ASCII" in err, err


ESC_ALIAS = "m\x1b]52;c;cm0gLXJmIH4K\x07"  # OSC 52: writes the terminal's clipboard


async def test_control_characters_from_the_host_are_shown_not_obeyed(tmp_path: Path) -> None:
    inst = {
        "id": "abc",
        "config": {"alias": ESC_ALIAS, "backend_type": "llamacpp"},
        "status": "running\x1b[2J\x1b[H",
    }
    job = {
        "job_id": "j1",
        "name": "train\x1b]0;pwned\x07",
        "status": "failed",
        "error_message": "oom\x1b[1A\x1b[2K all good",
        "steps": [],
    }
    routes = {
        "GET /instances": jsn([inst]),
        "GET /jobs/j1": jsn(job),
        "GET /models": jsn({"detail": "busy\x1b[2J\nsolar-host: all models present"}, 503),
    }
    with fake_host(routes) as fake:
        conn = ("--url", fake.url, "--api-key", "k" * 20)
        runs = await asyncio.gather(
            cli("instances", *conn, cwd=tmp_path),
            cli("jobs", "show", "j1", *conn, cwd=tmp_path),
            cli("models", *conn, cwd=tmp_path),
            cli("instances", "--json", *conn, cwd=tmp_path),
        )
    (_, table_out, _), (_, job_out, _), (rc, _, models_err), (_, as_json, _) = runs
    for shown in (table_out, job_out, models_err):
        assert "\x1b" not in shown and "\x07" not in shown, shown
    assert "m\\x1b]52;c;cm0gLXJmIH4K\\x07" in table_out and "running\\x1b[2J" in table_out
    assert "train\\x1b]0;pwned\\x07" in job_out and "oom\\x1b[1A" in job_out
    assert rc == 1 and one_line(models_err) and "busy\\x1b[2J\\x0asolar-host" in models_err
    assert json.loads(as_json)[0]["config"]["alias"] == ESC_ALIAS  # --json: as the host sent it

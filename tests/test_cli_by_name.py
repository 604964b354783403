"""The CLI as a subprocess against a whole host process (tests/fixtures/hostproc.py): instances
by alias, id or id prefix, create / delete / restart, live start phases, --json, --version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from solar_host import __version__
from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config

REPO = Path(__file__).resolve().parents[1]
CLEARED = ("API_KEY", "SOLAR_HOST_URL", "PORT", "CONFIG_FILE", "LOG_FORMAT")

pytestmark = pytest.mark.timeout(240)


def run_cli(*args: str, cwd: Path, timeout: float = 90) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run(
        [sys.executable, "-m", "solar_host", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def host(tmp_path: Path):
    with HostProc(tmp_path / "host") as h:
        h.start(timeout=60)
        yield h


def conn(h: HostProc) -> tuple[str, ...]:
    return ("--url", h.url, "--api-key", h.api_key)


def test_version(tmp_path: Path) -> None:
    rc, out, _ = run_cli("--version", cwd=tmp_path)
    assert rc == 0 and out.strip() == f"solar-host {__version__}"


def test_instances_by_alias_id_and_prefix(host: HostProc, tmp_path: Path) -> None:
    c = conn(host)
    # create from flags (--json: the host's answer) and from a JSON file
    cfg = script_config(host.tmp, "--lines", "hello", alias="tiny:1b")
    rc, out, err = run_cli(
        "create",
        "--backend-type",
        "llamacpp",
        "--alias",
        "tiny:1b",
        "--model",
        cfg["model"],
        "--ctx-size",
        "2048",
        "--set",
        'fake_args=["--lines", "hello"]',
        "--json",
        *c,
        cwd=tmp_path,
    )
    assert rc == 0, err
    first = json.loads(out)["instance"]
    assert first["config"]["alias"] == "tiny:1b" and first["config"]["ctx_size"] == 2048
    spec = tmp_path / "other.json"
    spec.write_text(json.dumps(script_config(host.tmp, alias="other:1b")))
    rc, out, err = run_cli("create", "--file", str(spec), *c, cwd=tmp_path)
    assert rc == 0, err
    assert out.startswith("created ") and "(other:1b)" in out
    other_id = out.split()[1]
    assert len(other_id) == 36

    # by alias, by a unique prefix of the id, by the whole id
    for ref in ("tiny:1b", first["id"][:8], first["id"]):
        rc, out, err = run_cli("stop", ref, "--json", *c, cwd=tmp_path)
        assert rc == 0, (ref, err)
        assert json.loads(out)["instance"]["id"] == first["id"]

    # no match: exit 1 naming what was looked for; --json says so too
    rc, out, err = run_cli("start", "nope:1b", *c, cwd=tmp_path)
    assert rc == 1 and "no instance matches 'nope:1b'" in err and out == ""
    rc, out, _ = run_cli("delete", "nope:1b", "--json", *c, cwd=tmp_path)
    assert rc == 1 and json.loads(out)["error"] == "not_found"

    # ambiguous: an alias two instances share, and an id prefix of several ids: exit 2, listed
    dup = [first["id"], other_id]
    with host.client() as http:
        for _ in range(2):
            r = http.post("/instances", json={"config": script_config(host.tmp, alias="dup")})
            assert r.status_code == 200, r.text
        dups = [i["id"] for i in http.get("/instances").json() if i["config"]["alias"] == "dup"]
        ids = [i["id"] for i in http.get("/instances").json()]
        # enough instances that two ids share a first character (pigeonhole over 16 digits)
        while len({i[0] for i in ids}) == len(ids):
            r = http.post("/instances", json={"config": script_config(host.tmp, alias="x")})
            ids.append(r.json()["instance"]["id"])
    rc, out, err = run_cli("logs", "dup", *c, cwd=tmp_path)
    assert rc == 2 and "'dup' matches 2 instances" in err
    assert all(i in err for i in dups)
    prefix = next(i[0] for i in ids if sum(j[0] == i[0] for j in ids) > 1)
    rc, out, err = run_cli("restart", prefix, "--json", *c, cwd=tmp_path)
    assert rc == 2
    doc = json.loads(out)
    assert doc["error"] == "ambiguous" and len(doc["matches"]) >= 2
    assert all(m.startswith(prefix) for m in doc["matches"])

    # delete by alias; then it is gone
    rc, out, err = run_cli("delete", "other:1b", *c, cwd=tmp_path)
    assert rc == 0 and out.strip() == f"deleted {other_id} (other:1b)", err
    rc, out, _ = run_cli("instances", "--json", *c, cwd=tmp_path)
    assert other_id not in {i["id"] for i in json.loads(out)}
    assert dup[0] in {i["id"] for i in json.loads(out)}


LOADING = (
    "Loading checkpoint shards:  50%|#####     | 1/2,"
    "Loading checkpoint shards: 100%|##########| 2/2"
)


def _phases(out: str) -> list[str]:
    """The phase lines (`  0.3 s  spawned pid ...`) of a start's plain output."""
    lines = []
    for line in out.splitlines():
        head, _, rest = line.strip().partition(" s  ")
        if rest and head.replace(".", "", 1).isdigit():
            lines.append(rest)
    return lines


def test_start_and_restart_show_phases_until_ready(host: HostProc, tmp_path: Path) -> None:
    c = conn(host)
    cfg = script_config(host.tmp, "--lines", LOADING, "--ready-after", "1.5", alias="slow:1b")
    spec = tmp_path / "slow.json"
    spec.write_text(json.dumps({"config": cfg}))
    rc, out, err = run_cli("create", "--file", str(spec), *c, cwd=tmp_path)
    assert rc == 0, err
    iid = out.split()[1]

    rc, out, err = run_cli("start", "slow:1b", *c, cwd=tmp_path)
    assert rc == 0, err
    phases = _phases(out)
    assert phases[0] == "starting", out
    assert phases[1].startswith("spawned pid ") and " on port " in phases[1], out
    assert phases[2:] == ["loading 50%", "loading 100%", "ready"], out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"{iid}: running (port ") and ", ready in " in last, out
    ready_s = float(last.rsplit("ready in ", 1)[1].split()[0])
    assert ready_s >= 1.5  # the backend's --ready-after

    # already running: said so, no phases
    rc, out, err = run_cli("start", iid[:6], *c, cwd=tmp_path)
    assert rc == 0 and _phases(out) == [] and "(already running)" in out, (out, err)

    # restart by id prefix: the old process stops, a new one loads; --json lists the phases
    rc, out, err = run_cli("restart", iid[:8], "--json", *c, cwd=tmp_path)
    assert rc == 0, err
    doc: dict[str, Any] = json.loads(out)
    assert doc["instance"]["status"] == "running" and doc["instance"]["id"] == iid
    seen = [p["phase"] for p in doc["phases"]]
    assert seen[:2] == ["stopping", "stopped"], seen
    assert seen[-3:] == ["loading 50%", "loading 100%", "ready"], seen
    assert any(p.startswith("spawned pid ") for p in seen)
    times = [p["at_s"] for p in doc["phases"]]
    assert times == sorted(times) and doc["elapsed_s"] >= times[-1]

    # a start that fails says why, with the backend's last lines
    bad = script_config(host.tmp, "--lines", "boom", "--exit-after", "0", "--exit-code", "3")
    spec.write_text(json.dumps({**bad, "alias": "bad:1b"}))
    rc, _, err = run_cli("create", "--file", str(spec), "--start", *c, cwd=tmp_path)
    assert rc == 1 and "boom" in err, err


def start_on_a_terminal(host: HostProc, tmp_path: Path, lines: str, alias: str) -> tuple[str, str]:
    """Create an instance whose backend prints `lines` (comma-separated) while it loads, and
    `solar-host start` it on a pseudo-terminal: (what was drawn, stderr)."""
    import fcntl
    import pty
    import struct
    import termios

    c = conn(host)
    cfg = script_config(host.tmp, "--lines", lines, "--ready-after", "2", alias=alias)
    spec = tmp_path / f"{alias.replace(':', '-')}.json"
    spec.write_text(json.dumps(cfg))
    rc, _, err = run_cli("create", "--file", str(spec), *c, cwd=tmp_path)
    assert rc == 0, err
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(PYTHONPATH=str(REPO), TERM="xterm-256color")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "solar_host", "start", alias, *c],
            cwd=tmp_path,
            env=env,
            stdout=slave,
            stderr=subprocess.PIPE,
        )
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not data:
                break
            chunks.append(data)
        err = proc.stderr.read().decode()  # type: ignore[union-attr]
        assert proc.wait(timeout=60) == 0, err
    finally:
        os.close(master)
    return b"".join(chunks).decode(errors="replace"), err


def test_start_on_a_terminal_draws_a_live_line(host: HostProc, tmp_path: Path) -> None:
    """On a terminal the phases print under a live spinner line that shows the backend's
    latest log line while it loads (rich redraws it in place)."""
    import re

    drawn, _ = start_on_a_terminal(host, tmp_path, LOADING, "tty:1b")
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)
    assert "\x1b[" in drawn  # drawn in place, not appended
    for phase in ("starting", "spawned pid", "loading 50%", "loading 100%", "ready"):
        assert phase in screen, screen
    # the live line: the latest backend line while it loads
    assert "loading (" in screen and "Loading checkpoint shards" in screen, screen
    assert re.search(r": running \(port \d+, pid \d+\), ready in \d+\.\d s", screen), screen


def test_live_line_shows_log_lines_as_text(host: HostProc, tmp_path: Path) -> None:
    """A backend line holding "[/models/m.gguf]" is text, not rich markup (a MarkupError killed
    the log watcher and every later loading phase went unseen); an escape sequence in one is
    shown, not obeyed."""
    import re

    # before the progress lines it would have hidden: on the live line as the next phase prints
    lines = "loading model from [/models/m.gguf] \x1b[2J," + LOADING
    drawn, err = start_on_a_terminal(host, tmp_path, lines, "brackets:1b")
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)
    for phase in ("spawned pid", "loading 50%", "loading 100%", "ready"):
        assert phase in screen, screen
    assert "loading model from [/models/m.gguf] \\x1b[2J" in screen, screen
    assert "\x1b[2J" not in drawn
    assert "warning" not in err, err

"""`solar-host doctor`: the availability table and the pre-fleet checks, each with its fix."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from solar_host.cli import doctor
from tests.fixtures.control_server import ControlServer
from tests.fixtures.docker import DockerDaemon, docker_daemon  # noqa: F401 (fixture)
from tests.fixtures.host import API_KEY, free_port, host_settings, running_host
from tests.fixtures.probes import FakeProbe

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.docker
async def test_all_checks_pass_exit_0(
    tmp_path: Path,
    docker_daemon: DockerDaemon,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", docker_daemon.host)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # not above the host's state (/tmp)
    async with ControlServer() as control:
        s = host_settings(
            tmp_path, solar_control_url=control.url, min_free_disk_gb=1, port=free_port()
        )
        out = io.StringIO()
        rc = await asyncio.to_thread(doctor.run, s, out=out, probe=FakeProbe(gpus=[(24, 1)]))
    text = out.getvalue()
    assert rc == 0, text
    assert "13/13 checks passed" in text and "FAIL" not in text
    assert "llamacpp" in text and "sglang" in text  # the table lists every backend type
    assert "Fake NVIDIA GPU" in text


def test_failures_name_the_fix_through_the_cli(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_text("x")
    env_file = tmp_path / ".env"
    env_file.write_text(
        "\n".join(
            [
                "API_KEY=short",
                f"LOG_DIR={tmp_path / 'not-a-dir' / 'logs'}",
                f"MODELS_DIR={tmp_path / 'models'}",
                f"CONFIG_FILE={tmp_path / 'config.json'}",
                f"JOBS_DIR={tmp_path / 'jobs'}",
                "MIN_FREE_DISK_GB=100000000",
                f"SOLAR_CONTROL_URL=http://127.0.0.1:{free_port()}",
                "LLAMA_SERVER_BIN=/nowhere/llama-server",
                "",
            ]
        )
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock",
    }
    r = subprocess.run(
        [sys.executable, "-m", "solar_host", "doctor", "--env-file", str(env_file)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert "LLAMA_SERVER_BIN=/nowhere/llama-server is not an executable" in out
    for name, fix in [
        ("api key", "at least 16 random characters"),
        ("log_dir writable", "point LOG_DIR elsewhere"),
        ("disk", "free space"),
        ("docker", "start dockerd"),
        ("control url", "check SOLAR_CONTROL_URL"),
    ]:
        line = next(ln for ln in out.splitlines() if f"] {name}" in ln)
        assert "[FAIL]" in line, line
        assert fix in out, fix
    assert "[  ok] models_dir writable" in out

    r = subprocess.run(
        [sys.executable, "-m", "solar_host", "doctor", "--json", "--env-file", str(env_file)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 1
    body = json.loads(r.stdout)
    assert body["backends"]["llamacpp"]["available"] is False
    assert {c["name"]: c["ok"] for c in body["checks"]}["api key"] is False


def test_bad_settings_exit_2(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("PORT=not-a-port\n")
    r = subprocess.run(
        [sys.executable, "-m", "solar_host", "doctor", "--env-file", str(env_file)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        timeout=60,
    )
    assert r.returncode == 2 and "PORT" in r.stderr


async def test_port_check_knows_a_running_host_and_its_key(tmp_path: Path) -> None:
    async with running_host(host_settings(tmp_path / "h")) as h:
        port = int(h.url.rsplit(":", 1)[1])
        ok = await asyncio.to_thread(doctor.check_port, host_settings(tmp_path, port=port), API_KEY)
        assert ok.ok and "serves on" in ok.detail, ok
        bad = await asyncio.to_thread(
            doctor.check_port, host_settings(tmp_path, port=port), "another-key-0123456789"
        )
        assert not bad.ok and "refuses this API key" in bad.detail and bad.fix
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(1)
    try:
        taken = doctor.check_port(host_settings(tmp_path, port=other.getsockname()[1]), API_KEY)
        assert not taken.ok and "another program" in taken.detail and "PORT" in taken.fix
    finally:
        other.close()
    free = doctor.check_port(host_settings(tmp_path, port=free_port()), API_KEY)
    assert free.ok and "is free" in free.detail


def test_read_confinement_check_follows_the_kernel_and_the_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    auto = host_settings(tmp_path)
    assert doctor.check_confinement(auto, abi=7).ok
    assert "Landlock ABI 7" in doctor.check_confinement(auto, abi=7).detail
    assert "write only their caches" in doctor.check_confinement(auto, abi=7).detail
    open_writes = host_settings(tmp_path, backend_write_confinement=False)
    assert "write anywhere" in doctor.check_confinement(open_writes, abi=7).detail
    unconfined = doctor.check_confinement(auto, abi=0)
    assert unconfined.ok and "unconfined" in unconfined.detail
    required = doctor.check_confinement(
        host_settings(tmp_path, backend_read_confinement="required"), abi=0
    )
    assert not required.ok and "5.19" in required.fix
    first = doctor.check_confinement(auto, abi=1)  # moves across directories all refused
    assert first.ok and "unconfined" in first.detail
    off = doctor.check_confinement(host_settings(tmp_path, backend_read_confinement="off"), abi=7)
    assert off.ok and "off" in off.detail


def test_backend_ports_inside_the_outgoing_range_are_a_warning(tmp_path: Path) -> None:
    """An instance's port in the kernel's range for outgoing connections can be taken by a
    client socket while its backend restarts (a TIME_WAIT on it moved a test's instance)."""
    outgoing = (32768, 60999)
    fine = doctor.check_backend_ports(host_settings(tmp_path, start_port=3500), outgoing)
    assert fine.ok and not fine.warning and "3500" in fine.detail
    for start in (32700, 40000, 60999):
        near = doctor.check_backend_ports(host_settings(tmp_path, start_port=start), outgoing)
        assert near.ok and near.warning, near
        assert str(start) in near.detail and "32768-60999" in near.detail
        assert "START_PORT below 32668" in near.fix
    above = doctor.check_backend_ports(host_settings(tmp_path, start_port=61000), outgoing)
    assert above.ok and not above.warning


def test_the_outgoing_port_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    from solar_host.instances.ports import LINUX_EPHEMERAL_RANGE, ephemeral_port_range

    low, high = ephemeral_port_range()
    assert 0 < low <= high <= 65535
    given = tmp_path / "range"
    given.write_text("10000\t20000\n")
    assert ephemeral_port_range(given) == (10000, 20000)
    given.write_text("garbage")
    assert ephemeral_port_range(given) == LINUX_EPHEMERAL_RANGE
    assert ephemeral_port_range(tmp_path / "missing") == LINUX_EPHEMERAL_RANGE


def test_host_state_that_backends_may_write_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write confinement protects the host's state only where that state lies outside what
    backends may write: a CONFIG_FILE under TMPDIR (here, /tmp with TMPDIR unset) does not."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    settings = host_settings(tmp_path)
    check = doctor.check_confinement(settings, abi=7)
    # A warning, not a failure (issue 39): the host runs, a checkout under /tmp passes
    assert check.ok and check.warning
    assert str(tmp_path) in check.detail and "TMPDIR" in check.fix
    # Writes not confined: nothing to protect, nothing said.
    open_writes = host_settings(tmp_path, backend_write_confinement=False)
    assert doctor.check_confinement(open_writes, abi=7).ok


def test_code_hard_linked_into_a_cache_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uv installs packages as hard links to ~/.cache/uv, which confined backends may write:
    the host's code is then theirs to change."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    settings = host_settings(tmp_path)
    assert doctor.check_confinement(settings, abi=7).ok  # a pip install: one name per file
    code = tmp_path / "pkg" / "solar_host"
    (code / "instances").mkdir(parents=True)
    (code / "settings").mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("__init__.py", "main.py", "settings/schema.py", "instances/confinement.py"):
        (code / name).write_text("")
    os.link(code / "main.py", cache / "main.py")  # as uv's cache holds it
    monkeypatch.setattr("solar_host.__file__", str(code / "__init__.py"))
    check = doctor.check_confinement(settings, abi=7)
    assert not check.ok and "hard-linked" in check.detail and "UV_LINK_MODE" in check.fix


def run_doctor(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "API_KEY": "k" * 20}
    return subprocess.run(
        [sys.executable, "-m", "solar_host", "doctor"],
        capture_output=True,
        text=True,
        env={**base, **env},
        cwd=tmp_path,
        timeout=120,
    )


def check_line(out: str, name: str) -> str:
    return next(ln for ln in out.splitlines() if f"] {name}" in ln)


def test_ipv6_host_and_malformed_control_urls_fail_checks_not_the_doctor(tmp_path: Path) -> None:
    """HOST=::1 (the URL needs brackets) is a FAIL line with a fix; a SOLAR_CONTROL_URL that
    cannot be parsed is refused as the host refuses it at start-up (one line naming the setting
    and the value, exit 2), not a traceback."""
    from tests.test_cli import fake_host, jsn

    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    routes = {
        "GET /": jsn({"service": "solar-host", "version": "9.9"}),
        "GET /instances": jsn({"detail": "Invalid or missing API key"}, 401),
    }
    with fake_host(routes, bind="::1") as fake:
        port = fake.url.rsplit(":", 1)[1]
        r = run_doctor(tmp_path, HOST="::1", PORT=port)
    assert "Traceback" not in r.stderr and r.returncode == 1, r.stderr
    port_line = check_line(r.stdout, "port")
    assert "[FAIL]" in port_line and "refuses this API key" in port_line, r.stdout
    for url in ("http://control:80a", "http://[::1"):
        r = run_doctor(tmp_path, SOLAR_CONTROL_URL=url)
        assert "Traceback" not in r.stderr and r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Invalid setting SOLAR_CONTROL_URL" in lines[0], r.stderr
        assert repr(url) in lines[0], r.stderr


def test_solar_host_url_in_the_env_file_is_no_unknown_setting(tmp_path: Path) -> None:
    """The command line reads SOLAR_HOST_URL from the same env file: not a typo."""
    (tmp_path / ".env").write_text("SOLAR_HOST_URL=http://127.0.0.1:8001\nSOLR_HOST_URL=x\n")
    r = run_doctor(tmp_path, SOLAR_HOST_URL="http://127.0.0.1:8001")
    assert "SOLAR_HOST_URL" not in r.stderr.replace("SOLR_HOST_URL", ""), r.stderr
    assert "unknown setting SOLR_HOST_URL" in r.stderr  # a real typo is still named


def test_a_standalone_host_in_a_checkout_under_tmp_passes(tmp_path: Path) -> None:
    """No Docker, no solar-control, no key yet, the checkout under /tmp (pytest's tmp_path):
    each optional part is marked skipped with why, and what this configuration needs passes."""
    assert str(tmp_path).startswith("/tmp/"), tmp_path
    r = subprocess.run(
        [sys.executable, "-m", "solar_host", "doctor"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PORT": str(free_port())},
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    control = check_line(r.stdout, "control url")
    assert control.startswith("  [skip]") and "runs standalone" in control, r.stdout
    docker = check_line(r.stdout, "docker")
    if not os.path.exists("/var/run/docker.sock"):
        assert docker.startswith("  [skip]") and "only jobs need it" in docker, r.stdout
    assert "[FAIL]" not in r.stdout, r.stdout
    key = check_line(r.stdout, "api key")
    assert "[  ok]" in key and "generates one" in key, r.stdout
    assert "skipped (optional, not configured): " in r.stdout.splitlines()[-1], r.stdout
    assert not (tmp_path / "api_key").exists()  # the doctor changes nothing

    r = subprocess.run(
        [sys.executable, "-m", "solar_host", "doctor", "--json"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PORT": str(free_port())},
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["control url"]["skipped"] and checks["control url"]["ok"]


def test_docker_is_checked_only_where_it_is_configured_or_installed(tmp_path: Path) -> None:
    import docker

    missing = str(tmp_path / "docker.sock")
    none = doctor.check_docker(environ={}, default_socket=missing)
    assert none.ok and none.skipped and "only jobs need it" in none.detail
    # Installed (its socket is there) but not answering: a warning, jobs are not configured
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(missing)  # bound, never listening: connections are refused

        def connect() -> object:
            return docker.DockerClient(base_url=f"unix://{missing}", timeout=5)

        silent = doctor.check_docker(connect, environ={}, default_socket=missing)
        assert silent.ok and silent.warning and not silent.skipped, silent
        assert "not reachable" in silent.detail and "dockerd" in silent.fix
        # DOCKER_HOST names it: jobs are meant to run, so it fails
        named = doctor.check_docker(
            connect, environ={"DOCKER_HOST": f"unix://{missing}"}, default_socket=missing
        )
        assert not named.ok and "not reachable" in named.detail

"""What a new operator ran into on a first walkthrough: the command line's flags and messages,
state found from another directory, the generated key kept out of logs, unexpanded paths."""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from solar_host.cli import command as cli
from solar_host.cli import doctor
from solar_host.cli import instances as cli_instances
from solar_host.cli.exits import EXIT_USAGE
from solar_host.cli.format import print_warnings
from solar_host.platform.statelock import StateLock
from solar_host.settings import SettingsError, load_settings
from tests.fixtures.host import host_settings
from tests.fixtures.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
# What the host and the command line read from the environment: nothing leaks in.
CLEARED = ("API_KEY", "SOLAR_HOST_URL", "PORT", "HOST", "CONFIG_FILE", "LOG_FORMAT", "MODELS_DIR")


def env_of(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "solar_host", *args],
        cwd=cwd,
        env=env_of(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- create: warnings and --model ---------------------------------------------------------


def test_an_answer_without_warnings_prints_none(capsys: pytest.CaptureFixture[str]) -> None:
    for body in ({"warnings": []}, {}, {"warnings": None}):
        print_warnings(body)
    assert capsys.readouterr().err == ""
    print_warnings({"warnings": ["unknown field speculative_knob"]})
    assert capsys.readouterr().err == "solar-host: warning: unknown field speculative_knob\n"


def _create_config(*args: str) -> dict[str, object]:
    parsed = cli.build_parser().parse_args(["create", *args])
    return cli_instances.create_body(parsed)["config"]


@pytest.mark.parametrize(
    ("backend", "field"),
    [
        ("llamacpp", "model"),
        ("huggingface_causal", "model_id"),
        ("huggingface_vision", "model_id"),
        ("huggingface_embedding", "model_id"),
        ("huggingface_classification", "model_id"),
        ("sglang", "model_path"),
    ],
)
def test_create_model_goes_into_the_backends_model_field(backend: str, field: str) -> None:
    config = _create_config("--backend-type", backend, "--alias", "a", "--model", "org/m")
    assert config[field] == "org/m"
    assert field == "model" or "model" not in config


def test_the_command_lines_model_fields_match_the_hosts() -> None:
    from solar_host.instances.schemas import config_models, model_field_of

    for backend in config_models():
        assert cli_instances.model_field(backend) == model_field_of(backend), backend


# --- --host / --port with other commands ---------------------------------------------------


@pytest.mark.parametrize("command", ["status", "instances", "doctor", "restore-state"])
def test_serve_flags_with_another_command_are_refused(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--port", "18432", command]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--port" in err, err
    if command in ("status", "instances"):
        assert "--url" in err
    assert cli.main(["--host", "127.0.0.1", "--port", "1", command]) == EXIT_USAGE
    assert "--host and --port" in capsys.readouterr().err


# --- HOST must be an address ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["http://127.0.0.1:8001", "127.0.0.1/24", "localhost/"])
def test_a_url_in_host_is_refused_in_one_line(value: str, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"^Invalid setting HOST: .*SOLAR_HOST_URL") as err:
        load_settings(None, environ={"HOST": value})
    assert "\n" not in str(err.value)
    for fine in ("0.0.0.0", "::1", "127.0.0.1", "fe80::1%eth0", "inference-1.internal"):
        assert load_settings(None, environ={"HOST": fine}).host == fine
    # the host itself: exit 2 with that line, nothing started
    p = run_cli("serve", "--env-file", os.devnull, cwd=tmp_path, HOST=value)
    assert p.returncode == 2 and "Invalid setting HOST" in p.stderr, p.stderr
    assert not (tmp_path / "config.json").exists() and not (tmp_path / "logs").exists()


# --- unexpanded ~ and $ in paths ------------------------------------------------------------


def test_unexpanded_paths_are_warned_and_fail_the_doctor(tmp_path: Path) -> None:
    env_file = tmp_path / "env"
    env_file.write_text(
        "MODELS_DIR=~/models\nLOG_DIR=$HOME/logs\nMODEL_ROOTS=~/more,/srv/${X}\n"
        f"CONFIG_FILE={tmp_path / 'config.json'}\nJOBS_DIR={tmp_path / 'jobs'}\n"
    )
    settings = load_settings(env_file, environ={}, env_file_required=True)
    warned = " | ".join(settings.load_warnings)
    assert "MODELS_DIR=~/models is taken as written" in warned
    assert "LOG_DIR=$HOME/logs is taken as written" in warned
    assert "MODEL_ROOTS=/srv/${X}" in warned and "~/more" not in warned  # MODEL_ROOTS expands ~
    checks = {c.name: c for c in doctor.check_directories(settings)}
    for name, setting in (("models_dir", "MODELS_DIR"), ("log_dir", "LOG_DIR")):
        check = checks[f"{name} writable"]
        assert not check.ok and f"{setting}=" in check.detail, check
        assert "expansion" in check.detail and "full path" in check.fix
    assert checks["jobs_dir writable"].ok and checks["config dir writable"].ok
    # written in full: nothing said
    plain = tmp_path / "plain.env"
    plain.write_text(f"MODELS_DIR={tmp_path / 'models'}\nMODEL_ROOTS=~/more\n")
    assert load_settings(plain, environ={}, env_file_required=True).load_warnings == []


# --- doctor: the env file's mode, the confinement label ---------------------------------------


def test_doctor_warns_when_the_env_file_holding_the_key_is_readable_by_others(
    tmp_path: Path,
) -> None:
    env_file = tmp_path / "env"
    env_file.write_text("API_KEY=a-long-enough-secret-0123456789\n")
    settings = load_settings(env_file, environ={}, env_file_required=True)
    env_file.chmod(0o644)
    check = doctor.check_api_key(settings, env_file)
    assert check.ok and check.warning and "readable by other users" in check.detail, check
    assert check.fix == f"chmod 600 {env_file}"
    env_file.chmod(0o600)
    check = doctor.check_api_key(settings, env_file)
    assert check.ok and not check.warning, check
    # a key not in the file (the environment's): the file's mode does not matter
    other = tmp_path / "other.env"
    other.write_text("PORT=8001\n")
    other.chmod(0o644)
    assert not doctor.check_api_key(settings, other).warning
    # shown as [warn], and the exit status stays 0 for it
    import io

    out = io.StringIO()
    env_file.chmod(0o640)
    warned = doctor.check_api_key(settings, env_file)
    doctor.render({}, [warned], out)
    assert "[warn] api key" in out.getvalue() and "fix: chmod 600" in out.getvalue()
    assert "1/1 checks passed; warnings: api key" in out.getvalue()


def test_state_backends_may_write_is_named_write_confinement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    check = doctor.check_confinement(host_settings(tmp_path), abi=7)
    assert check.warning and check.name == "write confinement", check


def test_the_state_lock_makes_a_new_directory_0750(tmp_path: Path) -> None:
    lock = StateLock.for_dirs(tmp_path / "logs")
    lock.acquire()
    try:
        assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o750
    finally:
        lock.release()


# --- state looked for from another directory ---------------------------------------------


def test_restore_state_says_where_it_looked_and_fails_when_nothing_is_there(
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env_file = tmp_path / "env"
    env_file.write_text("API_KEY=a-long-enough-secret-0123456789\n")
    for dry in ((), ("--dry-run",)):
        p = run_cli("restore-state", *dry, "--env-file", str(env_file), cwd=elsewhere)
        assert p.returncode == 1, p.stdout + p.stderr
        assert f"no state files in {elsewhere}" in p.stderr and "working directory" in p.stderr
        assert "CONFIG_FILE=config.json" in p.stderr and p.stdout == ""
    # in the host's directory: each file named with its whole path
    state = tmp_path / "state"
    state.mkdir()
    (state / "config.json").write_text('{"instances": []}')
    p = run_cli("restore-state", "--dry-run", "--env-file", str(env_file), cwd=state)
    assert p.returncode == 0, p.stderr
    assert f"{state / 'config.json'}: ok" in p.stdout
    assert f"{state / 'reservations.json'}: ok (absent)" in p.stdout
    # only a last good copy left: that is state too (the command goes on to say what it finds)
    (state / "config.json").rename(state / "config.json.prev")
    p = run_cli("restore-state", "--dry-run", "--env-file", str(env_file), cwd=state)
    assert "no state files" not in p.stderr and str(state / "config.json") in p.stdout, p.stderr


def test_handover_names_the_directory_it_looked_in(tmp_path: Path) -> None:
    p = run_cli("handover", "--env-file", os.devnull, "--timeout", "1", cwd=tmp_path)
    assert p.returncode == 1
    assert f"no solar-host is running on {tmp_path}" in p.stderr, p.stderr
    assert "CONFIG_FILE=config.json relative to" in p.stderr


# --- the generated key ------------------------------------------------------------------------


def _serve_until_ready(tmp_path: Path, **env: str) -> list[str]:
    """Start `solar-host serve` in `tmp_path` with stderr a pipe; its stderr lines until it
    serves (then it is stopped)."""
    import queue
    import threading

    proc = subprocess.Popen(
        [sys.executable, "-m", "solar_host", "serve"],
        cwd=tmp_path,
        env=env_of(HOST="127.0.0.1", PORT=str(free_port()), **env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    got: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            got.put(line.rstrip("\n"))
        got.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not any("serving the REST API" in line for line in lines):
            line = got.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                pytest.fail("the host exited:\n" + "\n".join(lines))
            lines.append(line)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    while (line := got.get_nowait() if not got.empty() else None) is not None:
        lines.append(line)
    return lines


def test_a_generated_key_is_not_written_to_a_log_and_json_lines_stay_json(tmp_path: Path) -> None:
    """Under systemd stderr goes to the journal: the key is not printed there; where it is
    stored is said as a log line (JSON with LOG_FORMAT=json). LOG_DIR, made by this start, has
    its mode from the start (no "tightened" warning), and MODELS_DIR=~/... is warned about."""
    (tmp_path / ".env").write_text("MODELS_DIR=~/models\n")
    lines = _serve_until_ready(tmp_path, LOG_FORMAT="json", TMPDIR=str(tmp_path))
    text = "\n".join(lines)
    key = (tmp_path / "api_key").read_text().strip()
    assert key and key not in text, text
    records = [json.loads(line) for line in lines if line.strip()]  # every line is JSON
    msgs = [r["msg"] for r in records]
    stored = (
        f"generated API key stored in {tmp_path / 'api_key'} (not shown; read it from that file)"
    )
    assert stored in msgs, text
    assert not any("tightened the mode" in m for m in msgs), text
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o750
    assert any(m.startswith("MODELS_DIR=~/models is taken as written") for m in msgs), text
    # the next start reuses the key and says nothing of it
    lines = _serve_until_ready(tmp_path, LOG_FORMAT="json", TMPDIR=str(tmp_path))
    assert not any("generated API key" in line for line in lines)


def test_a_generated_key_is_printed_on_a_terminal(tmp_path: Path) -> None:
    import pty

    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "solar_host", "serve"],
        cwd=tmp_path,
        env=env_of(HOST="127.0.0.1", PORT=str(free_port()), TMPDIR=str(tmp_path)),
        stdout=subprocess.DEVNULL,
        stderr=secondary,
    )
    os.close(secondary)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"serving the REST API" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 1)
            if ready:
                try:
                    seen += os.read(primary, 65536)
                except OSError:
                    break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        os.close(primary)
    key = (tmp_path / "api_key").read_text().strip()
    text = seen.decode(errors="replace")
    assert "generated API key (stored in" in text and key in text, text

"""A generated `api_key` that no longer holds the key its last good copy holds.

The host writes the key once, with a copy in `api_key.prev`. A key file cut short still parses
as a key: it must be refused like any damaged state file (its copy never overwritten from it,
no backend restarted for "a new key"), and `restore-state` must put the copy back. An operator
changes the key by deleting the copy with the edit, or by setting API_KEY (README).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from solar_host.cli.restore import restore_state
from solar_host.host import StartupError, resolve_api_key
from solar_host.platform.statefiles import StateFileError, read_api_key, store_api_key
from solar_host.settings import Settings
from tests.fixtures.hostproc import ROOT, HostProc
from tests.fixtures.script_backend import script_config
from tests.test_state_damage import refused

KEY = "sh-" + "k" * 43
REFUSAL = "cannot use state file"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_cut_short_api_key_is_refused_and_restore_state_puts_the_copy_back(
    tmp_path: Path,
) -> None:
    key_file, prev = tmp_path / "api_key", tmp_path / "api_key.prev"
    with HostProc(tmp_path, env={"API_KEY": ""}) as h:
        h.start()  # generates the key: api_key and its copy
        good = key_file.read_bytes()
        assert prev.read_bytes() == good and good.endswith(b"\n")
        h.api_key = good.decode().strip()
        with h.client() as c:
            r = c.post("/instances", json={"config": script_config(tmp_path, alias="keep")})
            iid = r.json()["instance"]["id"]
            pid = c.post(f"/instances/{iid}/start").json()["instance"]["pid"]
        deadline = time.monotonic() + 30
        while b'"running"' not in (tmp_path / "config.json").read_bytes():
            assert time.monotonic() < deadline, "config.json never recorded the backend"
            time.sleep(0.05)
        h.kill()

        key_file.write_bytes(good[:20])  # cut short: 20 bytes, no newline
        line = refused(h, key_file)
        assert str(key_file) in line and f"last good copy: {prev}" in line
        assert "restore-state" in line and "API_KEY" in line
        assert good[:20].decode() not in line  # the log never shows a key, cut short or not
        assert prev.read_bytes() == good  # the copy is not overwritten from the damaged file
        assert key_file.read_bytes() == good[:20]  # and the file is left as found
        assert _alive(pid)

        p = subprocess.run(
            [sys.executable, "-m", "solar_host", "restore-state", "--env-file", os.devnull],
            env={**h.env(), "PYTHONPATH": str(ROOT)},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        assert "DAMAGED" in p.stdout
        assert key_file.read_bytes() == good
        [aside] = tmp_path.glob("api_key.damaged-*")
        assert aside.read_bytes() == good[:20]

        # Started on the restored key: the backend is re-adopted, not restarted for a new key.
        h.start()
        with h.client() as c:
            inst = c.get(f"/instances/{iid}").json()
        assert inst["status"] == "running" and inst["pid"] == pid, inst
        assert "no longer the host's" not in h.log()


def test_a_key_file_that_differs_from_its_copy_is_refused_and_the_copy_kept(
    tmp_path: Path,
) -> None:
    key_file, prev = tmp_path / "api_key", tmp_path / "api_key.prev"
    store_api_key(key_file, KEY)
    key_file.write_text("sh-an-edited-but-valid-key-0123456789\n")
    with pytest.raises(StateFileError, match="not the one its last good copy holds"):
        read_api_key(key_file)
    assert prev.read_text() == KEY + "\n"
    # The host stops on it (StartupError), and restore-state takes the copy back.
    settings = Settings(
        api_key="", config_file=tmp_path / "config.json", jobs_dir=tmp_path / "jobs"
    )
    with pytest.raises(StartupError, match=r"api_key\.prev"):
        resolve_api_key(settings)
    assert restore_state(settings, say=lambda _: None) == 0
    assert read_api_key(key_file) == KEY


def test_the_same_key_without_its_newline_is_the_same_key(tmp_path: Path) -> None:
    key_file, prev = tmp_path / "api_key", tmp_path / "api_key.prev"
    store_api_key(key_file, KEY)
    key_file.write_text(KEY)  # an editor dropped the newline: nothing lost
    assert read_api_key(key_file) == KEY
    assert prev.read_text() == KEY + "\n"


def test_rotating_the_key_by_deleting_its_copy(tmp_path: Path) -> None:
    key_file, prev = tmp_path / "api_key", tmp_path / "api_key.prev"
    store_api_key(key_file, KEY)
    new = "sh-rotated-by-the-operator-0123456789"
    key_file.write_text(new + "\n")
    prev.unlink()
    assert read_api_key(key_file) == new
    assert prev.read_text() == new + "\n"  # the new key's copy, for the next damage
    assert read_api_key(key_file) == new


def test_api_key_in_the_environment_wins_over_a_damaged_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "api_key"
    store_api_key(key_file, KEY)
    key_file.write_text(KEY[:10])
    settings = Settings(api_key="sh-from-the-env-file-0123456789", config_file=tmp_path / "c.json")
    assert resolve_api_key(settings) == ("sh-from-the-env-file-0123456789", False)
    assert key_file.read_text() == KEY[:10]  # not read, not touched


def test_a_damaged_copy_is_never_replaced_from_the_file(tmp_path: Path) -> None:
    key_file, prev = tmp_path / "api_key", tmp_path / "api_key.prev"
    store_api_key(key_file, KEY)
    prev.write_bytes(b"")
    assert read_api_key(key_file) == KEY
    assert prev.read_bytes() == b""

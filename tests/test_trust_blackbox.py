"""Trust weak spots found by a black-box review: a real host process (scripted backend), real
files, real sockets.

- A state file that is not a regular file (a FIFO, a link to /dev/zero) hung the start for
  good, or read until memory ran out: it is refused at once like any damage, the backend left
  serving and re-adopted once the file is back.
- config.json missing (removed with its copy, or a link to a disk that is not mounted) while
  backends of this state directory's host id still run: the host started empty and stopped
  them as unmanaged (and wrote a fresh config.json where the link pointed). It refuses now.
- A model_file/mmproj pattern that matches nothing ran a recursive glob over MODELS_DIR that
  followed a link to / (the whole machine, /proc included) on the event loop: the host stopped
  answering. The search is bounded and never leaves MODELS_DIR. A model_file past PATH_MAX
  was a 500 (ENAMETOOLONG): it is a 422 now.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config, started
from tests.test_state_damage import adopted, refused

REFUSAL = "cannot use state file"


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def running_then_killed(h: HostProc) -> tuple[str, int]:
    """Start the host, create and start one instance, wait until config.json records its
    backend, SIGKILL the host: (instance id, backend pid)."""
    h.start()
    inst = started(h, alias="keep:1")
    iid, pid = inst["id"], inst["pid"]
    deadline = time.monotonic() + 30
    while f'"pid": {pid}' not in (h.tmp / "config.json").read_text():
        assert time.monotonic() < deadline, "config.json never recorded the backend"
        time.sleep(0.05)
    h.kill()
    return iid, pid


def _fifo(path: Path) -> Callable[[], None]:
    saved = path.with_name(path.name + ".saved")
    os.replace(path, saved)
    os.mkfifo(path)
    return lambda: os.replace(saved, path)


def _dev_zero(path: Path) -> Callable[[], None]:
    saved = path.with_name(path.name + ".saved")
    os.replace(path, saved)
    path.symlink_to("/dev/zero")
    return lambda: os.replace(saved, path)


@pytest.mark.parametrize(
    ("name", "how"),
    [
        ("config.json", "fifo"),
        ("config.json", "/dev/zero"),
        ("reservations.json", "fifo"),
        ("config.json.host-id", "fifo"),
    ],
)
def test_a_state_file_that_is_not_a_regular_file_is_refused_at_once(
    tmp_path: Path, name: str, how: str
) -> None:
    with HostProc(tmp_path) as h:
        iid, pid = running_then_killed(h)
        path = tmp_path / name
        if not path.exists():  # reservations.json: written by the first reservation only
            path.write_text('{"version": 1, "reservations": []}\n')
        undo = (_fifo if how == "fifo" else _dev_zero)(path)
        line = refused(h, path)
        assert "not a regular file" in line, line
        assert alive(pid)
        undo()
        adopted(h, iid, pid)


def test_an_unusable_copy_of_the_key_does_not_stop_the_start(tmp_path: Path) -> None:
    """api_key.prev a FIFO: the key file is good, the copy is left alone and logged."""
    (tmp_path / "api_key").write_text("k" * 32 + "\n")
    with HostProc(tmp_path, env={"API_KEY": ""}, api_key="k" * 32) as h:
        h.start()
        h.kill()
        prev = tmp_path / "api_key.prev"
        prev.unlink()
        os.mkfifo(prev)
        h.start(timeout=60)
        assert "cannot be used; left unchanged" in h.log()


def _removed_with_its_copy(tmp: Path) -> Callable[[], None]:
    config, prev = tmp / "config.json", tmp / "config.json.prev"
    os.replace(config, tmp / "config.saved")
    os.replace(prev, tmp / "prev.saved")

    def undo() -> None:
        os.replace(tmp / "config.saved", config)
        os.replace(tmp / "prev.saved", prev)

    return undo


def _link_to_a_disk_not_mounted(tmp: Path) -> Callable[[], None]:
    config = tmp / "config.json"
    os.replace(config, tmp / "config.saved")
    (tmp / "mnt").mkdir()
    config.symlink_to(tmp / "mnt" / "config.json")

    def undo() -> None:
        config.unlink()
        os.replace(tmp / "config.saved", config)

    return undo


@pytest.mark.parametrize("how", [_removed_with_its_copy, _link_to_a_disk_not_mounted])
def test_config_missing_while_its_backends_run_is_refused(
    tmp_path: Path, how: Callable[[Path], Callable[[], None]]
) -> None:
    with HostProc(tmp_path) as h:
        iid, pid = running_then_killed(h)
        undo = how(tmp_path)
        line = refused(h, tmp_path / "config.json")
        assert "missing" in line and str(pid) in line, line
        assert alive(pid)
        assert not (tmp_path / "mnt" / "config.json").exists()  # nothing written there
        undo()
        adopted(h, iid, pid)
        # With no backend of it left running, a missing config.json is a fresh start.
        with h.client() as c:
            assert c.post(f"/instances/{iid}/stop").status_code == 200
        h.kill()
        os.unlink(tmp_path / "config.json")
        shutil.rmtree(tmp_path / "mnt", ignore_errors=True)
        (tmp_path / "config.json.prev").unlink(missing_ok=True)
        h.start(timeout=60)
        with h.client() as c:
            assert c.get("/instances").json() == []


def test_a_pattern_that_matches_nothing_never_walks_out_of_models_dir(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "sub").mkdir(parents=True)
    (models / "sub" / "vision-mmproj.gguf").write_bytes(b"GGUF")
    (models / "root").symlink_to("/")  # a link to the whole machine
    (models / "loop").symlink_to(".")  # and one that loops
    with HostProc(tmp_path) as h:
        h.start()
        with h.client(timeout=20) as c:
            cfg = script_config(tmp_path, alias="a:1")
            t0 = time.monotonic()
            r = c.post("/instances", json={"config": {**cfg, "mmproj": "nothing-*.gguf"}})
            assert r.status_code == 422, r.text
            assert "mmproj" in r.text
            # Still found where it is, through a recursive pattern.
            r = c.post("/instances", json={"config": {**cfg, "mmproj": "*mmproj*.gguf"}})
            assert r.status_code == 200, r.text
            assert r.json()["instance"]["config"]["mmproj"] == str(
                models / "sub" / "vision-mmproj.gguf"
            )
            assert time.monotonic() - t0 < 10
            # A pattern past the kernel's path bounds is a 422 naming the field, not a 500.
            for pattern in ("a" * 5000, "x/" * 3000 + "m.gguf"):
                body = {**cfg, "model": str(models), "model_file": pattern}
                r = c.post("/instances", json={"config": body})
                assert r.status_code == 422 and "model_file" in r.text, r.text
        assert httpx.get(h.url + "/health", timeout=5).status_code == 200

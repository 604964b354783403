"""State files under faults of the disk they live on, against a real host process.

- A full state disk (a small tmpfs, out of space or out of inodes): every change is refused with
  a 507 naming the cause and left undone in memory, nothing on disk is erased, the host works
  again once space is freed (no restart), and a restart after that loses no acknowledged record
  and re-adopts the running backend.
- `<file>.prev` replaced from outside (a symlink out of the state directory, a directory): the
  host never writes or chmods through the link (a root host chmod-ed the link's target at every
  start, wrote the generated key through a dangling `api_key.prev`, and wrote config.json, with
  its instance keys, through `config.json.prev` when hard links were refused), and a write that
  cannot keep its copy fails naming the copy.

The tmpfs tests need root (mount); they skip where mounting is not permitted.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config
from tests.fixtures.tmpfs import small_tmpfs

STATE_FILES = ("config.json", "config.json.prev", "reservations.json", "reservations.json.prev")


def fill(directory: Path, what: str) -> list[Path]:
    """Use up the space (or the inodes) of the filesystem of `directory`; the files made."""
    made: list[Path] = []
    if what == "space":
        filler = directory / "filler"
        made.append(filler)
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"x" * 4096)
                f.flush()
    else:
        for i in range(100_000):
            try:
                (directory / f"fill{i}").touch()
            except OSError:
                break
            made.append(directory / f"fill{i}")
    return made


def on_disk(state: Path) -> dict[str, Any]:
    """Ids, aliases and reservation ids as the state files hold them; every state file parses."""
    for name in STATE_FILES:
        if (state / name).exists():
            json.loads((state / name).read_bytes())
    config = json.loads((state / "config.json").read_bytes())
    res = state / "reservations.json"
    return {
        "instances": {
            e["instance"]["id"]: e["instance"]["config"]["alias"] for e in config["instances"]
        },
        "reservations": sorted(r["id"] for r in json.loads(res.read_bytes())["reservations"])
        if res.exists()
        else [],
    }


def in_memory(client: Any) -> dict[str, Any]:
    snapshot = client.get("/resources").json()
    return {
        "instances": {i["id"]: i["config"]["alias"] for i in client.get("/instances").json()},
        "reservations": sorted(r["id"] for r in snapshot.get("reservations", [])),
    }


def reserve(client: Any, job: str) -> Any:
    return client.post(
        "/resources/reservations",
        json={"job_id": job, "vram_gb": 0, "ram_gb": 0.01, "ttl_seconds": 3600},
    )


@pytest.mark.parametrize(
    ("what", "options"), [("space", "size=256k"), ("inodes", "size=8m,nr_inodes=12")]
)
def test_a_full_state_disk_refuses_loudly_keeps_everything_and_recovers(
    tmp_path: Path, what: str, options: str
) -> None:
    state = tmp_path / "state"
    with small_tmpfs(state, options):
        host = HostProc(tmp_path / "host", env={"CONFIG_FILE": str(state / "config.json")})
        try:
            host.start(timeout=60)
            c = host.client(timeout=60)
            cfg = script_config(host.tmp)
            a = c.post("/instances", json={"config": {**cfg, "alias": "a"}}).json()["instance"]
            assert c.post(f"/instances/{a['id']}/start").status_code == 200
            b = c.post("/instances", json={"config": {**cfg, "alias": "b"}}).json()["instance"]
            r1 = reserve(c, "j1")
            assert r1.status_code == 201
            before = on_disk(state)
            assert before == in_memory(c)
            prev_before = (state / "config.json.prev").read_bytes()

            filler = fill(state, what)
            refused = {
                "create": c.post("/instances", json={"config": {**cfg, "alias": "c"}}),
                "update": c.put(f"/instances/{b['id']}", json={"config": {**cfg, "alias": "b2"}}),
                "start": c.post(f"/instances/{b['id']}/start"),
                "stop": c.post(f"/instances/{a['id']}/stop"),
                "delete": c.delete(f"/instances/{b['id']}"),
                "reserve": reserve(c, "j2"),
                "release": c.delete(f"/resources/reservations/{r1.json()['id']}"),
            }
            for name, r in refused.items():
                assert r.status_code == 507, (name, r.status_code, r.text)
                assert "No space left on device" in r.json()["detail"], (name, r.text)
            # Nothing half-applied: memory is what the disk holds, and nothing was erased.
            assert on_disk(state) == in_memory(c) == before
            assert (state / "config.json.prev").read_bytes() == prev_before
            statuses = {i["config"]["alias"]: i["status"] for i in c.get("/instances").json()}
            assert statuses == {"a": "running", "b": "stopped"}  # the refused stop left it up

            for f in filler:
                f.unlink()
            # Working again, without a restart.
            created = c.post("/instances", json={"config": {**cfg, "alias": "c"}})
            assert created.status_code == 200, created.text
            assert (
                c.put(f"/instances/{b['id']}", json={"config": {**cfg, "alias": "b2"}}).status_code
                == 200
            )
            r2 = reserve(c, "j2")
            assert r2.status_code == 201, r2.text
            acknowledged = in_memory(c)
            assert on_disk(state) == acknowledged
            pids = sorted(p.pid for p in host.backends())
            assert len(pids) == 1

            host.restart(timeout=60)
            c = host.client(timeout=60)
            assert in_memory(c) == acknowledged
            a_now = c.get(f"/instances/{a['id']}").json()
            assert a_now["status"] == "running"
            assert sorted(p.pid for p in host.backends()) == pids  # re-adopted, not respawned
        finally:
            host.reap()


# --- last good copies replaced from outside ---------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_symlinked_last_good_copy_is_never_chmodded_or_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    d = tmp_path / "host"
    host = HostProc(d, api_key="")  # the generated key: api_key and api_key.prev are written
    try:
        host.start(timeout=60)
        host.api_key = (d / "api_key").read_text().strip()
        with host.client(timeout=60) as c:
            assert reserve(c, "j0").status_code == 201
            assert reserve(c, "j1").status_code == 201  # reservations.json.prev exists
        host.stop()
        targets = {}
        for name in ("config.json.prev", "reservations.json.prev", "api_key.prev"):
            target = outside / name
            target.write_text(host.api_key + "\n" if name == "api_key.prev" else "theirs\n")
            target.chmod(0o644)
            (d / name).unlink(missing_ok=True)
            (d / name).symlink_to(target)
            targets[name] = target

        host.start(timeout=60)  # the start tightens the modes of the state files
        with host.client(timeout=60) as c:
            cfg = script_config(d)
            assert c.post("/instances", json={"config": cfg}).status_code == 200
            assert reserve(c, "j2").status_code == 201
        for name, target in targets.items():
            assert _mode(target) == 0o644, name  # a root host chmod-ed it to 0600
            expected = host.api_key + "\n" if name == "api_key.prev" else "theirs\n"
            assert target.read_text() == expected, name
        for name in ("config.json.prev", "reservations.json.prev"):
            # The write replaced the link by the real last good copy.
            assert not (d / name).is_symlink() and (d / name).is_file(), name
            json.loads((d / name).read_bytes())
    finally:
        host.reap()


def test_the_generated_key_is_never_written_through_a_dangling_api_key_prev(
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "outside" / "stolen-key"
    elsewhere.parent.mkdir()
    d = tmp_path / "host"
    d.mkdir()
    (d / "api_key.prev").symlink_to(elsewhere)
    host = HostProc(d, api_key="")
    try:
        host.start(timeout=60)
        key = (d / "api_key").read_text().strip()
        assert key
        assert not elsewhere.exists()  # the key used to land here
        assert not (d / "api_key.prev").is_symlink()
        assert (d / "api_key.prev").read_text().strip() == key
    finally:
        host.reap()


def _chattr(flag: str, path: Path) -> bool:
    try:
        done = subprocess.run(["chattr", flag, str(path)], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def test_the_copy_fallback_never_writes_config_json_through_a_symlinked_prev(
    tmp_path: Path,
) -> None:
    """An immutable config.json refuses a hard link (EPERM), so the last good copy is made by
    copying: that copy went through a `config.json.prev` symlink, putting config.json (instance
    keys in it) wherever the link pointed."""
    d = tmp_path / "host"
    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text("theirs\n")
    host = HostProc(d)
    config = d / "config.json"
    try:
        host.start(timeout=60)
        c = host.client(timeout=60)
        cfg = script_config(d)
        iid = c.post("/instances", json={"config": {**cfg, "alias": "x"}}).json()["instance"]["id"]
        (d / "config.json.prev").unlink()
        (d / "config.json.prev").symlink_to(victim)
        if os.geteuid() != 0 or not _chattr("+i", config):
            pytest.skip("chattr +i is not available here (needs root and a filesystem for it)")
        r = c.put(f"/instances/{iid}", json={"config": {**cfg, "alias": "y"}})
        assert r.status_code == 507, r.text
        assert "Operation not permitted" in r.json()["detail"]
        assert victim.read_text() == "theirs\n"
        assert c.get(f"/instances/{iid}").json()["config"]["alias"] == "x"  # undone
        _chattr("-i", config)
        r = c.put(f"/instances/{iid}", json={"config": {**cfg, "alias": "y"}})
        assert r.status_code == 200, r.text
        assert victim.read_text() == "theirs\n"
        assert json.loads(config.read_bytes())["instances"][0]["instance"]["config"]["alias"] == "y"
    finally:
        _chattr("-i", config)
        host.reap()


def test_a_directory_in_place_of_prev_is_named_and_the_host_recovers_without_restart(
    tmp_path: Path,
) -> None:
    d = tmp_path / "host"
    host = HostProc(d)
    try:
        host.start(timeout=60)
        c = host.client(timeout=60)
        cfg = script_config(d)
        iid = c.post("/instances", json={"config": {**cfg, "alias": "x"}}).json()["instance"]["id"]
        assert reserve(c, "j0").status_code == 201
        for name in ("config.json.prev", "reservations.json.prev"):
            with contextlib.suppress(FileNotFoundError):
                (d / name).unlink()
            (d / name).mkdir()
            (d / name / "keep").write_text("theirs")
        t0 = time.monotonic()
        update = c.put(f"/instances/{iid}", json={"config": {**cfg, "alias": "y"}})
        reservation = reserve(c, "j1")
        assert time.monotonic() - t0 < 30
        for r, name in ((update, "config.json.prev"), (reservation, "reservations.json.prev")):
            assert r.status_code == 507, r.text
            detail = r.json()["detail"]
            assert "cannot keep the last good copy" in detail and str(d / name) in detail, detail
            assert (d / name / "keep").read_text() == "theirs"  # nothing of it erased
        assert c.get(f"/instances/{iid}").json()["config"]["alias"] == "x"
        assert not [p.name for p in d.iterdir() if p.name.endswith(".tmp")]  # no temp left
        for name in ("config.json.prev", "reservations.json.prev"):
            (d / name / "keep").unlink()
            (d / name).rmdir()
        assert c.put(f"/instances/{iid}", json={"config": {**cfg, "alias": "y"}}).status_code == 200
        assert reserve(c, "j1").status_code == 201
        assert (d / "config.json.prev").is_file()
    finally:
        host.reap()

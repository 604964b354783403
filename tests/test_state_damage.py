"""Damaged state files: a real host (subprocess, scripted backend) with a running backend.

For each damage (config.json cut in half, emptied, one 0xFF byte, `null`, a non-list
`instances`, a directory in its place; an emptied or unreadable api_key; a damaged jobs or
reservation store; a state file the host may not read, EACCES enforced by Landlock) the host
refuses to start: exit 1, one line naming the file and its last good copy, the file's bytes
unchanged, the backend still alive; once the file is repaired (its bytes put back, or
`solar-host restore-state`) the backend is adopted (same pid). One entry that no
longer validates is quarantined instead: kept verbatim, its backend left alone, the rest loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from pydantic_core import to_json

from solar_host.instances import confinement
from solar_host.instances.confinement import AccessPolicy, Ruleset
from solar_host.platform.libc import libc as c_library
from tests.fixtures.host import API_KEY
from tests.fixtures.hostproc import ROOT, HostProc
from tests.fixtures.script_backend import script_config, started

REFUSAL = "cannot use state file"


def running(h: HostProc, alias: str) -> tuple[str, int]:
    """Create and start an instance; (id, backend pid)."""
    inst = started(h, alias=alias)
    return inst["id"], inst["pid"]


def written(h: HostProc, pid: int) -> None:
    """Wait until config.json records the backend as running and its last good copy records
    the process too (the copy is one save older: restoring it must still know the backend)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            docs = [
                json.loads((h.tmp / n).read_bytes()) for n in ("config.json", "config.json.prev")
            ]
            cur, prev = (d["instances"][0] for d in docs)
            if cur["instance"]["status"] == "running" and (prev["process"] or {}).get("pid") == pid:
                return
        except (OSError, ValueError, KeyError, IndexError):
            pass
        assert time.monotonic() < deadline, "config.json never recorded the running backend"
        time.sleep(0.05)


def recorded_then_killed(h: HostProc, alias: str = "keep") -> tuple[str, int]:
    """Start the host and one running instance, wait until config.json (and its last good
    copy) record the backend, then SIGKILL the host: (instance id, backend pid)."""
    h.start()
    iid, pid = running(h, alias)
    written(h, pid)
    h.kill()
    return iid, pid


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def refused(h: HostProc, path: Path) -> str:
    """Start the host on damaged state: it must exit 1 with one line naming `path`."""
    before = len(h.log())
    h.start(wait=False)
    assert h.proc is not None
    try:
        code = h.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the host started on a damaged {path.name}:\n{h.log()}")
    out = h.log()[before:] if len(h.log()) > before else h.log()
    lines = [ln for ln in out.splitlines() if REFUSAL in ln]
    assert code == 1, out
    assert len(lines) == 1 and str(path) in lines[0], out
    assert "Traceback" not in out
    return lines[0]


def adopted(h: HostProc, iid: str, pid: int) -> None:
    h.start(timeout=60)
    with h.client() as c:
        inst = c.get(f"/instances/{iid}").json()
    assert inst["status"] == "running" and inst["pid"] == pid, inst


def restore_state(h: HostProc) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "solar_host", "restore-state", "--env-file", os.devnull],
        env={**h.env(), "PYTHONPATH": str(ROOT)},
        cwd=h.tmp,
        capture_output=True,
        text=True,
        timeout=60,
    )


def damage(path: Path, how: str) -> None:
    if how == "directory":
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("x")
        return
    raw = path.read_bytes()
    data = {
        "cut in half": raw[: len(raw) // 2],
        "emptied": b"",
        "0xFF byte": b"\xff",
        "null": b"null",
        "instances not a list": b'{"roles": ["inference"], "instances": "x"}',
    }[how]
    path.write_bytes(data)


def snapshot(path: Path) -> Any:
    if path.is_dir():
        return sorted((p.name, p.read_bytes()) for p in path.iterdir())
    return path.read_bytes()


def repair(path: Path, good: bytes) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    path.write_bytes(good)


CONFIG_DAMAGE = ["cut in half", "emptied", "0xFF byte", "null", "instances not a list", "directory"]


@pytest.mark.parametrize("how", CONFIG_DAMAGE)
def test_damaged_config_json_is_refused_and_nothing_is_touched(tmp_path: Path, how: str) -> None:
    with HostProc(tmp_path) as h:
        iid, pid = recorded_then_killed(h)
        cfg = tmp_path / "config.json"
        good = cfg.read_bytes()
        damage(cfg, how)
        damaged = snapshot(cfg)
        others = sorted(p.name for p in tmp_path.iterdir())
        line = refused(h, cfg)
        assert "last good copy" in line and "config.json.prev" in line
        assert "restore-state" in line
        assert snapshot(cfg) == damaged
        assert sorted(p.name for p in tmp_path.iterdir()) == others  # nothing written beside
        assert alive(pid)
        if how == "cut in half":
            # The documented way back: the last good copy; the damaged file is kept aside.
            p = restore_state(h)
            assert p.returncode == 0, p.stdout + p.stderr
            assert "config.json.prev" in p.stdout
            [aside] = [q for q in tmp_path.iterdir() if ".damaged-" in q.name]
            assert aside.read_bytes() == damaged
            json.loads(cfg.read_text())
        else:
            repair(cfg, good)
        adopted(h, iid, pid)


def test_one_entry_that_no_longer_validates_is_quarantined(tmp_path: Path) -> None:
    with HostProc(tmp_path) as h:
        h.start()
        keep, keep_pid = running(h, "keep")
        odd, odd_pid = running(h, "odd")
        h.kill()
        cfg = tmp_path / "config.json"
        good = cfg.read_bytes()
        doc = json.loads(good)
        [entry] = [e for e in doc["instances"] if e["instance"]["id"] == odd]
        entry["instance"]["config"]["backend_type"] = "llamacpp-retired"  # as after an upgrade
        entry["instance"]["config"]["ctx_size"] = "a size a newer release understood"
        damaged = to_json(doc, indent=2, ensure_ascii=True)
        cfg.write_bytes(damaged)
        h.start()
        with h.client() as c:
            insts = c.get("/instances").json()
            assert [i["id"] for i in insts] == [keep]
            assert insts[0]["status"] == "running" and insts[0]["pid"] == keep_pid
            [q] = c.get("/instances/quarantined").json()
            assert q["id"] == odd and q["pid"] == odd_pid and q["index"] == 1
            assert "backend_type" in q["reason"] and q["entry"] == entry
            assert cfg.read_bytes() == damaged  # the start rewrote nothing
            assert alive(odd_pid)  # the boot sweep left its backend alone
            # A save (a create) writes the entry back verbatim, at its place.
            r = c.post("/instances", json={"config": script_config(tmp_path, alias="new")})
            assert r.status_code == 200
            entries = json.loads(cfg.read_text())["instances"]
            assert entries[1] == entry and len(entries) == 3
            assert c.get(f"/instances/{odd}").status_code == 404
        assert "quarantined" in h.log() and odd in h.log()
        h.kill()
        # Repaired (the upgrade undone): adopted, same pid.
        doc = json.loads(cfg.read_text())
        doc["instances"][1] = json.loads(good)["instances"][1]
        cfg.write_bytes(to_json(doc, indent=2, ensure_ascii=True))
        adopted(h, odd, odd_pid)
        adopted_keep = h.client().get(f"/instances/{keep}").json()
        assert adopted_keep["pid"] == keep_pid


@pytest.mark.parametrize("damage", ["pid null", "pid not an integer", "no process record"])
def test_a_quarantined_entry_keeps_its_backend_whatever_its_record_lost(
    tmp_path: Path, damage: str
) -> None:
    """The entry's backend carries the entry's id in its marker: the boot sweep leaves it
    alone even when the entry no longer says which pid it had (it was killed before)."""
    with HostProc(tmp_path) as h:
        h.start()
        odd, odd_pid = running(h, "odd")
        written(h, odd_pid)
        other, other_pid = running(h, "other")
        h.kill()
        os.kill(other_pid, 9)  # the boot restarts it: once running, the sweep is over
        cfg = tmp_path / "config.json"
        doc = json.loads(cfg.read_text())
        [entry] = [e for e in doc["instances"] if e["instance"]["id"] == odd]
        if damage == "pid null":
            entry["process"]["pid"] = None
        elif damage == "pid not an integer":
            entry["process"]["pid"] = odd_pid + 0.5
        else:
            entry["process"] = None
            entry["instance"]["config"]["backend_type"] = "llamacpp-retired"
        cfg.write_bytes(to_json(doc, indent=2))
        h.start()
        deadline = time.monotonic() + 60
        with h.client() as c:
            while True:
                inst = c.get(f"/instances/{other}").json()
                if inst["status"] == "running" and inst["pid"] not in (None, other_pid):
                    break
                assert time.monotonic() < deadline, inst
                time.sleep(0.1)
            assert odd in [q["id"] for q in c.get("/instances/quarantined").json()]
        assert alive(odd_pid), h.log()[-2000:]
        assert f"unmanaged backend pid {odd_pid}" not in h.log()


@pytest.mark.parametrize("damage", ["deleted", "emptied", "NULs", "another id"])
def test_a_damaged_host_id_is_taken_back_from_the_records_or_refused(
    tmp_path: Path, damage: str
) -> None:
    """The host id is in every backend's marker: lost, the host made a new one and left its
    backends running as strangers beside second copies it spawned (review of the state
    files). Now a missing or damaged file is rewritten from config.json's markers, and a
    valid file naming another id is refused."""
    with HostProc(tmp_path) as h:
        iid, pid = recorded_then_killed(h)
        hid = tmp_path / "config.json.host-id"
        old = hid.read_text()
        if damage == "deleted":
            hid.unlink()
        elif damage == "emptied":
            hid.write_bytes(b"")
        elif damage == "NULs":
            hid.write_bytes(b"\0" * 33)
        else:
            hid.write_text("0" * 32 + "\n")
            line = refused(h, hid)
            assert old.strip() in line, line
            assert hid.read_text() == "0" * 32 + "\n" and alive(pid)
            hid.write_text(old)  # what the message says to do
        adopted(h, iid, pid)
        assert hid.read_text() == old
        extra = [p for p in h.backends() if p.pid != pid]
        who = [(p.pid, p.ppid(), p.cmdline()) for p in extra]
        assert not extra, f"a second copy: {who}\n{h.log()}"


@pytest.mark.parametrize("port", ["70000", "0", "the next one"])
def test_a_wrong_port_in_a_process_record_is_corrected_not_fatal(tmp_path: Path, port: str) -> None:
    """A record naming another port made the serving backend look like one still loading: it
    was ended at its start deadline and the instance failed (review of the state files). The
    port the backend was spawned with is in its environment, and wins."""
    with HostProc(tmp_path) as h:
        h.start()
        iid, pid = running(h, "keep")
        written(h, pid)
        with h.client() as c:
            real_port = c.get(f"/instances/{iid}").json()["port"]
        h.kill()
        cfg = tmp_path / "config.json"
        doc = json.loads(cfg.read_text())
        rec = doc["instances"][0]["process"]
        rec["port"] = real_port + 1 if port == "the next one" else int(port)
        rec["spawned_at"] = "2020-01-01T00:00:00+00:00"  # its start deadline long past
        cfg.write_bytes(to_json(doc, indent=2))
        adopted(h, iid, pid)
        with h.client() as c:
            inst = c.get(f"/instances/{iid}").json()
        assert inst["port"] == real_port, inst
        assert "the record is corrected" in h.log()
        deadline = time.monotonic() + 60  # saved with the right port
        while json.loads(cfg.read_text())["instances"][0]["process"]["port"] != real_port:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_operator_deletes_a_quarantined_entry(tmp_path: Path) -> None:
    with HostProc(tmp_path) as h:
        h.start()
        odd, odd_pid = running(h, "odd")
        h.kill()
        cfg = tmp_path / "config.json"
        doc = json.loads(cfg.read_bytes())
        doc["instances"][0]["instance"]["config"]["backend_type"] = "gone"
        cfg.write_bytes(to_json(doc, indent=2, ensure_ascii=True))
        h.start()
        with h.client() as c:
            assert alive(odd_pid)
            r = c.delete(f"/instances/{odd}")
            assert r.status_code == 200, r.text
            assert r.json()["quarantined"]["id"] == odd
            assert c.get("/instances/quarantined").json() == []
            assert c.delete(f"/instances/{odd}").status_code == 404
        assert json.loads(cfg.read_text())["instances"] == []
        deadline = time.monotonic() + 20
        while alive(odd_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(odd_pid)  # deleting it leaves nothing running


@pytest.mark.parametrize("how", ["emptied", "directory"])
def test_damaged_api_key_is_refused_not_regenerated(tmp_path: Path, how: str) -> None:
    key_file = tmp_path / "api_key"
    key_file.write_text(API_KEY + "\n")
    with HostProc(tmp_path, env={"API_KEY": ""}) as h:
        h.start()
        iid, pid = running(h, "keep")
        h.kill()
        good = key_file.read_bytes()
        assert (tmp_path / "api_key.prev").read_bytes() == good
        if how == "emptied":
            key_file.write_bytes(b"")
        else:
            damage(key_file, "directory")
        damaged = snapshot(key_file)
        line = refused(h, key_file)
        assert "api_key.prev" in line
        assert snapshot(key_file) == damaged
        assert alive(pid)
        p = restore_state(h)
        assert p.returncode == 0, p.stdout + p.stderr
        assert key_file.read_bytes() == good
        adopted(h, iid, pid)


@pytest.mark.parametrize("store", ["jobs/jobs_store.json", "reservations.json"])
def test_damaged_jobs_or_reservation_store_is_refused(tmp_path: Path, store: str) -> None:
    path = tmp_path / store
    with HostProc(tmp_path) as h:
        h.start()
        iid, pid = running(h, "keep")
        h.kill()
        path.parent.mkdir(parents=True, exist_ok=True)
        for damaged in (b'{"version": 1, "jo', b"\xff", b"[]"):
            path.write_bytes(damaged)
            refused(h, path)
            assert path.read_bytes() == damaged
            assert alive(pid)
        path.unlink()
        adopted(h, iid, pid)


def test_state_files_are_private_and_loosened_ones_tightened(tmp_path: Path) -> None:
    key_file = tmp_path / "api_key"
    with HostProc(tmp_path, env={"API_KEY": ""}) as h:
        key_file.write_text(API_KEY + "\n")
        os.chmod(key_file, 0o644)
        h.start()
        with h.client() as c:
            r = c.post(
                "/resources/reservations", json={"job_id": "j", "vram_gb": 0, "ram_gb": 0.001}
            )
            assert r.status_code == 201, r.text
        running(h, "keep")
        h.kill()
        mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
        for name in ("config.json", "config.json.prev", "reservations.json", "api_key"):
            assert mode(tmp_path / name) == 0o600, name
        assert mode(tmp_path / "logs") == 0o750
        os.chmod(tmp_path / "config.json", 0o644)
        os.chmod(tmp_path / "logs", 0o777)
        h.start()
        assert mode(tmp_path / "config.json") == 0o600
        assert mode(tmp_path / "logs") == 0o750
        assert "tightened the mode of" in h.log() and "config.json" in h.log()


def _unreadable(path: Path) -> Ruleset:
    """A Landlock ruleset under which everything reads as before except `path` and its hard
    links (EACCES), as a file of mode 000 reads to a host that does not run as root: whatever
    lies beside the chain of directories from / down to the file may be read."""
    inode = path.stat().st_ino  # its hard links (the last good copy may be one) share a mode
    trees: list[str] = []
    for parent in path.parents:
        on_chain = (
            path
            if parent == path.parent
            else next(p for p in path.parents if p.parent == parent and p != parent)
        )
        trees += [
            str(entry)
            for entry in parent.iterdir()
            # Links are left out: a rule is on what a link leads to (pytest-current leads to
            # this very test's directory).
            if entry != on_chain and not entry.is_symlink() and entry.lstat().st_ino != inode
        ]
    return Ruleset.build(AccessPolicy(tuple(trees), ()))


def _restricting(ruleset: Ruleset) -> Callable[[], None]:
    """A preexec_fn restricting the child with `ruleset` (the host itself starts its backends
    through landlock_exec.py instead: a preexec_fn makes every spawn a full fork())."""
    libc, fd = c_library(), ruleset.fd

    def restrict() -> None:
        if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(446, fd, 0) != 0:
            raise OSError("landlock_restrict_self failed")

    return restrict


@pytest.mark.skipif(confinement.abi_version() < 1, reason="this kernel has no Landlock")
@pytest.mark.parametrize("name", ["config.json", "jobs/jobs_store.json", "reservations.json"])
def test_an_unreadable_state_file_is_refused_not_replaced(tmp_path: Path, name: str) -> None:
    """EACCES on a state file (a file of mode 000, a host that is not root): the host refuses
    to start, naming the file, and writes nothing over it; readable again, it adopts."""
    path = tmp_path / name
    with HostProc(tmp_path) as h:
        h.start()
        iid, pid = running(h, "keep")
        h.kill()
        created = not path.exists()
        if created:  # never written yet: its content is not read, so any will do
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"{}")
        before = path.read_bytes()
        ruleset = _unreadable(path)
        h.preexec = _restricting(ruleset)
        try:
            line = refused(h, path)
        finally:
            ruleset.close()
            h.preexec = None
        assert "Permission denied" in line, line
        assert path.read_bytes() == before
        assert alive(pid)
        if created:
            path.unlink()
        adopted(h, iid, pid)

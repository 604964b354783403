"""A state file that is a symlink (CONFIG_FILE linked to a persistent disk) stays one.

Every write goes through the link: the temp file, the rename and the last good copy are in the
target's directory, so the link keeps pointing at a file that holds the host's state (renaming
over the link would leave a regular file in its place and the target forever stale).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from solar_host.cli.restore import restore_state
from solar_host.instances.store import InstanceStore
from solar_host.platform.statefiles import (
    PRIVATE,
    StateFileError,
    atomic_write_bytes,
    last_good_path,
    read_api_key,
    store_api_key,
)
from solar_host.settings import Settings
from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config

EMPTY = b'{"roles": ["inference"], "instances": []}'


def _linked(tmp: Path, name: str = "config.json") -> tuple[Path, Path]:
    """(the link, its target): etc/<name> -> persist/<name>."""
    (tmp / "persist").mkdir(exist_ok=True)
    (tmp / "etc").mkdir(exist_ok=True)
    target = tmp / "persist" / name
    target.write_bytes(EMPTY)
    target.chmod(PRIVATE)
    link = tmp / "etc" / name
    # Relative, as operators often make them: resolved against the link's directory.
    link.symlink_to(os.path.join("..", "persist", name))
    return link, target


def test_a_write_goes_through_the_link_and_keeps_the_copy_beside_the_target(
    tmp_path: Path,
) -> None:
    link, target = _linked(tmp_path)
    atomic_write_bytes(link, b"second", PRIVATE, keep_previous=True)
    atomic_write_bytes(link, b"third", PRIVATE, keep_previous=True)
    assert link.is_symlink() and link.resolve() == target
    assert target.read_bytes() == b"third"
    assert last_good_path(link) == target.with_name("config.json.prev")
    assert (tmp_path / "persist" / "config.json.prev").read_bytes() == b"second"
    assert not (tmp_path / "etc" / "config.json.prev").exists()
    # No temp file left on either side.
    assert sorted(p.name for p in (tmp_path / "etc").iterdir()) == ["config.json"]
    assert sorted(p.name for p in (tmp_path / "persist").iterdir()) == [
        "config.json",
        "config.json.prev",
    ]


def test_an_api_key_link_stays_a_link(tmp_path: Path) -> None:
    link, target = _linked(tmp_path, "api_key")
    link.unlink()
    target.unlink()
    link.symlink_to(target)  # dangling: the key is generated into the target
    store_api_key(link, "sh-" + "k" * 43)
    assert link.is_symlink() and target.read_text() == "sh-" + "k" * 43 + "\n"
    assert read_api_key(link) == "sh-" + "k" * 43
    assert (tmp_path / "persist" / "api_key.prev").is_file()


def test_damage_behind_a_link_is_refused_and_restored_through_it(tmp_path: Path) -> None:
    link, target = _linked(tmp_path)
    store = InstanceStore(link, tmp_path)
    store.load()
    store.save_sync([], ["inference", "embeddings"])  # the file before it becomes the copy
    target.write_bytes(b'{"roles": [')  # cut short
    with pytest.raises(StateFileError) as err:
        InstanceStore(link, tmp_path).load()
    assert f"last good copy: {target}.prev" in str(err.value)

    settings = Settings(api_key="k" * 20, config_file=link, jobs_dir=tmp_path / "jobs")
    assert restore_state(settings, say=lambda _: None) == 0
    assert link.is_symlink() and target.read_bytes() == EMPTY
    assert [p.name for p in (tmp_path / "persist").glob("config.json.damaged-*")]
    assert InstanceStore(link, tmp_path).load().records == []


def test_a_host_on_a_linked_config_json_keeps_the_link(tmp_path: Path) -> None:
    link, target = _linked(tmp_path)
    with HostProc(tmp_path, env={"CONFIG_FILE": str(link)}) as h:
        h.start()
        with h.client() as c:
            r = c.post("/instances", json={"config": script_config(tmp_path, alias="linked")})
            assert r.status_code == 200, r.text
            iid = r.json()["instance"]["id"]
        assert link.is_symlink() and link.resolve() == target
        doc = json.loads(target.read_bytes())
        assert [e["instance"]["id"] for e in doc["instances"]] == [iid]
        # A second write keeps the first as the copy beside the target.
        with h.client() as c:
            assert c.post(f"/instances/{iid}/start").status_code == 200
            assert c.post(f"/instances/{iid}/stop").status_code == 200
        assert link.is_symlink()
        assert json.loads((tmp_path / "persist" / "config.json.prev").read_bytes())["instances"]
        # Restarted on the same link: the instance is there.
        h.kill()
        h.start()
        with h.client() as c:
            assert c.get(f"/instances/{iid}").status_code == 200
        assert link.is_symlink()

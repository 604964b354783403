"""GET /instances shows the host key in config.api_key of an instance without a key of its own
(control's HTTP-poll path needs it, ruling 2). Read, edited and put back, such a config must
not make the host key that instance's own: after the host key changed, the old one still
opened that backend (operator walkthrough)."""

from __future__ import annotations

import json
from pathlib import Path

from solar_host.backends.registry import BackendRegistry
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config


async def test_a_config_read_and_put_back_does_not_keep_the_host_key(tmp_path: Path) -> None:
    settings = host_settings(tmp_path)
    async with running_host(settings, backends=BackendRegistry([ScriptBackend()])) as h:
        c = h.client
        r = await c.post("/instances", json={"config": script_config(tmp_path)})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        own = {**script_config(tmp_path), "alias": "own", "api_key": "its-own-key-123"}
        r = await c.post("/instances", json={"config": own})
        own_id = r.json()["instance"]["id"]
        for instance_id in (iid, own_id):
            shown = (await c.get(f"/instances/{instance_id}")).json()["config"]
            r = await c.put(f"/instances/{instance_id}", json={"config": shown})
            assert r.status_code == 200, r.text
        # Still shown to control as before...
        shown = (await c.get(f"/instances/{iid}")).json()["config"]
        assert shown["api_key"] == API_KEY
        assert (await c.get(f"/instances/{own_id}")).json()["config"]["api_key"] == (
            "its-own-key-123"
        )
    # ...but stored as no key of its own; a key of its own is kept.
    stored = {
        e["instance"]["id"]: e["instance"]["config"].get("api_key")
        for e in json.loads(settings.config_file.read_text())["instances"]
    }
    assert stored == {iid: None, own_id: "its-own-key-123"}

"""The host's log says what happened to each instance (operator walkthrough: create, start,
stop and delete left no line at all, even at LOG_LEVEL=debug; only crashes did)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from solar_host.backends.registry import BackendRegistry
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config


async def test_each_step_of_an_instances_life_is_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="solar_host.instances.manager")
    settings = host_settings(tmp_path)
    async with running_host(settings, backends=BackendRegistry([ScriptBackend()])) as h:
        c = h.client
        cfg = {**script_config(tmp_path), "alias": "journal-me"}
        iid = (await c.post("/instances", json={"config": cfg})).json()["instance"]["id"]
        assert (await c.post(f"/instances/{iid}/start")).status_code == 200
        assert (await c.post(f"/instances/{iid}/stop")).status_code == 200
        assert (await c.put(f"/instances/{iid}", json={"config": cfg})).status_code == 200
        assert (await c.delete(f"/instances/{iid}")).status_code == 200
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "solar_host.instances.manager" and iid in r.getMessage()
    ]
    steps = [line.split(": ", 1)[1].split(" (")[0] for line in lines]
    assert steps == [
        "stopped",  # created
        "starting",
        "running",
        "stopping",
        "stopped",
        "stopped",  # updated
        "deleted",
    ], lines
    assert all("(journal-me)" in line for line in lines[:-1]), lines

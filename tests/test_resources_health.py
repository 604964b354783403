"""host_health carries the same snapshot as GET /resources, plus the legacy summary block."""

from __future__ import annotations

from pathlib import Path

import httpx

from solar_host.control.payloads import PayloadBuilder
from tests.fixtures.probes import FakeProbe
from tests.test_api_resources import H, create_app, make_settings, open_client


async def test_host_health_resources_equal_get_resources(tmp_path: Path) -> None:
    probe = FakeProbe(gpus=[(24, 2)], ram=(64, 8), disk=(1000, 100))
    app = create_app(make_settings(tmp_path), probe=probe)
    async with open_client(app) as client:
        r = await client.post(
            "/resources/reservations",
            headers=H,
            json={"job_id": "job-7", "vram_gb": 4, "ram_gb": 2},
        )
        assert r.status_code == 201
        payload = await PayloadBuilder(app.state.host).host_health()
        rest = (await client.get("/resources", headers=H)).json()
    data = payload["data"]
    assert data["resources"] == rest
    assert data["resources"]["memory_type"] == "VRAM"
    assert [x["job_id"] for x in data["resources"]["reservations"]] == ["job-7"]
    summary = data["reservations"]
    assert summary["active_count"] == 1
    assert summary["vram"]["available_gb"] == 18.0
    assert summary["ram"] == rest["ram"] and summary["disk"] == rest["disk"]
    assert "reservations" not in summary  # per-reservation details only in `resources`


async def test_summary_on_cpu_host_has_no_vram(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), probe=FakeProbe(ram=(16, 4), disk=None))
    async with open_client(app) as client:
        assert isinstance(client, httpx.AsyncClient)
        summary = app.state.host.resources.health_summary()
    assert summary["active_count"] == 0
    assert set(summary) == {"active_count", "ram"}  # absent dimensions are left out, not null

"""GET /resources and the reservation routes, through a whole host built by create_app."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from solar_host.app import create_app as _create_app
from solar_host.backends.registry import BackendRegistry
from solar_host.events import ReservationsChanged
from solar_host.settings import Settings
from tests.fixtures.probes import FakeProbe
from tests.test_resources_ledger import FakeJobs

KEY = "k" * 20
H = {"X-API-Key": KEY}


def make_settings(tmp_path: Path, **kw) -> Settings:
    return Settings(
        api_key=KEY,
        config_file=tmp_path / "config.json",
        log_dir=tmp_path / "logs",
        models_dir=tmp_path / "models",
        jobs_dir=tmp_path / "jobs",
        **kw,
    )


def create_app(settings: Settings, **kw):
    """A whole host; no backends registered, as none is needed for the ledger."""
    return _create_app(settings, backends=BackendRegistry([]), **kw)


@contextlib.asynccontextmanager
async def open_client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://host") as client:
            yield client


@pytest.fixture
def probe() -> FakeProbe:
    return FakeProbe(gpus=[(24, 8)], ram=(16, 4), disk=(500, 100))


@pytest.fixture
def app(tmp_path: Path, probe: FakeProbe):
    return create_app(make_settings(tmp_path), probe=probe)


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with open_client(app) as c:
        yield c


def host_jobs(app) -> FakeJobs:
    """Put a fake JobView in place of the jobs service (no Docker needed for these rules)."""
    jobs = FakeJobs()
    app.state.host.resources.jobs = jobs
    return jobs


async def test_key_required(client: httpx.AsyncClient) -> None:
    assert (await client.get("/resources")).status_code == 401
    body = {"job_id": "j", "vram_gb": 1, "ram_gb": 1}
    assert (await client.post("/resources/reservations", json=body)).status_code == 401
    assert (await client.delete("/resources/reservations/res-x")).status_code == 401


async def test_snapshot_shape(client: httpx.AsyncClient, app) -> None:
    r = await client.get("/resources", headers=H)
    assert r.status_code == 200
    body = r.json()
    assert body == app.state.host.resources.snapshot()  # the route returns exactly it
    assert body["memory_type"] == "VRAM"
    assert body["vram"]["available_gb"] == 16.0
    assert body["ram"]["available_gb"] == 12.0
    assert body["disk"]["available_gb"] == 400.0
    assert body["reservations"] == []


async def test_create_list_release(client: httpx.AsyncClient, app) -> None:
    events: list[str] = []
    app.state.host.bus.subscribe(lambda e: events.append(e.reason), ReservationsChanged)
    r = await client.post(
        "/resources/reservations",
        headers=H,
        json={
            "job_id": "intent:abc",
            "requester": "intent:llama",
            "workload_type": "inference",
            "vram_gb": 4,
            "ram_gb": 0.0,
            "ttl_seconds": 3300,
        },
    )
    assert r.status_code == 201, r.text
    view = r.json()
    assert view["id"].startswith("res-") and len(view["id"]) == 36
    assert view["status"] == "pending" and view["vram_gb"] == 4.0 and view["ram_gb"] == 0.0
    assert view["workload_type"] == "inference" and view["requester"] == "intent:llama"
    assert view["actual_vram_gb"] is None and view["expires_at"].endswith("Z")
    snap = (await client.get("/resources", headers=H)).json()
    assert [x["id"] for x in snap["reservations"]] == [view["id"]]
    assert snap["vram"]["reserved_headroom_gb"] == 4.0 and snap["vram"]["available_gb"] == 12.0
    r = await client.delete(f"/resources/reservations/{view['id']}", headers=H)
    assert r.status_code == 200 and r.json() == {"detail": "released", "id": view["id"]}
    r = await client.delete(f"/resources/reservations/{view['id']}", headers=H)
    assert r.status_code == 404 and view["id"] in r.json()["detail"]
    assert events == ["created", "released"]


async def test_capacity_409_is_flat(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/resources/reservations", headers=H, json={"job_id": "j", "vram_gb": 20, "ram_gb": 1}
    )
    assert r.status_code == 409
    assert r.json() == {
        "error": "capacity_exceeded",
        "dimension": "vram",
        "requested_gb": 20.0,
        "available_gb": 16.0,
    }
    r = await client.post(
        "/resources/reservations",
        headers=H,
        json={"job_id": "j", "vram_gb": 1, "ram_gb": 1, "disk_gb": 401},
    )
    assert r.status_code == 409 and r.json()["dimension"] == "disk"
    assert (await client.get("/resources", headers=H)).json()["reservations"] == []


async def test_bad_bodies_are_422_and_change_nothing(client: httpx.AsyncClient) -> None:
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    cases = [
        ({}, "job_id"),
        ({"job_id": "j", "ram_gb": 1}, "vram_gb"),
        ({"job_id": "j", "vram_gb": None, "ram_gb": 1}, "vram_gb"),
        ({"job_id": "j", "vram_gb": -1, "ram_gb": 1}, "vram_gb"),
        ({"job_id": "j", "vram_gb": 1, "ram_gb": -2}, "ram_gb"),
        ({"job_id": "j", "vram_gb": 1, "ram_gb": 1, "disk_gb": -1}, "disk_gb"),
        ({"job_id": "j", "vram_gb": 1, "ram_gb": 1, "ttl_seconds": 0}, "ttl_seconds"),
        (
            {"job_id": "j", "vram_gb": 1, "ram_gb": 1, "ttl_seconds": 60, "expires_at": future},
            "ttl_seconds or expires_at",
        ),
        ({"job_id": "j", "vram_gb": 1, "ram_gb": 1, "expires_at": "2000-01-01T00:00"}, "past"),
        ({"job_id": "j", "vram_gb": 1, "ram_gb": 1, "expires_at": "soon"}, "expires_at"),
        ({"job_id": "j", "vram_gb": 1, "ram_gb": 1, "workload_type": "x"}, "workload_type"),
        # Near the float limit two sizes sum to inf, which no JSON answer can carry (was a 500).
        ({"job_id": "j", "vram_gb": 1e308, "ram_gb": 1e308}, "vram_gb"),
        ({"job_id": "j", "vram_gb": 1, "ram_gb": 1, "disk_gb": 2.0**21}, "disk_gb"),
    ]
    for body, mention in cases:
        r = await client.post("/resources/reservations", headers=H, json=body)
        assert r.status_code == 422, (body, r.text)
        assert mention in r.text, (mention, r.text)
    r = await client.post(
        "/resources/reservations",
        headers={**H, "Content-Type": "application/json"},
        content=b"{not json",
    )
    assert r.status_code == 422
    assert (await client.get("/resources", headers=H)).json()["reservations"] == []


async def test_naive_expires_at_read_as_utc(client: httpx.AsyncClient) -> None:
    naive = (datetime.now(UTC) + timedelta(hours=2)).replace(tzinfo=None, microsecond=0)
    r = await client.post(
        "/resources/reservations",
        headers=H,
        json={"job_id": "j", "vram_gb": 1, "ram_gb": 1, "expires_at": naive.isoformat()},
    )
    assert r.status_code == 201 and r.json()["expires_at"] == naive.isoformat() + "Z"


async def test_running_job_rules(client: httpx.AsyncClient, app) -> None:
    jobs = host_jobs(app)
    r = await client.post(
        "/resources/reservations", headers=H, json={"job_id": "job-9", "vram_gb": 2, "ram_gb": 1}
    )
    res_id = r.json()["id"]
    jobs.running.add("job-9")
    snap = (await client.get("/resources", headers=H)).json()
    assert snap["reservations"][0]["status"] == "running"
    r = await client.delete(f"/resources/reservations/{res_id}", headers=H)
    assert r.status_code == 409 and "job 'job-9' is currently running" in r.json()["detail"]
    jobs.running.clear()
    r = await client.delete(f"/resources/reservations/{res_id}", headers=H)
    assert r.status_code == 200


async def test_cpu_host(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), probe=FakeProbe(ram=(16, 4)))
    async with open_client(app) as client:
        r = await client.post(
            "/resources/reservations", headers=H, json={"job_id": "j", "vram_gb": 4, "ram_gb": 1}
        )
        assert r.status_code == 201 and (r.json()["vram_gb"], r.json()["ram_gb"]) == (0.0, 5.0)
        snap = (await client.get("/resources", headers=H)).json()
        assert snap["memory_type"] == "RAM" and snap["vram"] is None
        assert snap["ram"]["available_gb"] == 7.0
        r = await client.post(
            "/resources/reservations", headers=H, json={"job_id": "j", "vram_gb": 8, "ram_gb": 0}
        )
        assert r.status_code == 409 and r.json()["dimension"] == "ram"


async def test_fifty_concurrent_creates(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), probe=FakeProbe(gpus=[(12, 2)], ram=(64, 0)))
    async with open_client(app) as client:

        async def one(i: int) -> int:
            body = {"job_id": f"job-{i}", "vram_gb": 1 + i % 3, "ram_gb": 0.5}
            return (await client.post("/resources/reservations", headers=H, json=body)).status_code

        codes = await asyncio.gather(*(one(i) for i in range(50)))
        assert set(codes) == {201, 409}
        snap = (await client.get("/resources", headers=H)).json()
        assert codes.count(201) == len(snap["reservations"])
        assert sum(r["vram_gb"] for r in snap["reservations"]) <= 10.0
        assert snap["vram"]["available_gb"] >= 0.0


async def test_loops_run_without_control_url(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, reservation_cleanup_interval_s=0.05)
    assert not settings.control_urls
    app = create_app(settings, probe=FakeProbe(gpus=[(24, 0)]))
    async with open_client(app) as client:
        r = await client.post(
            "/resources/reservations",
            headers=H,
            json={"job_id": "j", "vram_gb": 1, "ram_gb": 0, "ttl_seconds": 0.1},
        )
        assert r.status_code == 201
        for _ in range(100):
            snap = (await client.get("/resources", headers=H)).json()
            if not snap["reservations"]:
                break
            await asyncio.sleep(0.05)
        assert snap["reservations"] == []


async def test_openapi_lists_the_routes(client: httpx.AsyncClient) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert "post" in paths["/resources/reservations"]
    assert "delete" in paths["/resources/reservations/{reservation_id}"]
    assert "get" in paths["/resources"]


async def test_without_a_resource_service_503(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), probe=FakeProbe())
    app.state.host.resources = None
    async with open_client(app) as client:
        r = await client.get("/resources", headers=H)
        assert r.status_code == 503 and r.json() == {"detail": "Resource manager unavailable"}

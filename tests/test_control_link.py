"""The control link against a real Socket.IO server playing solar-control (tests/fixtures).

Payloads are validated with pydantic models written from control-contract tables 1.5, 3.1,
3.5, so a shape control would reject fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from solar_host import __version__
from solar_host.control.client import ControlLink, ControlLinkUnavailable
from solar_host.events import (
    InstancesChanged,
    JobLifecycle,
    LogLine,
    PullProgress,
    ReservationsChanged,
    RuntimeStateChanged,
    StepLog,
)
from solar_host.host import Host
from solar_host.instances.errors import InstanceConflict, InstanceNotFound, StartFailed
from solar_host.instances.schemas import Instance
from solar_host.resources.probes import LiveProbe
from solar_host.settings import Settings
from tests.fixtures.control_server import ControlServer, free_port

KEY = "test-host-key-0123456789"
ROOT = Path(__file__).resolve().parents[1]

# --- the contract, as pydantic models ---------------------------------------------------------


class FlatInstance(BaseModel):
    """Contract 3.1; RegistryEntry strictness: alias/supported_endpoints/backend_type never null."""

    model_config = ConfigDict(extra="forbid")
    id: StrictStr
    alias: StrictStr
    status: Literal["stopped", "starting", "running", "failed", "stopping"]
    port: StrictInt | None
    supported_endpoints: list[StrictStr]
    served_model_name: StrictStr | None
    capabilities: list[StrictStr] | None
    backend_type: StrictStr
    priority: Literal["production", "staging", "ephemeral"]
    managed_by: Literal["intent"] | None
    intent_id: StrictStr | None
    model_source: StrictStr | None
    ctx_size: StrictInt | None = None
    created_at: StrictStr


class WSRegistration(BaseModel):
    api_key: StrictStr | None = None
    host_name: StrictStr | None = None
    instances: list[FlatInstance] = []
    gpu_type: Literal["nvidia_cuda", "apple_mps", "cpu"] | None = None
    roles: list[StrictStr] = Field(min_length=1)
    supported_backends: list[StrictStr] | None = None
    version: StrictStr | None = None


class MemoryInfo(BaseModel):
    used_gb: float
    total_gb: float
    available_gb: float | None = None
    percent: float
    memory_type: Literal["VRAM", "RAM"]


class HealthData(BaseModel):
    model_config = ConfigDict(extra="forbid")
    memory: MemoryInfo
    gpu_type: StrictStr
    roles: list[StrictStr] = Field(min_length=1)
    supported_backends: list[StrictStr]
    disk_total_gb: float
    disk_used_gb: float
    disk_available_gb: float
    version: StrictStr
    instance_count: StrictInt
    running_instance_count: StrictInt
    resources: dict[str, Any]
    reservations: dict[str, Any]


class HostHealth(BaseModel):
    timestamp: StrictStr
    data: HealthData


class InstancesUpdate(BaseModel):
    timestamp: StrictStr
    data: dict[Literal["instances"], list[FlatInstance]]


class LogEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instance_id: StrictStr
    seq: StrictInt
    line: StrictStr
    timestamp: StrictStr


class StepLogEntry(BaseModel):
    job_id: StrictStr
    step_name: StrictStr | None
    step_index: StrictInt | None
    stream: StrictStr | None
    seq: StrictInt
    line: StrictStr
    completed: StrictBool = False
    exit_code: StrictInt | None = None
    timestamp: StrictStr


# --- fakes for what the link reads -----------------------------------------------------------


class FakeInstances:
    """The instance-service interface the link uses; publishes InstancesChanged before it
    returns, as the manager does."""

    def __init__(self, bus: Any, start_delay: float = 0.0):
        self.bus = bus
        self.start_delay = start_delay
        self.create_delay = 0.0
        self.items: dict[str, Instance] = {}
        self.calls: list[tuple[str, Any]] = []
        self._n = 0

    def list(self) -> list[Instance]:
        return list(self.items.values())

    def supported_backends(self) -> list[str]:
        return ["llamacpp"]

    def get(self, instance_id: str) -> Instance:
        return self._get(instance_id)

    def _get(self, instance_id: str) -> Instance:
        if instance_id not in self.items:
            raise InstanceNotFound(instance_id)
        return self.items[instance_id]

    @staticmethod
    def _copy(inst: Instance, **changes: Any) -> Instance:
        return Instance.model_validate({**inst.model_dump(), **changes})

    def _set(self, inst: Instance, reason: str) -> Instance:
        self.items[inst.id] = inst
        self.bus.publish(InstancesChanged(inst.id, inst.status.value, reason))
        return inst

    async def create(
        self, config: dict, priority=None, managed_by=None, intent_id=None, instance_id=None
    ):
        self.calls.append(("create", config))
        if instance_id in self.items:
            raise InstanceConflict(f"Instance {instance_id} already exists")
        self._n += 1
        await asyncio.sleep(self.create_delay)
        inst = Instance(
            id=instance_id or f"inst-{self._n}",
            config=config,
            created_at=datetime.now(UTC),
            priority=priority or "production",
            managed_by=managed_by,
            intent_id=intent_id,
            supported_endpoints=["/v1/chat/completions", "/v1/completions", "/v1/models"],
            capabilities=["completion"],
        )
        return self._set(inst, "created")

    async def update(self, instance_id: str, fields: dict):
        self.calls.append(("update", (instance_id, fields)))
        inst = self._get(instance_id)
        changes = {k: v for k, v in fields.items() if k != "config"}
        return self._set(self._copy(inst, **changes), "updated")

    async def delete(self, instance_id: str):
        inst = self._get(instance_id)
        if inst.status.value == "running":
            raise InstanceConflict("Cannot delete a running instance; stop it first")
        del self.items[instance_id]
        self.bus.publish(InstancesChanged(instance_id, None, "deleted"))
        return inst

    async def start(self, instance_id: str):
        self.calls.append(("start", instance_id))
        inst = self._get(instance_id)
        if inst.config.alias == "broken":
            raise StartFailed(instance_id, "Process exited with code 1", 1, ["boom"])
        await asyncio.sleep(self.start_delay)
        return self._set(self._copy(inst, status="running", port=3500), "started")

    async def stop(self, instance_id: str):
        inst = self._get(instance_id)
        return self._set(self._copy(inst, status="stopped", port=None), "stopped")

    async def restart(self, instance_id: str):
        await self.stop(instance_id)
        return await self.start(instance_id)

    def crash(self, instance_id: str) -> Instance:
        """The backend died: the supervisor's own transition, no command behind it."""
        inst = self._get(instance_id)
        return self._set(self._copy(inst, status="failed", port=None), "crashed")


SNAPSHOT = {
    "memory_type": "RAM",
    "vram": None,
    "ram": {
        "total_gb": 64.0,
        "system_used_gb": 8.5,
        "reserved_headroom_gb": 0.0,
        "reported_used_gb": 8.5,
        "available_gb": 55.5,
    },
    "disk": None,
    "reservations": [],
}


class FakeResources:
    def snapshot(self) -> dict:
        return json.loads(json.dumps(SNAPSHOT))

    def health_summary(self) -> dict:
        return {"active_count": 0, "ram": {"total_gb": 64.0}}


class FakeJobs:
    available = True


def make_host(tmp_path: Path, urls: str, **settings: Any) -> Host:
    values: dict[str, Any] = {
        "solar_control_url": urls,
        "api_key": KEY,
        "host_name": "test-host",
        "config_file": tmp_path / "config.json",
        "models_dir": tmp_path / "models",
        "ws_reconnect_delay": 0.05,
        "ws_reconnect_max_delay": 0.3,
        "health_report_interval_s": 30.0,
        "outbox_flush_interval_s": 0.05,
    }
    values.update(settings)
    host = Host(settings=Settings(**values), probe=LiveProbe())
    host.api_key = KEY
    host.instances = FakeInstances(host.bus)
    host.resources = FakeResources()
    return host


async def started_link(host: Host, **kw: Any) -> ControlLink:
    link = ControlLink(host, **kw)
    host.control = link
    await link.start()
    return link


async def wait_for(predicate: Any, within_s: float = 5.0) -> Any:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.01)
    raise TimeoutError("condition not met")


@pytest.fixture
async def server():
    srv = ControlServer()
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def known_server():
    srv = ControlServer(known_keys={KEY: "host-1"})
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def link_factory():
    links: list[ControlLink] = []

    async def make(host: Host, **kw: Any) -> ControlLink:
        link = await started_link(host, **kw)
        links.append(link)
        return link

    yield make
    for link in links:
        await link.stop()


# --- registration and approval ----------------------------------------------------------------


async def test_pending_approve_ack_then_full_sync(tmp_path, server, link_factory):
    host = make_host(tmp_path, server.url + "/ws/host-channel", health_report_interval_s=0.3)
    host.jobs = FakeJobs()
    await host.instances.create(
        {"backend_type": "llamacpp", "alias": "tiny:1b", "model": "/m.gguf"}
    )
    link = await link_factory(host)

    pending_id = await server.wait_until(lambda: server.pending_ids() and server.pending_ids()[0])
    assert server.connects == [{"api_key": KEY, "host_name": "test-host"}]
    await wait_for(lambda: link.pending_id == pending_id)
    # While pending: registration (full), repeated; nothing else is sent.
    regs = await server.wait_event("registration", count=2, within_s=3)
    reg = WSRegistration.model_validate(regs[0])
    assert reg.host_name == "test-host" and reg.version == __version__
    assert reg.roles == ["inference", "training"] and reg.supported_backends == ["llamacpp"]
    assert [i.alias for i in reg.instances] == ["tiny:1b"] and reg.instances[0].ctx_size
    assert {r.event for r in server.received} == {"registration"}
    assert link.connected and not link.registered
    assert await link.reconnect() == "already_connected"

    host_id = await server.approve(pending_id)
    await server.wait_event("host_health", approved=True)
    approved = [r.event for r in server.received if r.approved]
    assert approved[:3] == ["registration", "instances_update", "host_health"]
    assert link.host_id == host_id and link.registered
    InstancesUpdate.model_validate(server.events("instances_update")[0])
    health = HostHealth.model_validate(server.events("host_health")[0])
    assert health.data.resources == SNAPSHOT
    assert json.dumps(server.events("host_health")[0]["data"]["resources"]) == json.dumps(SNAPSHOT)
    assert health.data.instance_count == 1 and health.data.running_instance_count == 0
    # And the cadence: host_health keeps coming every HEALTH_REPORT_INTERVAL_S.
    t0 = time.monotonic()
    await server.wait_event("host_health", count=3, within_s=3)
    assert time.monotonic() - t0 < 1.5
    for body in server.events("host_health"):
        HostHealth.model_validate(body)


async def test_known_key_gets_ack_before_connect_and_still_syncs(
    tmp_path, known_server, link_factory, monkeypatch
):
    """Control emits registration_ack inside its connect handler: it reaches the client before
    the namespace counts as connected (contract 8.2). The sync must still happen."""
    seen: list[bool] = []
    original = ControlLink._maybe_sync

    def traced(self: ControlLink, session: Any) -> None:
        seen.append(session.ns_connected)
        original(self, session)

    monkeypatch.setattr(ControlLink, "_maybe_sync", traced)
    host = make_host(tmp_path, known_server.url)
    link = await link_factory(host)
    await known_server.wait_event("host_health")
    events = [r.event for r in known_server.received]
    assert events[:3] == ["registration", "instances_update", "host_health"]
    assert events.count("registration") == 1  # one sync, not one per handler
    assert link.host_id == "host-1" and not known_server.pending_ids()
    assert link.metrics()["sent"]["host_health"] == 1
    assert seen == [False, True]  # the ack came first; the connect handler ran the sync


async def test_reject_stops_reconnecting_until_reconnect(tmp_path, server, link_factory):
    host = make_host(tmp_path, server.url)
    link = await link_factory(host)
    pending_id = await server.wait_until(lambda: server.pending_ids() and server.pending_ids()[0])
    await server.reject(pending_id)
    await wait_for(lambda: link.rejected and not link.connected)
    await asyncio.sleep(1.0)  # 3x the backoff cap: no new attempt
    assert len(server.connects) == 1
    assert link.metrics()["rejected"] is True

    assert await link.reconnect() == "reconnecting"
    await server.wait_until(lambda: len(server.connects) == 2 and server.pending_ids())
    assert not link.rejected


async def test_reconnect_route_answers_like_the_reference(tmp_path, known_server, link_factory):
    host = make_host(tmp_path, known_server.url)
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    assert await link.reconnect() == "already_connected"
    await link.stop()
    with pytest.raises(ControlLinkUnavailable):
        await link.reconnect()


async def test_reconnect_wakes_the_backoff_at_once(tmp_path, link_factory):
    port = free_port()
    host = make_host(
        tmp_path, f"http://127.0.0.1:{port}", ws_reconnect_delay=5.0, ws_reconnect_max_delay=5.0
    )
    link = await link_factory(host)
    await wait_for(lambda: link.connect_failures >= 1)
    srv = ControlServer(known_keys={KEY: "h"}, port=port)
    await srv.start()
    try:
        t0 = time.monotonic()
        assert await link.reconnect() == "reconnecting"
        await wait_for(lambda: link.registered, within_s=3)
        assert time.monotonic() - t0 < 1.0
    finally:
        await link.stop()
        await srv.stop()


# --- reconnects and fail-over -----------------------------------------------------------------


async def test_control_restart_on_same_port_reconnects_within_the_cap(
    tmp_path, known_server, link_factory
):
    host = make_host(tmp_path, known_server.url)
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    await known_server.stop()
    await wait_for(lambda: not link.connected)
    await asyncio.sleep(0.5)  # some failed attempts while control is away
    assert link.connect_failures >= 1
    known_server.received.clear()
    t0 = time.monotonic()
    await known_server.start()
    await known_server.wait_event("host_health", within_s=3)
    assert time.monotonic() - t0 < 0.3 + 0.5  # cap 0.3 s plus connect time
    assert link.reconnects == 1 and link.registered
    assert [r.event for r in known_server.received][:3] == [
        "registration",
        "instances_update",
        "host_health",
    ]


async def test_fails_over_to_the_second_url(tmp_path, known_server, link_factory):
    dead = f"http://127.0.0.1:{free_port()}"
    host = make_host(tmp_path, f"{dead},{known_server.url}")
    link = await link_factory(host)
    await wait_for(lambda: link.registered, within_s=2)
    assert link.metrics()["url"] == known_server.url
    assert link.connect_failures == 1


async def test_connect_timeout_is_retried(tmp_path, known_server, link_factory):
    known_server.hang_connect = True
    host = make_host(tmp_path, known_server.url)
    link = await link_factory(host, connect_timeout_s=0.3)
    await wait_for(lambda: link.connect_failures >= 2, within_s=4)
    known_server.hang_connect = False
    await wait_for(lambda: link.registered, within_s=4)


# --- telemetry --------------------------------------------------------------------------------


async def test_instances_update_follows_each_change_promptly(tmp_path, known_server, link_factory):
    host = make_host(tmp_path, known_server.url)
    link = await link_factory(host)
    await known_server.wait_event("host_health")
    n0 = len(known_server.events("instances_update"))
    t0 = time.monotonic()
    inst = await host.instances.create({"backend_type": "llamacpp", "alias": "a:1b", "model": "/a"})
    updates = await known_server.wait_event("instances_update", count=n0 + 1, within_s=2)
    assert time.monotonic() - t0 < 0.5
    assert [i["id"] for i in updates[-1]["data"]["instances"]] == [inst.id]
    # A burst: at most one send in flight, and the last list is the newest.
    for _ in range(20):
        await host.instances.start(inst.id)
        await host.instances.stop(inst.id)
    await host.instances.start(inst.id)
    await known_server.wait_until(
        lambda: (
            known_server.events("instances_update")[-1]["data"]["instances"][0]["status"]
            == "running"
        )
    )
    sent = len(known_server.events("instances_update")) - n0 - 1
    assert 1 <= sent <= 41
    entry = FlatInstance.model_validate(
        known_server.events("instances_update")[-1]["data"]["instances"][0]
    )
    assert entry.port == 3500 and entry.supported_endpoints
    assert link.sent["instances_update"] == len(known_server.events("instances_update"))


async def test_reservation_change_pushes_health_early(tmp_path, known_server, link_factory):
    host = make_host(
        tmp_path, known_server.url, health_report_interval_s=30.0, control_report_echo_s="1.5"
    )
    await link_factory(host)
    await known_server.wait_event("host_health")
    t0 = time.monotonic()
    for _ in range(5):  # a burst is debounced into one push
        host.bus.publish(ReservationsChanged("created"))
    await known_server.wait_event("host_health", count=2, within_s=2)
    pushed = time.monotonic() - t0
    assert pushed < 1.0
    # Then one echo, 1.5 s after the change, and nothing more.
    await known_server.wait_event("host_health", count=3, within_s=4)
    assert time.monotonic() - t0 >= 1.5
    await asyncio.sleep(0.3)
    assert len(known_server.events("host_health")) == 3


async def test_log_flood_is_batched_capped_and_never_blocks(tmp_path, known_server, link_factory):
    host = make_host(
        tmp_path, known_server.url, outbox_max_entries=500, outbox_flush_interval_s=0.2
    )
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    now = datetime.now(UTC).isoformat()
    t0 = time.perf_counter()
    for i in range(20_000):
        host.bus.publish(LogLine("inst-1", i, now, f"line {i}"))
    for i in range(10):
        host.bus.publish(RuntimeStateChanged("inst-1", now, {"busy": True, "n": i}))
    publish_s = time.perf_counter() - t0
    assert publish_s < 1.0, publish_s  # ~10 us per publish, whatever the socket does
    batches = await known_server.wait_event("log_batch")
    await known_server.wait_event("instance_state_batch")
    entries = [LogEntry.model_validate(e) for b in batches for e in b["entries"]]
    assert len(entries) <= 500
    assert entries[-1].seq == 19_999
    assert link.metrics()["dropped"]["log"] >= 19_500
    (state_batch,) = known_server.events("instance_state_batch")
    assert [e["data"]["n"] for e in state_batch["entries"]] == [9]
    assert link.metrics()["sent"]["log_batch"] == len(batches)


async def test_jobs_pulls_and_step_logs_pass_through(tmp_path, known_server, link_factory):
    host = make_host(tmp_path, known_server.url)
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    now = datetime.now(UTC).isoformat()
    bus = host.bus
    bus.publish(
        JobLifecycle(
            "job_started", {"job_id": "j1", "name": "n", "status": "running", "timestamp": now}
        )
    )
    for seq in range(3):
        bus.publish(
            StepLog(
                {
                    "job_id": "j1",
                    "step_name": "s",
                    "step_index": 0,
                    "stream": "stdout",
                    "seq": seq,
                    "line": f"l{seq}",
                    "timestamp": now,
                }
            )
        )
    bus.publish(
        StepLog(
            {
                "job_id": "j1",
                "step_name": "s",
                "step_index": 0,
                "stream": "stdout",
                "seq": 3,
                "line": "",
                "completed": True,
                "exit_code": 0,
                "timestamp": now,
            }
        )
    )
    bus.publish(
        PullProgress(
            {
                "source_uri": "repo://m:1",
                "phase": "downloading",
                "bytes_done": 1,
                "bytes_total": 2,
                "speed_bps": 1.0,
            }
        )
    )
    bus.publish(
        PullProgress(
            {
                "source_uri": "repo://m:1",
                "phase": "completed",
                "bytes_done": 2,
                "bytes_total": 2,
                "speed_bps": None,
            }
        )
    )
    (started,) = await known_server.wait_event("job_started")
    assert started["host_id"] == "host-1" and started["job_id"] == "j1"
    (steps,) = await known_server.wait_event("step_log")
    parsed = [StepLogEntry.model_validate(e) for e in steps["entries"]]
    assert [e.seq for e in parsed] == [0, 1, 2, 3] and parsed[-1].completed
    pulls = await known_server.wait_event("pull_progress", count=2)
    assert [p["data"]["phase"] for p in pulls] == ["downloading", "completed"]
    assert all(isinstance(p["timestamp"], str) for p in pulls)


async def test_unreachable_control_never_delays_anything(tmp_path, link_factory):
    # A control that accepts the connection and never answers: anything that waited on it would
    # wait for the whole connect timeout (30 s here), far above the bound below, which leaves a
    # loaded machine room for the create's fsync and the thousand publishes (0.1 s failed under
    # two CPU hogs in CI: 0.125 s).
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    host = make_host(tmp_path, f"http://127.0.0.1:{silent.getsockname()[1]}")
    link = await link_factory(host, connect_timeout_s=30.0)
    now = datetime.now(UTC).isoformat()
    t0 = time.perf_counter()
    inst = await host.instances.create({"backend_type": "llamacpp", "alias": "x", "model": "/x"})
    await host.instances.start(inst.id)
    for i in range(1000):
        host.bus.publish(LogLine(inst.id, i, now, "x"))
    host.bus.publish(JobLifecycle("job_failed", {"job_id": "j"}))
    host.bus.publish(ReservationsChanged())
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, elapsed
    assert not link.connected
    assert link.metrics()["dropped"]["log"] == 1000
    assert link.metrics()["dropped"]["job_lifecycle"] == 1
    assert await link.reconnect() == "reconnecting"
    silent.close()


# --- commands over the socket -----------------------------------------------------------------


async def test_commands_answer_through_acks(tmp_path, known_server, link_factory):
    host = make_host(tmp_path, known_server.url)
    host.instances.start_delay = 0.6
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    call = known_server.call

    created = await call(
        "create_instance",
        {
            "config": {"backend_type": "llamacpp", "alias": "c:1b", "model": "/c.gguf"},
            "priority": "staging",
            "managed_by": "intent",
            "intent_id": "i-1",
        },
    )
    assert created["ok"] is True
    inst = Instance.model_validate(created["instance"])
    assert inst.priority == "staging" and inst.intent_id == "i-1"
    iid = inst.id

    # A slow start does not hold up other commands on the same socket.
    t0 = time.monotonic()
    start = asyncio.create_task(call("start_instance", {"instance_id": iid}))
    await asyncio.sleep(0.1)
    updated = await call(
        "update_instance", {"instance_id": iid, "managed_by": None, "intent_id": None}
    )
    assert time.monotonic() - t0 < 0.45  # the start is still running
    assert updated["ok"] and updated["instance"]["managed_by"] is None
    assert host.instances.calls[-1] == ("update", (iid, {"managed_by": None, "intent_id": None}))
    assert not start.done()
    started = await start
    assert started["ok"] and started["instance"]["status"] == "running"

    conflict = await call("delete_instance", {"instance_id": iid})
    assert conflict == {
        "ok": False,
        "status": 409,
        "detail": "Cannot delete a running instance; stop it first",
        "error": {
            "code": "conflict",
            "message": "Cannot delete a running instance; stop it first",
        },
    }
    assert (await call("stop_instance", {"instance_id": iid}))["instance"]["status"] == "stopped"
    assert (await call("restart_instance", {"instance_id": iid}))["ok"]
    await call("stop_instance", {"instance_id": iid})
    assert (await call("delete_instance", {"instance_id": iid}))["ok"]

    missing = await call("start_instance", {"instance_id": "nope"})
    assert missing == {
        "ok": False,
        "status": 404,
        "detail": "Instance not found",
        "error": {"code": "not_found", "message": "Instance not found"},
    }
    no_id = await call("stop_instance", {})
    assert no_id["ok"] is False and no_id["status"] == 400 and "instance_id" in no_id["detail"]
    bad = await call("create_instance", {"priority": "urgent"})
    assert bad["status"] == 422 and bad["error"]["code"] == "invalid_body"
    assert {tuple(e["loc"]) for e in bad["detail"]} == {("config",), ("priority",)}
    assert "config" in bad["error"]["message"] and "priority" in bad["error"]["message"]

    broken = await call(
        "create_instance",
        {"config": {"backend_type": "llamacpp", "alias": "broken", "model": "/b"}},
    )
    failed = await call("start_instance", {"instance_id": broken["instance"]["id"]})
    assert failed["ok"] is False and failed["status"] == 500
    assert failed["exit_code"] == 1 and failed["log_tail"] == ["boom"]
    assert "Process exited" in failed["detail"]
    assert failed["error"]["code"] == "start_failed"


async def test_build_host_wires_the_link_only_with_a_url(tmp_path):
    from solar_host.host import build_host

    base = {"api_key": KEY, "config_file": tmp_path / "c.json", "models_dir": tmp_path / "m"}
    standalone = build_host(Settings(**base))
    assert standalone.control is None
    linked = build_host(Settings(**base, solar_control_url="ws://127.0.0.1:9/ws/host-channel"))
    assert isinstance(linked.control, ControlLink)
    assert linked.control.urls == ["http://127.0.0.1:9"]
    assert linked.lifecycle[-1] is linked.control


# --- the whole host ---------------------------------------------------------------------------


@pytest.fixture
async def app_host(tmp_path, known_server):
    """A real host (create_app with every real service) linked to the fake control."""
    import httpx

    from solar_host.app import create_app

    settings = Settings(
        api_key=KEY,
        host_name="real-host",
        solar_control_url=known_server.url,
        config_file=tmp_path / "config.json",
        log_dir=tmp_path / "logs",
        models_dir=tmp_path / "models",
        jobs_dir=tmp_path / "jobs",
        ws_reconnect_delay=0.05,
        ws_reconnect_max_delay=0.3,
        health_report_interval_s=30.0,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://host", headers={"X-API-Key": KEY}
        ) as client:
            yield app.state.host, client


async def test_real_host_reports_and_pushes_before_post_instances_answers(
    tmp_path, known_server, app_host
):
    host, client = app_host
    link = host.control
    await known_server.wait_event("host_health")
    health = HostHealth.model_validate(known_server.events("host_health")[0])
    # The resources block is byte-identical to GET /resources.
    resources = (await client.get("/resources")).json()
    sent = known_server.events("host_health")[0]["data"]["resources"]
    assert set(sent) == set(resources) and sent["memory_type"] == resources["memory_type"]
    assert health.data.roles[0] == "inference"

    model = tmp_path / "models" / "tiny.gguf"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(b"GGUF")
    before = link.sent["instances_update"]
    r = await client.post(
        "/instances",
        json={"config": {"backend_type": "llamacpp", "alias": "tiny:1b", "model": str(model)}},
    )
    assert r.status_code == 200, r.text
    # The emit was already handed to the socket when the response came back.
    assert link.sent["instances_update"] == before + 1
    iid = r.json()["instance"]["id"]
    updates = await known_server.wait_until(
        lambda: [u for u in known_server.events("instances_update") if u["data"]["instances"]]
    )
    entry = FlatInstance.model_validate(updates[-1]["data"]["instances"][0])
    assert entry.id == iid and entry.alias == "tiny:1b" and entry.status == "stopped"
    assert entry.backend_type == "llamacpp" and entry.ctx_size

    r = await client.post("/reconnect")
    assert r.status_code == 200 and r.json() == {"status": "already_connected"}
    await link.stop()
    r = await client.post("/reconnect")
    assert r.status_code == 503 and r.json()["detail"] == "Failed to trigger reconnection"


@pytest.mark.parametrize("insecure", [False, True])
async def test_tls_verification_is_off_only_when_insecure(
    tmp_path, known_server, link_factory, monkeypatch, insecure
):
    import socketio

    made: list[dict[str, Any]] = []
    real = socketio.AsyncClient

    def spy(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr("solar_host.control.client.socketio.AsyncClient", spy)
    host = make_host(tmp_path, known_server.url, insecure=insecure)
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    assert made[0]["ssl_verify"] is (not insecure)
    assert made[0]["reconnection"] is False


# --- crash recovery through a control quiet window ---------------------------------------------


@pytest.mark.parametrize("echo", ["1,2,3,4,5", ""])
async def test_crash_inside_the_settle_window_is_seen_within_a_second_after_it(
    tmp_path, known_server, link_factory, echo
):
    """Control's reconciler ignores an intent for 3 s after creating its replica; a crash the
    host reports inside that window must reach it again within 1 s after the window."""
    window = 3.0
    known_server.settle_window_s = window
    host = make_host(tmp_path, known_server.url, control_report_echo_s=echo)
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    created = await known_server.call(
        "create_instance",
        {
            "config": {"backend_type": "llamacpp", "alias": "r:1b", "model": "/r.gguf"},
            "managed_by": "intent",
            "intent_id": "intent-1",
        },
    )
    assert "intent-1" in known_server.intent_created  # the create opened the window
    iid = created["instance"]["id"]
    assert (await known_server.call("start_instance", {"instance_id": iid}))["ok"]
    # As if the replica had been created half a second before the crash, whatever the load.
    opened = known_server.intent_created["intent-1"] = time.monotonic() - 0.5
    host.instances.crash(iid)  # well inside the window
    await known_server.wait_until(
        lambda: any(e.get("status") == "failed" for e in known_server.cache), within_s=2
    )
    assert time.monotonic() - opened < window  # the report itself landed in the window

    def failed_seen() -> list[Any]:
        return [o for o in known_server.observed if o.status == "failed" and o.instance_id == iid]

    if echo:
        (first, *_) = await known_server.wait_until(failed_seen, within_s=window + 3)
        assert window <= first.at - opened <= window + 1.0, first.at - opened
        assert link.metrics()["echoes"] >= 1
    else:
        # Without echoes nothing wakes the reconciler until the next health tick (30 s here):
        # the fixture's window really swallows the report.
        await asyncio.sleep(window + 1.5 - (time.monotonic() - opened))
        assert not failed_seen() and known_server.skipped_wakes >= 1


# --- bounded, coalesced reporting --------------------------------------------------------------


async def test_a_burst_of_2000_changes_sends_a_few_dozen_full_lists(
    tmp_path, known_server, link_factory
):
    host = make_host(tmp_path, known_server.url, health_report_interval_s=30.0)
    link = await link_factory(host)
    await known_server.wait_event("host_health")
    lists0 = len(known_server.events("instances_update"))
    health0 = len(known_server.events("host_health"))
    t0 = time.monotonic()
    config = {"backend_type": "llamacpp", "alias": "b:1b", "model": "/b.gguf"}
    for i in range(2000):
        await host.instances.create(dict(config))
        if i % 20 == 19:
            await asyncio.sleep(0.02)  # spread over about two seconds
    burst_s = time.monotonic() - t0
    # Wait for the newest list and then for the echoes to end (the last at +5 s).
    await known_server.wait_until(
        lambda: len(known_server.events("instances_update")[-1]["data"]["instances"]) == 2000,
        within_s=10,
    )
    await wait_for(lambda: not link.instances_reporter.pending, within_s=15)
    await asyncio.sleep(0.3)
    lists = known_server.events("instances_update")[lists0:]
    healths = known_server.events("host_health")[health0:]
    elapsed = time.monotonic() - t0
    # At most ~10 per second while changes come, then the five echoes.
    assert 2 <= len(lists) <= 10 * burst_s + 5 + 3, (len(lists), burst_s)
    assert len(lists) < 60
    assert len(healths) <= 10 * elapsed + 3, (len(healths), elapsed)
    # Each one is a full list (control replaces its cache with it), and they only grow.
    sizes = [len(b["data"]["instances"]) for b in lists]
    assert sizes == sorted(sizes) and sizes[-1] == 2000
    InstancesUpdate.model_validate(lists[-1])
    gaps = [
        b.at - a.at
        for a, b in zip(
            [r for r in known_server.received if r.event == "instances_update"][lists0:],
            [r for r in known_server.received if r.event == "instances_update"][lists0 + 1 :],
            strict=False,
        )
    ]
    # 0.1 s apart when sent; delivery jitter can pull two arrivals closer, not most of them.
    assert sorted(gaps)[len(gaps) // 2] >= 0.09, sorted(gaps)


# --- commands: one answer each -----------------------------------------------------------------


async def test_commands_beyond_the_bound_are_answered_busy(tmp_path, known_server, link_factory):
    host = make_host(tmp_path, known_server.url, control_max_commands_in_flight=4)
    host.instances.start_delay = 1.0
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    created = await known_server.call(
        "create_instance",
        {"config": {"backend_type": "llamacpp", "alias": "s:1b", "model": "/s.gguf"}},
    )
    iid = created["instance"]["id"]
    answers = await known_server.flood([("start_instance", {"instance_id": iid})] * 20)
    assert None not in answers  # every command answered
    ok = [a for a in answers if a["ok"]]
    busy = [a for a in answers if not a["ok"]]
    assert len(ok) == 4 and len(busy) == 16
    assert {a["error"]["code"] for a in busy} == {"busy"} and {a["status"] for a in busy} == {503}
    assert link.metrics()["commands_refused"]["busy"] == 16
    assert link.commands.in_flight == 0
    # Free again once they finished.
    assert (await known_server.call("stop_instance", {"instance_id": iid}))["ok"]


async def test_oversized_and_malformed_commands_each_get_one_structured_answer(
    tmp_path, known_server, link_factory
):
    host = make_host(tmp_path, known_server.url)
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    call = known_server.call
    huge = {
        "config": {
            "backend_type": "llamacpp",
            "alias": "big",
            "model": "/b.gguf",
            "x": "a" * (3 * 1024 * 1024),
        }
    }
    t0 = time.monotonic()
    big = await call("create_instance", huge)
    assert time.monotonic() - t0 < 5
    assert big["ok"] is False and big["status"] == 413
    assert big["error"]["code"] == "payload_too_large" and "1048576" in big["error"]["message"]
    assert host.instances.items == {}  # nothing created
    assert link.registered  # the link survived it
    for payload in (None, "start", ["instance_id"], 42):
        answer = await call("start_instance", payload)
        assert answer["ok"] is False and answer["status"] == 400, payload
        assert answer["error"]["code"] == "invalid_request"
    wrong = await call("stop_instance", {"instance_id": 7})
    assert wrong["status"] == 400 and "instance_id" in wrong["error"]["message"]
    nope = await call("delete_instance", {"instance_id": "missing"})
    assert nope["error"] == {"code": "not_found", "message": "Instance not found"}
    gone = await call("update_instance", {"instance_id": "missing", "managed_by": None})
    assert gone["status"] == 404 and gone["error"]["code"] == "not_found"
    # The link still works normally.
    ok = await call(
        "create_instance",
        {"config": {"backend_type": "llamacpp", "alias": "k", "model": "/k.gguf"}},
    )
    assert ok["ok"] is True


async def test_a_create_carrying_an_id_is_idempotent(tmp_path, known_server, link_factory):
    host = make_host(tmp_path, known_server.url)
    host.instances.create_delay = 0.3
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    body = {
        "instance_id": "replica-7",
        "config": {"backend_type": "llamacpp", "alias": "i:1b", "model": "/i.gguf"},
        "managed_by": "intent",
        "intent_id": "intent-7",
    }
    # The sender retries while the first create still runs, and once more afterwards.
    first, retry = await known_server.flood([("create_instance", body)] * 2)
    again = await known_server.call("create_instance", body)
    assert first["ok"] and retry["ok"] and again["ok"]
    assert {a["instance"]["id"] for a in (first, retry, again)} == {"replica-7"}
    assert "existing" not in first and retry["existing"] and again["existing"]
    assert list(host.instances.items) == ["replica-7"]
    assert [c for c in host.instances.calls if c[0] == "create"] == [("create", body["config"])]
    for bad_id in ("", "../x", "a" * 200, 12, "has space"):
        answer = await known_server.call("create_instance", {**body, "instance_id": bad_id})
        assert answer["status"] == 422 and answer["detail"][0]["loc"] == ["instance_id"], bad_id
    assert list(host.instances.items) == ["replica-7"]


# --- hostile and malformed events ----------------------------------------------------------------


async def test_an_ack_after_rejected_keeps_the_link_reconnecting(
    tmp_path, known_server, link_factory
):
    known_server.connect_script = [
        ("rejected", {"reason": "changed my mind"}),
        ("registration_ack", {"host_id": "host-1", "host_name": "h", "timestamp": "t"}),
    ]
    host = make_host(tmp_path, known_server.url)
    link = await link_factory(host)
    await wait_for(lambda: link.registered)
    assert not link.rejected and link.host_id == "host-1"
    known_server.connect_script = None
    await known_server.drop()
    await known_server.wait_until(lambda: len(known_server.connects) == 2, within_s=5)
    await wait_for(lambda: link.registered)
    # And a rejection as the last word does stop it, for this key.
    known_server.connect_script = [("rejected", {"reason": 17})]
    await known_server.drop()
    await known_server.wait_until(lambda: len(known_server.connects) == 3, within_s=5)
    await wait_for(lambda: link.rejected)
    assert link.rejected_reason is None and link.metrics()["ignored_fields"] >= 1
    await known_server.drop()
    await asyncio.sleep(1.0)  # 3x the backoff cap
    assert len(known_server.connects) == 3


async def test_wrong_typed_fields_are_ignored_and_nothing_wedges(tmp_path, server, link_factory):
    host = make_host(tmp_path, server.url, health_report_interval_s=0.3)
    link = await link_factory(host)
    await server.wait_until(lambda: server.pending_ids())
    sid = server.only_sid()
    await wait_for(lambda: link.pending_id is not None)
    for event, data in [
        ("pending", {"pending_id": {"x": 1}}),
        ("registration_ack", {"host_id": 123, "host_name": ["x"]}),
        ("registration_ack", {"host_id": True}),
        ("registration_ack", "not a dict"),
        ("rejected", [1, 2]),
        ("registration_ack", {"host_id": "h" * 10_000}),
        ("no_such_event", {"a": 1}),
        ("start_instance", "x" * 100),
    ]:
        await server.emit(event, data, sid=sid)
    await wait_for(lambda: link.metrics()["ignored_fields"] >= 7)
    # Wrong types (and a 10 kB id) never stored.
    assert link.pending_id is None and link.host_id is None
    # The last word was an ack (after the rejected): still connected, registered, not rejected.
    assert link.registered and not link.rejected
    n = len(server.events("host_health"))
    await server.wait_event("host_health", count=n + 2, within_s=3)
    await server.emit("registration_ack", {"host_id": "host-9", "host_name": "h9"}, sid=sid)
    await wait_for(lambda: link.host_id == "host-9")


async def test_a_control_repeating_malformed_events_cannot_flood_the_log(
    tmp_path, server, link_factory, caplog
):
    host = make_host(tmp_path, server.url)
    link = await link_factory(host)
    await server.wait_until(lambda: server.pending_ids())
    sid = server.only_sid()
    caplog.clear()
    for _ in range(500):
        await server.emit("pending", {"pending_id": 5}, sid=sid)
        await server.emit("pending", {"pending_id": "same"}, sid=sid)
    await wait_for(lambda: link.metrics()["ignored_fields"] >= 500, within_s=10)
    control_lines = [r for r in caplog.records if r.name == "solar_host.control.client"]
    assert len(control_lines) <= 60, len(control_lines)
    assert link.connected


# --- a control that stops reading ----------------------------------------------------------------


async def test_a_control_that_stops_reading_cannot_grow_the_hosts_queues(tmp_path, link_factory):
    """Control's process frozen (SIGSTOP): its socket stops reading, the host's TCP buffers fill,
    and from then on reports wait (coalesced) and the outbox keeps its cap, instead of piling
    full lists into the socket's send queue."""
    import os
    import signal
    import sys

    from solar_host.control.connection import MAX_QUEUED_PACKETS

    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.fixtures.control_server",
        "--port",
        str(port),
        "--known",
        f"{KEY}=host-1",
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert b"listening" in line
        host = make_host(
            tmp_path, f"http://127.0.0.1:{port}", outbox_max_entries=1000, ws_reconnect_delay=0.2
        )
        link = await link_factory(host)
        await wait_for(lambda: link.registered, within_s=20)
        config = {"backend_type": "llamacpp", "alias": "q:1b", "model": "/q.gguf"}
        for _ in range(1000):  # lists of ~400 kB each
            await host.instances.create(dict(config))
        os.kill(proc.pid, signal.SIGSTOP)
        queue = link._session.sio.eio.queue  # type: ignore[union-attr]
        now = datetime.now(UTC).isoformat()
        peak = 0
        # Changes and log lines (10 lists/s wanted) until reports have waited a few times and
        # the outbox has had to drop log lines. How soon the socket's buffers (megabytes on
        # loopback) fill depends on how fast this machine encodes and sends lists, so the wait
        # is for both, bounded, not a fixed time (waiting for the reports alone, a fast machine
        # got there before 1,000 log lines had queued, and nothing had been dropped yet).
        deadline = time.monotonic() + 90

        def filled() -> bool:
            m = link.metrics()
            return m["reports_deferred"] >= 5 and m["dropped"].get("log", 0) > 0

        while not filled():
            assert time.monotonic() < deadline, link.metrics()
            inst = next(iter(host.instances.items.values()))
            await host.instances.start(inst.id)
            await host.instances.stop(inst.id)
            for i in range(200):
                host.bus.publish(LogLine(inst.id, i, now, "x" * 200))
            peak = max(peak, queue.qsize())
            await asyncio.sleep(0.05)
        metrics = link.metrics()
        assert peak <= MAX_QUEUED_PACKETS + 8, peak
        assert len(link.outbox) <= 1000 and metrics["dropped"]["log"] > 0
        os.kill(proc.pid, signal.SIGCONT)
        # Control reads again: the newest list gets through (on this session or a new one).
        n = link.sent["instances_update"]
        await wait_for(lambda: link.sent["instances_update"] > n, within_s=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        await proc.wait()


# --- the Reporter on its own ----------------------------------------------------------------------


async def test_reporter_coalesces_bounds_the_rate_echoes_and_survives_a_failing_send():
    from solar_host.control.reporter import Reporter

    sends: list[float] = []
    fail_next = [True]

    async def send() -> bool:
        if fail_next[0]:
            fail_next[0] = False
            raise RuntimeError("boom")  # a bug in one send
        sends.append(time.monotonic())
        return True

    reporter = Reporter(send, min_interval_s=0.1, echo_s=(0.5, 1.0), cost_factor=0)
    task = asyncio.create_task(reporter.run())
    try:
        reporter.mark()
        await wait_for(lambda: not fail_next[0])  # the failing send was attempted
        t0 = time.monotonic()
        for _ in range(100):  # 100 marks in ~0.5 s: about five sends, not 100
            reporter.mark()
            await asyncio.sleep(0.005)
        last_change = time.monotonic()
        await wait_for(lambda: not reporter.pending, within_s=5)
        during = [t for t in sends if t <= last_change + 0.01]
        after = [t - last_change for t in sends if t > last_change + 0.01]
        assert 2 <= len(during) <= (last_change - t0) / 0.1 + 2, len(during)
        assert all(b - a >= 0.099 for a, b in itertools.pairwise(sends))
        # The last change itself (coalesced), then the two echoes counted from it.
        assert len(after) in (2, 3), after
        assert 0.45 <= after[-2] <= 0.95 and 0.95 <= after[-1] <= 1.6, after
        assert reporter.echoes == 2 and reporter.coalesced >= 50
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("bad", ["1,x", "0", "-1", "61"])
def test_a_bad_echo_schedule_is_refused_naming_the_setting(bad):
    from solar_host.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="CONTROL_REPORT_ECHO_S"):
        load_settings(None, environ={"API_KEY": KEY, "CONTROL_REPORT_ECHO_S": bad})
    assert Settings(api_key=KEY, control_report_echo_s=" 2, 0.5 ,").control_echo_delays == [
        0.5,
        2.0,
    ]


# --- a hostile control, second review: packets that wedged the link or grew memory ------------


async def _raw_send(server: ControlServer, data: str | bytes) -> None:
    """A raw Engine.IO message to the only connected host, past the server's own encoder."""
    eio_sid = server.sio.manager.eio_sid_from_sid(server.only_sid(), "/hosts")
    await server.sio.eio.send(eio_sid, data)


async def test_a_binary_event_from_control_is_refused_and_commands_still_answer(
    tmp_path: Path,
) -> None:
    """A binary event's header announcing a million attachments: every message after it was
    taken as one, so commands were never answered while the link looked healthy, and each
    binary frame was kept in memory. The contract has no binary events: refused, one by one."""
    async with ControlServer(known_keys={KEY: "h1"}) as server:
        link = await started_link(make_host(tmp_path, server.url))
        try:
            await wait_for(lambda: link.registered, 10)
            await _raw_send(server, '51000000-/hosts,["pending",{"_placeholder":true,"num":0}]')
            for _ in range(20):
                await _raw_send(server, b"\0" * 65536)
            ack = await server.call("stop_instance", {"instance_id": "missing"}, within_s=10)
            assert ack["error"]["code"] == "not_found", ack
            assert link.refused_packets == 21 and link.registered and link.reconnects == 0
        finally:
            await link.stop()


async def test_a_command_nested_too_deep_to_decode_is_answered_with_a_400(tmp_path: Path) -> None:
    """JSON nested past the decoder's recursion limit raised inside python-socketio, before any
    host code: the command got no answer at all (REST answers the same body with a 400)."""
    async with ControlServer(known_keys={KEY: "h1"}) as server:
        link = await started_link(make_host(tmp_path, server.url))
        try:
            await wait_for(lambda: link.registered, 10)
            answered: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            plain = server.sio._handle_ack

            async def spy(eio_sid: str, namespace: str, ack_id: int, data: Any) -> None:
                if ack_id == 7 and not answered.done():
                    answered.set_result(data)
                await plain(eio_sid, namespace, ack_id, data)

            server.sio._handle_ack = spy
            deep = "[" * 100_000 + "]" * 100_000  # past 3.13's limit too (5,000 passes there)
            await _raw_send(server, f'2/hosts,7["create_instance",{{"config":{deep}}}]')
            [ack] = await asyncio.wait_for(answered, 10)
            assert ack["ok"] is False and ack["status"] == 400, ack
            assert "nested too deep" in ack["error"]["message"], ack
            again = await server.call("stop_instance", {"instance_id": "missing"}, within_s=10)
            assert again["error"]["code"] == "not_found"
        finally:
            await link.stop()


async def test_a_control_that_reads_no_answers_cannot_grow_the_hosts_memory(
    tmp_path: Path,
) -> None:
    """Commands sent without end and no ack ever read: each ack was queued in the host's memory
    (the queue's cap held back reports only). MAX_UNREAD_PACKETS queued for UNREAD_S close
    the link."""
    from solar_host.control import connection
    from tests.fixtures.raw_control import frame, serve_raw

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.pause_reading()  # reads nothing the host sends from now on
        for i in range(4000):
            writer.write(frame(f'42/hosts,{i}["stop_instance",{{"instance_id":"m{i}"}}]'))
            if i % 500 == 0:
                await writer.drain()
        await writer.drain()
        await asyncio.sleep(60)

    server = await serve_raw(flood)
    port = server.sockets[0].getsockname()[1]
    link = await started_link(make_host(tmp_path, f"http://127.0.0.1:{port}"))
    try:
        await wait_for(lambda: link.reconnects >= 1, 60)
        assert link.reconnects >= 1
        session = link._session
        queued = session.sio.eio.queue.qsize() if session is not None else 0
        assert queued <= connection.UNREAD_HARD_PACKETS, queued
    finally:
        await link.stop()
        server.close()


async def test_answers_queued_in_a_burst_that_drains_keep_the_link() -> None:
    """Thousands of commands read in one turn of the event loop queue thousands of answers
    before the writer runs (seen on Python 3.13): the link was closed though control read
    everything. Only a queue that stays full (UNREAD_S), or passes UNREAD_HARD_PACKETS, closes
    it."""
    from solar_host.control import connection

    session = connection.new_session(
        "http://127.0.0.1:9", api_key=KEY, insecure=False, timeout_s=5, max_command_bytes=1024
    )
    queue: asyncio.Queue[int] = asyncio.Queue()
    session.sio.eio.queue = queue

    def fill(n: int) -> None:
        while queue.qsize() < n:
            queue.put_nowait(0)

    def drain() -> None:
        while not queue.empty():
            queue.get_nowait()

    def age(seconds: float) -> None:  # as if the first full look was `seconds` earlier
        assert session.unread_since is not None
        session.unread_since -= seconds

    try:
        fill(connection.MAX_UNREAD_PACKETS * 2)  # a burst
        assert not session.close_if_unread()
        age(connection.UNREAD_S / 2)
        drain()  # control read it
        assert not session.close_if_unread()
        assert session.unread_since is None
        fill(connection.MAX_UNREAD_PACKETS)  # the next burst: the clock starts again
        assert not session.close_if_unread()
        age(connection.UNREAD_S / 2)
        assert not session.close_if_unread()
        assert not session.closed.is_set()
        age(connection.UNREAD_S / 2)  # full at every look for UNREAD_S: nothing is read
        assert session.close_if_unread()
        assert session.closed.is_set()

        session.closed.clear()
        session.unread_since = None
        fill(connection.UNREAD_HARD_PACKETS)  # too much to wait on at all
        assert session.close_if_unread()
    finally:
        drain()
        assert session.http is not None
        await session.http.close()


async def test_a_control_that_falls_silent_is_left_for_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine.IO takes its ping timeouts from the server: a control that announced an hour and
    fell silent after its ack kept the host registered to a dead peer for that hour, never
    failing over. Silence past MAX_SILENCE_S closes the link."""
    from solar_host.control import connection
    from tests.fixtures.raw_control import serve_raw

    monkeypatch.setattr(connection, "MAX_SILENCE_S", 2.0)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(60)

    dead = await serve_raw(silent, ping_ms=3_600_000)
    port = dead.sockets[0].getsockname()[1]
    async with ControlServer(known_keys={KEY: "h1"}) as good:
        link = await started_link(make_host(tmp_path, f"http://127.0.0.1:{port},{good.url}"))
        try:
            await good.wait_until(lambda: good.connects, within_s=30)
            await wait_for(lambda: link.registered, 10)
        finally:
            await link.stop()
            dead.close()


async def test_pending_after_an_ack_takes_the_registration_back(tmp_path: Path) -> None:
    """`pending` (or `rejected`) after `registration_ack` in the same session left the host
    registered: it went on sending host_health, which control reads only from approved hosts.
    Until the next ack, only registration goes out; the next ack syncs everything again."""
    async with ControlServer(known_keys={KEY: "h1"}) as server:
        link = await started_link(make_host(tmp_path, server.url, health_report_interval_s=0.2))
        try:
            await wait_for(lambda: link.registered, 10)
            await server.emit("pending", {"pending_id": "p-1"})
            await wait_for(lambda: not link.registered and link.pending_id == "p-1", 5)
            await asyncio.sleep(0.5)  # a report in flight at the pending may still land
            health = len(server.events("host_health"))
            await asyncio.sleep(1.0)
            assert len(server.events("host_health")) == health
            await server.emit("registration_ack", {"host_id": "h1", "host_name": "test-host"})
            await wait_for(lambda: link.registered, 5)
            await server.wait_until(lambda: len(server.events("host_health")) > health, 5)
        finally:
            await link.stop()


async def test_a_report_past_controls_message_limit_is_named_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Past about 2,500 instances (here 3,000) the full list is over the 1 MB message limit
    that control's Socket.IO server keeps by default: control dropped each report and the link
    with it, and the host reconnected at the base delay for ever with nothing in its log to
    say why."""
    async with ControlServer(known_keys={KEY: "h1"}) as server:
        host = make_host(tmp_path, server.url)
        instances = host.instances
        for i in range(3000):
            await instances.create(
                {"backend_type": "llamacpp", "alias": f"a{i}", "model": "m.gguf", "pad": "x" * 900}
            )
        with caplog.at_level("ERROR", logger="solar_host.control.telemetry"):
            link = await started_link(host)
            try:
                await wait_for(lambda: link.oversized_reports >= 1, 10)
            finally:
                await link.stop()
    assert any("refuses messages over 1000000 bytes" in r.getMessage() for r in caplog.records)

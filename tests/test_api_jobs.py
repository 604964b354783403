"""The /jobs REST API against a real Docker daemon (tests/fixtures/docker.py) and busybox.

The host is the whole app from `create_app` (temp dirs, a probe with fake GPUs and an adjustable
disk), driven through its lifespan with httpx over ASGI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from solar_host.app import create_app
from solar_host.events import EventBus, JobLifecycle, StepLog
from solar_host.jobs.executor import SHUTDOWN_MESSAGE
from solar_host.jobs.service import JobService
from solar_host.jobs.store import RESTART_MESSAGE
from solar_host.resources.probes import GB, GpuDevice, Usage, disk_usage
from solar_host.settings import Settings
from tests.fixtures.docker import DockerDaemon, docker_daemon  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(sys.platform != "linux", reason="Docker job tests need Linux"),
    pytest.mark.timeout(120),
]

KEY = "k" * 20
REPO = Path(__file__).resolve().parents[1]
SECRET = "hf_TOPSECRET_123"


class Probe:
    """The real disk unless `disk_gb` is set; `gpus` fake devices (CUDA cannot run here)."""

    def __init__(self, gpus: int = 0, disk_gb: float | None = None) -> None:
        self._gpus = [
            GpuDevice(index=i, uuid=f"GPU-{i}", name="H100", total_bytes=80 * GB, used_bytes=0)
            for i in range(gpus)
        ]
        self.disk_gb = disk_gb

    def gpu_type(self) -> str:
        return "nvidia_cuda" if self._gpus else "cpu"

    def gpus(self) -> list[GpuDevice]:
        return self._gpus

    def ram(self) -> Usage:
        return Usage(16 * GB, 0, 16 * GB)

    def disk(self, path: Path) -> Usage | None:
        if self.disk_gb is None:
            return disk_usage(path)
        avail = int(self.disk_gb * GB)
        return Usage(total_bytes=100 * GB, used_bytes=100 * GB - avail, available_bytes=avail)

    def gpu_process_memory(self) -> dict[int, int]:
        return {}

    def gpu_process_memory_by_device(self) -> dict[int, dict[int, int]]:
        return {}


def make_settings(tmp_path: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = {
        "api_key": KEY,
        "config_file": tmp_path / "config.json",
        "models_dir": tmp_path / "models",
        "jobs_dir": tmp_path / "jobs",
        "log_dir": tmp_path / "logs",
        "hf_cache_dir": tmp_path / "hf",
        "job_network_mode": "none",
        "hf_token": SECRET,
        "job_cancel_wait_s": 10.0,
    }
    base.update(kw)
    return Settings(**base)


class Host:
    """The whole host from `create_app`, with recorders on its event bus."""

    def __init__(self, settings: Settings, probe: Probe | None = None) -> None:
        self.settings = settings
        self.probe = probe or Probe()
        self.app = create_app(settings, probe=self.probe)
        host = self.app.state.host
        self.bus: EventBus = host.bus
        self.jobs: JobService = host.jobs
        self.events: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        self.step_logs: list[dict[str, Any]] = []
        self.bus.subscribe(self._on_lifecycle, JobLifecycle)
        self.bus.subscribe(lambda e: self.step_logs.append(e.entry), StepLog)  # type: ignore[attr-defined]

    def _on_lifecycle(self, event: Any) -> None:
        # What GET /jobs/{id} would show at the moment the event is published.
        job = self.jobs.get(event.payload["job_id"])
        seen = {
            "status": job.status.value if job else None,
            "finished_at": job.finished_at if job else None,
            "steps": [s.status.value for s in job.steps] if job else [],
        }
        self.events.append((event.name, event.payload, seen))

    def names(self, job_id: str) -> list[str]:
        return [n for n, p, _ in self.events if p["job_id"] == job_id]


@contextlib.asynccontextmanager
async def running(host: Host) -> AsyncIterator[httpx.AsyncClient]:
    app = host.app
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://host", headers={"X-API-Key": KEY}, timeout=30
        ) as client:
            yield client


def job_body(job_id: str, *steps: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"job_id": job_id, "name": f"test {job_id}", "steps": list(steps), **kw}


def sh(name: str, image: str, script: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "image": image, "command": ["sh", "-c", script], **kw}


async def wait_for(client: httpx.AsyncClient, job_id: str, cond: Any, within: float = 30) -> dict:
    deadline = time.monotonic() + within
    body: dict = {}
    while time.monotonic() < deadline:
        r = await client.get(f"/jobs/{job_id}")
        body = r.json()
        if r.status_code == 200 and cond(body):
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} never reached the condition; last: {body}")


def finished(body: dict) -> bool:
    return body["status"] in ("completed", "failed", "cancelled")


def job_containers(daemon: DockerDaemon, job_id: str) -> list[Any]:
    client = docker.DockerClient(base_url=daemon.host)
    try:
        return client.containers.list(all=True, filters={"label": f"solar-host.job={job_id}"})
    finally:
        client.close()


@pytest.fixture
def dockerd(docker_daemon: DockerDaemon, monkeypatch: pytest.MonkeyPatch) -> DockerDaemon:  # noqa: F811
    monkeypatch.setenv("DOCKER_HOST", docker_daemon.host)
    return docker_daemon


# --- the happy path -------------------------------------------------------------------------


async def test_multi_step_job_runs_logs_and_events(
    dockerd: DockerDaemon, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    host = Host(make_settings(tmp_path))
    first = sh(
        "prepare",
        dockerd.image,
        "echo out1; echo err1 >&2; echo out2; echo err2 >&2; "
        "echo hello > /workspace/output/result.txt; echo len=${#HF_TOKEN}; "
        "id -u; printf 'no-newline'",
        is_preparation_step=True,
    )
    second = sh(
        "train",
        dockerd.image,
        "cat /workspace/output/result.txt; echo idx=$STEP_INDEX job=$JOB_ID; "
        "touch /workspace/models/x 2>/dev/null || echo models-read-only",
    )
    async with running(host) as client:
        r = await client.post(
            "/jobs",
            json=job_body("ok-1", first, second, submission_id="sub-1", correlation_id="corr-1"),
        )
        assert r.status_code == 202, r.text
        sub = r.json()
        ws = (tmp_path / "jobs" / "ok-1").absolute()
        assert sub == {
            "job_id": "ok-1",
            "status": "running",
            "workspace_path": str(ws),
            "submission_id": "sub-1",
            "correlation_id": "corr-1",
        }
        body = await wait_for(client, "ok-1", finished)
        listed = (await client.get("/jobs")).json()

    assert body["status"] == "completed", body
    assert body["finished_at"] and body["started_at"] and body["error_message"] is None
    assert body["current_step_index"] == 1
    assert [s["status"] for s in body["steps"]] == ["completed", "completed"]
    assert all(s["exit_code"] == 0 and s["duration_s"] >= 0 for s in body["steps"])
    assert [j["job_id"] for j in listed] == ["ok-1"]
    assert (ws / "output" / "result.txt").read_text() == "hello\n"

    prep, train = body["steps"]
    assert prep["log_file"] == str(ws / "logs" / "prepare.log")
    lines = [e["line"] for e in prep["recent_logs"]]
    stdout = [e["line"] for e in prep["recent_logs"] if e["stream"] == "stdout"]
    stderr = [e["line"] for e in prep["recent_logs"] if e["stream"] == "stderr"]
    assert stdout[:3] == ["out1", "out2", f"len={len(SECRET)}"]
    assert stdout[3:] == ["1000", "no-newline", ""]  # container uid, held partial line, marker
    assert stderr == ["err1", "err2"]
    assert [e["seq"] for e in prep["recent_logs"]] == list(range(len(lines)))
    assert prep["recent_logs"][-1]["completed"] is True
    assert prep["recent_logs"][-1]["exit_code"] == 0
    assert [e["line"] for e in train["recent_logs"]] == [
        "hello",
        "idx=1 job=ok-1",
        "models-read-only",
        "",
    ]
    durable = (ws / "logs" / "prepare.log").read_text().splitlines()
    assert sorted(durable) == sorted(lines[:-1])

    # StepLog events: per-step seq from 0 in order, the marker last
    for step in ("prepare", "train"):
        entries = [e for e in host.step_logs if e["step_name"] == step]
        assert [e["seq"] for e in entries] == list(range(len(entries)))
        assert entries[-1]["completed"] is True and entries[-1]["exit_code"] == 0
        assert not any(e.get("completed") for e in entries[:-1])

    # lifecycle events in order, each one after its store change
    assert host.names("ok-1") == [
        "job_started",
        "step_started",
        "step_completed",
        "step_started",
        "step_completed",
        "job_completed",
    ]
    for name, payload, seen in host.events:
        assert "host_id" not in payload
        if name.startswith("step_"):
            assert seen["steps"][payload["step_index"]] == payload["status"]
        else:
            assert seen["status"] == payload["status"]
    _, done, seen = host.events[-1]
    assert seen["finished_at"] is not None
    assert done["workspace_path"] == str(ws) and "retention_deadline" in done
    assert host.events[2][1]["exit_code"] == 0 and host.events[2][1]["duration_s"] >= 0

    # the secret reached the container but no response, log record or log file
    assert SECRET not in json.dumps(body) + json.dumps(listed) + caplog.text
    assert SECRET not in (ws / "logs" / "prepare.log").read_text()
    assert job_containers(dockerd, "ok-1") == []  # containers are removed after each step


async def test_failing_step_fails_the_job(dockerd: DockerDaemon, tmp_path: Path) -> None:
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        r = await client.post(
            "/jobs",
            json=job_body(
                "fail-1",
                sh("a", dockerd.image, "echo working; echo boom-reason >&2; exit 3"),
                sh("b", dockerd.image, "echo never"),
            ),
        )
        assert r.status_code == 202, r.text
        body = await wait_for(client, "fail-1", finished)
        # a finished job cannot be cancelled
        r = await client.delete("/jobs/fail-1")
        assert r.status_code == 409 and "terminal state 'failed'" in r.json()["detail"]

    assert body["status"] == "failed" and body["finished_at"]
    assert body["error_message"] == "Step 'a' failed with exit code 3"
    a, b = body["steps"]
    assert a["status"] == "failed" and a["exit_code"] == 3 and "boom-reason" in a["error_message"]
    assert b["status"] == "cancelled" and b["started_at"] is None
    assert a["recent_logs"][-1] == {**a["recent_logs"][-1], "completed": True, "exit_code": 3}
    assert host.names("fail-1") == ["job_started", "step_started", "step_failed", "job_failed"]
    failed = host.events[2][1]
    assert failed["exit_code"] == 3 and "boom-reason" in failed["error_summary"]
    assert host.events[3][1]["error_message"] == "Step 'a' failed with exit code 3"
    assert host.events[3][2]["status"] == "failed" and host.events[3][2]["finished_at"]


async def test_cancel_mid_step_is_fast_and_forgets_the_job(
    dockerd: DockerDaemon, tmp_path: Path
) -> None:
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        r = await client.post(
            "/jobs",
            json=job_body(
                "cancel-1",
                sh("long", dockerd.image, "echo started; sleep 30"),
                sh("after", dockerd.image, "echo never"),
            ),
        )
        assert r.status_code == 202
        await wait_for(
            client,
            "cancel-1",
            lambda b: any(e["line"] == "started" for e in b["steps"][0]["recent_logs"]),
        )
        assert host.jobs.is_running("cancel-1")
        assert host.jobs.container_root_pid("cancel-1")
        mem = await asyncio.to_thread(host.jobs.container_memory_bytes, "cancel-1")
        assert mem is not None and mem > 0
        t0 = time.monotonic()
        r = await client.delete("/jobs/cancel-1")
        elapsed = time.monotonic() - t0
        assert r.status_code == 200 and r.json() == {"detail": "cancelled", "job_id": "cancel-1"}
        assert elapsed < 5, f"cancel took {elapsed:.1f} s"
        assert (await client.get("/jobs/cancel-1")).status_code == 404
        assert (await client.delete("/jobs/cancel-1")).status_code == 404
        assert (await client.get("/jobs")).json() == []

    names = host.names("cancel-1")
    assert names == ["job_started", "step_started", "job_cancelled"]
    assert host.events[-1][2]["status"] == "cancelled"
    assert host.events[-1][2]["finished_at"] is not None
    assert not (tmp_path / "jobs" / "cancel-1").exists()
    assert job_containers(dockerd, "cancel-1") == []
    marker = [e for e in host.step_logs if e.get("completed")]
    assert len(marker) == 1 and marker[0]["step_name"] == "long"


# --- refusals -------------------------------------------------------------------------------


async def test_bad_requests_change_nothing(dockerd: DockerDaemon, tmp_path: Path) -> None:
    host = Host(make_settings(tmp_path), Probe(gpus=2))
    img = dockerd.image
    step = {"name": "s", "image": img, "command": ["true"]}
    cases: list[tuple[Any, int, str]] = [
        (job_body("../etc", step), 400, "job_id"),
        (job_body("a/b", step), 400, "job_id"),
        (
            job_body(
                "ok",
            ),
            400,
            "steps",
        ),
        (job_body("ok", {"name": "bad name", "image": img}), 400, "step name"),
        (job_body("ok", step, step), 400, "used twice"),
        (job_body("ok", {**step, "gpu": {}}), 400, "gpu"),
        (job_body("ok", {**step, "gpu": {"count": -5}}), 400, "gpu"),
        ({"name": "no id", "steps": [step]}, 400, "job_id"),
        ([1, 2], 400, "body"),
    ]
    async with running(host) as client:
        for body, code, word in cases:
            r = await client.post("/jobs", json=body)
            assert r.status_code == code, (body, r.text)
            assert word in json.dumps(r.json()["detail"]), (body, r.text)
        r = await client.post(
            "/jobs", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400
        # GPU requests beyond this host's two GPUs
        for gpu in ({"count": 3}, {"device_ids": ["7"]}, ["0", "GPU-9"]):
            r = await client.post("/jobs", json=job_body("gpu-x", {**step, "gpu": gpu}))
            assert r.status_code == 400, r.text
            detail = r.json()["detail"]
            assert detail["error"] == "gpu_unavailable" and detail["available_count"] == 2
        assert not (tmp_path / "jobs" / "gpu-x").exists()
        assert (await client.get("/jobs")).json() == []
        # unknown ids, and no key at all
        assert (await client.get("/jobs/nope")).status_code == 404
        assert (await client.get("/jobs/a..b")).status_code == 404
        assert (await client.delete("/jobs/nope")).status_code == 404
        r = await client.get("/jobs", headers={"X-API-Key": "wrong"})
        assert r.status_code == 401

        # 409 for a duplicate id, before anything is rewritten
        r = await client.post("/jobs", json=job_body("dup", sh("s", img, "sleep 30")))
        assert r.status_code == 202
        job_json = tmp_path / "jobs" / "dup" / "config" / "job.json"
        before = job_json.read_text()
        r = await client.post("/jobs", json=job_body("dup", sh("other", img, "true")))
        assert r.status_code == 409 and "already exists" in r.json()["detail"]
        assert job_json.read_text() == before
        assert (await client.delete("/jobs/dup")).status_code == 200

        # GPUs the host has pass validation; this daemon has no NVIDIA runtime, so the step
        # fails to start (exit_code null) and the job fails with the reason
        r = await client.post("/jobs", json=job_body("gpu-ok", {**step, "gpu": ["0", "1"]}))
        assert r.status_code == 202, r.text
        body = await wait_for(client, "gpu-ok", finished)
    assert body["status"] == "failed" and body["finished_at"]
    assert "container start failed" in body["error_message"]
    assert body["steps"][0]["exit_code"] is None
    assert host.names("gpu-ok") == ["job_started", "step_started", "step_failed", "job_failed"]


async def test_insufficient_disk_is_507(dockerd: DockerDaemon, tmp_path: Path) -> None:
    probe = Probe(disk_gb=1.0)
    host = Host(make_settings(tmp_path, min_free_disk_gb=2.0), probe)
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("disk-1", sh("s", dockerd.image, "true")))
        assert r.status_code == 507
        assert r.json()["detail"] == {
            "error": "insufficient_storage",
            "required_gb": 2.0,
            "available_gb": 1.0,
        }
        assert not (tmp_path / "jobs" / "disk-1").exists()
        # a job may ask for less than the host's floor
        body = job_body("disk-2", sh("s", dockerd.image, "true"), min_free_disk_gb=0.5)
        assert (await client.post("/jobs", json=body)).status_code == 202
        assert (await wait_for(client, "disk-2", finished))["status"] == "completed"
        # the floor is checked again before each step
        body = job_body("disk-3", sh("a", dockerd.image, "true"), sh("b", dockerd.image, "true"))
        body["min_free_disk_gb"] = 0.5
        assert (await client.post("/jobs", json=body)).status_code == 202
        probe.disk_gb = 0.1
        done = await wait_for(client, "disk-3", finished)
    # step a may or may not have started before the disk shrank; the job fails either way
    assert done["status"] == "failed" and "insufficient disk" in done["error_message"]


async def test_a_job_the_store_cannot_record_is_507_and_leaves_nothing(
    dockerd: DockerDaemon, tmp_path: Path
) -> None:
    """A 202 promises a job that survives a restart: when the job store cannot be written the
    submit is refused, its workspace removed and nothing started (it was a 202 and a job
    that a restart forgot)."""
    from solar_host.jobs.store import STORE_FILE

    host = Host(make_settings(tmp_path), Probe())
    async with running(host) as client:
        store = tmp_path / "jobs" / STORE_FILE
        store.unlink(missing_ok=True)
        (store / "blocker").mkdir(parents=True)  # a directory in its place: renames fail
        r = await client.post("/jobs", json=job_body("lost-1", sh("s", dockerd.image, "true")))
        assert r.status_code == 507, r.text
        assert r.json()["detail"]["error"] == "not_persisted"
        assert (await client.get("/jobs/lost-1")).status_code == 404
        assert not (tmp_path / "jobs" / "lost-1").exists()
        assert host.names("lost-1") == []  # never started
        (store / "blocker").rmdir()
        store.rmdir()
        r = await client.post("/jobs", json=job_body("lost-1", sh("s", dockerd.image, "true")))
        assert r.status_code == 202, r.text
        assert (await wait_for(client, "lost-1", finished))["status"] == "completed"
    assert "lost-1" in store.read_text()


async def test_no_daemon_is_503_and_a_later_daemon_is_picked_up(
    docker_daemon: DockerDaemon,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/missing.sock")
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        assert host.jobs.available is False
        body = job_body("nd-1", sh("s", docker_daemon.image, "echo hi"))
        r = await client.post("/jobs", json=body)
        assert r.status_code == 503 and r.json()["detail"]["error"] == "executor_unavailable"
        r = await client.get("/jobs")
        assert r.status_code == 200 and r.json() == []
        assert not (tmp_path / "jobs" / "nd-1").exists()
        # the daemon "comes up": the next submission finds it
        monkeypatch.setenv("DOCKER_HOST", docker_daemon.host)
        r = await client.post("/jobs", json=body)
        assert r.status_code == 202, r.text
        assert host.jobs.available is True
        assert (await wait_for(client, "nd-1", finished))["status"] == "completed"


# --- retention, shutdown, restart -----------------------------------------------------------


async def test_retention_removes_finished_jobs(dockerd: DockerDaemon, tmp_path: Path) -> None:
    host = Host(make_settings(tmp_path, job_cleanup_interval_s=0.1))
    async with running(host) as client:
        keep = job_body("keep-1", sh("s", dockerd.image, "true"))
        gone = job_body("gone-1", sh("s", dockerd.image, "true"), retention_hours=0)
        assert (await client.post("/jobs", json=keep)).status_code == 202
        assert (await client.post("/jobs", json=gone)).status_code == 202
        await wait_for(client, "keep-1", finished)
        deadline = time.monotonic() + 10
        while (await client.get("/jobs/gone-1")).status_code != 404:
            assert time.monotonic() < deadline, "retention never removed gone-1"
            await asyncio.sleep(0.05)
        assert (await client.get("/jobs/keep-1")).status_code == 200
    assert not (tmp_path / "jobs" / "gone-1").exists()
    assert (tmp_path / "jobs" / "keep-1").exists()


async def test_host_shutdown_fails_running_jobs(dockerd: DockerDaemon, tmp_path: Path) -> None:
    host = Host(make_settings(tmp_path))
    t0 = 0.0
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("sd-1", sh("s", dockerd.image, "sleep 30")))
        assert r.status_code == 202
        await wait_for(client, "sd-1", lambda b: b["steps"][0]["container_id"] is not None)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 8
    job = host.jobs.get("sd-1")
    assert job is not None and job.status.value == "failed"
    assert job.error_message == SHUTDOWN_MESSAGE and job.finished_at is not None
    assert host.names("sd-1")[-1] == "job_failed"
    assert job_containers(dockerd, "sd-1") == []


RESTART_SCRIPT = """
import asyncio, json, sys
from solar_host.events import EventBus
from solar_host.jobs.schemas import JobDefinition
from solar_host.jobs.service import JobService
from solar_host.resources.probes import LiveProbe
from solar_host.settings import Settings

async def main():
    cfg = json.loads(sys.argv[1])
    svc = JobService(Settings(**cfg["settings"]), bus=EventBus(), probe=LiveProbe())
    await svc.start()
    await svc.submit(JobDefinition.model_validate(cfg["job"]))
    for _ in range(400):
        job = svc.get(cfg["job"]["job_id"])
        if job.steps[0].container_id and svc.container_root_pid(job.job_id):
            print("RUNNING", flush=True)
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(120)

asyncio.run(main())
"""


async def test_restart_mid_job_marks_it_failed(dockerd: DockerDaemon, tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    cfg = {
        "settings": {
            "api_key": KEY,
            "config_file": str(tmp_path / "config.json"),
            "log_dir": str(tmp_path / "logs"),
            "models_dir": str(tmp_path / "models"),
            "jobs_dir": str(tmp_path / "jobs"),
            "hf_cache_dir": str(tmp_path / "hf"),
            "job_network_mode": "none",
        },
        "job": job_body("rs-1", sh("s", dockerd.image, "echo up; sleep 60")),
    }
    env = {**os.environ, "PYTHONPATH": str(REPO), "DOCKER_HOST": dockerd.host}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        RESTART_SCRIPT,
        json.dumps(cfg),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if line.strip() != b"RUNNING":
            proc.kill()
            raise AssertionError((line, await proc.stderr.read()))
        assert len(job_containers(dockerd, "rs-1")) == 1
    finally:
        if proc.returncode is None:
            proc.kill()  # a crash: no shutdown code runs
        await asyncio.wait_for(proc.wait(), 10)

    host = Host(settings)
    async with running(host) as client:
        r = await client.get("/jobs/rs-1")
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "failed" and body["error_message"] == RESTART_MESSAGE
        assert body["finished_at"] is not None
        assert body["steps"][0]["status"] == "failed"
        assert job_containers(dockerd, "rs-1") == []  # the leftover container was removed
        assert (await client.delete("/jobs/rs-1")).status_code == 409

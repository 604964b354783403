"""Job faults a reviewer found against a real host and dockerd: what a job could reach on the
host through its mounts and workspace, what retention deletes, a step filling the disk, and the
memory finished jobs keep.

The docker tests use the real daemon and busybox image of tests/fixtures/docker.py (the host
from `create_app`, as tests/test_api_jobs.py does); the others use real files only.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from solar_host.events import EventBus, utc_now
from solar_host.jobs.docker import DaemonUnavailableError, DockerJobs
from solar_host.jobs.schemas import JobState, JobStatus, StepState, StepStatus
from solar_host.jobs.service import JobService
from solar_host.jobs.step_logs import FINISHED_STEP_LOG_CHARS, RECENT_LOGS, StepLogBuffer
from solar_host.jobs.store import STORE_FILE, JobStore
from tests.fixtures.docker import DockerDaemon
from tests.test_api_jobs import (  # noqa: F401 (docker_daemon, dockerd are fixtures)
    Host,
    Probe,
    docker_daemon,
    dockerd,
    finished,
    job_body,
    make_settings,
    running,
    sh,
    wait_for,
)

DOCKER_MARKS = (
    pytest.mark.docker,
    pytest.mark.skipif(sys.platform != "linux", reason="Docker job tests need Linux"),
    pytest.mark.timeout(120),
)
F = TypeVar("F", bound=Callable[..., Any])


def docker_test(fn: F) -> F:
    """The marks tests/test_api_jobs.py puts on its module, for the tests here that need them."""
    for mark in DOCKER_MARKS:
        fn = mark(fn)
    return fn


TOKEN = "hf_SECRETsecretSECRETsecret0123"


# --- 1. the host's HF token -----------------------------------------------------------------


@docker_test
async def test_a_job_never_sees_or_rewrites_the_hosts_hf_token(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """HF_CACHE_DIR is the host's HF home: `hf auth login` left token and stored_tokens
    there. With JOB_INJECT_SECRETS=false no step reads them, and hf_cache_write (any caller
    may ask) writes only the hub cache, never the token."""
    hf = tmp_path / "hf"
    (hf / "hub" / "models--a--b").mkdir(parents=True)
    (hf / "hub" / "models--a--b" / "weights").write_text("w")
    (hf / "token").write_text(TOKEN)
    (hf / "stored_tokens").write_text(f"[default]\nhf_token = {TOKEN}\n")
    for path in (hf, hf / "hub", hf / "token", hf / "stored_tokens"):
        os.chown(path, 1000, 1000)  # the host's user is the containers' (a non-root install)
    host = Host(make_settings(tmp_path, job_inject_secrets=False))
    read = (
        'cat "$HF_HOME/token" "$HF_HOME/stored_tokens" /workspace/.cache/huggingface/token; '
        'cat "$HF_HUB_CACHE/models--a--b/weights"; echo; echo "env=$HF_TOKEN"'
    )
    overwrite = (
        'echo x > "$HF_HOME/token"; echo x > "$HF_HUB_CACHE/../token"; '
        'echo new > "$HF_HUB_CACHE/written"'
    )
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("tok-1", sh("a", dockerd.image, read)))
        assert r.status_code == 202, r.text
        body = await wait_for(client, "tok-1", finished, within=60)
        assert body["status"] == "completed", body
        log = (tmp_path / "jobs" / "tok-1" / "logs" / "a.log").read_text()
        assert TOKEN not in log, log
        assert "w\nenv=\n" in log, log  # the hub cache is there to read
        step = sh("a", dockerd.image, overwrite, hf_cache_write=True)
        r = await client.post("/jobs", json=job_body("tok-2", step))
        assert r.status_code == 202, r.text
        assert (await wait_for(client, "tok-2", finished, within=60))["status"] == "completed"
    assert (hf / "token").read_text() == TOKEN
    assert (hf / "stored_tokens").read_text() == f"[default]\nhf_token = {TOKEN}\n"
    assert (hf / "hub" / "written").read_text() == "new\n"


# --- 2. links planted in a workspace that outlives its record ---------------------------------


@docker_test
async def test_resubmitting_a_job_whose_record_was_lost_never_writes_through_its_links(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A step plants config/job.json and config/training.json -> host files; the operator then
    removes a damaged jobs_store.json (the workspace stays). The same job_id submitted again
    must not make the host write those files."""
    victim = tmp_path / "host-file.json"
    victim.write_text("precious\n")
    plant = (
        f"for f in job.json training.json; do rm -f /workspace/config/$f; "
        f"ln -s {victim} /workspace/config/$f; done"
    )
    training = {"training_config": {"lr": 0.1}}
    async with running(Host(make_settings(tmp_path))) as client:
        body = job_body("plant-1", sh("a", dockerd.image, plant), **training)
        r = await client.post("/jobs", json=body)
        assert r.status_code == 202, r.text
        assert (await wait_for(client, "plant-1", finished, within=60))["status"] == "completed"
    jobs = tmp_path / "jobs"
    assert (jobs / "plant-1" / "config" / "job.json").is_symlink()
    for name in (STORE_FILE, f"{STORE_FILE}.prev"):
        (jobs / name).unlink(missing_ok=True)
    async with running(Host(make_settings(tmp_path))) as client:
        body = job_body("plant-1", sh("a", dockerd.image, "cat /workspace/config/job.json"))
        r = await client.post("/jobs", json={**body, **training})
        assert r.status_code == 202, r.text
        again = await wait_for(client, "plant-1", finished, within=60)
    assert victim.read_text() == "precious\n"
    assert again["status"] == "completed", again
    config = jobs / "plant-1" / "config" / "job.json"
    assert not config.is_symlink() and json.loads(config.read_text())["job_id"] == "plant-1"
    # The old workspace is kept aside for the operator, links and all.
    [aside] = (jobs / ".orphaned").iterdir()
    assert (aside / "config" / "job.json").is_symlink()


# --- 3. retention deletes JOBS_DIR/<id>, never a stored path ---------------------------------


def _no_docker() -> DockerJobs:
    raise DaemonUnavailableError("no daemon in this test")


def _finished_job(job_id: str, workspace: Path) -> dict[str, Any]:
    long_ago = utc_now() - timedelta(days=2)
    state = JobState(
        job_id=job_id,
        name=job_id,
        status=JobStatus.completed,
        steps=[StepState(name="s", status=StepStatus.completed)],
        workspace_path=str(workspace),
        created_at=long_ago,
        started_at=long_ago,
        finished_at=long_ago,
        retention_hours=1.0,
    )
    return state.model_dump(mode="json")


async def test_retention_deletes_the_workspace_in_jobs_dir_not_the_stored_path(
    tmp_path: Path,
) -> None:
    """JOBS_DIR copied to a new disk (cp -a) and JOBS_DIR pointed at the copy: the store still
    names the old workspaces, which are now the operator's backup. An edited entry may name
    anything (here a directory outside JOBS_DIR; ids are checked at load, see below)."""
    old_jobs, jobs = tmp_path / "old" / "jobs", tmp_path / "new" / "jobs"
    precious = tmp_path / "precious"
    for d in (old_jobs / "keep" / "output", jobs / "keep" / "output", precious):
        d.mkdir(parents=True)
        (d / "result.txt").write_text("result\n")
    entries = [
        _finished_job("keep", old_jobs / "keep"),
        _finished_job("edited", precious),
    ]
    (jobs / STORE_FILE).write_text(json.dumps({"version": 1, "jobs": entries}))
    settings = make_settings(tmp_path, jobs_dir=jobs)
    service = JobService(settings, bus=EventBus(), probe=Probe(), docker_factory=_no_docker)
    await service.load_state()
    assert sorted(j.job_id for j in service.list()) == ["edited", "keep"]
    view = service.view(service.store.get("keep"))  # type: ignore[arg-type]
    assert view["workspace_path"] == str(jobs.absolute() / "keep")
    assert await service.sweep_expired() == 2
    await service.store.drain()
    assert (old_jobs / "keep" / "output" / "result.txt").exists()  # the backup stays
    assert (precious / "result.txt").exists()
    assert not (jobs / "keep").exists()  # the workspace this host owns is gone
    assert json.loads((jobs / STORE_FILE).read_text())["jobs"] == []


# --- 4. a step filling the disk ---------------------------------------------------------------


@docker_test
async def test_a_step_that_fills_the_disk_is_stopped_and_failed(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The floor is checked before each step; a step that eats the disk while it runs is
    stopped at MIN_FREE_DISK_GB, before job store writes start failing with ENOSPC."""
    probe = Probe(disk_gb=50.0)
    host = Host(make_settings(tmp_path, min_free_disk_gb=2.0), probe)
    steps = (
        sh("fill", dockerd.image, "echo filling; sleep 60; echo done"),
        sh("second", dockerd.image, "echo second"),
    )
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("fill-1", *steps, min_free_disk_gb=40))
        assert r.status_code == 202, r.text
        await wait_for(
            client,
            "fill-1",
            lambda b: any(e["line"] == "filling" for e in b["steps"][0]["recent_logs"]),
        )
        probe.disk_gb = 10.0  # below the job's 40 GB start floor, above the host's 2 GB
        await _still_running(client, "fill-1", seconds=2.0)
        probe.disk_gb = 1.5  # the step wrote the disk down below the host's floor
        body = await wait_for(client, "fill-1", finished, within=30)
    fill, second = body["steps"]
    assert body["status"] == "failed", body
    assert fill["status"] == "failed" and second["status"] == "cancelled", body
    assert "disk free below floor during step" in fill["error_message"], fill
    assert "disk free below floor during step" in body["error_message"], body
    saved = json.loads((tmp_path / "jobs" / STORE_FILE).read_text())["jobs"][0]
    assert saved["status"] == "failed"


async def _still_running(client: Any, job_id: str, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        body = (await client.get(f"/jobs/{job_id}")).json()
        assert body["status"] == "running", body
        await asyncio.sleep(0.2)


# --- 5. what finished steps keep in memory ----------------------------------------------------


def test_a_finished_step_keeps_a_small_tail_of_its_log() -> None:
    buffer = StepLogBuffer(EventBus(), maxlen=1000)
    line = "x" * 16 * 1024
    for step in ("a", "b"):
        buffer.add_lines("j", step, 0, "stdout", [f"{line}{i}" for i in range(1000)])
    buffer.mark_completed("j", "a", 0, 0)
    kept = buffer.recent("j", "a", 1000)
    assert kept[-1]["completed"] is True and kept[-2]["line"] == f"{line}999"
    assert len(kept) <= RECENT_LOGS
    assert sum(len(e["line"]) for e in kept) <= FINISHED_STEP_LOG_CHARS
    assert [e["seq"] for e in kept] == list(range(1001 - len(kept), 1001))
    assert len(buffer.recent("j", "b", 1000)) == 1000  # a running step keeps its whole ring
    # Short lines: the last RECENT_LOGS of them, as GET /jobs/{id} shows.
    buffer.add_lines("j", "c", 0, "stdout", [str(i) for i in range(1000)])
    buffer.mark_completed("j", "c", 0, 0)
    assert len(buffer.recent("j", "c", 1000)) == RECENT_LOGS


@docker_test
async def test_finished_jobs_hold_little_memory_and_list_small(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    host = Host(make_settings(tmp_path))
    flood = (
        "L=$(head -c 8000 /dev/zero | tr '\\0' x); i=0; "
        'while [ $i -lt 600 ]; do echo "$L$i"; i=$((i+1)); done'
    )
    steps = [sh(f"s{i}", dockerd.image, flood) for i in range(3)]
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("flood-1", *steps))
        assert r.status_code == 202, r.text
        body = await wait_for(client, "flood-1", finished, within=90)
        listed = await client.get("/jobs")
    assert body["status"] == "completed", body
    for step in body["steps"]:
        assert step["recent_logs"][-1]["completed"] is True
        assert step["recent_logs"][-2]["line"].endswith("x599")
    retained = sum(
        len(e["line"]) for s in ("s0", "s1", "s2") for e in host.jobs.buffer.recent("flood-1", s)
    )
    assert retained <= 3 * FINISHED_STEP_LOG_CHARS, retained
    assert len(listed.content) < 10_000, len(listed.content)
    assert [s["recent_logs"] for s in listed.json()[0]["steps"]] == [[], [], []]


def test_store_load_refuses_ids_that_are_not_directory_names(tmp_path: Path) -> None:
    path = tmp_path / STORE_FILE
    entries = [_finished_job(i, tmp_path) for i in ("ok-1", "..", "a/b", ".hidden")]
    path.write_text(json.dumps({"version": 1, "jobs": entries}))
    store = JobStore(path)
    store.load()
    assert [j.job_id for j in store.all()] == ["ok-1"]
    assert [e["job_id"] for e in store.unreadable] == ["..", "a/b", ".hidden"]

"""Containerised jobs against a hostile key holder and faults: each test reproduces a defect
an adversarial review found (and failed before its fix).

A holder of the host's API key (or a fault: a slow pull, a daemon restart) against the real
dockerd of tests/fixtures/docker.py and its busybox image.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import psutil
import pytest

from solar_host.jobs.docker import DockerJobs
from tests.fixtures.docker import DockerDaemon, OwnDaemon, build_image
from tests.test_api_jobs import (  # noqa: F401 (docker_daemon, dockerd are fixtures)
    KEY,
    SECRET,
    Host,
    docker_daemon,
    dockerd,
    finished,
    job_body,
    job_containers,
    make_settings,
    running,
    sh,
    wait_for,
)

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(sys.platform != "linux", reason="Docker job tests need Linux"),
    pytest.mark.timeout(180),
]


def _file_size(path: str) -> int | None:
    return os.path.getsize(path) if path and os.path.exists(path) else None


def _logged(line: str) -> Callable[[dict], bool]:
    """A wait_for condition: the first step has printed `line`."""
    return lambda body: any(e["line"] == line for e in body["steps"][0]["recent_logs"])


def _client(daemon: DockerDaemon) -> docker.DockerClient:
    return docker.DockerClient(base_url=daemon.host, timeout=60)


# --- 1. container names: one job's step kills another job's running container ---------------


async def test_container_names_of_two_jobs_never_collide(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Job 'a-b' step 'c' and job 'a' step 'b-c' both map to container 'solar-job-a-b-c'. The
    second create got 409, and the host force-removed the FIRST job's running container as a
    leftover of its own (job a-b failed with exit code 137). Now the second takes a name of
    its own."""
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        r = await client.post(
            "/jobs", json=job_body("a-b", sh("c", dockerd.image, "echo started; sleep 6"))
        )
        assert r.status_code == 202, r.text
        await wait_for(
            client,
            "a-b",
            _logged("started"),
        )
        r = await client.post("/jobs", json=job_body("a", sh("b-c", dockerd.image, "echo two")))
        assert r.status_code == 202, r.text
        other = await wait_for(client, "a", finished)
        first = await wait_for(client, "a-b", finished, within=30)
    assert other["status"] == "completed", other
    assert first["status"] == "completed", (
        f"job a-b was killed by job a: {first['status']} {first['error_message']}"
    )


# --- 2. retention_hours that overflow a timedelta ---------------------------------------------


@pytest.mark.parametrize("hours", ["1e12", "Infinity"])
async def test_huge_retention_does_not_break_retention_of_other_jobs(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
    hours: str,
) -> None:
    """retention_hours=1e12 (or Infinity, which json.loads accepts) is accepted; the job's
    `job_completed` payload raises OverflowError (never published), and every retention sweep
    raises too: no job on the host is ever removed again (disk fills with workspaces)."""
    host = Host(make_settings(tmp_path, job_cleanup_interval_s=0.1))
    async with running(host) as client:
        raw = json.dumps(job_body("big", sh("s", dockerd.image, "true"))).replace(
            '"steps"', f'"retention_hours": {hours}, "steps"'
        )
        r = await client.post("/jobs", content=raw, headers={"content-type": "application/json"})
        if r.status_code == 202:  # accepted: it must then behave
            done = await wait_for(client, "big", finished)
            assert done["status"] == "completed"
            await asyncio.sleep(0.3)
            assert "job_completed" in host.names("big"), host.names("big")
        else:
            assert r.status_code in (400, 422), r.text
        gone = job_body("gone", sh("s", dockerd.image, "true"), retention_hours=0)
        assert (await client.post("/jobs", json=gone)).status_code == 202
        deadline = time.monotonic() + 10
        while (await client.get("/jobs/gone")).status_code != 404:
            assert time.monotonic() < deadline, "retention never removed 'gone'"
            await asyncio.sleep(0.1)


# --- 3. a job id that is the store's last-good copy -------------------------------------------


async def test_job_id_cannot_take_the_store_backup_name(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """job_id 'jobs_store.json.prev' makes JOBS_DIR/jobs_store.json.prev a directory; every later
    store write fails (IsADirectoryError renaming onto it): all further submits are 507 and no
    job change is persisted."""
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        r = await client.post(
            "/jobs", json=job_body("jobs_store.json.prev", sh("s", dockerd.image, "sleep 2"))
        )
        assert r.status_code in (202, 400), r.text
        r = await client.post("/jobs", json=job_body("ok-1", sh("s", dockerd.image, "true")))
        assert r.status_code == 202, r.text
        await wait_for(client, "ok-1", finished)
    store = json.loads((tmp_path / "jobs" / "jobs_store.json").read_text())
    assert any(j["job_id"] == "ok-1" and j["status"] == "completed" for j in store["jobs"])


# --- 4. a cancel that timed out, then the same job id again -----------------------------------


class _SlowPull(DockerJobs):
    """A daemon whose pull of the image 'slow/pull:1' takes a few seconds (a big image)."""

    def create(self, spec: Any) -> str:
        if spec.image == "slow/pull:1":
            time.sleep(4)
            from solar_host.jobs.docker import ContainerStartError

            raise ContainerStartError("image 'slow/pull:1' not found and pull failed")
        return super().create(spec)


async def test_stale_task_of_a_cancelled_job_does_not_touch_its_successor(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """DELETE waits job_cancel_wait_s, then forgets the job although its task still runs (here:
    a pull). A new job with the same id is accepted; when the old task ends it writes into the
    NEW job's record (step failed with the old pull error, job 'cancelled'), pops the new run
    from `_runs`, so the new job's container keeps running untracked and DELETE is a 409.
    (Reproduced too with a real loopback registry that never answers.)"""
    host = Host(make_settings(tmp_path, job_cancel_wait_s=0.5))
    host.jobs._docker_factory = _SlowPull.connect
    async with running(host) as client:
        old = job_body("x", {"name": "s", "image": "slow/pull:1", "command": ["true"]})
        assert (await client.post("/jobs", json=old)).status_code == 202
        await asyncio.sleep(0.3)
        assert (await client.delete("/jobs/x")).status_code == 200
        new = job_body("x", sh("s", dockerd.image, "echo new-running; sleep 30"))
        r = await client.post("/jobs", json=new)
        if r.status_code == 409:  # refused while the old task lives: acceptable
            return
        assert r.status_code == 202, r.text
        await asyncio.sleep(6)  # the old task has ended by now
        body = (await client.get("/jobs/x")).json()
        try:
            assert body["status"] == "running", body
            assert body["steps"][0]["status"] == "running", body
            assert (await client.delete("/jobs/x")).status_code == 200
            assert job_containers(dockerd, "x") == []
        finally:
            for ct in job_containers(dockerd, "x"):
                ct.remove(force=True)


# --- 5. setuid binaries in the image: CONTAINER_UID is bypassed -------------------------------

ROOTSH_C = r"""
#include <unistd.h>
#include <stdio.h>
int main(int c, char **v) {
    if (setgid(0) || setuid(0)) perror("setuid");
    v[0] = "sh";
    execv("/bin/sh", v);
    return 127;
}
"""


@pytest.fixture
def suid_image(dockerd: DockerDaemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: F811
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to build the setuid helper")
    ctx = tmp_path_factory.mktemp("suidctx")
    (ctx / "r.c").write_text(ROOTSH_C)
    out = subprocess.run(
        [gcc, "-static", "-O2", "-o", str(ctx / "rootsh"), str(ctx / "r.c")],
        capture_output=True,
        timeout=60,
    )
    if out.returncode != 0:
        pytest.skip(f"cannot build a static helper: {out.stderr[-300:]!r}")
    (ctx / "Dockerfile").write_text(
        f"FROM {dockerd.image}\nCOPY rootsh /bin/rootsh\nRUN chmod 4755 /bin/rootsh\n"
    )
    tag = "solar-review/suid:local"
    client = _client(dockerd)
    try:
        client.images.build(path=str(ctx), tag=tag, rm=True)
        yield tag
    finally:
        try:
            client.images.remove(tag, force=True)
        except Exception:
            pass
        client.close()


async def test_a_setuid_binary_in_the_image_does_not_give_root(
    dockerd: DockerDaemon,  # noqa: F811
    suid_image: str,
    tmp_path: Path,
) -> None:
    """The host refuses the `user` field (CONTAINER_UID/GID are the operator's), but containers
    run without no-new-privileges: any image with a setuid-root program turns the step into
    uid 0 with Docker's default capabilities, e.g. writing root-owned files into the mounts
    (here output/)."""
    host = Host(make_settings(tmp_path))
    script = "id -u; touch /workspace/output/owned-by-me; id -u > /workspace/output/uid"
    async with running(host) as client:
        r = await client.post(
            "/jobs",
            json=job_body(
                "suid", {"name": "s", "image": suid_image, "command": ["rootsh", "-c", script]}
            ),
        )
        assert r.status_code == 202, r.text
        body = await wait_for(client, "suid", finished)
    lines = [e["line"] for e in body["steps"][0]["recent_logs"]]
    owner = tmp_path / "jobs" / "suid" / "output" / "owned-by-me"
    assert "0" not in lines, lines
    assert not owner.exists() or owner.stat().st_uid != 0


# --- 6. the daemon's own copy of the step output is unbounded ---------------------------------


async def test_docker_keeps_no_unbounded_copy_of_step_output(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The host rotates logs/<step>.log at LOG_FILE_MAX_BYTES, but the container is created with
    the daemon's default json-file driver and no max-size: dockerd stores every byte again
    (about 2.7x, JSON-wrapped) under /var/lib/docker for as long as the step runs. 30 MB of
    output -> ~80 MB on the daemon's disk; a step printing forever fills it."""
    host = Host(make_settings(tmp_path, log_file_max_bytes=1024 * 1024, log_file_generations=1))
    script = (
        "yes 0123456789012345678901234567890123456789 | head -c 30000000; echo; echo END; sleep 30"
    )
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("flood", sh("s", dockerd.image, script)))
        assert r.status_code == 202, r.text
        body = await wait_for(
            client,
            "flood",
            _logged("END"),
            within=90,
        )
        cid = body["steps"][0]["container_id"]
        c = _client(dockerd)
        try:
            info = c.api.inspect_container(cid)
        finally:
            c.close()
        log_path = info.get("LogPath") or ""
        size = _file_size(log_path)
        await client.delete("/jobs/flood")
    cfg = info["HostConfig"]["LogConfig"]
    bounded = cfg.get("Type") in ("none",) or "max-size" in (cfg.get("Config") or {})
    assert bounded, f"log driver {cfg} unbounded; daemon copy is {size} bytes"


# --- 7. a daemon restart mid-job leaves an orphan container -----------------------------------


@pytest.fixture
def private_daemon(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[OwnDaemon, str]]:
    """A dockerd of this test only, so that it can be stopped and started again."""
    d = OwnDaemon()
    d.start()
    try:
        image = build_image(d.host, d.dir)
        monkeypatch.setenv("DOCKER_HOST", d.host)
        yield d, image
    finally:
        if d.proc is None:
            d.start()
        c = docker.DockerClient(base_url=d.host, timeout=30)
        try:
            for ct in c.containers.list(all=True, filters={"label": "solar-host.job"}):
                ct.remove(force=True)
        finally:
            c.close()
        d.stop()


async def test_daemon_restart_mid_job_leaves_no_orphan_container(
    private_daemon: tuple[OwnDaemon, str],
    tmp_path: Path,
) -> None:
    """dockerd stops while a step runs: the job fails (fine), but the step's `remove` fails
    (daemon gone) and leftovers are swept only once per host process: after the daemon is back
    the exited container stays forever (with live-restore it would keep RUNNING, untracked)."""
    daemon, image = private_daemon
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("dd", sh("s", image, "echo up; sleep 60")))
        assert r.status_code == 202
        await wait_for(client, "dd", _logged("up"))
        await asyncio.to_thread(functools.partial(daemon.stop, keep_data=True))
        body = await wait_for(client, "dd", finished, within=30)
        assert body["status"] == "failed"
        await asyncio.to_thread(daemon.start)
        # the host notices the daemon again (watch loop every 5 s) and runs jobs
        deadline = time.monotonic() + 20
        while True:
            r = await client.post("/jobs", json=job_body("after", sh("s", image, "true")))
            if r.status_code == 202:
                break
            assert time.monotonic() < deadline, r.text
            await asyncio.sleep(0.5)
        await wait_for(client, "after", finished)
        await asyncio.sleep(11)  # two watch cycles
        c = docker.DockerClient(base_url=daemon.host, timeout=30)
        try:
            left = c.containers.list(all=True, filters={"label": "solar-host.job=dd"})
            names = [(ct.name, ct.status) for ct in left]
        finally:
            c.close()
    assert names == [], f"orphan container(s) of job dd: {names}"


# --- 8. secrets printed by a step end up in responses and the log file -----------------------


async def test_secrets_printed_by_a_step_are_redacted(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Ruling 14: HF_TOKEN / HARBOR_* are injected and 'never appear in logs or responses'. A
    step that prints its environment (`env`, a debug print) puts them verbatim into
    GET /jobs/{id} recent_logs, step_log events and logs/<step>.log. (Redaction cannot stop a
    step that encodes the value; it stops the verbatim leak.)"""
    password = "HARBOR/PW 9x7+"
    host = Host(make_settings(tmp_path, harbor_password=password, harbor_username="robot"))
    # What tools print without being asked: the env, curl -v's Basic header, a docker
    # config.json's auth, a registry URL with the password percent-encoded.
    script = (
        "env | sort; "
        'printf "Authorization: Basic %s\\n" "$(printf %s "$HARBOR_USERNAME:$HARBOR_PASSWORD" '
        '| base64)"; '
        'echo "token $(printf %s "$HF_TOKEN" | base64)"; '
        'echo "https://robot:HARBOR%2FPW%209x7%2B@registry.example/v2/"'
    )
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("leak", sh("s", dockerd.image, script)))
        assert r.status_code == 202
        body = await wait_for(client, "leak", finished)
    text = json.dumps(body) + json.dumps(host.step_logs)
    text += (tmp_path / "jobs" / "leak" / "logs" / "s.log").read_text()
    assert "HF_TOKEN=" in text  # the variable is there...
    assert SECRET not in text  # ...its value is not
    assert "Authorization: Basic ***" in text and "https://robot:***@registry" in text
    basic = base64.b64encode(f"robot:{password}".encode()).decode().rstrip("=")
    token = base64.b64encode(SECRET.encode()).decode().rstrip("=")
    for leaked in (password, basic, token, "HARBOR%2FPW%209x7%2B"):
        assert leaked not in text, leaked


# --- 9. a step can take every process slot or all the memory of the machine ------------------


async def test_a_fork_bomb_stays_inside_its_container(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Job containers had no pids limit: a step starting processes without end exhausts the
    machine's, and the model servers can no longer start a thread. JOB_PIDS_LIMIT caps them per
    container; the container also carries the out-of-memory score that makes its processes the
    kernel's first choice when memory runs out."""
    host = Host(make_settings(tmp_path, job_pids_limit=40))
    # The bomb runs in a subshell, which dies at its first failed fork; the step's shell then
    # needs no fork of its own (echo is a builtin, exec replaces it) to stay up for inspection.
    script = "(for i in $(seq 120); do sleep 60 & done) 2>/dev/null; echo spawned; exec sleep 60"
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("bomb", sh("s", dockerd.image, script)))
        assert r.status_code == 202, r.text
        body = await wait_for(
            client,
            "bomb",
            lambda b: finished(b) or _logged("spawned")(b),
            within=60,
        )
        cid = body["steps"][0]["container_id"]
        c = _client(dockerd)
        try:
            cfg = c.api.inspect_container(cid)["HostConfig"]
            procs = c.api.top(cid)["Processes"] or []
        finally:
            c.close()
        await client.delete("/jobs/bomb")
    assert cfg["PidsLimit"] == 40
    assert cfg["OomScoreAdj"] == 1000
    assert 0 < len(procs) <= 40, f"{len(procs)} processes in a container limited to 40"


async def test_a_step_past_its_memory_limit_fails_and_says_why(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """With JOB_MEMORY_LIMIT_GB set, a step that allocates past it is killed inside its own
    container (the machine's memory, and the model servers using it, are untouched), and the
    step's failure names the limit instead of a bare exit code 137."""
    host = Host(make_settings(tmp_path, job_memory_limit_gb=0.0625))  # 64 MiB
    step = {
        "name": "s",
        "image": dockerd.image,
        "command": ["dd", "if=/dev/zero", "of=/dev/null", "bs=200M", "count=1"],
    }
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("hog", step))
        assert r.status_code == 202, r.text
        body = await wait_for(client, "hog", finished, within=60)
    assert body["status"] == "failed", body
    s = body["steps"][0]
    assert s["exit_code"] == 137, s
    assert "JOB_MEMORY_LIMIT_GB (0.0625 GiB)" in body["error_message"], body["error_message"]
    assert "out of memory" in s["error_message"], s


# --- 10. a step that never ends holds its job, and its reservation, forever -------------------


async def test_a_step_past_its_time_limit_is_stopped_and_fails_saying_why(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Steps had no time limit: a hung step (a deadlocked collective, a download that never
    finishes) kept its job running and its GPUs taken until someone noticed. A step's
    timeout_s stops its container once it has run that long; the step fails and says which
    limit it ran past, and the steps after it do not run."""
    host = Host(make_settings(tmp_path))
    steps = [
        sh("quick", dockerd.image, "echo fine", timeout_s=60),
        sh("hang", dockerd.image, "echo hanging; exec sleep 600", timeout_s=1.5),
        sh("never", dockerd.image, "echo ran"),
    ]
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("hung", *steps))
        assert r.status_code == 202, r.text
        started = time.monotonic()
        body = await wait_for(client, "hung", finished, within=60)
        took = time.monotonic() - started
    assert body["status"] == "failed", body
    quick, hang, never = body["steps"]
    assert quick["status"] == "completed" and quick["time_limit_s"] == 60, quick
    assert hang["status"] == "failed" and hang["time_limit_s"] == 1.5, hang
    assert hang["exit_code"] == 143, hang  # busybox sleep ends on the SIGTERM of the stop
    assert hang["duration_s"] >= 1.5, hang
    assert "time limit of 1.5 s (timeout_s)" in hang["error_message"], hang
    assert hang["error_message"].startswith("timed out"), hang
    assert "time limit of 1.5 s (timeout_s) and was stopped" in body["error_message"], body
    assert never["status"] == "cancelled" and never["started_at"] is None, never
    assert took < 30, f"the job took {took:.1f} s to fail"
    assert job_containers(dockerd, "hung") == []


async def test_the_operators_step_time_limit_caps_what_a_job_asks(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """JOB_STEP_TIMEOUT_S is the most a step may run, whatever its timeout_s says, and the
    limit of steps that give none: a job cannot lift the operator's limit by asking."""
    host = Host(make_settings(tmp_path, job_step_timeout_s=1.5))
    async with running(host) as client:
        greedy = sh("greedy", dockerd.image, "exec sleep 600", timeout_s=3600)
        r = await client.post("/jobs", json=job_body("greedy", greedy))
        assert r.status_code == 202, r.text
        silent = sh("silent", dockerd.image, "exec sleep 600")
        r = await client.post("/jobs", json=job_body("silent", silent))
        assert r.status_code == 202, r.text
        shorter = sh("shorter", dockerd.image, "exec sleep 600", timeout_s=1)
        r = await client.post("/jobs", json=job_body("shorter", shorter))
        assert r.status_code == 202, r.text
        bodies = [await wait_for(client, j, finished, within=60) for j in ("greedy", "silent")]
        short = await wait_for(client, "shorter", finished, within=60)
    for body in bodies:
        step = body["steps"][0]
        assert body["status"] == "failed", body
        assert step["time_limit_s"] == 1.5, step
        assert "time limit of 1.5 s (JOB_STEP_TIMEOUT_S)" in step["error_message"], step
    step = short["steps"][0]
    assert step["time_limit_s"] == 1 and "(timeout_s)" in step["error_message"], step


@pytest.mark.parametrize("value", [0, -1, "soon", 10**9, True])
async def test_a_step_time_limit_that_is_no_time_limit_is_a_400_naming_it(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
    value: Any,
) -> None:
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        r = await client.post(
            "/jobs", json=job_body("t-1", sh("a", dockerd.image, "echo hi", timeout_s=value))
        )
        assert r.status_code == 400, r.text
        assert "steps.0.timeout_s" in r.json()["detail"], r.text
        assert (await client.get("/jobs/t-1")).status_code == 404


# --- 11. a second review of job faults ----------------------------------------------------------


async def test_steps_stopped_for_their_time_limit_do_not_hold_up_the_host(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Each stop of a step that ignores SIGTERM waits out its 10 s grace, and it held a worker
    of the shared executor that long: with eight of them (6 workers on 2 cores) every submit,
    docker ping and state-file write of the host waited behind them, and the later steps ran
    10 s past their limit and grace."""
    host = Host(make_settings(tmp_path))
    stubborn = "trap '' TERM; echo up; while true; do sleep 1; done"
    async with running(host) as client:
        for i in range(8):
            step = sh("s", dockerd.image, stubborn, timeout_s=2)
            r = await client.post("/jobs", json=job_body(f"t{i}", step))
            assert r.status_code == 202, r.text
        await asyncio.sleep(3.5)  # the limits have fired: eight stops wait out their grace
        t0 = time.monotonic()
        r = await client.post("/jobs", json=job_body("quick", sh("s", dockerd.image, "true")))
        took = time.monotonic() - t0
        assert r.status_code == 202, r.text
        assert took < 3, f"a submit took {took:.1f} s while steps were being stopped"
        bodies = [await wait_for(client, f"t{i}", finished, within=90) for i in range(8)]
    durations = [b["steps"][0]["duration_s"] for b in bodies]
    assert all(b["steps"][0]["error_message"].startswith("timed out") for b in bodies)
    assert max(durations) < 2 + 10 + 6, durations


async def test_a_daemon_killed_mid_step_fails_the_step_saying_so(
    private_daemon: tuple[OwnDaemon, str],
    tmp_path: Path,
) -> None:
    """dockerd killed (SIGKILL, an OOM kill) while a step runs: the wait's connection broke
    and the error escaped the step, so the job failed as an "Internal error" with no
    step_failed event, and a timed step never said it timed out."""
    daemon, image = private_daemon
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        r = await client.post(
            "/jobs", json=job_body("dk", sh("s", image, "echo up; exec sleep 60", timeout_s=30))
        )
        assert r.status_code == 202, r.text
        await wait_for(client, "dk", _logged("up"))
        assert daemon.proc is not None
        children = psutil.Process(daemon.proc.pid).children()  # its containerd
        daemon.proc.send_signal(signal.SIGKILL)  # dockerd alone, as the OOM killer would
        daemon.proc.wait(timeout=10)
        daemon.proc = None  # started again by the fixture, to sweep what is left
        body = await wait_for(client, "dk", finished, within=60)
        for child in children:  # ended as dockerd would have, so the next one starts clean
            with contextlib.suppress(psutil.Error):
                child.terminate()
        psutil.wait_procs(children, timeout=10)
    assert body["status"] == "failed", body
    step = body["steps"][0]
    assert step["status"] == "failed" and "Docker daemon was lost" in step["error_message"], step
    assert host.names("dk").count("step_failed") == 1, host.names("dk")
    assert host.names("dk")[-1] == "job_failed", host.names("dk")


async def test_a_cancel_that_stops_waiting_still_ends_the_job_with_one_event(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """DELETE waits JOB_CANCEL_WAIT_S for the job, then forgets it. A step stuck in its create
    (a slow pull: an image no registry here can serve, so the delay is injected) outlived
    the wait, and the job never got a terminal event: no job_cancelled, ever."""
    from solar_host.jobs.docker import ContainerStartError, DockerJobs

    class SlowPull(DockerJobs):
        def create(self, spec: Any) -> str:
            if spec.image == "slow/pull:1":
                time.sleep(3)
                raise ContainerStartError("image 'slow/pull:1' could not be pulled")
            return super().create(spec)

    host = Host(make_settings(tmp_path, job_cancel_wait_s=0.5))
    host.jobs._docker_factory = SlowPull.connect
    async with running(host) as client:
        step = {"name": "s", "image": "slow/pull:1", "command": ["true"]}
        assert (await client.post("/jobs", json=job_body("x", step))).status_code == 202
        await asyncio.sleep(0.3)
        assert (await client.delete("/jobs/x")).status_code == 200
        assert host.names("x").count("job_cancelled") == 1, host.names("x")
        await asyncio.sleep(4)  # the stuck create has ended by now
        assert (await client.get("/jobs/x")).status_code == 404
    names = host.names("x")
    assert names.count("job_cancelled") == 1 and "job_failed" not in names, names

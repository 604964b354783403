"""`solar-host jobs` (list, show, logs, cancel) as a subprocess against a host running real
Docker jobs (tests/fixtures/docker.py: a real daemon and a local busybox image)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.fixtures.docker import DockerDaemon, docker_daemon  # noqa: F401 (fixture)
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.test_api_jobs import sh
from tests.test_api_jobs import wait_for as wait_job
from tests.test_cli import cli

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(sys.platform != "linux", reason="Docker job tests need Linux"),
    pytest.mark.timeout(180),
]


@pytest.fixture
def dockerd(docker_daemon: DockerDaemon, monkeypatch: pytest.MonkeyPatch) -> DockerDaemon:  # noqa: F811
    monkeypatch.setenv("DOCKER_HOST", docker_daemon.host)
    return docker_daemon


async def test_jobs_list_show_logs_cancel(dockerd: DockerDaemon, tmp_path: Path) -> None:
    settings = host_settings(tmp_path, job_network_mode="none", job_cancel_wait_s=10.0)
    async with running_host(settings) as h:
        conn = ("--url", h.url, "--api-key", API_KEY)
        rc, out, err = await cli("jobs", *conn, cwd=tmp_path)
        assert rc == 0 and out.strip() == "no jobs", err

        done = {
            "job_id": "cli-ok",
            "name": "two steps",
            "steps": [
                sh("prep", dockerd.image, "echo prepared; echo oops >&2"),
                sh("train", dockerd.image, "echo epoch 1; echo epoch 2"),
            ],
        }
        slow = {
            "job_id": "cli-slow",
            "name": "sleeper",
            "steps": [sh("wait", dockerd.image, "sleep 300")],
        }
        for body in (done, slow):
            r = await h.client.post("/jobs", json=body)
            assert r.status_code == 202, r.text
        await wait_job(h.client, "cli-ok", lambda b: b["status"] == "completed", within=60)
        await wait_job(h.client, "cli-slow", lambda b: b["status"] == "running", within=60)

        rc, out, err = await cli("jobs", "list", "--json", *conn, cwd=tmp_path)
        assert rc == 0, err
        assert {j["job_id"]: j["status"] for j in json.loads(out)} == {
            "cli-ok": "completed",
            "cli-slow": "running",
        }
        rc, out, err = await cli("jobs", *conn, cwd=tmp_path)
        assert rc == 0, err
        assert out.splitlines()[0].split() == ["JOB", "STATUS", "STEP", "CREATED", "ERROR"]
        assert any(ln.split()[:2] == ["cli-ok", "completed"] for ln in out.splitlines())

        rc, out, err = await cli("jobs", "show", "cli-ok", *conn, cwd=tmp_path)
        assert rc == 0, err
        assert "status     completed" in out
        assert [ln.split()[:3] for ln in out.splitlines() if ln.startswith(("prep", "train"))] == [
            ["prep", "completed", "0"],
            ["train", "completed", "0"],
        ]
        rc, out, err = await cli("jobs", "show", "cli-ok", "--json", *conn, cwd=tmp_path)
        assert rc == 0 and json.loads(out)["job_id"] == "cli-ok"

        # logs: stdout lines on stdout, stderr lines on stderr, prefixed by step when several
        rc, out, err = await cli("jobs", "logs", "cli-ok", *conn, cwd=tmp_path)
        assert rc == 0, err
        assert out.splitlines() == ["[prep] prepared", "[train] epoch 1", "[train] epoch 2"]
        assert "[prep] oops" in err and "full log of train" in err
        rc, out, err = await cli(
            "jobs", "logs", "cli-ok", "--step", "train", "--json", *conn, cwd=tmp_path
        )
        assert rc == 0, err
        entries = [json.loads(ln) for ln in out.splitlines()]
        assert [e["line"] for e in entries if not e["completed"]] == ["epoch 1", "epoch 2"]
        assert all(e["step"] == "train" for e in entries) and entries[-1]["completed"] is True
        rc, _, err = await cli("jobs", "logs", "cli-ok", "--step", "nope", *conn, cwd=tmp_path)
        assert rc == 2 and "steps: prep, train" in err

        # cancel a running job; unknown and finished jobs are the host's 404 and 409
        rc, out, err = await cli("jobs", "cancel", "cli-slow", "--json", *conn, cwd=tmp_path)
        assert rc == 0, err
        assert json.loads(out) == {"detail": "cancelled", "job_id": "cli-slow"}
        rc, _, err = await cli("jobs", "show", "no-such-job", *conn, cwd=tmp_path)
        assert rc == 1 and "not found" in err
        rc, out, _ = await cli("jobs", "cancel", "cli-ok", "--json", *conn, cwd=tmp_path)
        assert rc == 1 and json.loads(out)["status_code"] == 409

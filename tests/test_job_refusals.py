"""Job specs say no (issue 17), against a real dockerd: step fields that would widen a
container's privileges, and fields the host does not implement, are a 422 naming them (not a
202 that silently drops them); the HF cache is mounted read-only unless a step writes it
(`hf_cache_write`, by default only preparation steps); step logs are bounded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.docker import DockerDaemon
from tests.test_api_jobs import (  # noqa: F401 (dockerd is a fixture)
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

WIDENING: list[dict[str, Any]] = [
    {"privileged": True},
    {"volumes": {"/": {"bind": "/host", "mode": "rw"}}},
    {"binds": ["/etc:/host-etc"]},
    {"mounts": [{"source": "/", "target": "/host"}]},
    {"network_mode": "host"},
    {"pid_mode": "host"},
    {"ipc_mode": "host"},
    {"devices": ["/dev/sda:/dev/sda"]},
    {"cap_add": ["SYS_ADMIN"]},
    {"security_opt": ["seccomp=unconfined"]},
    {"user": "0:0"},
    {"runtime": "runc"},
]


@pytest.mark.parametrize("extra", WIDENING, ids=lambda e: next(iter(e)))
async def test_privilege_widening_fields_are_refused(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
    extra: dict[str, Any],
) -> None:
    host = Host(make_settings(tmp_path))
    field = next(iter(extra))
    async with running(host) as client:
        body = job_body("w-1", sh("a", dockerd.image, "echo hi", **extra))
        r = await client.post("/jobs", json=body)
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert f"{field}" in detail and "widen the container's privileges" in detail, detail
        assert (await client.get("/jobs/w-1")).status_code == 404
    assert job_containers(dockerd, "w-1") == []


async def test_unimplemented_step_fields_are_named(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        step = sh("a", dockerd.image, "echo hi", retries=5, restart_policy="always")
        r = await client.post("/jobs", json=job_body("u-1", step))
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert "not implemented" in detail and "retries" in detail and "restart_policy" in detail
        # Job-level keys control sends stay accepted, and a clean step still runs.
        r = await client.post("/jobs", json=job_body("u-2", sh("a", dockerd.image, "echo ok")))
        assert r.status_code == 202, r.text
        body = await wait_for(client, "u-2", finished)
        assert body["status"] == "completed", body


async def test_hf_cache_is_read_only_unless_a_step_asks(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    hub = tmp_path / "hf" / "hub"  # only the hub cache of HF_CACHE_DIR is mounted
    hub.mkdir(parents=True)
    os.chmod(hub, 0o777)  # the container's user may write where the mount lets it
    (hub / "shared-model.bin").write_bytes(b"weights")
    host = Host(make_settings(tmp_path))
    write = 'echo new > "$HF_HUB_CACHE/written" && echo tamper > "$HF_HUB_CACHE/shared-model.bin"'
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("ro-1", sh("a", dockerd.image, write)))
        assert r.status_code == 202, r.text
        ro = await wait_for(client, "ro-1", finished, within=60)
        assert ro["status"] == "failed", ro
        assert not (hub / "written").exists()
        assert (hub / "shared-model.bin").read_bytes() == b"weights"
        step = sh("a", dockerd.image, 'echo new > "$HF_HUB_CACHE/written"', hf_cache_write=True)
        r = await client.post("/jobs", json=job_body("rw-1", step))
        assert r.status_code == 202, r.text
        rw = await wait_for(client, "rw-1", finished, within=60)
        assert rw["status"] == "completed", rw
        assert (hub / "written").read_text() == "new\n"
        # A preparation step downloads models: it writes by default, unless it says no.
        prep = sh("p", dockerd.image, 'echo prep > "$HF_HUB_CACHE/prep"', is_preparation_step=True)
        r = await client.post("/jobs", json=job_body("prep-1", prep))
        assert (await wait_for(client, "prep-1", finished, within=60))["status"] == "completed"
        assert (hub / "prep").read_text() == "prep\n"
        no = {
            **prep,
            "hf_cache_write": False,
            "command": ["sh", "-c", 'echo x > "$HF_HUB_CACHE/no"'],
        }
        r = await client.post("/jobs", json=job_body("prep-2", no))
        assert (await wait_for(client, "prep-2", finished, within=60))["status"] == "failed"
        assert not (hub / "no").exists()


async def test_step_logs_are_bounded(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A step printing ~40 MB and one 200 KB line: rotated files, the line cut with a marker."""
    mib = 1024 * 1024
    host = Host(make_settings(tmp_path, log_file_max_bytes=4 * mib, log_file_generations=2))
    script = (
        "yes 'a fairly ordinary line of job output, repeated' | head -c 40000000; "
        "yes x | head -c 400000 | tr -d '\\n'; echo; echo LAST"
    )
    async with running(host) as client:
        r = await client.post("/jobs", json=job_body("big-1", sh("a", dockerd.image, script)))
        assert r.status_code == 202, r.text
        body = await wait_for(client, "big-1", finished, within=180)
        assert body["status"] == "completed", body
    logs = sorted((tmp_path / "jobs" / "big-1" / "logs").iterdir())
    assert [p.name for p in logs] == ["a.log", "a.log.1", "a.log.2"], logs
    assert all(p.stat().st_size <= 4 * mib for p in logs)
    text = (tmp_path / "jobs" / "big-1" / "logs" / "a.log").read_text()
    cut = [ln for ln in text.splitlines() if "xxxx" in ln]
    assert len(cut) == 1 and cut[0].endswith(" [line cut: longer than 16384 bytes]")
    assert text.endswith("LAST\n")


async def test_a_lone_surrogate_in_a_job_is_a_400_naming_the_field(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    """JSON's "\\ud800" decodes to text that is no Unicode: it was accepted, and the container
    got something else than was sent (Docker's decoder makes it U+FFFD)."""
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        body = job_body("s-1", sh("a", dockerd.image, "echo hi", environment={"X": "@@"}))
        raw = json.dumps(body).replace('"@@"', '"\\ud800"')
        r = await client.post("/jobs", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "environment.X" in r.json()["detail"], r.text
        assert (await client.get("/jobs/s-1")).status_code == 404
        r = await client.post("/jobs", json=job_body("s-2", sh("a", dockerd.image, "echo ok")))
        assert r.status_code in (200, 201, 202), r.text
        body = await wait_for(client, "s-2", finished, within=60)
        assert body["status"] == "completed", body


@pytest.mark.parametrize(
    ("extra", "step_extra", "field"),
    [
        pytest.param(
            {"training_config": {"x": "@deep@"}}, {}, "training_config.x", id="nested-300-deep"
        ),
        pytest.param({"min_free_disk_gb": "@inf@"}, {}, "min_free_disk_gb", id="infinite-disk"),
        pytest.param({}, {"image": "busy\u0000box"}, "image", id="nul-in-image"),
        pytest.param({}, {"environment": {"A": "x\u0000y"}}, "environment", id="nul-in-env"),
        pytest.param({}, {"command": ["sh", "-c", "echo\u0000"]}, "command", id="nul-in-command"),
    ],
)
async def test_a_job_nothing_can_store_or_run_is_refused_and_leaves_nothing(
    dockerd: DockerDaemon,  # noqa: F811
    tmp_path: Path,
    extra: dict[str, Any],
    step_extra: dict[str, Any],
    field: str,
) -> None:
    """A training_config nested 300 deep was accepted and could not be encoded: a 500, a job
    shown running for ever with its workspace left, and every later submit failing the same
    way. Infinity for min_free_disk_gb made the 507's own body unencodable (a 500). NUL in a
    step's image, environment or command was accepted and failed only at the container."""
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        step = {**sh("a", dockerd.image, "echo hi"), **step_extra}
        raw = json.dumps(job_body("bad-1", step, **extra))
        nested: Any = 1
        for _ in range(300):
            nested = [nested]
        raw = raw.replace('"@deep@"', json.dumps(nested)).replace('"@inf@"', "Infinity")
        r = await client.post("/jobs", content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        assert field in r.text, r.text[:300]
        assert (await client.get("/jobs/bad-1")).status_code == 404
        assert not (tmp_path / "jobs" / "bad-1").exists()
        r = await client.post("/jobs", json=job_body("ok-1", sh("a", dockerd.image, "echo ok")))
        assert r.status_code == 202, r.text
        body = await wait_for(client, "ok-1", finished, within=60)
        assert body["status"] == "completed", body


async def test_control_characters_in_a_job_name_are_refused(tmp_path: Path) -> None:
    """A job's name is shown on operators' terminals and in solar-control: an escape sequence
    in it is a 400 naming the field, like one in an instance's alias (no daemon needed: the
    definition is refused before anything runs)."""
    host = Host(make_settings(tmp_path))
    async with running(host) as client:
        for name in ("train\x1b]0;pwned\x07", "oom\x1b[1A\x1b[2K", "two\nlines", "c1\x9b2J"):
            body = {**job_body("n-1", sh("a", "busybox", "true")), "name": name}
            r = await client.post("/jobs", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["detail"] == "name: name must not contain control characters"
        assert (await client.get("/jobs/n-1")).status_code == 404

"""Job pieces without a daemon: schemas, GPU forms, store, workspace, log splitting, env."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from solar_host.events import EventBus, StepLog
from solar_host.jobs.schemas import (
    GpuRequest,
    JobDefinition,
    JobState,
    JobStatus,
    StepState,
    StepStatus,
    normalise_gpu,
    validate_slug,
)
from solar_host.jobs.service import GpuUnavailable, validate_gpus
from solar_host.jobs.step_logs import LineSplitter, StepLogBuffer, pump_container_output
from solar_host.jobs.steps import container_spec, step_environment
from solar_host.jobs.store import RESTART_MESSAGE, JobStore
from solar_host.jobs.workspace import (
    InsufficientDiskError,
    check_disk,
    create_workspace,
    delete_workspace,
)
from solar_host.platform.statefiles import StateFileError
from solar_host.resources.probes import GB, GpuDevice, Usage
from solar_host.settings import Settings


def job(**kw: object) -> JobDefinition:
    data = {"job_id": "job-1", "name": "n", "steps": [{"name": "s1", "image": "img"}]}
    data.update(kw)
    return JobDefinition.model_validate(data)


# --- slugs and definitions -----------------------------------------------------------------


@pytest.mark.parametrize("good", ["job-abc123", "j_001", "job.v2", "A1B2C3", "a", "123"])
def test_valid_slugs(good: str) -> None:
    assert validate_slug(good, "job_id") == good


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("", "non-empty"),
        ("a/b", "'/'"),
        ("../escape", "'/'"),
        ("..leading", "'..'"),
        (".", "'.'"),
        ("has space", "letters"),
        ("a@b", "letters"),
        ("a:b", "letters"),
        ("x" * 200, "longer"),
    ],
)
def test_invalid_slugs(bad: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        validate_slug(bad, "job_id")


def test_definition_rules() -> None:
    with pytest.raises(ValidationError, match="steps"):
        job(steps=[])
    with pytest.raises(ValidationError, match="used twice"):
        job(steps=[{"name": "a", "image": "i"}, {"name": "a", "image": "i"}])
    with pytest.raises(ValidationError, match="step name"):
        job(steps=[{"name": "../x", "image": "i"}])
    with pytest.raises(ValidationError, match="reserved"):
        job(job_id="jobs_store.json")
    with pytest.raises(ValidationError, match="variable name"):
        job(steps=[{"name": "a", "image": "i", "environment": {"A=B": "x"}}])
    d = job(steps=[{"name": "a", "image": "i", "environment": {"N": 5, "F": True}}])
    assert d.steps[0].environment == {"N": "5", "F": "true"}
    assert d.retention_hours == 24.0 and d.display_name == "n"
    assert job(name=None).display_name == "job-1"
    # control's extra job-level keys are ignored; command may be a list or a string
    d = job(extra="x", steps=[{"name": "a", "image": "i", "command": "echo hi"}])
    assert d.steps[0].command == "echo hi"
    # a step field the host does not implement is refused by name (issue 17)
    with pytest.raises(ValidationError, match="not implemented by this host: other"):
        job(steps=[{"name": "a", "image": "i", "other": 1}])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"count": 1}, GpuRequest(count=1)),
        ({"count": -1}, GpuRequest(count=-1)),
        ({"device_ids": ["0", "GPU-abc"]}, GpuRequest(device_ids=["0", "GPU-abc"])),
        ({"count": 2, "device_ids": [1]}, GpuRequest(count=2, device_ids=["1"])),
        (True, GpuRequest(count=-1)),
        (2, GpuRequest(count=2)),
        ([0, "1"], GpuRequest(device_ids=["0", "1"])),
        ("GPU-x", GpuRequest(device_ids=["GPU-x"])),
        (None, None),
        (False, None),
        (0, None),
    ],
)
def test_gpu_forms(value: object, expected: GpuRequest | None) -> None:
    assert normalise_gpu(value) == expected


@pytest.mark.parametrize("bad", [{}, {"count": -2}, {"device_ids": []}, {"foo": 1}, 1.5, -3])
def test_gpu_refused(bad: object) -> None:
    with pytest.raises((ValueError, ValidationError)):
        normalise_gpu(bad)
    with pytest.raises(ValidationError, match="gpu"):
        job(steps=[{"name": "a", "image": "i", "gpu": bad}])


def _gpus(n: int) -> list[GpuDevice]:
    return [
        GpuDevice(index=i, uuid=f"GPU-{i}", name="H100", total_bytes=GB, used_bytes=0)
        for i in range(n)
    ]


def test_validate_gpus_against_inventory() -> None:
    def steps(gpu: object) -> JobDefinition:
        return job(steps=[{"name": "a", "image": "i", "gpu": gpu}])

    for ok in ({"count": 2}, {"count": -1}, ["0", "1"], {"device_ids": ["GPU-1"]}, True):
        validate_gpus(steps(ok), _gpus(2))
    validate_gpus(job(), [])  # no GPU asked: nothing to check
    for bad in ({"count": 5}, ["99"], {"device_ids": ["GPU-zzz"]}):
        with pytest.raises(GpuUnavailable) as exc:
            validate_gpus(steps(bad), _gpus(2))
        assert exc.value.detail["error"] == "gpu_unavailable"
        assert exc.value.detail["available_count"] == 2
    with pytest.raises(GpuUnavailable, match="no GPU"):
        validate_gpus(steps(True), [])


# --- store -----------------------------------------------------------------------------------


async def test_store_persists_and_marks_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "jobs_store.json"
    store = JobStore(path)
    running = JobState(
        job_id="r",
        name="r",
        status=JobStatus.running,
        steps=[StepState(name="a", status=StepStatus.running), StepState(name="b")],
    )
    await store.add(running)
    await store.add(JobState(job_id="done", name="d", status=JobStatus.completed))
    with pytest.raises(KeyError, match="already exists"):
        await store.add(JobState(job_id="r", name="x"))
    store.update_step("r", 0, container_id="abc")
    await store.drain()
    with pytest.raises(IndexError):
        store.update_step("r", 5, status=StepStatus.failed)
    with pytest.raises(IndexError):
        store.update_step("r", -1, status=StepStatus.failed)
    with pytest.raises(KeyError):
        store.update("missing", status=JobStatus.failed)
    assert json.loads(path.read_text())["jobs"][0]["steps"][0]["container_id"] == "abc"
    assert path.stat().st_mode & 0o777 == 0o600

    again = JobStore(path)
    assert again.load() == ["r"]
    r = again.get("r")
    assert r is not None and r.status == JobStatus.failed
    assert r.error_message == RESTART_MESSAGE and r.finished_at is not None
    assert [s.status for s in r.steps] == [StepStatus.failed, StepStatus.cancelled]
    assert again.get("done").status == JobStatus.completed  # type: ignore[union-attr]
    # the marking is written once the host starts, not by the load
    assert JobStore(path).load() == ["r"]
    await again.save_interrupted(["r"])
    assert JobStore(path).load() == []
    again.remove("r")
    again.remove("r")
    await again.drain()
    assert [j.job_id for j in JobStore(path).all()] == []  # not loaded yet
    third = JobStore(path)
    third.load()
    assert [j.job_id for j in third.all()] == ["done"]


def test_store_refuses_a_corrupt_file_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "jobs_store.json"
    for damaged in (b"{not json", b"", b"\xff", b"null", b'{"jobs": "x"}'):
        path.write_bytes(damaged)
        with pytest.raises(StateFileError, match=r"jobs_store\.json"):
            JobStore(path).load()
        assert path.read_bytes() == damaged


async def test_store_keeps_a_second_entry_of_a_job_and_keys_it_does_not_know(
    tmp_path: Path,
) -> None:
    """Both used to vanish at the next save without a word (review of the state files)."""
    path = tmp_path / "jobs_store.json"
    first = JobState(job_id="j", name="first", status=JobStatus.completed)
    second = JobState(job_id="j", name="second", status=JobStatus.completed)
    doc = {
        "version": 1,
        "written_by": "a newer release",
        "jobs": [first.model_dump(mode="json"), second.model_dump(mode="json")],
    }
    path.write_text(json.dumps(doc))
    store = JobStore(path)
    store.load()
    assert [j.name for j in store.all()] == ["first"]
    await store.add(JobState(job_id="k", name="k", status=JobStatus.completed))
    saved = json.loads(path.read_text())
    assert saved["written_by"] == "a newer release"
    assert [j["name"] for j in saved["jobs"]] == ["first", "k", "second"]


async def test_store_keeps_an_entry_that_no_longer_validates(tmp_path: Path) -> None:
    path = tmp_path / "jobs_store.json"
    odd = {"job_id": "odd", "name": "n", "status": "from-a-newer-host"}
    path.write_text(json.dumps({"version": 1, "jobs": [odd]}))
    store = JobStore(path)
    assert store.load() == [] and store.all() == []
    await store.add(JobState(job_id="new", name="n", status=JobStatus.completed))
    jobs = json.loads(path.read_text())["jobs"]
    assert [j["job_id"] for j in jobs] == ["new", "odd"] and jobs[1] == odd
    assert json.loads((tmp_path / "jobs_store.json.prev").read_text())["jobs"] == [odd]


async def test_store_writes_off_the_loop_and_encodes_only_the_job_that_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every change used to json-dump every retained job (definitions included) and fsync the
    file on the event loop: ten accepted jobs with 7 MB definitions held every API request for
    0.6-2.8 s at each step of each job (review of the jobs)."""
    import threading

    import solar_host.jobs.store as store_module

    path = tmp_path / "jobs_store.json"
    store = JobStore(path)
    for i in range(10):
        await store.add(JobState(job_id=f"j{i}", name="n", steps=[StepState(name="a")]))
    writers: list[str] = []
    real_write = store_module.atomic_write_bytes

    def recording_write(*args: Any, **kwargs: Any) -> None:
        writers.append(threading.current_thread().name)
        real_write(*args, **kwargs)

    dumped: list[str] = []
    real_dump = JobState.model_dump

    def counting_dump(self: JobState, *args: Any, **kwargs: Any) -> Any:
        dumped.append(self.job_id)
        return real_dump(self, *args, **kwargs)

    monkeypatch.setattr(store_module, "atomic_write_bytes", recording_write)
    monkeypatch.setattr(JobState, "model_dump", counting_dump)
    store.update_step("j3", 0, status=StepStatus.running)
    store.update("j7", error_message="x")
    await store.drain()
    assert sorted(dumped) == ["j3", "j7"]  # the other eight were reused as they were
    assert writers and threading.main_thread().name not in writers
    saved = json.loads(path.read_text())["jobs"]
    assert [j["job_id"] for j in saved] == [f"j{i}" for i in range(10)]
    assert saved[3]["steps"][0]["status"] == "running" and saved[7]["error_message"] == "x"


# --- workspace ---------------------------------------------------------------------------------


class DiskProbe:
    def __init__(self, available_gb: float) -> None:
        self.available = int(available_gb * GB)

    def disk(self, path: Path) -> Usage:
        return Usage(
            total_bytes=10 * self.available + 1, used_bytes=0, available_bytes=self.available
        )


def test_workspace_create_and_delete(tmp_path: Path) -> None:
    d = job(training_config={"lr": 0.1}, base_model_uri="hf://a/b")
    root = create_workspace(tmp_path / "jobs", d, os.getuid(), os.getgid())
    assert root == (tmp_path / "jobs" / "job-1").absolute()
    for sub in ("models", "data", "output", "config", "logs"):
        assert (root / sub).is_dir() and (root / sub).stat().st_mode & 0o777 == 0o755
    cfg = json.loads((root / "config" / "job.json").read_text())
    assert cfg["pipeline"] == ["s1"] and cfg["steps"] == {} and cfg["base_model_uri"] == "hf://a/b"
    assert json.loads((root / "config" / "training.json").read_text()) == {"lr": 0.1}
    (root / "logs" / "s1.log").write_text("old run\n")
    # A second create finds a workspace with no record: it is moved aside, not reused.
    create_workspace(tmp_path / "jobs", job(), os.getuid(), os.getgid())
    assert not (root / "logs" / "s1.log").exists()
    [aside] = (tmp_path / "jobs" / ".orphaned").iterdir()
    assert (aside / "logs" / "s1.log").read_text() == "old run\n"
    delete_workspace(tmp_path / "jobs", "job-1")
    assert not root.exists()
    delete_workspace(tmp_path / "jobs", "job-1")  # missing is fine


def test_workspace_reuse_never_writes_through_planted_links(tmp_path: Path) -> None:
    """A step planted config/job.json -> a host file, and its record was lost (damaged store,
    moved JOBS_DIR): re-submitting the id must not make the host write the linked file."""
    jobs = tmp_path / "jobs"
    victim, victim_dir = tmp_path / "host-config.json", tmp_path / "host-dir"
    victim.write_text("precious\n")
    victim_dir.mkdir()
    d = job(training_config={"lr": 0.1})
    root = create_workspace(jobs, d, os.getuid(), os.getgid())
    for name in ("job.json", "training.json"):
        (root / "config" / name).unlink()
        (root / "config" / name).symlink_to(victim)
    shutil.rmtree(root / "logs")
    (root / "logs").symlink_to(victim_dir)
    create_workspace(jobs, d, os.getuid(), os.getgid())
    assert victim.read_text() == "precious\n"
    assert list(victim_dir.iterdir()) == []
    for name in ("job.json", "training.json"):
        assert not (root / "config" / name).is_symlink()
    assert json.loads((root / "config" / "job.json").read_text())["job_id"] == "job-1"
    # The workspace itself replaced by a link: the link is moved aside, its target untouched.
    shutil.rmtree(root)
    root.symlink_to(victim_dir)
    create_workspace(jobs, d, os.getuid(), os.getgid())
    assert not root.is_symlink() and list(victim_dir.iterdir()) == []
    assert len(list((jobs / ".orphaned").iterdir())) == 2


def test_delete_workspace_is_confined_to_jobs_dir(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    for bad in ("..", "/", str(outside), "../outside", ".orphaned"):
        delete_workspace(tmp_path / "jobs", bad)
    assert (outside / "keep").is_dir()


def test_check_disk_boundaries(tmp_path: Path) -> None:
    check_disk(DiskProbe(10), tmp_path, 2.0)  # type: ignore[arg-type]
    check_disk(DiskProbe(2), tmp_path, 2.0)  # type: ignore[arg-type]
    with pytest.raises(InsufficientDiskError) as exc:
        check_disk(DiskProbe(1), tmp_path, 2.0)  # type: ignore[arg-type]
    assert exc.value.required_gb == 2.0 and exc.value.available_gb == pytest.approx(1.0)


# --- step logs ---------------------------------------------------------------------------------


def test_line_splitter_holds_partial_lines() -> None:
    s = LineSplitter()
    assert s.feed(b"one\ntw") == ["one"]
    assert s.feed(b"o\r\nthree\n") == ["two", "three"]
    assert s.feed("é".encode()[:1]) == []  # half a UTF-8 character waits too
    assert s.feed("é".encode()[1:] + b"\n") == ["é"]
    assert s.feed(b"tail") == []
    assert s.flush() == ["tail"]
    assert s.flush() == []


def test_step_log_buffer_seq_maxlen_marker() -> None:
    bus = EventBus()
    seen: list[dict] = []
    bus.subscribe(lambda e: seen.append(e.entry), StepLog)  # type: ignore[attr-defined]
    buf = StepLogBuffer(bus, maxlen=3)
    buf.add_lines("j", "a", 0, "stdout", [f"line {i}" for i in range(10)])
    buf.add_lines("j", "b", 1, "stderr", ["x"])
    buf.mark_completed("j", "a", 0, 0)
    assert [e["seq"] for e in seen if e["step_name"] == "a"] == list(range(11))
    assert [e["seq"] for e in seen if e["step_name"] == "b"] == [0]
    recent = buf.recent("j", "a")
    assert [e["line"] for e in recent] == ["line 8", "line 9", ""]
    assert recent[-1]["completed"] is True and recent[-1]["exit_code"] == 0
    assert seen[-1] == recent[-1]
    assert set(seen[0]) == {
        "job_id",
        "step_name",
        "step_index",
        "stream",
        "seq",
        "timestamp",
        "line",
    }
    buf.mark_completed("j", "never-logged", 2, 5)
    assert buf.recent("j", "never-logged")[0]["exit_code"] == 5
    buf.remove("j")
    buf.remove("j")
    assert buf.recent("j", "a") == []


def test_pump_writes_lines_and_flushes_the_tail(tmp_path: Path) -> None:
    got: list[tuple[str, list[str]]] = []
    chunks = [(b"out1\nout", None), (None, b"err1\n"), (b"2\n", b"partial"), (b"end", None)]
    pump_container_output(iter(chunks), tmp_path / "s.log", lambda n, ls: got.append((n, ls)))
    assert got == [
        ("stdout", ["out1"]),
        ("stderr", ["err1"]),
        ("stdout", ["out2"]),
        ("stdout", ["end"]),
        ("stderr", ["partial"]),
    ]
    assert (tmp_path / "s.log").read_text() == "out1\nerr1\nout2\nend\npartial\n"

    def broken():
        yield (b"a\n", None)
        raise OSError("connection reset")

    got.clear()
    pump_container_output(broken(), tmp_path / "t.log", lambda n, ls: got.append((n, ls)))
    assert got == [("stdout", ["a"])]


# --- container spec and environment --------------------------------------------------------


def _settings(tmp_path: Path, **kw: object) -> Settings:
    return Settings(
        api_key="k" * 20,
        jobs_dir=tmp_path / "jobs",
        hf_cache_dir=tmp_path / "hf",
        hf_token="hf_secret",
        harbor_password="hpass",
        **kw,
    )


def test_environment_secrets_gpu_and_overrides(tmp_path: Path) -> None:
    d = job(
        steps=[
            {"name": "a", "image": "i"},
            {"name": "b", "image": "i", "gpu": ["1"], "environment": {"HF_TOKEN": "mine"}},
            {"name": "c", "image": "i", "gpu": {"count": 2}},
            {
                "name": "d",
                "image": "i",
                "gpu": True,
                "environment": {"NVIDIA_VISIBLE_DEVICES": "3"},
            },
        ]
    )
    s = _settings(tmp_path)
    env = step_environment(s, d, d.steps[0], 0)
    assert env["JOB_ID"] == "job-1" and env["STEP_NAME"] == "a" and env["STEP_INDEX"] == "0"
    assert env["WORKSPACE_OUTPUT"] == "/workspace/output"
    assert env["JOB_CONFIG"] == "/workspace/config/job.json"
    assert env["HF_TOKEN"] == "hf_secret" and env["HARBOR_PASSWORD"] == "hpass"
    # No GPU asked: "void", so a CUDA image's own NVIDIA_VISIBLE_DEVICES=all gets none either
    # where nvidia is the daemon's default runtime.
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and "NVIDIA_DRIVER_CAPABILITIES" not in env
    env = step_environment(s, d, d.steps[1], 1)
    assert env["HF_TOKEN"] == "mine" and env["NVIDIA_VISIBLE_DEVICES"] == "1"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert step_environment(s, d, d.steps[2], 2)["NVIDIA_VISIBLE_DEVICES"] == "0,1"
    assert step_environment(s, d, d.steps[3], 3)["NVIDIA_VISIBLE_DEVICES"] == "3"

    off = step_environment(_settings(tmp_path, job_inject_secrets=False), d, d.steps[0], 0)
    assert not {"HF_TOKEN", "HARBOR_URL", "HARBOR_USERNAME", "HARBOR_PASSWORD"} & set(off)


def test_gpus_cannot_be_taken_through_the_environment() -> None:
    with pytest.raises(ValidationError) as err:
        job(steps=[{"name": "a", "image": "i", "environment": {"NVIDIA_VISIBLE_DEVICES": "all"}}])
    assert "NVIDIA_VISIBLE_DEVICES" in str(err.value) and "step_field_refused" in str(err.value)
    # With a gpu request the caller may still choose among what it asked for.
    job(
        steps=[
            {"name": "a", "image": "i", "gpu": 1, "environment": {"NVIDIA_VISIBLE_DEVICES": "0"}}
        ]
    )


def test_container_spec_mounts_and_identity(tmp_path: Path) -> None:
    d = job(
        steps=[
            {"name": "prep", "image": "i", "is_preparation_step": True},
            {"name": "t", "image": "i"},
        ]
    )
    s = _settings(tmp_path, container_uid=1234, container_gid=99, job_network_mode="none")
    root = str((tmp_path / "jobs" / "job-1").absolute())
    prep = container_spec(s, d, d.steps[0], 0)
    train = container_spec(s, d, d.steps[1], 1)
    assert prep.binds[f"{root}/models"] == {"bind": "/workspace/models", "mode": "rw"}
    assert train.binds[f"{root}/models"]["mode"] == "ro"
    assert train.binds[f"{root}/data"]["mode"] == "ro"
    assert train.binds[f"{root}/output"]["mode"] == "rw"
    assert train.binds[f"{root}/config"]["mode"] == "rw"
    # The host's HF home (its token) is not mounted: only its hub cache, over the job's own
    # HF_HOME.
    assert str(tmp_path / "hf") not in train.binds
    assert train.binds[str(tmp_path / "hf" / "hub")] == {
        "bind": "/workspace/.cache/huggingface/hub",
        "mode": "ro",
    }
    assert prep.binds[str(tmp_path / "hf" / "hub")]["mode"] == "rw"
    assert train.binds[f"{root}/hf_home"] == {"bind": "/workspace/.cache/huggingface", "mode": "rw"}
    assert train.environment["HF_HUB_CACHE"] == "/workspace/.cache/huggingface/hub"
    assert f"{root}/logs" not in train.binds  # logs are written by the host only
    assert train.user == "1234:99" and train.network_mode == "none"
    assert train.name == "solar-job-job-1-t"
    assert train.labels["solar-host.job"] == "job-1"
    assert train.gpu is None

"""The SGLang backend through a whole host (issue 6): real HTTP, the fake SGLang as the backend.

CUDA cannot run here, so the host sees a GPU through FakeProbe and runs the fake SGLang from a
venv-shaped directory (tests/fixtures/fake_sglang.py): it speaks SGLang's CLI, log lines,
/metrics and OpenAI routes over a real socket. One host serves the module (starting a host is the
slow part), but every test creates, starts, stops and deletes its own instance and relies on
nothing another test did, so the tests pass in any order (pytest-randomly). The metrics poll of
the (in-process) supervisor is shortened so a request's end shows within a fraction of a second.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import pytest_asyncio

from solar_host.backends import sglang_cache
from solar_host.instances import health as health_module
from tests.fixtures.fake_sglang import make_fake_sglang_venv
from tests.fixtures.host import API_KEY, free_port, host_settings, running_host
from tests.fixtures.probes import FakeProbe

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]

BEARER = {"Authorization": f"Bearer {API_KEY}"}
ALIAS = "qwen3:8b"
SERVED = "qwen3-8b"
READY_DELAY_S = 1.0  # the fake prints the uvicorn banner this long before "fired up"
READY_TIMEOUT_S = 60.0  # one start attempt's readiness deadline on the module's host
WAIT_S = 30.0  # generous bound for conditions that show within a fraction of a second when idle


@dataclass
class SgHost:
    client: httpx.AsyncClient
    url: str
    root: Path
    cache: Path
    model: Path
    boot_leftovers: dict[str, Path]
    # What this host's boot sweep handed to the purge thread (taken before any test ran).
    boot_purged: list[Path]
    purged: list[Path] = field(default_factory=list)  # trash dirs handed to the purge thread


def text_model_dir(root: Path) -> Path:
    model = root / "models" / "qwen3-8b"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return model


def sg_config(model: Path, alias: str = ALIAS, **extra: Any) -> dict[str, Any]:
    return {
        "backend_type": "sglang",
        "alias": alias,
        "model_path": str(model),
        "host": "127.0.0.1",
        "extra_env": {"FAKE_SGLANG_READY_DELAY_S": str(READY_DELAY_S)},
        **extra,
    }


@pytest.fixture(scope="module")
def fast_metrics_poll() -> Iterator[None]:
    """The supervisor polls /metrics every 2 s; 0.1 s keeps the module fast."""
    mp = pytest.MonkeyPatch()
    mp.setattr(health_module, "METRICS_POLL_S", 0.1)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def held_purges() -> Iterator[list[Path]]:
    """Record the trash directories handed to the background purge, and purge them later.

    The purge thread would delete a detached directory within milliseconds; holding it lets
    the tests see what was detached, where, and with which content.
    """
    held: list[Path] = []
    real = sglang_cache.purge_in_background
    mp = pytest.MonkeyPatch()
    mp.setattr(
        sglang_cache,
        "purge_in_background",
        lambda paths: held.extend(Path(p) for p in paths if p is not None),
    )
    yield held
    mp.undo()
    thread = real(held)
    if thread is not None:
        thread.join(10)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sg(
    tmp_path_factory: pytest.TempPathFactory, fast_metrics_poll: None, held_purges: list[Path]
) -> AsyncIterator[SgHost]:
    root = tmp_path_factory.mktemp("sg-host")
    venv = make_fake_sglang_venv(root)
    model = text_model_dir(root)
    cache = root / "prompt-cache"
    # What a previous run of the host left behind: the boot sweep must clear it.
    leftovers = {
        "instance": cache / f"old-model-{uuid.uuid4()}",
        "trash": cache / f".trash-{uuid.uuid4()}",
        "shared": cache / "shared-data",
    }
    for path in leftovers.values():
        path.mkdir(parents=True)
        (path / "page.bin").write_bytes(b"\0" * 16)
    settings = host_settings(
        root,
        sglang_venv_path=str(venv),
        sglang_prompt_cache_dir=str(cache),
        max_retries=0,
        instance_ready_timeout_s=READY_TIMEOUT_S,  # a loaded machine may start slowly
        start_port=free_port(),
    )
    probe = FakeProbe(gpus=[(80, 0)])
    held_before = len(held_purges)  # another test's host may have used the list already
    async with running_host(settings, probe=probe) as h:
        boot_purged = list(held_purges[held_before:])
        yield SgHost(h.client, h.url, root, cache, model, leftovers, boot_purged, held_purges)
        for iid in list(h.instances.supervisors):
            await h.client.post(f"/instances/{iid}/stop")


@asynccontextmanager
async def own_instance(sg: SgHost, config: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """An instance of this test alone: created here, stopped and deleted on the way out, so
    the shared host is left as the test found it."""
    inst = await create(sg, config)
    try:
        yield inst
    finally:
        await sg.client.post(f"/instances/{inst['id']}/stop")
        r = await sg.client.delete(f"/instances/{inst['id']}")
        assert r.status_code == 200, r.text


async def start(sg: SgHost, iid: str) -> dict[str, Any]:
    r = await sg.client.post(f"/instances/{iid}/start")
    assert r.status_code == 200, r.text
    inst = r.json()["instance"]
    assert inst["status"] == "running", inst
    return inst


async def eventually(probe: Callable[[], Awaitable[Any]], what: str) -> Any:
    """Poll `probe` until it returns something truthy, within WAIT_S (a bound, not a sleep)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        got = await probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {WAIT_S:.0f}s: {what}"
        await asyncio.sleep(0.05)


async def create(sg: SgHost, config: dict[str, Any]) -> dict[str, Any]:
    r = await sg.client.post("/instances", json={"config": config})
    assert r.status_code == 200, r.text
    return r.json()["instance"]


def cache_dir_of(sg: SgHost, iid: str) -> Path:
    return sg.cache / f"{SERVED}-{iid}"


# --- boot and advertisement -----------------------------------------------------------------------


async def test_boot_sweep_detaches_instance_caches_and_keeps_others(sg: SgHost) -> None:
    left = sg.boot_leftovers
    assert not left["instance"].exists()
    assert left["trash"] in sg.boot_purged  # old trash is collected as it is
    swept = [p for p in sg.boot_purged if p != left["trash"]]
    assert len(swept) == 1 and swept[0].name.startswith(".trash-")
    assert swept[0].parent == sg.cache and (swept[0] / "page.bin").exists()
    assert (left["shared"] / "page.bin").exists()  # not instance-shaped: untouched


async def test_sglang_is_advertised_on_a_cuda_host_with_the_venv(sg: SgHost) -> None:
    body = (await sg.client.get("/")).json()
    assert "sglang" in body["supported_backends"]
    assert "huggingface_causal" in body["supported_backends"]


async def test_extra_args_with_an_abbreviated_managed_flag_is_422(sg: SgHost) -> None:
    before = (await sg.client.get("/instances")).json()
    r = await sg.client.post(
        "/instances", json={"config": sg_config(sg.model, extra_args=["--por", "1"])}
    )
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any("extra_args" in e["loc"] for e in detail), detail
    text = json.dumps(detail)
    assert "--por" in text and "--port" in text and "managed by solar-host" in text
    assert (await sg.client.get("/instances")).json() == before


# --- create, start, serve -------------------------------------------------------------------------


async def test_create_reports_the_colon_free_served_name(sg: SgHost) -> None:
    async with own_instance(sg, sg_config(sg.model)) as inst:
        assert inst["status"] == "stopped"
        assert inst["served_model_name"] == SERVED and inst["config"]["alias"] == ALIAS
        assert inst["supported_endpoints"] == [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            "/health",
        ]
        assert inst["capabilities"] is None  # a text model
        listed = {i["id"]: i for i in (await sg.client.get("/instances")).json()}
        assert listed[inst["id"]]["served_model_name"] == SERVED


async def test_start_waits_for_fired_up_not_the_uvicorn_banner(sg: SgHost) -> None:
    async with own_instance(sg, sg_config(sg.model)) as created:
        iid = created["id"]
        # A cache directory a crashed run left under this instance's name: never inherited.
        stale = cache_dir_of(sg, iid)
        stale.mkdir(parents=True)
        (stale / "stale-page.bin").write_bytes(b"old")
        held = len(sg.purged)
        t0 = time.monotonic()
        inst = await start(sg, iid)
        elapsed = time.monotonic() - t0
        assert inst["pid"] and inst["port"]
        assert inst["served_model_name"] == SERVED
        assert elapsed >= READY_DELAY_S, elapsed

        lines = [e["line"] for e in (await sg.client.get(f"/instances/{iid}/logs")).json()]
        banner = next(i for i, ln in enumerate(lines) if "Uvicorn running on" in ln)
        fired = next(i for i, ln in enumerate(lines) if "fired up and ready to roll" in ln)
        assert banner < fired  # the banner came first and did not count as ready

        # The cache directory is fresh: the stale one was detached (as trash), not reused.
        fresh = cache_dir_of(sg, iid)
        assert fresh.is_dir() and not (fresh / "stale-page.bin").exists()
        assert fresh.stat().st_mode & 0o777 == 0o700
        assert any((p / "stale-page.bin").exists() for p in sg.purged[held:])
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{inst['port']}", timeout=WAIT_S
        ) as c:
            info = (await c.get("/fake/info", headers=BEARER)).json()
        assert info["env"]["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == str(fresh)
        assert info["args"]["served_model_name"] == SERVED
        assert info["args"]["enable_metrics"] is True
        assert info["env"]["VIRTUAL_ENV"] is not None


async def test_chat_with_the_host_key_and_metrics_driven_last_generation(sg: SgHost) -> None:
    async with own_instance(sg, sg_config(sg.model)) as created:
        iid = created["id"]
        inst = await start(sg, iid)
        before = datetime.now(UTC)
        body = {
            "model": SERVED,
            "messages": [{"role": "user", "content": "one two three"}],
            "max_tokens": 40,
        }
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{inst['port']}", timeout=WAIT_S
        ) as c:
            bad = await c.post(
                "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}
            )
            assert bad.status_code == 401
            models = (await c.get("/v1/models", headers=BEARER)).json()
            assert [m["id"] for m in models["data"]] == [SERVED]
            r = await c.post("/v1/chat/completions", json=body, headers=BEARER)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 40

        async def last_generation() -> dict[str, Any] | None:
            # The next /metrics poll (0.1 s here) closes the request.
            g = await sg.client.get(
                f"/instances/{iid}/last-generation",
                params={"after": before.isoformat(), "within_s": 30},
            )
            return g.json() if g.status_code == 200 else None

        rec = await eventually(last_generation, "the request's end in last-generation")
        assert rec["source"] == "metrics" and rec["instance_id"] == iid
        assert rec["generated_tokens"] == 40
        assert rec["prompt_tokens"] == usage["prompt_tokens"]
        assert rec["cached_tokens"] == 0 and rec["prompt_eval_tokens"] == usage["prompt_tokens"]
        assert rec["total_tokens"] == usage["prompt_tokens"] + 40
        assert rec["decode_tps"] == pytest.approx(100.0)
        assert datetime.fromisoformat(rec["finished_at"]) >= before

        state = (await sg.client.get(f"/instances/{iid}/state")).json()
        assert state["busy"] is False and state["phase"] == "idle"
        use = (await sg.client.get(f"/instances/{iid}/usage")).json()
        assert use["instance_id"] == iid and use["generated_tokens_total"] >= 40
        # The fake writes one KV page per request into the instance's cache directory.
        assert list(cache_dir_of(sg, iid).glob("page-*.bin"))


# --- stop -----------------------------------------------------------------------------------------


async def test_stop_sends_sigterm_and_detaches_the_cache(sg: SgHost) -> None:
    async with own_instance(sg, sg_config(sg.model)) as created:
        iid = created["id"]
        pid = (await start(sg, iid))["pid"]
        cache = cache_dir_of(sg, iid)
        (cache / "marker").write_text(iid)
        held = len(sg.purged)
        r = await sg.client.post(f"/instances/{iid}/stop")
        assert r.status_code == 200, r.text
        assert r.json()["instance"]["status"] == "stopped"
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        lines = [e["line"] for e in (await sg.client.get(f"/instances/{iid}/logs")).json()]
        # The fake logs these only from its SIGTERM handler (a SIGKILL would leave no trace).
        assert any("Shutting down" in ln for ln in lines)
        assert "Finished server process" in lines[-1]
        # Detached: the name is free at once; the content moved to a .trash-* sibling.
        assert not cache.exists()
        trash = sg.purged[held:]
        assert len(trash) == 1 and trash[0].name.startswith(".trash-")
        assert trash[0].parent == sg.cache and (trash[0] / "marker").read_text() == iid


async def test_next_start_gets_an_empty_cache(sg: SgHost) -> None:
    async with own_instance(sg, sg_config(sg.model)) as created:
        iid = created["id"]
        await start(sg, iid)
        # What the previous run left in its cache: a file of ours and a KV page of the fake's.
        (cache_dir_of(sg, iid) / "marker").write_text(iid)
        (cache_dir_of(sg, iid) / "page-old.bin").write_bytes(b"kv")
        r = await sg.client.post(f"/instances/{iid}/stop")
        assert r.status_code == 200, r.text
        await start(sg, iid)
        assert list(cache_dir_of(sg, iid).iterdir()) == []


async def test_usage_reports_the_snapshot_fields(sg: SgHost) -> None:
    """GET /usage: InstanceUsageSnapshot (reference-behavior section 3), not raw metric names."""
    async with own_instance(sg, sg_config(sg.model)) as created:
        iid = created["id"]
        await start(sg, iid)

        async def snapshot() -> dict[str, Any] | None:
            u = await sg.client.get(f"/instances/{iid}/usage")
            # 200 with only `memory` until the metrics poll stored a snapshot.
            return u.json() if u.status_code == 200 and "timestamp" in u.json() else None

        use = await eventually(snapshot, "a usage snapshot from the metrics poll")
        assert set(use) == {
            "instance_id",
            "backend_type",
            "prompt_tokens_total",
            "generated_tokens_total",
            "cached_tokens_total",
            "requests_processing",
            "requests_deferred",
            "kv_cache_usage_ratio",
            "timestamp",
            "memory",  # measured per device beside the estimate (estimates/accounting.py)
        }, use
        assert use["instance_id"] == iid and use["backend_type"] == "sglang"


async def test_failed_start_is_structured_and_discards_its_cache(sg: SgHost) -> None:
    config = sg_config(sg.model, alias="broken:1b")
    config["extra_env"] = {"FAKE_SGLANG_FAIL": "load"}
    async with own_instance(sg, config) as inst:
        iid = inst["id"]
        held = len(sg.purged)
        t0 = time.monotonic()
        r = await sg.client.post(f"/instances/{iid}/start")
        # Well under the readiness deadline: the exit is seen, not waited out.
        assert time.monotonic() - t0 < READY_TIMEOUT_S / 2
        assert r.status_code == 500, r.text
        body = r.json()
        assert set(body) == {"detail", "instance_id", "exit_code", "log_tail"}
        assert body["exit_code"] == 1 and "Process exited with code 1" in body["detail"]
        assert any("CUDA out of memory (fake)" in ln for ln in body["log_tail"])
        # The attempt's cache directory does not outlive the attempt (reference: "if idle"
        # discard after a start attempt that did not succeed).
        assert not (sg.cache / f"broken-1b-{iid}").exists()
        assert len(sg.purged) > held


# --- refusals -------------------------------------------------------------------------------------


async def test_cpu_host_does_not_advertise_sglang_and_refuses_a_start(tmp_path: Path) -> None:
    venv = make_fake_sglang_venv(tmp_path)
    model = text_model_dir(tmp_path)
    settings = host_settings(tmp_path, sglang_venv_path=str(venv), start_port=free_port())
    async with running_host(settings, probe=FakeProbe()) as h:
        body = (await h.client.get("/")).json()
        assert "sglang" not in body["supported_backends"]
        assert "huggingface_causal" in body["supported_backends"]
        r = await h.client.post("/instances", json={"config": sg_config(model)})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        t0 = time.monotonic()
        r = await h.client.post(f"/instances/{iid}/start")
        assert time.monotonic() - t0 < 5  # refused before any spawn (the deadline is 20 s)
        assert r.status_code == 500, r.text
        body = r.json()
        assert set(body) == {"detail", "instance_id", "exit_code", "log_tail"}
        assert "SGLang backend requires an NVIDIA CUDA host" in body["detail"]
        assert "gpu_type='cpu'" in body["detail"]
        assert body["instance_id"] == iid and body["exit_code"] is None
        inst = (await h.client.get(f"/instances/{iid}")).json()
        assert inst["status"] == "failed" and inst["pid"] is None
        assert "NVIDIA CUDA" in inst["error_message"]
        assert not any(p.name == "fake_sglang.py" for p in _children_cmdlines())


def _children_cmdlines() -> list[Path]:
    out = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            out += [Path(a) for a in child.cmdline()]
        except psutil.Error:
            continue
    return out


async def test_readopted_backend_keeps_its_cache(tmp_path: Path, held_purges: list[Path]) -> None:
    """KEEP_BACKENDS_ON_SHUTDOWN: the boot sweep must spare the caches of backends it re-adopts."""
    venv = make_fake_sglang_venv(tmp_path)
    model = text_model_dir(tmp_path)
    cache = tmp_path / "prompt-cache"
    settings = host_settings(
        tmp_path,
        sglang_venv_path=str(venv),
        sglang_prompt_cache_dir=str(cache),
        keep_backends_on_shutdown=True,
        start_port=free_port(),
    )
    probe = FakeProbe(gpus=[(80, 0)])
    async with running_host(settings, probe=probe) as h:
        r = await h.client.post("/instances", json={"config": sg_config(model)})
        iid = r.json()["instance"]["id"]
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        pid = r.json()["instance"]["pid"]
    mine = cache / f"{SERVED}-{iid}"
    (mine / "page-kept.bin").write_bytes(b"kv")
    try:
        async with running_host(settings, probe=FakeProbe(gpus=[(80, 0)])) as h:
            await asyncio.wait_for(h.instances.boot_done.wait(), 10)
            inst = (await h.client.get(f"/instances/{iid}")).json()
            assert inst["status"] == "running" and inst["pid"] == pid
            still_there = (mine / "page-kept.bin").exists()
            await h.client.post(f"/instances/{iid}/stop")
        assert still_there, "the boot sweep detached the cache of a re-adopted backend"
    finally:
        if psutil.pid_exists(pid):
            psutil.Process(pid).kill()

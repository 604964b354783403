"""The flight recorder through a real host: scripted backends (real processes on real sockets)
end in each of the ways the classifier names, and every end leaves a typed record, served by
GET /instances/{id}/flight-records (after a delete too), counted in /metrics, leading the
instance's error_message, and kept on disk across a host SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from solar_host.backends.llamacpp import LlamaCppBackend
from solar_host.backends.registry import BackendRegistry
from solar_host.instances import flight
from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import ScriptBackend, script_config


class PreflightedScript(ScriptBackend):
    """The scripted backend, with llama.cpp's own checks of the model file before a spawn."""

    def preflight(self, config: Any) -> list[str]:
        return LlamaCppBackend().preflight(config)


CUDA_OOM = (
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 8583.59 MiB on device 0: "
    "cudaMalloc failed: out of memory"
)
CUDA_ERR = "CUDA error: an illegal memory access was encountered"
SYSTEM_INFO = (
    "system_info: n_threads = 4 / 8 | CPU : SSE3 = 1 | AVX = 1 | AVX512 = 1 | REPACK = 1 |"
)

# (cause, the scripted backend's flags); each is started once, as control would.
SCRIPTED = [
    ("illegal_instruction", ("--lines", SYSTEM_INFO, "--exit-after", "0", "--die-by-signal", "4")),
    ("oom_killed", ("--exit-after", "1", "--die-by-signal", "9")),
    ("gpu_out_of_memory", ("--lines", CUDA_OOM, "--exit-after", "0", "--exit-code", "1")),
    ("cuda_error", ("--lines", CUDA_ERR, "--exit-after", "1", "--die-by-signal", "6")),
    ("load_timeout", ("--no-health", "--no-ready-line")),
    ("exited", ("--exit-after", "1", "--exit-code", "3")),
    ("killed_by_signal", ("--exit-after", "1", "--die-by-signal", "15")),
]


async def _create(h: Any, config: dict[str, Any]) -> str:
    r = await h.client.post("/instances", json={"config": config, "managed_by": "intent"})
    assert r.status_code == 200, r.text
    return r.json()["instance"]["id"]


async def _records(h: Any, iid: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        r = await h.client.get(f"/instances/{iid}/flight-records")
        assert r.status_code == 200, r.text
        recs = r.json()["records"]
        if recs or time.monotonic() > deadline:
            return recs
        await asyncio.sleep(0.1)


async def test_every_kind_of_end_gets_its_cause(tmp_path: Path) -> None:
    s = host_settings(
        tmp_path,
        max_retries=0,
        instance_ready_timeout_s=4.0,
        health_check_interval_s=0.2,
        unhealthy_after_s=1.0,
    )
    reg = BackendRegistry([PreflightedScript()])
    got: dict[str, str | None] = {}
    async with running_host(s, backends=reg) as h:
        ids: dict[str, str] = {}
        for kind, args in SCRIPTED:
            ids[kind] = await _create(h, script_config(tmp_path, *args, alias=f"f:{kind}"))
        # Files llama.cpp's preflight refuses: not there, not GGUF.
        for kind, content in (("model_missing", None), ("model_unreadable", b"PK\x03\x04")):
            model = tmp_path / "models" / f"{kind}.gguf"
            model.write_bytes(b"GGUF")
            config = script_config(tmp_path, alias=f"f:{kind}")
            ids[kind] = await _create(h, {**config, "model": str(model)})
            if content is None:
                model.unlink()
            else:
                model.write_bytes(content)
        # A port another program holds, named explicitly.
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            config = script_config(tmp_path, alias="f:port", port=port)
            ids["port_in_use"] = await _create(h, config)
            r = await h.client.post(f"/instances/{ids['port_in_use']}/start")
            assert r.status_code == 409, r.text
        ids["unresponsive"] = await _create(h, script_config(tmp_path, alias="f:hung"))
        starts = [k for k in ids if k != "port_in_use"]
        answers = await asyncio.gather(
            *(h.client.post(f"/instances/{ids[k]}/start") for k in starts)
        )
        # A running backend that goes silent (stopped): liveness ends it.
        hung = dict(zip(starts, answers, strict=True))["unresponsive"].json()["instance"]["pid"]
        os.kill(hung, signal.SIGSTOP)
        try:
            for kind, iid in ids.items():
                recs = await _records(h, iid)
                got[kind] = recs[0]["cause"] if recs else None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)
        right = [k for k, v in got.items() if k == v]
        assert len(right) == 11, got  # every kind but the canary's (not a flight of its own)

        # What a record holds.
        sigill = (await _records(h, ids["illegal_instruction"]))[0]
        assert sigill["signal"] == "SIGILL" and sigill["exit_code"] == -4
        assert sigill["phase"] == "start" and sigill["attempt"] == 1
        assert SYSTEM_INFO in sigill["log_tail"]
        assert sigill["config_digest"].startswith("sha256:") and sigill["spawned_at"]
        assert sigill["run_seconds"] >= 0 and sigill["ended_at"] > sigill["spawned_at"]
        assert sigill["message"].startswith("illegal_instruction: Process exited with code -4")
        missing = (await _records(h, ids["model_missing"]))[0]
        assert missing["spawned_at"] is None and missing["exit_code"] is None
        assert any("the backend was not started" in ln for ln in missing["log_tail"])
        hung_rec = (await _records(h, ids["unresponsive"]))[0]
        assert hung_rec["phase"] == "running" and hung_rec["signal"] == "SIGKILL"

        # The cause leads what control shows.
        for kind in ("illegal_instruction", "exited", "unresponsive", "model_missing"):
            inst = (await h.client.get(f"/instances/{ids[kind]}")).json()
            assert inst["status"] == "failed" and inst["error_message"].startswith(f"{kind}: ")

        # Counted by cause.
        text = (await h.client.get("/metrics")).text
        for kind in right:
            m = re.search(rf'^solar_host_backend_ends_total{{cause="{kind}"}} (\d+)', text, re.M)
            assert m and int(m.group(1)) >= 1, kind
        assert 'solar_host_backend_ends_total{cause="canary_mismatch"} 0' in text

        # Kept after a delete, as the logs are; an id never seen is a 404.
        iid = ids["exited"]
        assert (await h.client.delete(f"/instances/{iid}")).status_code == 200
        r = await h.client.get(f"/instances/{iid}/flight-records")
        assert r.status_code == 200 and r.json()["records"][0]["cause"] == "exited"
        assert (await h.client.get("/instances/nope/flight-records")).status_code == 404
        for iid in ids.values():
            with contextlib.suppress(httpx.HTTPError):
                await h.client.post(f"/instances/{iid}/stop")


def test_records_survive_a_host_sigkill(tmp_path: Path) -> None:
    """Appended with an fsync before the failure is answered: a host SIGKILLed right after
    the answer has the record when it comes back."""
    with HostProc(tmp_path, env={"MAX_RETRIES": "1"}) as hp:
        hp.start()
        with hp.client() as c:
            config = script_config(tmp_path, "--exit-after", "0", "--exit-code", "7")
            iid = c.post("/instances", json={"config": config}).json()["instance"]["id"]
            r = c.post(f"/instances/{iid}/start")
            assert r.status_code == 500, r.text
        hp.kill(signal.SIGKILL)
        hp.start()
        with hp.client() as c:
            r = c.get(f"/instances/{iid}/flight-records")
            assert r.status_code == 200, r.text
            recs = r.json()["records"]
        assert [(x["cause"], x["exit_code"], x["attempt"]) for x in recs] == [
            ("exited", 7, 1),
            ("exited", 7, 2),
        ]


def test_records_are_bounded_per_instance(tmp_path: Path) -> None:
    for i in range(2 * flight.RECORDS_KEPT + 1):
        rec = flight.build(
            instance_id="a",
            config={"alias": "m", "backend_type": "llamacpp"},
            phase="start",
            reason=f"Process exited with code {i}",
            exit_code=i % 100,
            lines=["x" * 300],
        )
        flight.append(tmp_path, rec)
    kept = flight.read(tmp_path, "a")
    assert kept is not None and len(kept) == flight.RECORDS_KEPT
    assert kept[-1]["message"].endswith(f"code {2 * flight.RECORDS_KEPT}")
    lines = flight.path_of(tmp_path, "a").read_text().splitlines()
    assert len(lines) <= 2 * flight.RECORDS_KEPT
    # A torn last line (killed mid-write) is skipped, not a failure.
    with flight.path_of(tmp_path, "a").open("a") as f:
        f.write('{"cause": "exi')
    assert len(flight.read(tmp_path, "a") or []) == flight.RECORDS_KEPT - 1
    # An id that is no file name stays inside LOG_DIR/flight.
    assert flight.path_of(tmp_path, "../x").parent == tmp_path / "flight"


async def test_a_real_hf_server_on_a_damaged_model(
    tmp_path: Path,
    tiny_hf_models: TinyHFModels,  # noqa: F811
) -> None:
    """Our real HF server on a safetensors file whose header does not parse (it got past the
    host's checks: the directory is there) and on a device this machine lacks: the causes
    come from the backend's own last lines."""
    import torch

    bad = tmp_path / "models" / "bad"
    shutil.copytree(tiny_hf_models.causal, bad)
    weights = next(bad.glob("*.safetensors"))
    weights.write_bytes((10**12).to_bytes(8, "little") + b"{not json")
    s = host_settings(
        tmp_path,
        max_retries=0,
        instance_ready_timeout_s=60.0,
        model_roots=str(tiny_hf_models.causal.parent),
    )
    async with running_host(s) as h:
        configs = {"model_unreadable": {"model_id": str(bad)}}
        if not torch.cuda.is_available():
            configs["cuda_error"] = {"model_id": str(tiny_hf_models.causal), "device": "cuda"}
        for want, extra in configs.items():
            config = {"backend_type": "huggingface_causal", "alias": f"hf:{want}", **extra}
            r = await h.client.post("/instances", json={"config": config})
            assert r.status_code == 200, r.text
            iid = r.json()["instance"]["id"]
            r = await h.client.post(f"/instances/{iid}/start")
            assert r.status_code == 500, r.text
            rec = (await _records(h, iid))[0]
            assert rec["cause"] == want, rec
            assert rec["exit_code"] not in (None, 0) and rec["log_tail"]


def test_a_crash_found_at_re_adoption_has_its_spawn_time(tmp_path: Path) -> None:
    """A running backend that stopped serving while no host ran (it exec'd a program that
    listens nowhere): the next host adopts it and records its end as a crash, with the time it
    was spawned (its record was gone by then; the kernel's start time says it)."""
    from tests import test_hostile_backend as hb
    from tests.fixtures.waiting import wait_for

    with hb.hostile_host(tmp_path) as h:
        iid, _, first = hb.exec_while_no_host_ran(h)
        with h.client() as c:

            def crash_record() -> dict[str, Any] | None:
                recs = c.get(f"/instances/{iid}/flight-records").json()["records"]
                return next((r for r in recs if "stopped serving port" in r["message"]), None)

            rec = wait_for(crash_record, 60, "the adopted crash's record")
            assert rec["phase"] == "running" and rec["spawned_at"], rec
            assert rec["run_seconds"] is not None and rec["run_seconds"] > 0
            c.post(f"/instances/{iid}/stop")
            wait_for(lambda: not hb.alive(first["pid"]), 10, "the first backend gone")

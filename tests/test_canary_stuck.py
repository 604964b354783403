"""Busy is not stuck: the canary against scripted backends whose requests the host sees in
flight (hf_server's [REQUEST]/[COMPLETE]/[ERROR] log lines, read by the HF log parser), over
real sockets, /health 200 all along.

- An engine that takes a user's request and never answers it looks busy for ever; once the
  request has shown no progress for a whole CANARY_INTERVAL_S it is probed anyway, the probe
  hangs too, and the backend is ended with cause canary_mismatch and the stall as evidence.
- A long generation streaming a token every 100 ms (a log line each) is never probed while it
  runs, however many intervals it lasts; it is probed once it is over.
- An engine that answers every user's request with a 500 is idle between them: the probe meets
  it at the next quiet moment.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from solar_host.backends.base import CanaryAsk, LogParser
from solar_host.backends.huggingface import HFLogParser
from solar_host.backends.llamacpp import BACKEND as LLAMA
from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.backends.registry import BackendRegistry
from solar_host.events import EventBus
from solar_host.instances.canary_watch import CONFIRM_S, QUIET_S
from solar_host.instances.telemetry import Telemetry
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config
from tests.fixtures.waiting import wait_until

INTERVAL_S = 2.0
TIMEOUT_S = 1.5
GOOD = " mat and the dog ran"
USER_KEY = "user-key"
# What a loaded two-core machine may add between the host's decision and the record on disk.
SLACK_S = 3.0


class SeenScript(ScriptBackend):
    """The scripted backend with a generation probe, whose requests the host sees in flight."""

    def canary_probe(self, config: Any) -> CanaryAsk | None:
        return CanaryAsk("generation", "/v1/completions")

    def new_parser(self, config: Any) -> LogParser:  # type: ignore[override]
        return HFLogParser()


def scripted(tmp_path: Path, alias: str, answers: list[str]) -> dict[str, Any]:
    return script_config(
        tmp_path, "--request-lines", "--answers", json.dumps(answers), alias=alias, api_key=USER_KEY
    )


async def user_post(port: int, timeout: float) -> httpx.Response:
    """A user's completion, straight to the backend (as control's clients reach it)."""
    async with httpx.AsyncClient(timeout=timeout) as c:
        return await c.post(
            f"http://127.0.0.1:{port}/v1/completions",
            headers={"Authorization": f"Bearer {USER_KEY}"},
            json={"prompt": "user-request: tell me", "max_tokens": 64},
        )


def requests_in_log(logs: list[dict[str, Any]]) -> list[tuple[str, str, str, int]]:
    """(marker, request id, prompt's first word or '', seq) of each marker line, in order."""
    out = []
    for e in logs:
        m = re.search(r"\[(REQUEST|COMPLETE|ERROR)\] id=(\S+)(?:.* prompt=(\S+))?", e["line"])
        if m:
            out.append((m.group(1), m.group(2), m.group(3) or "", e["seq"]))
    return out


class Instance:
    """One intent-managed instance of the host `h` (failed for control, never restarted)."""

    def __init__(self, h: Any, iid: str, port: int) -> None:
        self.h, self.id, self.port = h, iid, port

    @classmethod
    async def start(cls, h: Any, config: dict[str, Any]) -> Instance:
        r = await h.client.post("/instances", json={"config": config, "managed_by": "intent"})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        inst = cls(h, iid, r.json()["instance"]["port"])
        await wait_until(inst.fingerprinted, 20, "the known answer taken at ready")
        return inst

    async def probes(self) -> int:
        """Probes answered right (the first one took the known answer)."""
        metrics = (await self.h.client.get("/metrics")).text
        m = re.search(rf'canary_probes_total{{instance_id="{self.id}"}} (\d+)', metrics)
        return int(m.group(1)) if m else 0

    async def fingerprinted(self) -> bool:
        return await self.probes() >= 1

    async def record(self) -> dict[str, Any] | None:
        r = await self.h.client.get(f"/instances/{self.id}/flight-records")
        recs = r.json()["records"]
        return recs[0] if recs else None

    async def logs(self) -> list[dict[str, Any]]:
        return (await self.h.client.get(f"/instances/{self.id}/logs")).json()


def settings(tmp_path: Path) -> Any:
    return host_settings(
        tmp_path, max_retries=0, canary_interval_s=INTERVAL_S, canary_timeout_s=TIMEOUT_S
    )


async def test_a_request_that_hangs_is_stuck_not_busy_and_is_caught(tmp_path: Path) -> None:
    # The known answer at ready, then the engine hangs: on the user's request, on every probe.
    config = scripted(tmp_path, "c:stuck", [GOOD, "@hang"])
    async with running_host(settings(tmp_path), backends=BackendRegistry([SeenScript()])) as h:
        inst = await Instance.start(h, config)
        began = time.monotonic()
        user = asyncio.create_task(user_post(inst.port, timeout=60))
        try:
            rec = await wait_until(inst.record, 30, "the stuck backend caught")
            caught_s = time.monotonic() - began
        finally:
            user.cancel()
            await asyncio.gather(user, return_exceptions=True)
        assert rec["cause"] == "canary_mismatch" and rec["signal"] == "SIGKILL", rec
        assert f"no answer to /v1/completions within {TIMEOUT_S:g}s" in rec["message"], rec
        stalled = re.search(r"requests in flight had made no progress for (\d+)s", rec["message"])
        assert stalled and int(stalled.group(1)) >= INTERVAL_S, rec["message"]
        # One interval after the request's last sign of life, then the probe's timeout, its
        # confirmation and that one's timeout.
        assert caught_s < INTERVAL_S + 2 * TIMEOUT_S + CONFIRM_S + SLACK_S, caught_s
        # Not before: the first probe after the user's request came a whole interval later.
        logs = await inst.logs()
        marks = requests_in_log(logs)
        at = {e["seq"]: e for e in logs}
        user_req = next(m for m in marks if m[0] == "REQUEST" and m[2] == "user-request:")
        probe = next(m for m in marks if m[0] == "REQUEST" and m[3] > user_req[3])
        # The known answer's request, the user's, then the probe and its confirmation: both
        # hung too, none ended.
        assert [(m[0], m[2] == "user-request:") for m in marks] == [
            ("REQUEST", False),
            ("COMPLETE", False),
            ("REQUEST", True),
            ("REQUEST", False),
            ("REQUEST", False),
        ], marks
        gap = _seconds(at[probe[3]]) - _seconds(at[user_req[3]])
        assert gap >= INTERVAL_S - 0.05, gap

        async def failed() -> bool:
            got = (await h.client.get(f"/instances/{inst.id}")).json()
            return got["status"] == "failed"

        await wait_until(failed, 10, "failed for control")


async def test_a_long_streaming_generation_is_never_probed_while_it_runs(tmp_path: Path) -> None:
    # 50 tokens, one every 100 ms: 5 s, two and a half intervals.
    config = scripted(tmp_path, "c:stream", [GOOD, "@slow:50:100", GOOD])
    async with running_host(settings(tmp_path), backends=BackendRegistry([SeenScript()])) as h:
        inst = await Instance.start(h, config)
        began = time.monotonic()
        async with (
            httpx.AsyncClient(timeout=60) as c,
            c.stream(
                "POST",
                f"http://127.0.0.1:{inst.port}/v1/completions",
                headers={"Authorization": f"Bearer {USER_KEY}"},
                json={"prompt": "user-request: a long one", "stream": True},
            ) as r,
        ):
            assert r.status_code == 200
            tokens = [ln async for ln in r.aiter_lines() if ln.startswith("data: {")]
        streamed_s = time.monotonic() - began
        assert len(tokens) == 50 and streamed_s >= 2 * INTERVAL_S, (len(tokens), streamed_s)
        # Probed once it was over (the watch was alive all along), answered right.
        await wait_until(lambda: _at_least(inst.probes, 2), 20, "a probe after the stream")
        marks = requests_in_log(await inst.logs())
        user_req = next(m for m in marks if m[0] == "REQUEST" and m[2] == "user-request:")
        user_end = next(m for m in marks if m[0] == "COMPLETE" and m[1] == user_req[1])
        during = [m for m in marks if m[0] == "REQUEST" and user_req[3] < m[3] < user_end[3]]
        assert during == [], marks
        assert await inst.record() is None
        got = (await h.client.get(f"/instances/{inst.id}")).json()
        assert got["status"] == "running", got
        await h.client.post(f"/instances/{inst.id}/stop")


async def test_an_engine_that_500s_every_request_is_caught_between_them(tmp_path: Path) -> None:
    # The known answer at ready, then a 500 to every request, the users' and the probes'.
    config = scripted(tmp_path, "c:500", [GOOD, "@500"])
    async with running_host(settings(tmp_path), backends=BackendRegistry([SeenScript()])) as h:
        inst = await Instance.start(h, config)
        began = time.monotonic()
        statuses: list[int] = []
        rec = None
        # A user's request every 1.5 s (longer than QUIET_S apart), until the host catches it.
        while rec is None and time.monotonic() - began < 30:
            try:
                statuses.append((await user_post(inst.port, timeout=5)).status_code)
            except httpx.HTTPError:
                break  # ended meanwhile
            await asyncio.sleep(QUIET_S + 0.5)
            rec = await inst.record()
        rec = rec or await wait_until(inst.record, 10, "the 500ing backend caught")
        caught_s = time.monotonic() - began
        assert statuses and set(statuses) == {500}, statuses
        assert rec["cause"] == "canary_mismatch", rec
        assert "HTTP 500 to /v1/completions" in rec["message"], rec
        assert "no progress" not in rec["message"], rec  # probed while idle, not as stuck
        # After the interval's sleep: a quiet moment between two users' requests, the probe
        # and its confirmation.
        assert caught_s < INTERVAL_S + QUIET_S + 1.5 + CONFIRM_S + SLACK_S, caught_s


def test_progress_is_any_sign_of_life_of_the_engine() -> None:
    """What the host counts as progress of requests in flight: a log line, a finished request,
    a /metrics scrape whose engine values moved (llama-server logs nothing while it decodes,
    but its decode counter grows); not a scrape that repeats the last one, nor the Prometheus
    client's own process series, which tick while the engine is stuck."""
    t = Telemetry("i", EventBus())
    t.reset(LLAMA.new_parser(LlamaCppConfig(alias="a", model="/m.gguf")))
    scrape = {
        "llamacpp:requests_processing": 1.0,
        "llamacpp:n_decode_total": 100.0,
        "process_cpu_seconds_total": 1.0,
    }
    t.apply_metrics(scrape)  # the busy state it corrects: a state change, progress
    t.progress_at = 0.0
    t.apply_metrics(dict(scrape))
    assert t.progress_at == 0.0
    t.apply_metrics({**scrape, "process_cpu_seconds_total": 2.0, "python_gc_objects": 9.0})
    assert t.progress_at == 0.0 and t.state.busy
    t.apply_metrics({**scrape, "llamacpp:n_decode_total": 101.0})
    assert t.progress_at > 0.0
    t.progress_at = 0.0
    t.feed(["srv  update_slots: all is well"])  # any line: the parser need not know it
    assert t.progress_at > 0.0 and t.state.busy


async def _at_least(count: Any, n: int) -> bool:
    return await count() >= n


def _seconds(entry: dict[str, Any]) -> float:
    return datetime.fromisoformat(entry["timestamp"]).timestamp()

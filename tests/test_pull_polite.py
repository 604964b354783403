# ruff: noqa: ASYNC240  (tests inspect files on disk between awaits)
"""Pulls that are polite (issue 42): a 429 or 503 is waited out for as long as its Retry-After
(or RateLimit) header asks, with backoff when it names no time, and the pull's progress says it
waits and why; PULL_MAX_BYTES_PER_S caps the host's download rate (bench/pull_rate_cap.py
measures how closely; here only that the cap is never exceeded)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from solar_host.model_store import pacing
from solar_host.model_store.pacing import RateCap, retry_delay
from solar_host.model_store.pull import PullError
from tests.fixtures.fakehub import FakeHub
from tests.test_model_store import make_store
from tests.test_pull_verified import hf, hub_repo

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="loopback servers need Linux")


def test_retry_delay_reads_the_headers_sources_send():
    assert retry_delay({"Retry-After": "7"}) == 7.0
    assert retry_delay({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, now=1445412470.0) == 10.0
    assert retry_delay({"RateLimit": '"api";r=0;t=42'}) == 42.0  # the Hub's form
    assert retry_delay({"RateLimit-Reset": "3"}) == 3.0
    assert retry_delay({"Retry-After": "soon"}) is None
    assert retry_delay({}) is None


async def test_a_429_is_waited_out_as_retry_after_asks_and_progress_says_so(tmp_path):
    weights = os.urandom(200_000)
    hub = FakeHub(hub_repo(tmp_path, {"w.safetensors": weights})).start()
    try:
        hub.busy = [(429, {"Retry-After": "1"})]
        store = make_store(tmp_path, hf_endpoint=hub.url)
        await store.start()
        events: list[dict] = []
        began = time.monotonic()
        res = await asyncio.wait_for(store.pull(hf(), events.append), 30)
        took = time.monotonic() - began
        assert Path(res["path"], "w.safetensors").read_bytes() == weights
        assert took >= 1.0  # it waited as asked, and no less
        [waiting] = {e["waiting"] for e in events if e.get("waiting")}
        assert "429 Too Many Requests" in waiting and "retrying in 1 s" in waiting
        assert "as it asked" in waiting
        gets = [m for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
        assert len(gets) == 2
        assert events[-1]["phase"] == "completed" and "waiting" not in events[-1]
    finally:
        hub.stop()


async def test_a_503_of_the_hubs_api_without_a_time_backs_off(tmp_path, monkeypatch):
    monkeypatch.setattr(pacing, "BACKOFF_FIRST_S", 0.5)  # the progress polls every 0.2 s
    hub = FakeHub(hub_repo(tmp_path, {"config.json": b"{}"})).start()
    try:
        hub.busy_api = True
        hub.busy = [(503, {}), (503, {})]
        store = make_store(tmp_path, hf_endpoint=hub.url)
        await store.start()
        events: list[dict] = []
        began = time.monotonic()
        await asyncio.wait_for(store.pull(hf(), events.append), 30)
        assert time.monotonic() - began >= 0.5 + 1.0  # 0.5 s, then twice that
        notes = [e["waiting"] for e in events if e.get("waiting")]
        assert notes and all("503 Service Unavailable" in n and "backing off" in n for n in notes)
        assert {e["phase"] for e in events if e.get("waiting")} == {"resolving"}
    finally:
        hub.stop()


async def test_a_source_that_keeps_refusing_fails_the_pull_saying_so(tmp_path, monkeypatch):
    monkeypatch.setattr(pacing, "MAX_TRIES", 3)
    hub = FakeHub(hub_repo(tmp_path, {"config.json": b"{}"})).start()
    try:
        hub.busy = [(429, {"Retry-After": "0"})] * 3
        store = make_store(tmp_path, hf_endpoint=hub.url)
        await store.start()
        with pytest.raises(PullError) as err:
            await asyncio.wait_for(store.pull(hf()), 30)
        assert err.value.status_code == 503 and "after 3 tries" in err.value.detail
        # One asking for longer than the pull will wait fails at once, naming the wait.
        hub.busy = [(429, {"Retry-After": "86400"})]
        with pytest.raises(PullError) as err:
            await asyncio.wait_for(store.pull(hf()), 30)
        assert "86400 s" in err.value.detail
        assert store.list_models() == []
    finally:
        hub.stop()


async def test_a_cancelled_pull_stops_waiting_at_once(tmp_path):
    hub = FakeHub(hub_repo(tmp_path, {"config.json": b"{}"})).start()
    try:
        hub.busy = [(429, {"Retry-After": "100"})]
        store = make_store(tmp_path, hf_endpoint=hub.url)
        await store.start()
        task = asyncio.create_task(store.pull(hf()))
        deadline = time.monotonic() + 20
        while len(hub.requests) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        began = time.monotonic()
        assert store.cancel(hf()["source_uri"])
        with pytest.raises((PullError, asyncio.CancelledError)):
            await asyncio.wait_for(task, 20)
        assert time.monotonic() - began < 5
    finally:
        hub.stop()


async def test_the_rate_cap_holds_for_all_pulls_of_the_host(tmp_path):
    """Two models pulled at once under a 2 MB/s cap take at least their bytes / 2 MB/s: the
    cap is the host's, not each pull's (the bench measures how close to it they get)."""
    root = tmp_path / "hub"
    for name in ("a", "b"):
        (root / "acme" / name).mkdir(parents=True)
        (root / "acme" / name / "w.safetensors").write_bytes(os.urandom(1_500_000))
    hub = FakeHub(root).start()
    try:
        store = make_store(tmp_path, hf_endpoint=hub.url, pull_max_bytes_per_s=2_000_000)
        await store.start()
        began = time.monotonic()
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    store.pull({"source": "huggingface", "model_id": f"acme/{n}",
                                "source_uri": f"huggingface://acme/{n}"})
                    for n in ("a", "b")
                )
            ),
            60,
        )  # fmt: skip
        took = time.monotonic() - began
        assert took >= 3_000_000 / 2_000_000 * 0.95, took
    finally:
        hub.stop()


def test_rate_cap_accounting(monkeypatch):
    """Each take waits until the bytes so far fit the rate; an idle spell earns BURST_S."""
    now = [100.0]
    slept: list[float] = []
    monkeypatch.setattr(pacing.time, "sleep", slept.append)
    cap = RateCap(1000, clock=lambda: now[0])
    cap.take(500)
    cap.take(500)
    assert slept == [pytest.approx(0.5), pytest.approx(1.0)]
    now[0] += 10  # idle
    cap.take(100)
    assert slept[-1] == pytest.approx(0.1 - pacing.BURST_S)
    RateCap(0).take(10**9)  # no cap: nothing waits
    assert len(slept) == 3

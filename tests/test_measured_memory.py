"""Measured memory (issue 41, ruling 27): every instance's process tree is sampled, the peak of a
load is remembered per config across host restarts, a second start of the config is admitted
from it (plus MEASURED_MEMORY_MARGIN), and an instance outgrowing what it was admitted with
is caught (event, log line, metric)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.estimates.measured import MeasurementStore, memory_key
from solar_host.events import MemoryDrift
from tests.fixtures.gguf_sized import Shape, write_sized_gguf
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.hostproc import HostProc
from tests.fixtures.probes import FakeProbe
from tests.fixtures.script_backend import ScriptBackend, script_config

MIB = 1024**2
HOLD_MIB = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_sized_gguf(tmp_path_factory.mktemp("measured") / "m.gguf", Shape())


def cfg(tmp_path: Path, model: Path, *fake_args: str, alias: str = "mem:1") -> dict:
    c = script_config(tmp_path, "--ready-after", "0.1", *fake_args, alias=alias, ctx_size=4096)
    c["model"] = str(model)
    return c


# --- the store -------------------------------------------------------------------------------


def test_store_is_bounded_and_survives_reload(tmp_path: Path) -> None:
    path = tmp_path / "memory-measurements.json"
    store = MeasurementStore(path, lambda: 3)
    for i in range(5):
        store.record(f"k{i}", 100 + i, [i * MIB], (90, [i]), new_load=True)
    assert store.flush() and len(store) == 3
    again = MeasurementStore(path, lambda: 3)
    again.load()
    assert [again.get(f"k{i}") is None for i in range(5)] == [True, True, False, False, False]
    m = again.get("k4")
    assert m is not None and m.peak_cpu == 104 and m.peak_gpus == [4 * MIB] and m.loads == 1
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    # A second write keeps the first as the last good copy.
    again.record("k5", 1, [], None, new_load=True)
    assert again.flush() and path.with_name(path.name + ".prev").is_file()


@pytest.mark.parametrize(
    "damage",
    [
        b"{not json",
        b'{"version": 1, "measurements": []}',
        b'{"version": 1, "measurements": {"k": {"peak_cpu": -5, "peak_gpus": []}}}',
        b'{"version": 1, "measurements": {"k": {"peak_cpu": 1e30, "peak_gpus": []}}}',
    ],
)
def test_damage_is_quarantined_and_the_last_good_copy_used(tmp_path: Path, damage: bytes) -> None:
    path = tmp_path / "memory-measurements.json"
    store = MeasurementStore(path)
    store.record("good", 7 * MIB, [], None, new_load=True)
    store.flush()
    store.record("newer", 8 * MIB, [], None, new_load=True)
    store.flush()  # the file with "good" is now the .prev
    path.write_bytes(damage)
    again = MeasurementStore(path)
    again.load()
    assert len(again.quarantined) == 1
    assert again.quarantined[0].read_bytes() == damage  # moved aside, never erased
    assert again.get("good") is not None and again.get("newer") is None
    assert again.flush()  # the file is whole again
    third = MeasurementStore(path)
    third.load()
    assert third.get("good") is not None and not third.quarantined


def test_key_follows_what_changes_memory(tmp_path: Path, model: Path) -> None:
    from solar_host.backends.llamacpp_config import LlamaCppConfig

    base = LlamaCppConfig(alias="a", model=str(model), ctx_size=4096)
    key = memory_key(base)
    assert memory_key(base.model_copy(update={"alias": "b", "temp": 0.2, "port": 9})) == key
    assert memory_key(base.model_copy(update={"ctx_size": 8192})) != key
    assert memory_key(base.model_copy(update={"cache_type_k": "q8_0"})) != key
    assert memory_key(base, "llama-server b2") != memory_key(base, "llama-server b1")
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        assert memory_key(base) != key  # the model file changed
    finally:
        os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))


# --- real processes ----------------------------------------------------------------------------


async def _until_serving_sampled(h, iid: str, samples: int = 2) -> dict:
    sampler = h.host.memory
    for _ in range(samples):
        await sampler.sample()
    view = sampler.view(iid)
    assert view is not None
    return view


async def test_measured_within_a_few_percent_and_admitted_second_time(
    tmp_path: Path, model: Path
) -> None:
    probe = FakeProbe(ram=(64, 8))  # a CPU host
    settings = host_settings(
        tmp_path, model_roots=str(model.parent), memory_sample_interval_s=3600.0
    )
    async with running_host(
        settings, backends=BackendRegistry([ScriptBackend()]), probe=probe
    ) as h:
        ids = {}
        for name, args in (("base", ()), ("hold", ("--hold-mib", str(HOLD_MIB)))):
            r = await h.client.post(
                "/instances", json={"config": cfg(tmp_path, model, *args, alias=f"mem:{name}")}
            )
            ids[name] = r.json()["instance"]["id"]
            r = await h.client.post(f"/instances/{ids[name]}/start")
            assert r.status_code == 200, r.text
        base = await _until_serving_sampled(h, ids["base"])
        held = await _until_serving_sampled(h, ids["hold"])
        extra = held["peak_bytes"] - base["peak_bytes"]
        print(
            f"\nheld {HOLD_MIB} MiB: tree peak {held['peak_bytes'] / MIB:.1f} MiB, "
            f"baseline {base['peak_bytes'] / MIB:.1f} MiB, difference {extra / MIB:.1f} MiB"
        )
        assert extra == pytest.approx(HOLD_MIB * MIB, rel=0.03)

        # The first start was admitted from the estimate, and the usage says so.
        r = await h.client.get(f"/instances/{ids['hold']}/usage")
        mem = r.json()["memory"]
        assert mem["source"] == "estimated" and mem["admission"]["measured_bytes"] is None
        assert mem["sampled"]["peak_bytes"] == held["peak_bytes"]
        estimated = mem["admission"]["estimated_bytes"]

        # Remembered under the config's key; the second start is admitted from it.
        await h.client.post(f"/instances/{ids['hold']}/stop")
        r = await h.client.get(f"/instances/{ids['hold']}/estimate")
        doc = r.json()
        assert doc["source"] == "measured", doc
        assert doc["measured_bytes"] == held["peak_bytes"]
        assert doc["admitted_bytes"] == pytest.approx(held["peak_bytes"] * 1.05, abs=2)
        assert doc["estimated_bytes"] == estimated == doc["total_bytes"]
        r = await h.client.post(f"/instances/{ids['hold']}/start")
        assert r.status_code == 200, r.text
        mem = (await h.client.get(f"/instances/{ids['hold']}/usage")).json()["memory"]
        assert mem["source"] == "measured"
        assert mem["admission"]["measured_bytes"] == held["peak_bytes"]
        second = await _until_serving_sampled(h, ids["hold"])
        off = (second["peak_bytes"] - held["peak_bytes"]) / second["peak_bytes"]
        print(
            f"second load: peak {second['peak_bytes'] / MIB:.1f} MiB, admitted "
            f"{mem['admission']['admitted_bytes'] / MIB:.1f} MiB (first peak off by "
            f"{100 * off:+.2f} %), estimate {estimated / MIB:.1f} MiB"
        )
        assert abs(off) < 0.03

        # A host short of what was measured refuses the start, naming both figures (409).
        await h.client.post(f"/instances/{ids['hold']}/stop")
        free = (estimated + held["peak_bytes"]) / 2 if estimated < held["peak_bytes"] else 0
        assert free, "the fake's measured figure should exceed the tiny model's estimate"
        probe.set_ram(64, 64 - free / 1024**3)
        r = await h.client.post(f"/instances/{ids['hold']}/start")
        assert r.status_code == 409, r.text
        body = r.json()
        assert body["source"] == "measured" and body["measured_bytes"] == second["peak_bytes"]
        assert body["estimated_bytes"] == estimated
        assert body["needed_bytes"] == body["admitted_bytes"] > body["available_bytes"]
        await h.client.post(f"/instances/{ids['base']}/stop")


async def test_drift_is_an_event_a_metric_and_raises_the_admitted_figure(
    tmp_path: Path, model: Path
) -> None:
    probe = FakeProbe(ram=(64, 8))
    settings = host_settings(
        tmp_path, model_roots=str(model.parent), memory_sample_interval_s=3600.0
    )
    async with running_host(
        settings, backends=BackendRegistry([ScriptBackend()]), probe=probe
    ) as h:
        events: list[MemoryDrift] = []
        h.host.bus.subscribe(events.append, MemoryDrift)
        config = cfg(tmp_path, model, "--grow-mib-after", "0.3:200")
        r = await h.client.post("/instances", json={"config": config})
        iid = r.json()["instance"]["id"]
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        gate = h.host.instances.capacity
        admitted = dict(gate.placements[iid].needs)
        await asyncio.sleep(0.1)
        sampler = h.host.memory
        await sampler.sample()  # before it grows: within what was admitted, or not yet twice
        assert not events
        deadline = time.monotonic() + 20
        while not events and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            await sampler.sample()
        assert len(events) == 1, "no drift seen"
        ev = events[0]
        assert ev.instance_id == iid and ev.device == "cpu" and ev.source == "estimated"
        assert ev.measured_bytes > ev.admitted_bytes * 1.1
        assert ev.admitted_bytes == admitted["cpu"]
        # Counted at once: the instance is now admitted with what it takes.
        assert gate.placements[iid].needs["cpu"] == ev.measured_bytes
        await sampler.sample()
        assert len(events) == 1  # once per drift
        text = (await h.client.get("/metrics")).text
        assert f'solar_host_instance_memory_drift_total{{instance_id="{iid}"}} 1' in text
        mem = (await h.client.get(f"/instances/{iid}/usage")).json()["memory"]
        assert mem["sampled"]["drifting"] == ["cpu"]
        assert mem["admission"]["admitted_bytes"] >= ev.measured_bytes
        await h.client.post(f"/instances/{iid}/stop")


def _wait_for(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError("condition not met")


def test_measurement_survives_a_host_restart(tmp_path: Path, model: Path) -> None:
    models = tmp_path / "host" / "models"
    models.mkdir(parents=True)
    local = models / "sized.gguf"
    local.write_bytes(model.read_bytes())
    env = {"MEMORY_SAMPLE_INTERVAL_S": "0.2", "FIT_CHECK": "true"}
    with HostProc(tmp_path / "host", env=env) as hp:
        hp.start()
        with hp.client() as c:
            config = cfg(tmp_path / "host", local, "--hold-mib", "64")
            iid = c.post("/instances", json={"config": config}).json()["instance"]["id"]
            assert c.post(f"/instances/{iid}/start").status_code == 200

            def sampled() -> dict | None:
                mem = c.get(f"/instances/{iid}/usage").json().get("memory") or {}
                peak = (mem.get("sampled") or {}).get("peak_bytes")
                # steady: sampled while serving (samples during the load do not count)
                return mem if peak and mem["sampled"]["steady_bytes"] else None

            first = _wait_for(sampled)
            assert first["source"] == "estimated"
            c.post(f"/instances/{iid}/stop")
        store = tmp_path / "host" / "memory-measurements.json"
        doc = json.loads(_wait_for(lambda: store.is_file() and store.read_text()))
        (entry,) = doc["measurements"].values()
        assert entry["peak_cpu"] >= 64 * MIB and entry["loads"] == 1
        hp.stop()
        hp.start()
        with hp.client() as c:
            r = c.get(f"/instances/{iid}/estimate")
            assert r.json()["source"] == "measured", r.text
            assert r.json()["measured_bytes"] == entry["peak_cpu"]
            assert c.post(f"/instances/{iid}/start").status_code == 200
            mem = c.get(f"/instances/{iid}/usage").json()["memory"]
            assert mem["source"] == "measured"
            assert mem["admission"]["measured_bytes"] == entry["peak_cpu"]
            c.post(f"/instances/{iid}/stop")


def test_a_fifo_or_device_in_its_place_is_moved_aside_unread(tmp_path: Path) -> None:
    path = tmp_path / "memory-measurements.json"
    os.mkfifo(path)
    store = MeasurementStore(path)
    store.load()  # returns: a FIFO with no writer is never opened blocking
    assert len(store) == 0 and not path.exists()
    assert len(store.quarantined) == 1 and store.quarantined[0].is_fifo()
    path.symlink_to("/dev/zero")
    store = MeasurementStore(path)
    store.load()
    assert len(store) == 0 and store.quarantined[0].is_symlink() and not path.exists()


def test_tree_walk_finds_children_forked_by_any_thread() -> None:
    """procfs.children reads each thread's list: a child started from a worker thread (as
    HF and SGLang servers start theirs) is in the tree, and its own child too."""
    import subprocess
    import sys

    from solar_host.estimates.accounting import measure_tree, tree_pids
    from solar_host.resources.usage import process_tree

    script = (
        "import subprocess, threading, time\n"
        "kids = []\n"
        "t = threading.Thread(target=lambda: kids.append(subprocess.Popen("
        "['sh', '-c', 'sleep 60 & wait'])))\n"
        "t.start(); t.join()\n"
        "kids.append(subprocess.Popen(['sleep', '60']))\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        want = _wait_for(lambda: (lambda t: t if len(t) == 4 else None)(process_tree(parent.pid)))
        assert tree_pids(parent.pid) == want
        assert measure_tree(parent.pid, {})["cpu"] > 0
    finally:
        for pid in process_tree(parent.pid) - {parent.pid}:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        parent.kill()
        parent.wait(timeout=10)
    assert tree_pids(parent.pid) == set()


class BudgetProbe(FakeProbe):
    """A machine with `budget` bytes of RAM whose backends are the only users: what is
    available is the budget less the RSS of every running instance's tree, read live."""

    def __init__(self, budget: int):
        super().__init__(ram=(64, 0))
        self.budget = budget
        self.host = None

    def used(self) -> int:
        from solar_host.estimates.accounting import measure_tree

        sups = self.host.instances.supervisors.values() if self.host is not None else []
        return sum(measure_tree(s.instance.pid, {}).get("cpu", 0) for s in sups)

    def ram(self):
        from solar_host.resources.probes import Usage

        used = self.used()
        return Usage(self.budget, used, max(self.budget - used, 0))


async def test_twenty_configs_on_a_set_budget(tmp_path: Path, model: Path) -> None:
    """Issue 41: 20 configs measured once, then started one after another on a machine with
    a set amount of memory: none admitted takes the machine past it, and at most 5 % are
    refused that would have fit."""
    probe = BudgetProbe(1 << 40)
    settings = host_settings(
        tmp_path, model_roots=str(model.parent), memory_sample_interval_s=3600.0
    )
    async with running_host(
        settings, backends=BackendRegistry([ScriptBackend()]), probe=probe
    ) as h:
        probe.host = h.host
        ids, peaks = [], []
        for i in range(20):
            config = cfg(tmp_path, model, "--hold-mib", str(4 + 5 * i), alias=f"mem:{i}")
            r = await h.client.post("/instances", json={"config": config})
            ids.append(r.json()["instance"]["id"])
            assert (await h.client.post(f"/instances/{ids[-1]}/start")).status_code == 200
            peaks.append((await _until_serving_sampled(h, ids[-1]))["peak_bytes"])
            await h.client.post(f"/instances/{ids[-1]}/stop")
        probe.budget = int(sum(peaks) * 0.6)
        admitted, refused, would_fit, worst = 0, 0, 0, 0
        for iid, peak in zip(ids, peaks, strict=True):
            r = await h.client.post(f"/instances/{iid}/start")
            if r.status_code == 409:
                refused += 1
                body = r.json()
                assert body["source"] == "measured"
                would_fit += peak <= body["available_bytes"]
                continue
            assert r.status_code == 200, r.text
            admitted += 1
            await _until_serving_sampled(h, iid)
            used = probe.used()
            worst = max(worst, used)
            assert used <= probe.budget, (used, probe.budget)
        print(
            f"\nbudget {probe.budget / MIB:.0f} MiB: {admitted} admitted (most in use "
            f"{worst / MIB:.0f} MiB), {refused} refused, {would_fit} of them would have fit"
        )
        assert admitted and refused and would_fit <= 1
        for iid in ids:
            await h.client.post(f"/instances/{iid}/stop")

"""Per-instance memory accounting: measured use per device (NVML per-process on GPUs, RSS on the
CPU) beside the estimate, in GET /instances/{id}/usage and /metrics."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.estimates.accounting import measure_tree
from solar_host.resources.probes import LiveProbe
from tests.fixtures.gguf_sized import Shape, write_sized_gguf
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.probes import FakeProbe
from tests.fixtures.script_backend import ScriptBackend, script_config

GIB = 1024**3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_sized_gguf(tmp_path_factory.mktemp("mem") / "m.gguf", Shape())


class FakeNvml:
    """The part of pynvml LiveProbe calls, with processes per device."""

    def __init__(self, per_device: dict[int, list[tuple[int, int | None]]]):
        self.per_device = per_device

    def nvmlDeviceGetCount(self) -> int:
        return len(self.per_device)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in self.per_device[h]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        raise RuntimeError("not supported")  # as on many datacenter GPUs


def test_live_probe_reads_nvml_per_device() -> None:
    probe = LiveProbe()
    probe._nvml_tried = True
    probe._nvml = FakeNvml({0: [(10, 2 * GIB), (11, None)], 1: [(10, GIB), (12, 2**64 - 1)]})
    assert probe.gpu_process_memory_by_device() == {0: {10: 2 * GIB}, 1: {10: GIB}}
    assert probe.gpu_process_memory() == {10: 3 * GIB}


def test_measure_tree_counts_only_its_processes() -> None:
    # A process of its own: the test runner's tree holds whatever other tests started.
    # `sleep` (Popen returns after its exec): a small RSS that does not grow while measured.
    child = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        proc, rss, deadline = psutil.Process(child.pid), -1, time.monotonic() + 10
        while time.monotonic() < deadline:  # until the loader has mapped what it maps
            now = proc.memory_info().rss
            if now == rss:
                break
            rss = now
            time.sleep(0.1)
        out = measure_tree(child.pid, {0: {child.pid: GIB, 999_999_999: GIB}, 3: {child.pid: 5}})
        assert out["cpu"] == pytest.approx(rss, rel=0.5)
        assert out["cuda:0"] == GIB and out["cuda:3"] == 5
    finally:
        child.kill()
        child.wait(timeout=10)
    assert measure_tree(None, {}) == {} and measure_tree(2**22 + 12345, {}) == {}


async def test_usage_and_metrics_show_estimate_and_measured(tmp_path: Path, model: Path) -> None:
    probe = FakeProbe(gpus=[(24, 20), (24, 2)])
    backends = BackendRegistry([ScriptBackend()])
    settings = host_settings(tmp_path, model_roots=str(model.parent))
    async with running_host(settings, backends=backends, probe=probe) as h:
        config = script_config(tmp_path, "--ready-after", "0.1", ctx_size=4096)
        config["model"] = str(model)
        r = await h.client.post("/instances", json={"config": config})
        iid = r.json()["instance"]["id"]
        assert (await h.client.get(f"/instances/{iid}/usage")).status_code == 404  # stopped
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        inst = r.json()["instance"]
        assert inst["placed_devices"] == ["cuda:1"]
        probe.process_memory_by_device = {1: {inst["pid"]: 3 * GIB}, 0: {1: GIB}}
        r = await h.client.get(f"/instances/{iid}/usage")
        assert r.status_code == 200, r.text
        mem = r.json()["memory"]
        by = {d["device"]: d for d in mem["devices"]}
        assert set(by) == {"cpu", "cuda:1"}
        assert by["cuda:1"]["measured_bytes"] == 3 * GIB
        assert by["cuda:1"]["estimate_bytes"] > 40 * 1024**2
        assert by["cpu"]["measured_bytes"] > 0  # the backend's RSS
        assert by["cpu"]["estimate_bytes"] > 0  # token_embd stays on the CPU
        assert mem["measured_bytes"] == sum(d["measured_bytes"] for d in by.values())
        text = (await h.client.get("/metrics")).text
        est_line = (
            f'solar_host_instance_memory_estimate_bytes{{instance_id="{iid}",device="cuda:1"}}'
        )
        used_line = (
            f'solar_host_instance_memory_measured_bytes{{instance_id="{iid}",device="cuda:1"}}'
        )
        assert est_line in text and f"{used_line} {3 * GIB}" in text
        assert (
            f'solar_host_instance_memory_measured_bytes{{instance_id="{iid}",device="cpu"}}' in text
        )
        await h.client.post(f"/instances/{iid}/stop")

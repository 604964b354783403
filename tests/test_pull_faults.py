# ruff: noqa: ASYNC240  (tests inspect files on disk between awaits)
"""Model pulls under faults: hostile peers on loopback sockets (tests/fixtures/hostile_peers.py),
a real full disk (a small tmpfs, where this runs as root), a host process killed mid-pull
(tests/fixtures/pull_child.py), and pulls racing one another. Every wait is bounded."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from solar_host.model_store import huggingface, oci
from solar_host.model_store.pull import PullError
from solar_host.model_store.service import ModelStore
from tests.fixtures.fakehub import FakeHub
from tests.fixtures.hostile_peers import HostileHub, HostileOCI, PlainFiles
from tests.fixtures.pull_child import kill_mid_pull
from tests.fixtures.tmpfs import small_tmpfs
from tests.test_model_store import make_store

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="loopback servers need Linux")

HF_URI = "huggingface://acme/m"
LOGIN = "Basic " + base64.b64encode(b"alice:s3cret").decode()


def hf(filters: list[str] | None = None) -> dict:
    req = {"source": "huggingface", "model_id": "acme/m", "source_uri": HF_URI}
    if filters is not None:
        req["file_filters"] = filters
    return req


def harbor() -> dict:
    return {"source": "harbor", "source_uri": "repo://m:v1", "harbor_ref": "proj/m:v1"}


def hub_repo(tmp_path: Path, files: dict[str, bytes]) -> Path:
    root = tmp_path / "hub"
    repo = root / "acme" / "m"
    repo.mkdir(parents=True)
    for name, data in files.items():
        (repo / name).write_bytes(data)
    return root


def names(store: ModelStore) -> list[tuple[str, list[str]]]:
    return [(m["slug"], [f["name"] for f in m["files"]]) for m in store.list_models()]


def file_gets(hub: FakeHub) -> list[str]:
    return sorted(
        p.rsplit("/", 1)[-1] for m, p, _ in list(hub.requests) if m == "GET" and "/resolve/" in p
    )


async def failed_within(coro, seconds: float) -> tuple[PullError, float]:
    began = time.monotonic()
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(coro, seconds)
    return err.value, time.monotonic() - began


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture
def hostile_hub(tmp_path):
    hubs: list[HostileHub] = []

    def make(files: dict[str, bytes]) -> HostileHub:
        hub = HostileHub(hub_repo(tmp_path, files)).start()
        hubs.append(hub)
        return hub

    yield make
    for hub in hubs:
        hub.stop()


@pytest.fixture
def registry():
    reg = HostileOCI()
    yield reg
    reg.stop()


@pytest.fixture
def tmpfs(tmp_path):
    """A real 6 MiB filesystem (tmpfs) mounted for the test; skipped where mounts are refused."""
    with small_tmpfs(tmp_path / "small-disk", "size=6m") as mnt:
        yield mnt


# --- hostile peers ---------------------------------------------------------------------------


async def test_a_hub_body_longer_than_announced_is_refused_before_it_fills_the_disk(
    tmp_path, hostile_hub
):
    """The Hub announced 300 KB and sent zeros without end: huggingface_hub compares the size
    only once a body ends, so the host wrote until the disk was full (a 64 MiB tmpfs: 79 MB
    sent, 507 "Insufficient disk space"); with a disk floor, down to the floor."""
    hub = hostile_hub({"config.json": b"{}", "w.bin": os.urandom(300_000)})
    hub.bad.modes["w.bin"] = "endless"
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    err, _ = await failed_within(store.pull(hf()), 60)
    assert (err.status_code, err.error) == (502, "model_pull_failed"), err.detail
    assert "announced" in err.detail
    assert disk_bytes(store.models_dir) < 32 << 20  # one 10 MB chunk past the size at most
    assert store.list_models() == []


async def test_a_trickling_hub_body_fails_the_pull(tmp_path, hostile_hub, monkeypatch):
    """A byte every half second never trips a read timeout, and huggingface_hub retries a
    timed-out body for as long as each try brings a byte: the pull hung (over 90 s for a
    300 KB file sent at a byte per 5 s; days to finish). Under the rate floor it fails."""
    monkeypatch.setattr(huggingface, "RATE_WINDOW_S", 1.0)
    hub = hostile_hub({"w.bin": os.urandom(300_000)})
    hub.bad.modes["w.bin"] = "trickle"
    hub.bad.stall_after, hub.bad.trickle_s = 1000, 0.3
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    err, _ = await failed_within(store.pull(hf()), 60)
    assert err.status_code == 502 and "stalled" in err.detail, err.detail
    assert store.list_models() == []


async def test_a_trickling_registry_blob_fails_and_the_pull_resumes_from_it(
    tmp_path, registry, monkeypatch
):
    """The registry side of the trickle (it hung past 100 s); what came is kept, and the next
    pull asks for the rest only."""
    monkeypatch.setattr(oci, "RATE_WINDOW_S", 1.0)
    data = os.urandom(400_000)
    digest = registry.add_artifact("proj/m", "v1", {"w.bin": data})[0]
    registry.bad.modes[digest] = "trickle"
    registry.bad.stall_after, registry.bad.trickle_s = 100_000, 0.3
    store = make_store(tmp_path, harbor_url=registry.url)
    await store.start()
    err, _ = await failed_within(store.pull(harbor()), 60)
    assert err.status_code == 502 and "stalled" in err.detail, err.detail
    [part] = (store.models_dir / ".partial").rglob("*.part")
    kept = part.stat().st_size
    assert kept >= 100_000
    registry.bad.modes.clear()
    res = await asyncio.wait_for(store.pull(harbor()), 60)
    assert Path(res["path"], "w.bin").read_bytes() == data
    assert registry.ranges == [f"bytes={kept}-"]


async def test_a_registry_that_stalls_mid_blob_times_out(tmp_path, registry, monkeypatch):
    monkeypatch.setattr(oci, "READ_TIMEOUT_S", 1.0)
    digest = registry.add_artifact("proj/m", "v1", {"w.bin": os.urandom(300_000)})[0]
    registry.bad.modes[digest] = "stall"
    registry.bad.stall_after = 50_000
    store = make_store(tmp_path, harbor_url=registry.url)
    await store.start()
    err, took = await failed_within(store.pull(harbor()), 60)
    assert err.status_code == 502 and "timed out" in err.detail, err.detail
    assert took < 30


async def test_a_hub_that_stalls_mid_body_times_out(tmp_path, hostile_hub, monkeypatch):
    """huggingface_hub's own read timeout (HF_HUB_DOWNLOAD_TIMEOUT, 10 s) and its five retries
    bound it: 65.6 s measured with the defaults; 1 s here."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    hub = hostile_hub({"w.bin": os.urandom(300_000)})
    hub.bad.modes["w.bin"] = "stall"
    hub.bad.stall_after = 50_000
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    err, took = await failed_within(store.pull(hf()), 90)
    assert err.status_code == 502, err.detail
    assert took < 60


def _other_loopback_host() -> str:
    """127.0.0.2 (another host, as far as a client can tell) where it can be bound."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return "127.0.0.2"
    except OSError:
        return "127.0.0.1"


async def test_a_blob_redirected_to_another_host_gets_no_credentials(tmp_path, registry):
    """A registry may send blobs to storage elsewhere: the bytes are still verified, and the
    registry's login never goes with the redirect."""
    data = os.urandom(200_000)
    digest = registry.add_artifact("proj/m", "v1", {"w.bin": data})[0]
    registry.login = LOGIN
    other = PlainFiles({f"/v2/proj/m/blobs/{digest}": data}, host=_other_loopback_host())
    try:
        registry.bad.modes[digest] = "redirect"
        registry.bad.redirect_to = other.url
        store = make_store(
            tmp_path, harbor_url=registry.url, harbor_username="alice", harbor_password="s3cret"
        )
        await store.start()
        res = await asyncio.wait_for(store.pull(harbor()), 60)
        assert Path(res["path"], "w.bin").read_bytes() == data
        assert other.seen_auth and all(auth is None for _p, auth in other.seen_auth)
        # A redirect to wrong bytes fails the digest check, and nothing is recorded.
        other.files[f"/v2/proj/m/blobs/{digest}"] = os.urandom(200_000)
        await store.delete("repo--m--v1")
        err, _ = await failed_within(store.pull(harbor()), 60)
        assert err.status_code == 502 and "digest mismatch" in err.detail
        assert store.list_models() == []
    finally:
        other.stop()


async def test_a_hub_file_redirected_to_another_host_gets_no_token(tmp_path, hostile_hub):
    data = os.urandom(100_000)
    hub = hostile_hub({"w.bin": data})
    other = PlainFiles({}, host=_other_loopback_host())
    try:
        hub.bad.modes["w.bin"] = "redirect"
        hub.bad.redirect_to = other.url
        store = make_store(tmp_path, hf_endpoint=hub.url, hf_token="hf_secret")
        await store.start()
        other.files = {_resolve_path(hub): data}
        await asyncio.wait_for(store.pull(hf()), 60)
        assert other.seen_auth and all(auth is None for _p, auth in other.seen_auth)
    finally:
        other.stop()


def _resolve_path(hub: FakeHub) -> str:
    from tests.fixtures.fakehub import _commit

    return f"/acme/m/resolve/{_commit(hub.root / 'acme' / 'm')}/w.bin"


# --- a full disk -----------------------------------------------------------------------------


async def test_a_real_full_disk_while_adding_files_keeps_the_model(tmp_path, tmpfs):
    """ENOSPC from a real filesystem, not a probe: the model already on disk stays whole,
    listed and answered from the cache, and what the failed pull wrote is freed."""
    small = os.urandom(500_000)
    hub = FakeHub(hub_repo(tmp_path, {"small.bin": small, "big.bin": os.urandom(12_000_000)}))
    hub.start()
    try:
        store = make_store(tmpfs, hf_endpoint=hub.url)
        await store.start()
        first = await asyncio.wait_for(store.pull(hf(["small.bin"])), 60)
        err, _ = await failed_within(store.pull(hf(["big.bin"])), 60)
        assert err.status_code == 507
        assert names(store) == [("hf--acme--m", ["small.bin"])]
        assert Path(first["path"], "small.bin").read_bytes() == small
        assert not [p for p in (store.models_dir / ".partial").rglob("*") if p.is_file()]
        again = await asyncio.wait_for(store.pull(hf(["small.bin"])), 60)
        assert again["cached"] is True
    finally:
        hub.stop()


# --- a top-up (a pull adding files to a model on disk) ----------------------------------------


async def test_a_model_stays_listed_and_usable_while_files_are_added(tmp_path, hostile_hub):
    """A top-up moved the model into .partial and took it out of the manifest for the whole
    download: GET /models was empty, an instance naming the source was "never pulled", and a
    pull of the files already there waited for the top-up (63 s against a stalled Hub)."""
    small = os.urandom(100_000)
    hub = hostile_hub({"small.bin": small, "big.bin": os.urandom(300_000)})
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    first = await asyncio.wait_for(store.pull(hf(["small.bin"])), 60)
    hub.bad.modes["big.bin"] = "stall"
    adding = asyncio.create_task(store.pull(hf(["big.bin"])))
    try:
        deadline = time.monotonic() + 20
        while hub.bad.sent.get("big.bin") is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert hub.bad.sent.get("big.bin") == 0, "the top-up never reached the file"
        assert names(store) == [("hf--acme--m", ["small.bin"])]
        assert store.lookup_dir(HF_URI) == Path(first["path"])
        assert Path(first["path"], "small.bin").read_bytes() == small
        cached = await asyncio.wait_for(store.pull(hf(["small.bin"])), 5)
        assert cached["cached"] is True
    finally:
        hub.bad.modes.clear()
        hub.bad.released.set()  # the Hub sends the file after all: the top-up completes
        res = await asyncio.wait_for(adding, 60)
    assert res["path"] == first["path"]
    assert names(store) == [("hf--acme--m", ["big.bin", "small.bin"])]
    assert Path(first["path"], "small.bin").read_bytes() == small


async def test_a_pull_waiting_for_another_can_itself_be_cancelled(tmp_path, hostile_hub):
    """A pull of other filters waits for the running one; its own cancellation (a client gone,
    a timeout) was swallowed with the other's outcome, so it waited as long as that did."""
    hub = hostile_hub({"a.bin": b"a" * 1000, "b.bin": os.urandom(300_000)})
    hub.bad.modes["b.bin"] = "stall"
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    running = asyncio.create_task(store.pull(hf(["b.bin"])))
    try:
        await asyncio.sleep(0.3)
        began = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(store.pull(hf(["a.bin"])), 1)
        assert time.monotonic() - began < 10
        assert not running.done()
    finally:
        hub.bad.modes.clear()
        hub.bad.released.set()
        await asyncio.wait_for(running, 60)


# --- the host killed mid-pull ----------------------------------------------------------------


async def test_a_host_killed_while_adding_files_keeps_the_model(tmp_path, hostile_hub):
    """SIGKILL mid top-up: after the restart the model was gone from GET /models (its files
    in .partial), and the pull that finished it recorded only the new filters."""
    small = os.urandom(100_000)
    hub = hostile_hub({"small.bin": small, "big.bin": os.urandom(300_000)})
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    first = await asyncio.wait_for(store.pull(hf(["small.bin"])), 60)
    hub.bad.modes["big.bin"] = "stall"
    hub.bad.stall_after = 1000
    await asyncio.to_thread(
        kill_mid_pull,
        store.models_dir,
        hub.url,
        hf(["big.bin"]),
        lambda: "big.bin" in hub.bad.sent,
    )
    restarted = make_store(tmp_path, hf_endpoint=hub.url)
    await restarted.start()
    assert names(restarted) == [("hf--acme--m", ["small.bin"])]
    assert restarted.lookup_dir(HF_URI) == Path(first["path"])
    hub.bad.modes.clear()
    hub.requests.clear()
    res = await asyncio.wait_for(restarted.pull(hf(["big.bin"])), 60)
    assert res["cached"] is False
    assert file_gets(hub) == ["big.bin"]  # the file already there was not fetched again
    assert names(restarted) == [("hf--acme--m", ["big.bin", "small.bin"])]
    assert restarted.manifest.get(HF_URI).file_filters == ["big.bin", "small.bin"]
    assert Path(res["path"], "small.bin").read_bytes() == small


async def test_a_host_killed_mid_blob_lists_nothing_and_the_pull_resumes(tmp_path, registry):
    data = os.urandom(600_000)
    digest = registry.add_artifact("proj/m", "v1", {"w.bin": data})[0]
    registry.bad.modes[digest] = "stall"
    registry.bad.stall_after = 300_000
    models = tmp_path / "models"
    await asyncio.to_thread(
        kill_mid_pull,
        models,
        registry.url,
        harbor(),
        lambda: any(p.stat().st_size for p in models.rglob("*.part")),
    )
    store = make_store(tmp_path, harbor_url=registry.url)
    await store.start()
    assert store.list_models() == [] and store.lookup_dir("repo://m:v1") is None
    [part] = models.rglob("*.part")
    kept = part.stat().st_size
    registry.bad.modes.clear()
    res = await asyncio.wait_for(store.pull(harbor()), 60)
    assert Path(res["path"], "w.bin").read_bytes() == data
    assert registry.ranges == [f"bytes={kept}-"]


async def test_an_older_copy_left_aside_by_a_crash_is_put_back(tmp_path, registry):
    """A replacing pull renames the older copy aside before the new one takes its place; a
    host killed between the two renames finds it back on start."""
    data = os.urandom(1000)
    registry.add_artifact("proj/m", "v1", {"w.bin": data})
    store = make_store(tmp_path, harbor_url=registry.url)
    await store.start()
    res = await asyncio.wait_for(store.pull(harbor()), 60)
    aside = store._replaced("repo--m--v1")
    aside.parent.mkdir(parents=True)
    os.replace(res["path"], aside)  # the state such a crash leaves
    restarted = make_store(tmp_path, harbor_url=registry.url)
    await restarted.start()
    assert Path(res["path"], "w.bin").read_bytes() == data
    assert not aside.exists()
    assert (await restarted.pull(harbor()))["cached"] is True


# --- concurrency and deletes -----------------------------------------------------------------


async def test_two_pulls_at_once_share_one_download_and_delete_waits(tmp_path, hostile_hub):
    data = os.urandom(300_000)
    hub = hostile_hub({"w.bin": data})
    hub.bytes_per_s = 600_000
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    both = [asyncio.create_task(store.pull(hf())) for _ in range(2)]
    await asyncio.sleep(0.2)
    from solar_host.model_store.service import StoreError

    with pytest.raises(StoreError) as busy:
        await store.delete("hf--acme--m")
    assert busy.value.status_code == 409
    done = await asyncio.wait_for(asyncio.gather(*both), 60)
    assert done[0]["path"] == done[1]["path"]
    assert file_gets(hub) == ["w.bin"]
    assert Path(done[0]["path"], "w.bin").read_bytes() == data

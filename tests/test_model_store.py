# ruff: noqa: ASYNC240  (tests inspect files on disk between awaits)
"""The model store against real servers on loopback: the Debian docker-registry (plain http,
self-signed TLS with htpasswd) with artifacts pushed by oras, and the fake HF Hub."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from solar_host.events import PullProgress
from solar_host.instances.schemas import ConfigError, parse_config
from solar_host.model_store.manifest import Manifest
from solar_host.model_store.pull import PullError
from solar_host.model_store.service import ModelStore
from solar_host.resources.probes import Usage
from solar_host.settings import Settings
from tests.fixtures.fakehub import FakeHub
from tests.fixtures.registry import Registry, StallProxy, sha256_file

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="loopback registry needs Linux")

GB = 1024**3


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    r = Registry(tmp_path_factory.mktemp("reg")).start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def tls_reg(tmp_path_factory):
    r = Registry(tmp_path_factory.mktemp("tlsreg"), tls=True, users={"alice": "s3cret"}).start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    repo = root / "acme" / "tiny"
    (repo / "sub").mkdir(parents=True)
    (repo / "config.json").write_text('{"model_type": "llama"}')
    (repo / "model.safetensors").write_bytes(os.urandom(200_000))
    (repo / "tokenizer.json").write_text("{}")
    (repo / "sub" / "notes.txt").write_text("hello")
    big = root / "acme" / "big"
    big.mkdir(parents=True)
    (big / "weights.bin").write_bytes(os.urandom(2_000_000))
    return root


@pytest.fixture
def hub(hub_root):
    h = FakeHub(hub_root).start()
    yield h
    h.stop()


class FakeDisk:
    """Injectable probe: free space given by a callable of the number of calls so far."""

    def __init__(self, free):
        self.free = free
        self.calls = 0

    def disk(self, path):
        self.calls += 1
        avail = self.free(self.calls)
        return Usage(total_bytes=1000 * GB, used_bytes=1000 * GB - avail, available_bytes=avail)


def make_store(tmp_path, **kw) -> ModelStore:
    probe = kw.pop("probe", None)
    s = Settings(
        models_dir=tmp_path / "models",
        min_free_disk_gb=kw.pop("min_free_disk_gb", 0),
        pull_progress_interval_s=0.05,
        pull_disk_poll_interval_s=0.05,
        **kw,
    )
    return ModelStore(s, probe=probe)


def harbor_store(tmp_path, registry, **kw) -> ModelStore:
    kw.setdefault("harbor_url", registry.url)
    kw.setdefault("harbor_username", "alice")
    kw.setdefault("harbor_password", "s3cret")
    return make_store(tmp_path, **kw)


@pytest.fixture(scope="module")
def gguf_artifact(reg, tmp_path_factory):
    art = tmp_path_factory.mktemp("art")
    (art / "model-00001-of-00002.gguf").write_bytes(os.urandom(300_000))
    (art / "model-00002-of-00002.gguf").write_bytes(os.urandom(400_000))
    (art / "small.gguf").write_bytes(os.urandom(1000))
    (art / "config.json").write_text("{}")
    names = [Path(p.name) for p in sorted(art.iterdir())]
    reg.push("proj/iris:v3", names, art)
    return art


def phases(events):
    return [e["phase"] for e in events]


def assert_one_terminal(events, phase):
    terminals = [e for e in events if e["phase"] in ("completed", "failed")]
    assert [e["phase"] for e in terminals] == [phase], phases(events)
    assert events[-1]["phase"] == phase


# --- manifest ---------------------------------------------------------------------------------


def test_manifest_missing_and_corrupt_are_rebuilt(tmp_path, caplog):
    m = Manifest(tmp_path / "models")
    assert m.entries() == []
    m.ensure()
    assert json.loads(m.path.read_text()) == {"models": []}
    m.path.write_text("{not json")
    assert m.entries() == []  # corrupt reads as empty, no exception
    m.ensure()
    assert json.loads(m.path.read_text()) == {"models": []}
    assert list((tmp_path / "models").glob("manifest.json.corrupt-*"))
    assert "unreadable" in caplog.text
    assert not list((tmp_path / "models").glob(".manifest.json.*.tmp"))


# --- OCI ------------------------------------------------------------------------------------------


async def test_oci_pull_llamacpp_picks_first_shard_and_reports_progress(
    tmp_path, reg, gguf_artifact
):
    store = harbor_store(tmp_path, reg)
    await store.start()
    bus_events = []
    store.bus.subscribe(lambda e: bus_events.append(e.payload), PullProgress)
    events: list[dict] = []
    req = {
        "source": "harbor",
        "source_uri": "repo://iris:v3",
        "harbor_ref": f"{reg.host}/proj/iris:v3",
        "backend_type": "llamacpp",
        "category": "llm",
        "name": "iris",
        "version": "v3",
    }
    res = await store.pull(req, events.append)
    # The largest file is a trailing shard; llama.cpp must be pointed at the first one.
    assert res == {
        "path": str(store.models_dir / "repo--iris--v3" / "model-00001-of-00002.gguf"),
        "cached": False,
        "source_uri": "repo://iris:v3",
    }
    got = store.models_dir / "repo--iris--v3" / "model-00002-of-00002.gguf"
    assert sha256_file(got) == sha256_file(gguf_artifact / got.name)
    seq = phases(events)
    assert seq[0] == "resolving" and "downloading" in seq
    assert seq[-3:] == ["verifying", "finalizing", "completed"]
    assert_one_terminal(events, "completed")
    assert all(e["source_uri"] == "repo://iris:v3" for e in events)
    assert events[-1]["bytes_total"] == 701_002
    assert bus_events == events
    assert not (store.models_dir / ".partial").exists()

    (entry,) = store.list_models()
    assert entry["name"] == "repo--iris--v3" and entry["model_name"] == "iris"
    assert entry["metadata"]["harbor_ref"] == f"{reg.host}/proj/iris:v3"
    assert {f["name"] for f in entry["files"]} == {p.name for p in gguf_artifact.iterdir()}
    assert entry["size_bytes"] == 701_002
    assert store.lookup_dir("repo://iris:v3/small.gguf") == store.models_dir / "repo--iris--v3"

    # Cache hit: at once, cached, still exactly one terminal event.
    events.clear()
    res = await store.pull({**req, "source_uri": "repo://iris:v3/small.gguf"}, events.append)
    assert res["cached"] is True and res["path"].endswith("repo--iris--v3/small.gguf")
    assert phases(events) == ["resolving", "completed"]

    # A missing subpath is a 404 with one failed event; the model stays.
    events.clear()
    with pytest.raises(PullError) as err:
        await store.pull({**req, "source_uri": "repo://iris:v3/nope.gguf"}, events.append)
    assert err.value.status_code == 404
    assert_one_terminal(events, "failed")
    assert store.lookup_dir("repo://iris:v3") is not None

    # A file that changed size makes the cache unusable: pulled again.
    (store.models_dir / "repo--iris--v3" / "small.gguf").write_bytes(b"x")
    res = await store.pull(req)
    assert res["cached"] is False


async def test_oci_directory_layer_and_traversal_subpath(tmp_path, reg):
    art = tmp_path / "art"
    (art / "model" / "sub").mkdir(parents=True)
    (art / "model" / "config.json").write_text("{}")
    (art / "model" / "sub" / "w.bin").write_bytes(os.urandom(5000))
    reg.push("proj/dirmodel:v1", [Path("model")], art)
    store = harbor_store(tmp_path, reg)
    await store.start()
    req = {"source": "harbor", "source_uri": "repo://dirmodel:v1", "harbor_ref": "proj/dirmodel:v1"}
    res = await store.pull(req)
    root = Path(res["path"])
    assert (root / "model" / "sub" / "w.bin").read_bytes() == (
        art / "model" / "sub" / "w.bin"
    ).read_bytes()
    events: list[dict] = []
    with pytest.raises(PullError) as err:
        await store.pull({**req, "source_uri": "repo://dirmodel:v1/../../etc"}, events.append)
    assert err.value.status_code == 400
    assert_one_terminal(events, "failed")


async def test_oci_tls_with_ca_bundle_and_basic_auth(tmp_path, tls_reg, monkeypatch):
    art = tmp_path / "art"
    art.mkdir()
    (art / "m.gguf").write_bytes(os.urandom(10_000))
    tls_reg.push("proj/secure:v1", [Path("m.gguf")], art)
    req = {"source": "harbor", "source_uri": "repo://secure:v1", "harbor_ref": "proj/secure:v1"}

    # Without the CA the certificate is refused: 502, nothing stored.
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    store = harbor_store(tmp_path / "a", tls_reg)
    await store.start()
    with pytest.raises(PullError) as err:
        await store.pull(req)
    assert err.value.status_code == 502 and "TLS" in err.value.detail

    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls_reg.cert))
    bad = harbor_store(tmp_path / "b", tls_reg, harbor_password="wrong")
    await bad.start()
    events: list[dict] = []
    with pytest.raises(PullError) as err:
        await bad.pull(req, events.append)
    assert err.value.status_code == 401 and err.value.error == "auth_failed"
    assert tls_reg.host in err.value.detail and "HARBOR_PASSWORD" in err.value.detail
    assert_one_terminal(events, "failed")

    # No credentials against a registry that needs a login: a 401 naming what to set.
    anon = harbor_store(tmp_path / "anon", tls_reg, harbor_username="", harbor_password="")
    await anon.start()
    with pytest.raises(PullError) as err:
        await anon.pull(req)
    assert err.value.status_code == 401 and tls_reg.host in err.value.detail
    assert "set HARBOR_USERNAME and HARBOR_PASSWORD" in err.value.detail

    # HARBOR_URL given bare (no scheme) means https.
    good = harbor_store(tmp_path / "c", tls_reg, harbor_url=tls_reg.host)
    await good.start()
    res = await good.pull(req)
    assert Path(res["path"], "m.gguf").read_bytes() == (art / "m.gguf").read_bytes()


async def test_oci_errors_unknown_unreachable_mismatch_credentials(tmp_path, reg):
    store = harbor_store(tmp_path, reg)
    await store.start()
    base = {"source": "harbor", "source_uri": "repo://ghost:v1", "harbor_ref": "proj/ghost:v1"}
    with pytest.raises(PullError) as err:
        await store.pull(base)
    assert (err.value.status_code, err.value.error) == (404, "not_found")

    for ref, status in [
        ("proj/other:v1", 422),  # names another artifact
        ("proj/ghost:v2", 422),  # another version
        ("evil.example.com/proj/ghost:v1", 422),  # Harbor credentials never go elsewhere
        ("proj/ghost", 400),  # no tag
    ]:
        events: list[dict] = []
        with pytest.raises(PullError) as err:
            await store.pull({**base, "harbor_ref": ref}, events.append)
        assert err.value.status_code == status, ref
        assert_one_terminal(events, "failed")
    with pytest.raises(PullError) as err:
        await store.pull({**base, "source_uri": "huggingface://ghost/v1"})
    assert err.value.status_code == 400

    down = harbor_store(tmp_path / "x", reg, harbor_url="http://127.0.0.1:9")
    with pytest.raises(PullError) as err:
        await down.pull(base)
    assert err.value.status_code == 502

    # Credentials are optional (an open registry pulls anonymously: it reaches the 404);
    # only HARBOR_URL is needed, and its absence says so (503, not a 500).
    nocreds = harbor_store(tmp_path / "y", reg, harbor_username="", harbor_password="")
    with pytest.raises(PullError) as err:
        await nocreds.pull(base)
    assert (err.value.status_code, err.value.error) == (404, "not_found")
    nourl = harbor_store(tmp_path / "z", reg, harbor_url="")
    with pytest.raises(PullError) as err:
        await nourl.pull(base)
    assert (err.value.status_code, err.value.error) == (503, "credentials_missing")
    assert "HARBOR_URL" in err.value.detail
    assert store.list_models() == []


async def test_oci_tampered_blob_fails_integrity_and_stores_nothing(tmp_path, reg):
    art = tmp_path / "art"
    art.mkdir()
    (art / "w.gguf").write_bytes(os.urandom(50_000))
    reg.push("proj/tamper:v1", [Path("w.gguf")], art)
    blob = reg.blob_data(sha256_file(art / "w.gguf"))
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    store = harbor_store(tmp_path, reg)
    await store.start()
    events: list[dict] = []
    with pytest.raises(PullError) as err:
        await store.pull(
            {"source": "harbor", "source_uri": "repo://tamper:v1", "harbor_ref": "proj/tamper:v1"},
            events.append,
        )
    assert err.value.status_code == 502 and "integrity" in err.value.detail
    assert "w.gguf" in err.value.detail
    assert_one_terminal(events, "failed")
    assert store.list_models() == []
    assert not (store.models_dir / "repo--tamper--v1").exists()
    assert not list((store.models_dir / ".partial").rglob("*.part"))


async def test_oci_resume_after_interrupted_pull(tmp_path, reg):
    art = tmp_path / "art"
    art.mkdir()
    payload = os.urandom(3_000_000)
    (art / "big.gguf").write_bytes(payload)
    reg.push("proj/resume:v1", [Path("big.gguf")], art)
    proxy = StallProxy(reg.host)
    try:
        proxy.stall_after = 1_000_000
        store = harbor_store(tmp_path, reg, harbor_url=f"http://{proxy.host}")
        await store.start()
        req = {"source": "harbor", "source_uri": "repo://resume:v1", "harbor_ref": "proj/resume:v1"}
        events: list[dict] = []
        pull = asyncio.create_task(store.pull(req, events.append))
        assert await asyncio.to_thread(proxy.stalled.wait, 20)
        await asyncio.sleep(0.2)
        assert store.cancel("repo://resume:v1")
        with pytest.raises(PullError):
            await asyncio.wait_for(pull, 20)
        assert_one_terminal(events, "failed")
        parts = list((store.models_dir / ".partial").rglob("*.part"))
        assert len(parts) == 1 and 0 < parts[0].stat().st_size < len(payload)
        have = parts[0].stat().st_size

        proxy.stall_after = None
        res = await store.pull(req)
        assert res["cached"] is False
        assert proxy.ranges == [f"bytes={have}-"]
        assert hashlib.sha256(Path(res["path"], "big.gguf").read_bytes()).digest() == (
            hashlib.sha256(payload).digest()
        )
        assert not (store.models_dir / ".partial").exists()
    finally:
        proxy.close()


async def test_oci_stream_ring_writeback_and_fsync_before_rename(tmp_path, reg, monkeypatch):
    """A blob several times the buffer ring, of an odd size, arrives whole; it is fsynced as
    `.part`, complete, before the rename; writeback is started along the way; every placed file
    is fsynced before the model directory is renamed into place."""
    from solar_host.model_store import pull, streaming

    monkeypatch.setattr(streaming, "BUF_SIZE", 64 * 1024)
    monkeypatch.setattr(streaming, "BUFFERS", 2)
    monkeypatch.setattr(streaming, "WRITEBACK_EVERY", 128 * 1024)
    writebacks: list[tuple[int, int]] = []
    start_writeback = streaming.start_writeback

    def record_writeback(fd, offset, length):
        writebacks.append((offset, length))
        start_writeback(fd, offset, length)

    monkeypatch.setattr(streaming, "start_writeback", record_writeback)
    durable: list[tuple[str, int]] = []
    make_durable = streaming.make_durable

    def record_durable(fd):
        durable.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        make_durable(fd)

    monkeypatch.setattr(streaming, "make_durable", record_durable)
    synced: list[str] = []
    fsync_path = pull._fsync_path

    def record_sync(path, flags):
        synced.append(path)
        fsync_path(path, flags)

    monkeypatch.setattr(pull, "_fsync_path", record_sync)
    readers: list[str] = []
    body_reader = streaming.body_reader

    def record_reader(resp, length):
        reader = body_reader(resp, length)
        readers.append(reader.__name__)
        return reader

    monkeypatch.setattr(streaming, "body_reader", record_reader)

    art = tmp_path / "art"
    art.mkdir()
    payload = os.urandom(1_000_003)
    (art / "w.gguf").write_bytes(payload)
    reg.push("proj/ring:v1", [Path("w.gguf")], art)
    store = harbor_store(tmp_path, reg)
    await store.start()
    res = await store.pull(
        {"source": "harbor", "source_uri": "repo://ring:v1", "harbor_ref": "proj/ring:v1"}
    )
    assert Path(res["path"], "w.gguf").read_bytes() == payload
    hexd = hashlib.sha256(payload).hexdigest()
    assert durable == [
        (
            str(store.models_dir / ".partial" / "repo--ring--v1" / "blobs" / f"sha256-{hexd}.part"),
            len(payload),
        )
    ]
    # Contiguous ranges from the start, each at least WRITEBACK_EVERY long.
    assert writebacks and writebacks[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(writebacks))
    assert all(n >= 128 * 1024 for _, n in writebacks)
    assert readers == ["read_socket"]  # a Content-Length body is read straight off the socket
    tree = store.models_dir / ".partial" / "repo--ring--v1" / "tree"
    assert str(tree / "w.gguf") in synced and str(tree) in synced


class _BodyHandler(http.server.BaseHTTPRequestHandler):
    """Serves `server.body` chunked, or with a Content-Length and only `server.send` bytes."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body, send = self.server.body, self.server.send  # type: ignore[attr-defined]
        self.send_response(200)
        if send is None:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 70_001):
                piece = body[i : i + 70_001]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:send])
            self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("send", [None, 100_000], ids=["chunked", "closed-early"])
def test_oci_stream_chunked_body_and_early_close(tmp_path, send):
    """A chunked body goes through urllib3 into the same ring; a body cut short keeps every
    byte received on disk and is a retryable 502, not an integrity failure."""
    import requests

    from solar_host.model_store import streaming
    from solar_host.model_store.progress import ByteCounter

    body = os.urandom(300_003)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BodyHandler)
    srv.body, srv.send = body, send  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        resp = requests.get(f"http://127.0.0.1:{srv.server_port}/blob", stream=True, timeout=10)
        part = tmp_path / "blob.part"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
        hasher, counter = hashlib.sha256(), ByteCounter()
        try:
            if send is None:
                n = streaming.stream_body(
                    resp, fd, 0, len(body), hasher, counter, streaming.CancelToken()
                )
                assert n == counter.done == len(body)
                assert hasher.digest() == hashlib.sha256(body).digest()
            else:
                with pytest.raises(PullError) as err:
                    streaming.stream_body(
                        resp, fd, 0, len(body), hasher, counter, streaming.CancelToken()
                    )
                assert err.value.status_code == 502
                assert "Download interrupted" in err.value.detail
        finally:
            os.close(fd)
            resp.close()
        assert part.read_bytes() == body[: send or len(body)]
    finally:
        srv.shutdown()
        srv.server_close()


async def test_oci_write_failure_mid_stream_is_507_without_hanging(tmp_path, reg, monkeypatch):
    """A full disk (ENOSPC from a write, which cannot be produced safely here) stops the
    receiving, hashing and writing threads and reports 507 once."""
    import errno

    from solar_host.model_store import streaming

    monkeypatch.setattr(streaming, "BUF_SIZE", 64 * 1024)
    monkeypatch.setattr(streaming, "BUFFERS", 2)
    calls = []
    write_all = streaming.write_all

    def failing_write(fd, view):
        calls.append(len(view))
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_all(fd, view)

    monkeypatch.setattr(streaming, "write_all", failing_write)
    art = tmp_path / "art"
    art.mkdir()
    (art / "w.gguf").write_bytes(os.urandom(2_000_000))
    reg.push("proj/full:v1", [Path("w.gguf")], art)
    store = harbor_store(tmp_path, reg)
    await store.start()
    events: list[dict] = []
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(
            store.pull(
                {"source": "harbor", "source_uri": "repo://full:v1", "harbor_ref": "proj/full:v1"},
                events.append,
            ),
            20,
        )
    assert err.value.status_code == 507 and "disk space" in err.value.detail
    assert_one_terminal(events, "failed")
    assert len(calls) == 3  # nothing written after the failure
    assert store.list_models() == []
    assert not (store.models_dir / "repo--full--v1").exists()


async def test_oci_disk_floor_abort_mid_download(tmp_path, reg):
    art = tmp_path / "art"
    art.mkdir()
    (art / "big.gguf").write_bytes(os.urandom(3_000_000))
    reg.push("proj/floor:v1", [Path("big.gguf")], art)
    proxy = StallProxy(reg.host)
    try:
        proxy.stall_after = 500_000  # the download hangs mid-way while the disk fills up
        probe = FakeDisk(lambda n: 100 * GB if n <= 2 else 1 * GB)
        store = harbor_store(
            tmp_path, reg, harbor_url=f"http://{proxy.host}", probe=probe, min_free_disk_gb=2
        )
        await store.start()
        events: list[dict] = []
        with pytest.raises(PullError) as err:
            await asyncio.wait_for(
                store.pull(
                    {
                        "source": "harbor",
                        "source_uri": "repo://floor:v1",
                        "harbor_ref": "proj/floor:v1",
                    },
                    events.append,
                ),
                20,
            )
        assert err.value.status_code == 507 and "during download" in err.value.detail
        assert_one_terminal(events, "failed")
        assert not (store.models_dir / ".partial" / "repo--floor--v1").exists()
        assert not (store.models_dir / "repo--floor--v1").exists()
        assert store.list_models() == []
    finally:
        proxy.close()


@pytest.mark.parametrize("whole", [True, False])
async def test_oci_complete_part_left_by_a_crash(tmp_path, reg, whole):
    """A `.part` with every byte but no rename (a crash after the last write): verified and kept
    without asking for an empty Range (a 416), or fetched again when its bytes are wrong."""
    art = tmp_path / "art"
    art.mkdir()
    payload = os.urandom(300_000)
    (art / "w.gguf").write_bytes(payload)
    reg.push("proj/whole:v1", [Path("w.gguf")], art)
    proxy = StallProxy(reg.host)
    try:
        store = harbor_store(tmp_path, reg, harbor_url=f"http://{proxy.host}")
        await store.start()
        blobs = store.models_dir / ".partial" / "repo--whole--v1" / "blobs"
        blobs.mkdir(parents=True)
        hexd = hashlib.sha256(payload).hexdigest()
        (blobs / f"sha256-{hexd}.part").write_bytes(payload if whole else os.urandom(300_000))
        res = await store.pull(
            {"source": "harbor", "source_uri": "repo://whole:v1", "harbor_ref": "proj/whole:v1"}
        )
        assert Path(res["path"], "w.gguf").read_bytes() == payload
        assert proxy.ranges == []
        assert not (store.models_dir / ".partial").exists()
    finally:
        proxy.close()


async def test_disk_precheck_refuses_with_507(tmp_path, reg, gguf_artifact):
    probe = FakeDisk(lambda n: 1 * GB)
    store = harbor_store(tmp_path, reg, probe=probe, min_free_disk_gb=2)
    await store.start()
    events: list[dict] = []
    with pytest.raises(PullError) as err:
        await store.pull(
            {"source": "harbor", "source_uri": "repo://iris:v3", "harbor_ref": "proj/iris:v3"},
            events.append,
        )
    assert err.value.status_code == 507 and "Insufficient disk space" in err.value.detail
    assert "1.00" in err.value.detail
    assert_one_terminal(events, "failed")
    assert not (store.models_dir / "repo--iris--v3").exists()


# --- HuggingFace ---------------------------------------------------------------------------------


def hf_req(model_id="acme/tiny", **kw):
    return {
        "source": "huggingface",
        "source_uri": f"huggingface://{model_id}",
        "model_id": model_id,
        **kw,
    }


async def test_hf_pull_filters_topup_and_cache(tmp_path, hub):
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    events: list[dict] = []
    res = await store.pull(hf_req(file_filters=["*.json"]), events.append)
    root = store.models_dir / "hf--acme--tiny"
    assert res == {"path": str(root), "cached": False, "source_uri": "huggingface://acme/tiny"}
    assert sorted(p.name for p in root.iterdir() if p.name != ".cache") == [
        "config.json",
        "tokenizer.json",
    ]
    assert_one_terminal(events, "completed")
    assert events[0]["bytes_total"] is None

    # A subset of the stored filters is a cache hit.
    hub.requests.clear()
    res = await store.pull(hf_req(file_filters=["*.json"]))
    assert res["cached"] is True and hub.requests == []

    # A new pattern tops the snapshot up (union of filters), keeping what is there.
    res = await store.pull(hf_req(file_filters=["*.safetensors"]))
    assert res["cached"] is False
    assert (root / "model.safetensors").stat().st_size == 200_000
    assert (root / "config.json").exists()
    (entry,) = store.list_models()
    assert entry["file_filters"] == ["*.json", "*.safetensors"]
    fetched = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert fetched == ["/acme/tiny/resolve/" + fetched[0].split("/resolve/")[1]]
    assert fetched[0].endswith("model.safetensors")

    # No filters: the whole repository (nested files kept), recorded as a full snapshot.
    res = await store.pull(hf_req())
    assert (root / "sub" / "notes.txt").read_text() == "hello"
    assert store.list_models()[0]["file_filters"] is None
    assert (await store.pull(hf_req(file_filters=["*.txt"])))["cached"] is True


async def test_a_directory_the_store_did_not_record_is_kept_aside(tmp_path, hub):
    """An operator's own directory that happens to have a pull's name was deleted by the pull
    (as "stale"); it is moved aside instead, and the pull takes its place."""
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    mine = store.models_dir / "hf--acme--tiny"
    mine.mkdir(parents=True)
    (mine / "my-notes.txt").write_text("mine")
    res = await store.pull(hf_req(file_filters=["*.json"]))
    assert res["path"] == str(mine) and (mine / "config.json").exists()
    [aside] = [p for p in store.models_dir.iterdir() if p.name.startswith("hf--acme--tiny.kept-")]
    assert (aside / "my-notes.txt").read_text() == "mine"
    # Its own older copy is replaced, not kept (a full pull after a filtered one).
    await store.pull(hf_req())
    assert [p.name for p in store.models_dir.iterdir() if ".kept-" in p.name] == [aside.name]


async def test_hf_errors_and_token(tmp_path, hub_root):
    hub = FakeHub(hub_root, token="hf_right").start()
    try:
        ok = make_store(tmp_path / "a", hf_endpoint=hub.url, hf_token="hf_right")
        await ok.start()
        assert (await ok.pull(hf_req(file_filters=["config.json"])))["cached"] is False
        bad = make_store(tmp_path / "b", hf_endpoint=hub.url, hf_token="hf_wrong")
        events: list[dict] = []
        with pytest.raises(PullError) as err:
            await bad.pull(hf_req(), events.append)
        assert (err.value.status_code, err.value.error) == (401, "auth_failed")
        assert_one_terminal(events, "failed")
    finally:
        hub.stop()
    hub = FakeHub(hub_root).start()
    try:
        store = make_store(tmp_path / "c", hf_endpoint=hub.url)
        with pytest.raises(PullError) as err:
            await store.pull(hf_req("acme/missing"))
        assert err.value.status_code == 404
        with pytest.raises(PullError) as err:
            await store.pull({**hf_req(), "model_id": "acme/other"})
        assert err.value.status_code == 422
        assert not (store.models_dir / "hf--acme--missing").exists()
    finally:
        hub.stop()
    down = make_store(tmp_path / "d", hf_endpoint="http://127.0.0.1:9")
    with pytest.raises(PullError) as err:
        await down.pull(hf_req())
    assert err.value.status_code == 502


async def test_concurrent_pulls_share_one_download(tmp_path, hub):
    hub.bytes_per_s = 8_000_000
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    ev1: list[dict] = []
    ev2: list[dict] = []
    r1, r2 = await asyncio.gather(
        store.pull(hf_req("acme/big"), ev1.append), store.pull(hf_req("acme/big"), ev2.append)
    )
    assert r1 == r2 and r1["cached"] is False
    gets = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert len(gets) == 1
    assert_one_terminal(ev1, "completed")
    assert_one_terminal(ev2, "completed")
    assert "downloading" in phases(ev2)


async def test_hf_resume_after_cancel_keeps_finished_files(tmp_path, hub_root):
    # What finished before the cancel is not fetched again (and the rest resumes, below).
    repo = hub_root / "acme" / "multi"
    repo.mkdir(exist_ok=True)
    (repo / "small.json").write_text("{}")
    (repo / "big.bin").write_bytes(os.urandom(400_000))
    hub = FakeHub(hub_root).start()
    try:
        hub.bytes_per_s = 400_000
        store = make_store(tmp_path, hf_endpoint=hub.url)
        await store.start()
        events: list[dict] = []
        task = asyncio.create_task(store.pull(hf_req("acme/multi"), events.append))
        done_file = store.models_dir / ".partial" / "hf--acme--multi" / "small.json"
        for _ in range(200):
            if done_file.exists():
                break
            await asyncio.sleep(0.02)
        assert done_file.exists()
        assert store.cancel("huggingface://acme/multi")
        with pytest.raises(PullError) as err:
            await asyncio.wait_for(task, 20)
        assert "cancelled" in err.value.detail
        assert_one_terminal(events, "failed")
        assert store.list_models() == []
        hub.bytes_per_s = None
        hub.requests.clear()
        res = await store.pull(hf_req("acme/multi"))
        gets = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
        assert [g.rsplit("/", 1)[1] for g in gets] == ["big.bin"]
        assert Path(res["path"], "big.bin").stat().st_size == 400_000
        assert Path(res["path"], "small.json").read_text() == "{}"
    finally:
        hub.stop()


async def test_disk_floor_abort_mid_download(tmp_path, hub):
    hub.bytes_per_s = 2_000_000
    probe = FakeDisk(lambda n: 100 * GB if n <= 2 else 1 * GB)
    store = make_store(tmp_path, hf_endpoint=hub.url, probe=probe, min_free_disk_gb=2)
    await store.start()
    events: list[dict] = []
    with pytest.raises(PullError) as err:
        await store.pull(hf_req("acme/big"), events.append)
    assert err.value.status_code == 507 and "during download" in err.value.detail
    assert_one_terminal(events, "failed")
    assert not (store.models_dir / ".partial" / "hf--acme--big").exists()
    assert not (store.models_dir / "hf--acme--big").exists()
    assert store.list_models() == []


# --- delete ---------------------------------------------------------------------------------------


async def pulled_tiny(tmp_path, hub) -> ModelStore:
    store = make_store(tmp_path, hf_endpoint=hub.url)
    await store.start()
    await store.pull(hf_req())
    return store


async def test_delete_in_use_filters_and_traversal(tmp_path, hub):
    from solar_host.model_store.service import StoreError

    store = await pulled_tiny(tmp_path, hub)
    root = store.models_dir / "hf--acme--tiny"
    running = [("inst-1", "sglang", [str(root)], None)]
    store.in_use = lambda: running
    with pytest.raises(StoreError) as err:
        await store.delete("hf--acme--tiny")
    assert err.value.status_code == 409 and "inst-1" in err.value.detail
    # mmproj / draft paths are model paths too: a file inside the dir blocks the delete.
    running[:] = [("inst-2", "llamacpp", ["/elsewhere/m.gguf", str(root / "config.json")], None)]
    with pytest.raises(StoreError) as err:
        await store.delete("hf--acme--tiny")
    assert err.value.status_code == 409
    # Filtered delete: files the instance does not use may go; its own file may not.
    with pytest.raises(StoreError):
        await store.delete("hf--acme--tiny", ["config.json"])
    out = await store.delete("hf--acme--tiny", ["*.safetensors"])
    assert out["removed"] == ["model.safetensors"] and out["freed_bytes"] == 200_000
    assert out["remaining"] == 3
    (entry,) = store.list_models()
    assert entry["file_filters"] == ["config.json", "sub/notes.txt", "tokenizer.json"]
    out = await store.delete("hf--acme--tiny", ["*.nothing"])
    assert out["removed"] == [] and out["remaining"] == 3
    # An instance filtered to other files does not block.
    running[:] = [("inst-3", "huggingface_causal", [str(root)], ["*.safetensors"])]
    out = await store.delete("hf--acme--tiny", ["sub/*"])
    assert out["removed"] == ["sub/notes.txt"] and not (root / "sub").exists()

    for bad in ("..", ".partial", "../models", "a/b", "hf--acme--tiny/../x", ""):
        with pytest.raises(StoreError) as err:
            await store.delete(bad)
        assert err.value.status_code in (400, 404), bad
    with pytest.raises(StoreError) as err:
        await store.delete("repo--nope--v1")
    assert err.value.status_code == 404

    running.clear()
    out = await store.delete("hf--acme--tiny")
    assert out["detail"] == "Model deleted" and not root.exists()
    assert store.list_models() == []
    assert store.models_dir.exists() and (store.models_dir / "manifest.json").exists()


async def test_delete_refuses_manifest_paths_outside_models_dir(tmp_path, hub):
    from solar_host.model_store.service import StoreError

    store = await pulled_tiny(tmp_path, hub)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    data = json.loads((store.models_dir / "manifest.json").read_text())
    data["models"][0]["path"] = str(victim)
    (store.models_dir / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(StoreError) as err:
        await store.delete("hf--acme--tiny")
    assert err.value.status_code == 409
    assert (victim / "keep.txt").exists()


# --- model_source confinement (ruling 12) -------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {"backend_type": "llamacpp", "alias": "a", "model_source": "local://../outside.gguf"},
        {"backend_type": "llamacpp", "alias": "a", "model": "../outside.gguf"},
        {"backend_type": "sglang", "alias": "a", "model_path": "sub/../../outside"},
        {"backend_type": "huggingface_causal", "alias": "a", "model_source": "local://../x"},
    ],
)
def test_parse_config_refuses_escapes_from_models_dir(tmp_path, config):
    models = tmp_path / "models"
    models.mkdir()
    (tmp_path / "outside.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError) as err:
        parse_config(config, models_dir=models)
    assert "outside of MODELS_DIR" in str(err.value)


def test_parse_config_refuses_symlink_escape(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (tmp_path / "secret.gguf").write_bytes(b"GGUF")
    (models / "link.gguf").symlink_to(tmp_path / "secret.gguf")
    with pytest.raises(ConfigError):
        parse_config(
            {"backend_type": "llamacpp", "alias": "a", "model_source": "local://link.gguf"},
            models_dir=models,
        )


async def test_lookup_dir_feeds_parse_config(tmp_path, reg, gguf_artifact):
    store = harbor_store(tmp_path, reg)
    await store.start()
    await store.pull(
        {"source": "harbor", "source_uri": "repo://iris:v3", "harbor_ref": "proj/iris:v3"}
    )
    assert store.lookup_dir("repo://unknown:v1") is None
    cfg = parse_config(
        {
            "backend_type": "llamacpp",
            "alias": "a",
            "model_source": "repo://iris:v3",
            "model": str(store.models_dir / "repo--iris--v3" / "small.gguf"),
            "model_file": "small.gguf",
        },
        models_dir=store.models_dir,
        manifest_lookup=store.lookup_dir,
    )
    assert SimpleNamespace(m=cfg.model).m.endswith("small.gguf")


def test_the_manifest_is_parsed_once_per_change_and_never_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every pull, create and listing asks for the manifest's entries: parsed once per version
    of the file (each write renames a new one into place; an operator's edit changes its
    mtime), and what a caller changes in an entry never reaches the next caller."""
    from solar_host.model_store.manifest import ManifestEntry

    m = Manifest(tmp_path / "models")
    m.ensure()
    digests = {f"f{i}.safetensors": "sha256:" + "0" * 64 for i in range(50)}
    for i in range(20):
        m.upsert(ManifestEntry(f"s{i}", f"hf://a/m{i}", str(tmp_path / f"s{i}"), 1, None,
                               file_digests=dict(digests)))  # fmt: skip
    reads = []
    real = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: reads.append(self) or real(self, *a, **k)
    )
    first = m.entries()
    assert len(first) == 20 and len(m.entries()) == 20 and m.get("hf://a/m3") is not None
    assert len(reads) == 1

    first[0].file_digests["extra"] = "sha256:x"  # type: ignore[index]
    first[0].slug = "changed"
    again = m.entries()[0]
    assert again.slug == "s0" and "extra" not in (again.file_digests or {})

    # An edit in place by hand, same size: its new mtime is seen.
    raw = m.path.read_bytes()
    m.path.write_bytes(raw.replace(b'"s0"', b'"t0"'))
    os.utime(m.path, ns=(m.path.stat().st_atime_ns, m.path.stat().st_mtime_ns + 1_000_000))
    assert m.entries()[0].slug == "t0"
    m.remove("hf://a/m1")
    assert [e.slug for e in m.entries()][:2] == ["t0", "s2"]


async def test_a_pull_during_a_delete_of_the_same_model_waits_for_it(
    tmp_path, hub, monkeypatch
) -> None:
    """A delete refused pulls in flight, but not a pull that arrived while the delete was
    removing files: it found them half gone, started a download into the directory being
    removed, and the delete's last step then struck the new copy from the manifest (files on
    disk, no record) or removed files under it. The two are now one after the other: the pull
    waits and downloads a whole new copy, recorded."""
    import shutil

    store = await pulled_tiny(tmp_path, hub)
    root = store.models_dir / "hf--acme--tiny"
    halfway = threading.Event()
    real_rmtree = shutil.rmtree

    def slow_rmtree(path, *a, **kw):  # a big model: removing its files takes a while
        if Path(path) == root and not halfway.is_set():
            first = sorted(p for p in Path(path).rglob("*") if p.is_file())[:1]
            for p in first:
                p.unlink()
            halfway.set()
            time.sleep(1.0)
        real_rmtree(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    deleting = asyncio.create_task(store.delete("hf--acme--tiny"))
    assert await asyncio.to_thread(halfway.wait, 10)
    pulled = await store.pull(hf_req())
    out = await deleting
    assert out["detail"] == "Model deleted"
    assert pulled["cached"] is False, pulled  # pulled anew, after the delete
    entry = store.manifest.get_slug("hf--acme--tiny")
    assert entry is not None, "the new copy is on disk but not recorded"
    for rel, size in (entry.file_sizes or {}).items():
        assert (root / rel).stat().st_size == size, rel

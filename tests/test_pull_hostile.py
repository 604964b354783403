# ruff: noqa: ASYNC230, ASYNC240  (tests inspect files on disk between awaits)
"""Model pulls against a hostile or broken remote (adversarial review).

A small OCI registry stand-in (`HostileRegistry`, stdlib http.server on 127.0.0.1) serves
whatever manifests and blobs a test puts in it, with per-path hooks; the HF side reuses
tests/fixtures/fakehub.py. Every wait is bounded and every server is loopback only.
"""

from __future__ import annotations

import asyncio
import errno
import gzip
import hashlib
import io
import json
import os
import socket
import sys
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from solar_host.model_store import download, huggingface, layers, oci
from solar_host.model_store.huggingface import bytes_on_disk
from solar_host.model_store.pull import PullError
from solar_host.model_store.service import ModelStore
from solar_host.resources.probes import Usage
from tests.fixtures.fakehub import FakeHub
from tests.fixtures.loopback_http import LoopbackHTTP
from tests.test_model_store import GB, FakeDisk, make_store

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="loopback servers need Linux")

MB = 1 << 20


class HostileRegistry(LoopbackHTTP):
    """The OCI distribution API's two GET routes, serving dicts; `handlers` override a path."""

    def __init__(self) -> None:
        self.manifests: dict[tuple[str, str], bytes] = {}
        self.blobs: dict[str, bytes] = {}
        self.handlers: dict[str, object] = {}
        self.serve(head=True)

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        self._handle(request)

    def add_blob(self, data: bytes) -> str:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[d] = data
        return d

    def manifest_for(self, files: list[tuple[str, bytes, bool]]) -> bytes:
        layers = []
        for title, data, unpack in files:
            ann = {"org.opencontainers.image.title": title}
            if unpack:
                ann["io.deis.oras.content.unpack"] = "true"
            layers.append(
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar"
                    + ("+gzip" if unpack else ""),
                    "digest": self.add_blob(data),
                    "size": len(data),
                    "annotations": ann,
                }
            )
        cfg = self.add_blob(b"{}")
        return json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.empty.v1+json",
                    "digest": cfg,
                    "size": 2,
                },
                "layers": layers,
            }
        ).encode()

    def add_artifact(self, repo: str, tag: str, files: list[tuple[str, bytes, bool]]) -> bytes:
        body = self.manifest_for(files)
        self.manifests[(repo, tag)] = body
        return body

    def send(self, h, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _handle(self, h) -> None:
        path = urlsplit(h.path).path
        if path in self.handlers:
            self.handlers[path](h)  # type: ignore[operator]
            return
        if path == "/v2/":
            self.send(h, 200, b"{}")
            return
        parts = path.split("/")
        if "manifests" in parts:
            i = parts.index("manifests")
            key = ("/".join(parts[2:i]), parts[i + 1])
            if key in self.manifests:
                ctype = {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}
                self.send(h, 200, self.manifests[key], ctype)
                return
        if "blobs" in parts and parts[-1] in self.blobs:
            self.send(h, 200, self.blobs[parts[-1]])
            return
        self.send(h, 404, b"{}")


@pytest.fixture
def hreg():
    r = HostileRegistry()
    yield r
    r.stop()


class StallServer:
    """Accepts TCP connections on loopback and never answers (until closed)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        self.sock.close()
        for c in list(self.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


@pytest.fixture
def stall():
    s = StallServer()
    yield s
    s.close()


def store_for(tmp_path: Path, registry_url: str = "", **kw) -> ModelStore:
    return make_store(tmp_path, harbor_url=registry_url, **kw)


def harbor(name: str, version: str = "v1", ref: str | None = None, **kw) -> dict:
    return {
        "source": "harbor",
        "source_uri": f"repo://{name}:{version}",
        "harbor_ref": ref or f"proj/{name}:{version}",
        **kw,
    }


def escape_tar(dest_len: int, up: int, name: str, content: bytes) -> bytes:
    """A tar that the 'data' filter of Python < 3.11.13 lets write `<dest>/..(up times)/name`
    (CVE-2025-4517: symlinks that os.path.realpath stops expanding past PATH_MAX)."""
    steps = "abcdefghijklmnop"
    comp = "d" * ((4096 - (dest_len + 1)) // (len(steps) + 1))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(n: str, typ: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b"") -> None:
            ti = tarfile.TarInfo(n)
            ti.type = typ
            ti.linkname = link
            ti.mode = 0o755 if typ == tarfile.DIRTYPE else 0o644
            if typ == tarfile.REGTYPE:
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))
            else:
                tar.addfile(ti)

        path = ""
        for s in steps:
            add(os.path.join(path, comp), tarfile.DIRTYPE)
            add(os.path.join(path, s), tarfile.SYMTYPE, comp)
            path = os.path.join(path, comp)
        linkpath = os.path.join(*steps, "l" * 254)
        add(linkpath, tarfile.SYMTYPE, os.path.join(*[".."] * len(steps)))
        add("escape", tarfile.SYMTYPE, os.path.join(linkpath, *[".."] * up))
        add(os.path.join("escape", name), data=content)
    return gzip.compress(buf.getvalue())


def zeros_tar_gz(member: str, size: int) -> bytes:
    class Zeros(io.RawIOBase):
        left = size

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:
            n = min(len(b), self.left)
            b[:n] = bytes(n)
            self.left -= n
            return n

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz", compresslevel=9) as tf:
        ti = tarfile.TarInfo(member)
        ti.size = size
        tf.addfile(ti, io.BufferedReader(Zeros()))
    return raw.getvalue()


# --- 1. unpacked layers write outside MODELS_DIR ----------------------------------------------


async def test_unpack_layer_cannot_write_outside_models_dir(tmp_path, hreg):
    """Ruling 12: a directory layer from the registry must land inside the model directory,
    whatever its links do; the tarfile 'data' filter of this Python can be bypassed."""
    models = tmp_path / "models"
    tree = models / ".partial" / "repo--evil--v1" / "tree"  # where the layer is unpacked
    victim = tmp_path / "pwned.txt"  # models/.partial/<slug>/tree -> 4 levels up
    hreg.add_artifact(
        "proj/evil", "v1", [("model", escape_tar(len(str(tree)), 4, victim.name, b"x"), True)]
    )
    store = store_for(tmp_path, hreg.url)
    await store.start()
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(store.pull(harbor("evil")), 30)
    assert err.value.status_code == 502
    assert not victim.exists(), "the registry wrote a file outside MODELS_DIR"
    assert store.list_models() == []


# --- 2. a decompression bomb is not held to the disk floor; ENOSPC while placing files -------


async def test_unpack_layer_is_held_to_the_disk_floor(tmp_path, hreg):
    """A 250 KB layer that unpacks to 96 MiB on a (simulated) 64 MiB disk: the unpacking must
    stop at MIN_FREE_DISK_GB with a 507, as a download does, and leave nothing behind."""
    models = tmp_path / "models"
    cap = 64 * MB

    class Disk:
        def disk(self, p):
            used = bytes_on_disk(models) if models.exists() else 0
            return Usage(total_bytes=cap, used_bytes=used, available_bytes=max(0, cap - used))

    hreg.add_artifact("proj/bomb", "v1", [("model", zeros_tar_gz("model/w.bin", 96 * MB), True)])
    store = store_for(tmp_path, hreg.url, probe=Disk(), min_free_disk_gb=8 / 1024)
    await store.start()
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(store.pull(harbor("bomb")), 60)
    assert err.value.status_code == 507
    assert bytes_on_disk(models) < cap
    assert store.list_models() == []


async def test_enospc_while_placing_files_is_507(tmp_path, hreg, monkeypatch):
    """A full disk while the verified blobs are placed/unpacked is a 507, like one mid-download
    (the reference: OSError ENOSPC -> 507), not a 500 with the errno text."""
    hreg.add_artifact("proj/full", "v1", [("m.gguf", os.urandom(1000), False)])

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(download, "assemble", full)
    store = store_for(tmp_path, hreg.url)
    await store.start()
    events: list[dict] = []
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(store.pull(harbor("full"), events.append), 30)
    assert (err.value.status_code, err.value.error) == (507, "insufficient_storage")
    assert [e["phase"] for e in events if e["phase"] in ("completed", "failed")] == ["failed"]
    assert store.list_models() == []


# --- 3. manifests: size, shape, digest --------------------------------------------------------


async def test_manifest_body_is_size_bounded(tmp_path, hreg):
    """A registry streaming an endless manifest must be cut off (distribution caps manifests at
    4 MiB), not read whole into memory."""
    sent = {"n": 0}

    def endless(h) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        chunk = b" " * MB
        try:
            for _ in range(64):
                h.wfile.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                sent["n"] += len(chunk)
            h.wfile.write(b'e\r\n{"layers": []}\r\n0\r\n\r\n')
        except OSError:
            pass

    hreg.handlers["/v2/proj/huge/manifests/v1"] = endless
    store = store_for(tmp_path, hreg.url)
    await store.start()
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(store.pull(harbor("huge")), 60)
    assert err.value.status_code == 502
    assert sent["n"] < 24 * MB, f"read {sent['n'] >> 20} MiB of manifest"


DIGEST0 = "sha256:" + "0" * 64


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-nesting"),
        pytest.param(b"[1, 2]", id="not-an-object"),
        pytest.param(
            json.dumps(
                {"layers": [{"digest": DIGEST0, "size": "big", "annotations": {layers.TITLE: "x"}}]}
            ).encode(),
            id="size-not-a-number",
        ),
        pytest.param(
            json.dumps(
                {"layers": [{"digest": DIGEST0, "size": -5, "annotations": {layers.TITLE: "x"}}]}
            ).encode(),
            id="negative-size",
        ),
    ],
)
async def test_malformed_manifest_is_a_502(tmp_path, hreg, body):
    """A manifest the registry got wrong is the registry's fault: 502 model_pull_failed, not a
    500 carrying a Python exception's text (or a host path)."""
    hreg.manifests[("proj/bad", "v1")] = body
    store = store_for(tmp_path, hreg.url)
    await store.start()
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(store.pull(harbor("bad")), 30)
    assert (err.value.status_code, err.value.error) == (502, "model_pull_failed"), err.value.detail
    assert str(tmp_path) not in err.value.detail


@pytest.mark.parametrize(
    "titles",
    [
        pytest.param(["."], id="dot"),
        pytest.param(["x" * 300], id="name-too-long"),
        pytest.param(["a", "a/b"], id="file-and-dir-collide"),
        pytest.param(["x", "x"], id="one-name-twice"),
    ],
)
async def test_unplaceable_layer_titles_are_a_502(tmp_path, hreg, titles):
    hreg.add_artifact(
        "proj/titles", "v1", [(t, f"content {i}".encode(), False) for i, t in enumerate(titles)]
    )
    store = store_for(tmp_path, hreg.url)
    await store.start()
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(store.pull(harbor("titles")), 30)
    assert (err.value.status_code, err.value.error) == (502, "model_pull_failed"), err.value.detail
    assert str(tmp_path) not in err.value.detail


async def test_digest_pinned_ref_gets_exactly_that_manifest(tmp_path, hreg):
    """harbor_ref `proj/name@sha256:D` pins content: a registry answering with another manifest
    must be refused, not stored under the pin."""
    good = hreg.manifest_for([("m.gguf", b"GOOD" * 100, False)])
    pinned = "sha256:" + hashlib.sha256(good).hexdigest()
    hreg.manifests[("proj/pin", pinned)] = hreg.manifest_for([("m.gguf", b"EVIL" * 100, False)])
    store = store_for(tmp_path, hreg.url)
    await store.start()
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(store.pull(harbor("pin", ref=f"proj/pin@{pinned}")), 30)
    assert err.value.status_code == 502
    assert store.list_models() == []


# --- 4. two artifacts, one directory ------------------------------------------------------------


async def test_artifacts_sharing_a_slug_do_not_clobber_each_other(tmp_path, hreg):
    """repo://a--b:c and repo://a:b--c both map to MODELS_DIR/repo--a--b--c. Pulling the second
    must not delete the first's files under its still-listed manifest entry."""
    hreg.add_artifact("proj/a--b", "c", [("first.gguf", os.urandom(1000), False)])
    hreg.add_artifact("proj/a", "b--c", [("second.gguf", os.urandom(2000), False)])
    store = store_for(tmp_path, hreg.url)
    await store.start()
    first = await store.pull(harbor("a--b", "c"))
    assert Path(first["path"], "first.gguf").is_file()
    try:
        await asyncio.wait_for(store.pull(harbor("a", "b--c")), 30)
    except PullError as err:  # refusing the second pull is fine
        assert err.status_code in (409, 422), err.detail
    assert Path(first["path"], "first.gguf").is_file(), "the other pull deleted this model"
    for m in store.list_models():
        names = {f["name"] for f in m["files"]}
        want = "first.gguf" if m["source_uri"] == "repo://a--b:c" else "second.gguf"
        assert want in names, (m["source_uri"], names)


# --- 5. a peer that never answers ----------------------------------------------------------------


async def test_token_realm_that_never_answers_is_bounded(tmp_path, hreg, stall, monkeypatch):
    """The registry's Bearer challenge names the token endpoint (the realm); one that accepts
    the connection and never answers must time out like every other registry request."""
    monkeypatch.setattr(oci, "READ_TIMEOUT_S", 2.0, raising=False)
    challenge = {"Www-Authenticate": f'Bearer realm="{stall.url}/token",service="reg"'}
    hreg.handlers["/v2/proj/locked/manifests/v1"] = lambda h: hreg.send(h, 401, b"{}", challenge)
    store = store_for(tmp_path, hreg.url, harbor_username="alice", harbor_password="s3cret")
    await store.start()
    try:
        with pytest.raises(PullError) as err:
            await asyncio.wait_for(store.pull(harbor("locked")), 30)
        assert err.value.status_code == 502
    finally:
        stall.close()  # unblock a worker left waiting (before the event loop is torn down)
        await asyncio.sleep(0.5)


async def test_hub_api_that_never_answers_is_bounded(tmp_path, stall, monkeypatch):
    """snapshot_download asks the Hub for the repo info and file tree with no timeout at all; a
    Hub that accepts the connection and never answers must not hang the pull forever."""
    monkeypatch.setattr(huggingface, "READ_TIMEOUT_S", 2.0, raising=False)
    store = store_for(tmp_path, hf_endpoint=stall.url)
    await store.start()
    req = {
        "source": "huggingface",
        "source_uri": "huggingface://acme/tiny",
        "model_id": "acme/tiny",
    }
    try:
        with pytest.raises(PullError) as err:
            await asyncio.wait_for(store.pull(req), 30)
        assert err.value.status_code == 502
    finally:
        stall.close()  # unblock a worker left waiting (before the event loop is torn down)
        await asyncio.sleep(0.5)


class EndlessTreeHub(FakeHub):
    """A Hub whose file listing never ends: every page links to a next one."""

    pages = 0

    def _handle(self, h, head):
        self.__dict__.setdefault("conns", []).append(h.connection)
        path = urlsplit(h.path).path
        if "/tree/" not in path:
            return super()._handle(h, head)
        self.pages += 1
        body = json.dumps(
            [{"type": "file", "path": f"f{self.pages}.bin", "size": 1, "oid": "0" * 40}]
        ).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        port = h.server.server_address[1]
        h.send_header("Link", f'<http://127.0.0.1:{port}{path}?cursor={self.pages}>; rel="next"')
        h.end_headers()
        h.wfile.write(body)
        return None


ENDLESS_PULL = {
    "source": "huggingface",
    "source_uri": "huggingface://acme/tiny",
    "model_id": "acme/tiny",
}


def _endless_hub(tmp_path: Path) -> EndlessTreeHub:
    root = tmp_path / "hub"
    (root / "acme" / "tiny").mkdir(parents=True)
    (root / "acme" / "tiny" / "config.json").write_text("{}")
    return EndlessTreeHub(root).start()


async def test_cancel_stops_a_pull_stuck_in_the_hub_listing(tmp_path):
    """Cancelling a pull must stop its worker: after cancel() returns, the host makes no more
    requests (a resumed pull would otherwise race a live writer in the same .partial dir)."""
    hub = _endless_hub(tmp_path)
    try:
        store = store_for(tmp_path, hf_endpoint=hub.url)
        await store.start()
        req = dict(ENDLESS_PULL)
        task = asyncio.create_task(store.pull(req))
        deadline = time.monotonic() + 20
        while hub.pages < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert hub.pages >= 20
        t0 = time.monotonic()
        assert store.cancel(req["source_uri"])
        with pytest.raises((PullError, asyncio.CancelledError)):
            await asyncio.wait_for(task, 45)
        took = time.monotonic() - t0
        before = hub.pages
        await asyncio.sleep(1.0)
        assert hub.pages - before <= 1, "the cancelled pull's worker is still listing"
        assert took < 10, f"cancel took {took:.1f} s"
    finally:
        hub.stop()
        for c in hub.__dict__.get("conns", []):  # unblock a worker left reading
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


async def test_an_endless_hub_listing_fails_the_pull(tmp_path, monkeypatch):
    """A Hub whose listing always links to a next page: the pull fails with a 502 saying so
    after MAX_LISTING_PAGES pages, instead of listing until someone cancels it."""
    monkeypatch.setattr(huggingface, "MAX_LISTING_PAGES", 40)
    hub = _endless_hub(tmp_path)
    try:
        store = store_for(tmp_path, hf_endpoint=hub.url)
        await store.start()
        req = dict(ENDLESS_PULL)
        with pytest.raises(PullError) as err:
            await asyncio.wait_for(store.pull(req), 60)
        assert err.value.status_code == 502
        assert "40 pages" in str(err.value)
        assert hub.pages == 40  # the page past the cap is never asked for
    finally:
        hub.stop()


# --- 6. a second review: what a pull does to the copy already on disk -------------------------


def _hub_repo(tmp_path: Path, files: dict[str, bytes]) -> Path:
    repo = tmp_path / "hub" / "acme" / "m"
    repo.mkdir(parents=True)
    for name, data in files.items():
        (repo / name).write_bytes(data)
    return tmp_path / "hub"


def _hf(filters: list[str] | None = None) -> dict:
    req = {"source": "huggingface", "source_uri": "huggingface://acme/m", "model_id": "acme/m"}
    if filters is not None:
        req["file_filters"] = filters
    return req


async def test_low_disk_while_adding_files_keeps_the_model_already_pulled(tmp_path):
    """A pull asking for more files of a model on disk moves the model aside to reuse it. The
    disk floor's abort then deleted that directory, the model with it: 507, and GET /models
    empty. Now only what the pull added goes, and the model is as it was."""
    a = os.urandom(300_000)
    hub = FakeHub(_hub_repo(tmp_path, {"a.gguf": a, "b.gguf": os.urandom(3_000_000)})).start()
    try:
        low = {"now": False}
        probe = FakeDisk(lambda _n: 1 * GB if low["now"] else 100 * GB)
        store = make_store(tmp_path, hf_endpoint=hub.url, probe=probe, min_free_disk_gb=2)
        await store.start()
        first = await store.pull(_hf(["a.gguf"]))
        hub.bytes_per_s = 1_000_000
        adding = asyncio.create_task(store.pull(_hf(["b.gguf"])))
        await asyncio.sleep(0.5)
        low["now"] = True
        with pytest.raises(PullError) as err:
            await asyncio.wait_for(adding, 30)
        assert err.value.status_code == 507
        root = Path(first["path"])
        assert (root / "a.gguf").read_bytes() == a
        assert not (root / "b.gguf").exists()
        assert not list(root.rglob("*.incomplete"))  # the disk the aborted file took is freed
        [model] = store.list_models()
        assert [f["name"] for f in model["files"]] == ["a.gguf"]
        low["now"] = False
        hub.bytes_per_s = None
        again = await store.pull(_hf(["a.gguf"]))
        assert again["cached"] is True
    finally:
        hub.stop()


async def test_a_damaged_hub_file_is_fetched_again_not_kept(tmp_path):
    """A pulled file cut short with its time kept (cp -p, a restore): the store saw the size
    change and pulled again, but huggingface_hub's metadata said the file was complete, so the
    damaged file stayed and its size was recorded; every later pull answered it as cached."""
    data = os.urandom(200_000)
    hub = FakeHub(_hub_repo(tmp_path, {"w.bin": data})).start()
    try:
        store = make_store(tmp_path, hf_endpoint=hub.url)
        await store.start()
        f = Path((await store.pull(_hf()))["path"], "w.bin")
        st = f.stat()
        with open(f, "r+b") as fh:
            fh.truncate(1000)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        again = await store.pull(_hf())
        assert again["cached"] is False
        assert Path(again["path"], "w.bin").read_bytes() == data
        assert store.manifest.get("huggingface://acme/m").file_sizes == {"w.bin": len(data)}
    finally:
        hub.stop()


async def test_two_sources_of_one_directory_pulled_at_once_one_is_refused(tmp_path, hreg):
    """repo://a--b:c and repo://a:b--c share a directory. Pulled at the same moment, both passed
    the check (it came before an await, the registration after), and one recorded the other's
    files. Now the second is a 409 and the first's files are its own."""
    hreg.add_artifact("proj/a--b", "c", [("one.gguf", b"GGUF-first" * 1000, False)])
    hreg.add_artifact("proj/a", "b--c", [("two.gguf", b"GGUF-second" * 1000, False)])
    for attempt in range(3):
        store = store_for(tmp_path / str(attempt), hreg.url)
        await store.start()
        results = await asyncio.gather(
            store.pull(harbor("a--b", "c")), store.pull(harbor("a", "b--c")), return_exceptions=True
        )
        refused = [r for r in results if isinstance(r, PullError)]
        assert [r.status_code for r in refused] == [409], results
        [entry] = store.manifest.entries()
        want = "one.gguf" if entry.source_uri == "repo://a--b:c" else "two.gguf"
        assert sorted(p.name for p in Path(entry.path).iterdir()) == [want]


async def test_a_pull_pinned_to_a_new_digest_is_not_answered_from_the_old_copy(tmp_path, hreg):
    """repo://m:v1 pulled, then the tag moved: a pull pinned to the new manifest digest was
    answered `cached` with the old bytes. And the request's own `digest` replaced the one the
    host computed, so GET /models showed whatever the caller wrote."""
    hreg.add_artifact("proj/m", "v1", [("m.gguf", b"GGUF-old", False)])
    store = store_for(tmp_path, hreg.url)
    await store.start()
    await store.pull(harbor("m"))
    new = hreg.add_artifact("proj/m", "v1", [("m.gguf", b"GGUF-new", False)])
    digest = "sha256:" + hashlib.sha256(new).hexdigest()
    hreg.manifests[("proj/m", digest)] = new
    label = "sha256:" + "0" * 64
    r = await store.pull(harbor("m", ref=f"proj/m:v1@{digest}", digest=label))
    assert r["cached"] is False
    assert Path(r["path"], "m.gguf").read_bytes() == b"GGUF-new"
    assert store.manifest.get("repo://m:v1").digest == digest
    again = await store.pull(harbor("m", ref=f"proj/m:v1@{digest}"))
    assert again["cached"] is True


async def test_an_empty_file_in_an_artifact_is_pulled(tmp_path, hreg):
    hreg.add_artifact("proj/e", "v1", [("m.gguf", b"GGUF" * 10, False), ("empty.txt", b"", False)])
    store = store_for(tmp_path, hreg.url)
    await store.start()
    r = await asyncio.wait_for(store.pull(harbor("e")), 30)
    assert Path(r["path"], "empty.txt").read_bytes() == b""


def _chunked(h, total: int, tail: bytes) -> None:
    """Answer 200 with `total` bytes of JSON whitespace, then `tail`, chunked (no length)."""
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    block = b" " * (256 * 1024)
    try:
        for _ in range(total // len(block)):
            h.wfile.write(b"%x\r\n" % len(block) + block + b"\r\n")
        h.wfile.write(b"%x\r\n" % len(tail) + tail + b"\r\n0\r\n\r\n")
    except OSError:
        pass


async def _refused_pull(tmp_path: Path, hub: FakeHub) -> PullError:
    """What the pull of acme/m from `hub` (started here, stopped after) was refused with."""
    hub.start()
    try:
        store = make_store(tmp_path, hf_endpoint=hub.url)
        await store.start()
        with pytest.raises(PullError) as err:
            await asyncio.wait_for(store.pull(_hf()), 60)
        return err.value
    finally:
        hub.stop()


class HugeInfoHub(FakeHub):
    """A Hub whose repository info is an answer of `size` bytes with no length given."""

    size = 0

    def _handle(self, h, head):
        parts = urlsplit(h.path).path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and "tree" not in parts and not head:
            body = json.dumps({"id": "acme/m", "sha": "a" * 40, "siblings": []}).encode()
            return _chunked(h, self.size, body)
        return super()._handle(h, head)


async def test_an_endless_hub_answer_is_refused_not_read_into_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface, "MAX_METADATA_BYTES", 1 * MB)
    hub = HugeInfoHub(_hub_repo(tmp_path, {"w.bin": b"x"}))
    hub.size = 8 * MB
    err = await _refused_pull(tmp_path, hub)
    assert err.status_code == 502 and "over 1 MiB" in err.detail


async def test_an_endless_token_answer_is_refused_not_read_into_memory(tmp_path, hreg, monkeypatch):
    monkeypatch.setattr(oci, "MAX_RESPONSE_BYTES", 1 * MB)
    hreg.add_artifact("proj/m", "v1", [("m.gguf", b"GGUF1234", False)])
    plain = hreg._handle

    def handle(h) -> None:
        if urlsplit(h.path).path == "/token":
            return _chunked(h, 8 * MB, b'{"token": "t"}')
        if h.headers.get("Authorization") != "Bearer t":
            realm = f'Bearer realm="{hreg.url}/token",service="r",scope="repository:proj/m:pull"'
            return hreg.send(h, 401, b"{}", {"Www-Authenticate": realm})
        return plain(h)

    hreg._handle = handle
    store = store_for(tmp_path, hreg.url)
    await store.start()
    with pytest.raises(PullError) as err:
        await asyncio.wait_for(store.pull(harbor("m")), 60)
    assert err.value.status_code == 502 and "/token" in err.value.detail


class LyingHub(FakeHub):
    """A Hub that lists a file named `../../evil.txt`, or announces a size it does not send."""

    lie = ""

    def _handle(self, h, head):
        parts = urlsplit(h.path).path.strip("/").split("/")
        if self.lie == "dotdot" and "tree" in parts:
            items = [{"type": "file", "path": "../../evil.txt", "size": 3, "oid": "0" * 40}]
            return self._json(h, 200, items, head)
        if self.lie == "size" and len(parts) >= 5 and parts[2] == "resolve" and head:
            h.send_response(200)
            h.send_header("Content-Length", "1000")
            h.send_header("ETag", '"abc"')
            h.send_header("X-Repo-Commit", "a" * 40)
            h.end_headers()
            return None
        return super()._handle(h, head)


@pytest.mark.parametrize("lie", ["dotdot", "size"])
async def test_what_a_hub_sends_that_cannot_be_stored_is_a_502(tmp_path, lie):
    """The Hub client's own checks (a name out of the directory, a body shorter than its
    announced size) were 500s, as if the host had failed."""
    hub = LyingHub(_hub_repo(tmp_path, {"config.json": b"{}"}))
    hub.lie = lie
    err = await _refused_pull(tmp_path, hub)
    assert (err.status_code, err.error) == (502, "model_pull_failed"), err
    assert not (tmp_path / "evil.txt").exists()
    assert not (tmp_path / "models" / "evil.txt").exists()


@pytest.mark.parametrize(
    ("model_id", "why"),
    [
        ("acme/tiny/extra", "namespace/repo_name"),
        ("acme/ti--ny", "Cannot have -- or .."),
        ("acme/" + "x" * 97, "maximum length is 96"),
        ("acme/tiny.", "cannot start or end"),
    ],
)
async def test_a_model_id_the_hub_would_refuse_is_a_400_before_anything_is_made(
    tmp_path, model_id, why
):
    store = make_store(tmp_path, hf_endpoint="http://127.0.0.1:9")
    await store.start()
    req = {"source": "huggingface", "source_uri": f"huggingface://{model_id}", "model_id": model_id}
    with pytest.raises(PullError) as err:
        await store.pull(req)
    assert (
        err.value.status_code == 400 and "model_id" in err.value.detail and why in err.value.detail
    )
    assert not (tmp_path / "models" / ".partial").exists()


async def test_names_no_file_can_hold_are_a_400(tmp_path, hreg):
    store = store_for(tmp_path, hreg.url)
    await store.start()
    long_name = "a" * 250  # a valid OCI name; its directory name is past 255 bytes
    with pytest.raises(PullError) as err:
        await store.pull(harbor(long_name))
    assert err.value.status_code == 400 and "model directory" in err.value.detail
    hreg.add_artifact("proj/m", "v1", [("m.gguf", b"GGUF", False)])
    req = harbor("m")
    req["source_uri"] += "/" + "s" * 300
    with pytest.raises(PullError) as err:
        await store.pull(req)
    assert err.value.status_code == 400 and "subpath" in err.value.detail

# ruff: noqa: ASYNC240  (tests inspect files on disk between awaits)
"""Pulling from peers (issue 42, ruling 26): three hosts on loopback (real uvicorn servers) and
the loopback Hub. Host 1 pulls from the Hub; hosts 2 and 3 ask their peers first, by digest,
and the Hub serves the model's bytes once; with the Hub down, a peer's record stands in for
its listing; a peer that serves bytes that are not the digest is skipped and named; the peer
routes take PEER_TOKEN only."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest

from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.loopback_http import LoopbackHTTP
from tests.fixtures.peers import (
    CONFIG,
    PEER_TOKEN,
    URI,
    hub_bytes,
    peer_settings,
    pull,
    serving_model,
    weights,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="loopback servers need Linux")

SIZE = 2_000_000


@pytest.fixture
def hub(tmp_path):
    with serving_model(tmp_path / "hub", SIZE) as h:
        yield h


class CorruptPeer(LoopbackHTTP):
    """A 'host' that claims every file and serves random bytes of the size asked for."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.serve()

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        data = os.urandom(self.size)
        request.send_response(200)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)


async def test_three_hosts_take_the_model_from_the_hub_once(tmp_path, hub):
    data = weights(hub).read_bytes()
    model_size = SIZE + len(CONFIG)
    bad = CorruptPeer(SIZE)
    try:
        async with running_host(peer_settings(tmp_path / "h1", hub.url)) as h1:
            await pull(h1)
            assert hub_bytes(hub) == model_size
            async with running_host(peer_settings(tmp_path / "h2", hub.url, [h1.url])) as h2:
                ev2: list[dict] = []
                res2 = await pull(h2, ev2)
                assert Path(res2["path"], "w.safetensors").read_bytes() == data
                assert hub_bytes(hub) == model_size  # the Hub sent no file body again
                assert f"peer {h1.url}" in {e.get("from") for e in ev2}

                # The Hub goes down; host 3 asks a corrupt peer first, then hosts 1 and 2.
                down = hub.url
                hub.stop()
                peers3 = [bad.url, h1.url, h2.url]
                async with running_host(peer_settings(tmp_path / "h3", down, peers3)) as h3:
                    ev3: list[dict] = []
                    res3 = await pull(h3, ev3)
                    assert Path(res3["path"], "w.safetensors").read_bytes() == data
                    skipped = [e["skipped_peers"] for e in ev3 if e.get("skipped_peers")]
                    assert skipped and bad.url in skipped[-1]
                    assert "not its digest" in skipped[-1][bad.url]
                    entry = h3.host.models.manifest.get(URI)
                    assert entry.metadata["listed_by"] == f"peer {h1.url}"
                    assert entry.file_digests == h1.host.models.manifest.get(URI).file_digests
                    listed = (await h3.client.get("/models")).json()
                    assert [m["name"] for m in listed] == ["hf--acme--m"]
        # Over the three pulls the Hub served the model's bytes once: at most 1.01x its size.
        assert hub_bytes(hub) <= 1.01 * model_size
    finally:
        bad.stop()


async def test_peer_routes_take_the_peer_token_and_nothing_else(tmp_path, hub):
    async with running_host(peer_settings(tmp_path / "h1", hub.url)) as h1:
        await pull(h1)
        digest = h1.host.models.manifest.get(URI).file_digests["w.safetensors"]
        url = f"{h1.url}/peer/v1/files/{digest}"
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.get(url)).status_code == 401
            assert (await c.get(url, headers={"X-API-Key": API_KEY})).status_code == 401
            bearer_key = {"Authorization": f"Bearer {API_KEY}"}
            assert (await c.get(url, headers=bearer_key)).status_code == 401
            peer = {"Authorization": f"Bearer {PEER_TOKEN}"}
            r = await c.get(url, headers={**peer, "Range": "bytes=10-19"})
            assert r.status_code == 206 and len(r.content) == 10
            whole = Path(h1.host.models.manifest.get(URI).path, "w.safetensors").read_bytes()
            assert r.content == whole[10:20]
            assert (await c.post(url, headers=peer)).status_code == 405  # read-only
            unknown = f"{h1.url}/peer/v1/files/sha256:{'0' * 64}"
            assert (await c.get(unknown, headers=peer)).status_code == 404
            bad = f"{h1.url}/peer/v1/files/..%2F..%2Fetc%2Fpasswd"
            assert (await c.get(bad, headers=peer)).status_code in (404, 422)
            listing = f"{h1.url}/peer/v1/models?source_uri={URI}"
            r = await c.get(listing, headers=peer)
            assert r.status_code == 200
            assert {f["path"] for f in r.json()["files"]} == {"config.json", "w.safetensors"}
            # A file changed on disk since its pull is not served.
            Path(h1.host.models.manifest.get(URI).path, "w.safetensors").write_bytes(b"x")
            assert (await c.get(url, headers=peer)).status_code == 404
    # No PEER_TOKEN, or one equal to the API key: nothing is served.
    for token in ("", API_KEY):
        s = host_settings(tmp_path / f"off{len(token)}", peer_token=token)
        async with running_host(s) as h:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.get(
                    f"{h.url}/peer/v1/models?source_uri={URI}",
                    headers={"Authorization": f"Bearer {token or 'anything'}"},
                )
                assert r.status_code == 404


async def test_a_pull_with_no_peer_that_has_the_model_takes_it_from_the_hub(tmp_path, hub):
    async with running_host(peer_settings(tmp_path / "h1", hub.url)) as h1:
        async with running_host(
            peer_settings(tmp_path / "h2", hub.url, [h1.url, "http://127.0.0.1:9"])
        ) as h2:
            ev: list[dict] = []
            await asyncio.wait_for(pull(h2, ev), 60)
            assert "source" in {e.get("from") for e in ev}
            assert hub_bytes(hub) == SIZE + len(CONFIG)


async def test_an_artifact_of_the_registry_is_taken_from_a_peer_too(tmp_path):
    from tests.fixtures.hostile_peers import HostileOCI

    registry = HostileOCI()
    data = os.urandom(500_000)
    registry.add_artifact("proj/m", "v1", {"m.gguf": data, "config.json": b"{}"})
    body = {"source": "harbor", "source_uri": "repo://m:v1", "harbor_ref": "proj/m:v1"}

    def blob_gets() -> int:
        return sum(1 for path, _ in registry.bad.seen_auth if "/blobs/" in path)

    def for_registry(name: str, peers: list[str]):
        return peer_settings(tmp_path / name, None, peers, harbor_url=registry.url)

    try:
        async with running_host(for_registry("h1", [])) as h1:
            assert (await h1.client.post("/models/pull", json=body)).status_code == 200
            assert blob_gets() == 2
            async with running_host(for_registry("h2", [h1.url])) as h2:
                r = await h2.client.post("/models/pull", json=body)
                assert r.status_code == 200, r.text
                assert Path(r.json()["path"], "m.gguf").read_bytes() == data
                assert blob_gets() == 2  # the manifest came from the registry, no blob did
    finally:
        registry.stop()


class HalfPeer(LoopbackHTTP):
    """Serves the first half of the true file, then closes the connection."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.served: list[int] = []
        self.serve()

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        data = self.data
        if hashlib.sha256(data).hexdigest() not in request.path:
            request.send_response(404)
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        request.send_response(200)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data[: len(data) // 2])
        request.close_connection = True
        self.served.append(len(data) // 2)


async def test_what_a_peer_that_failed_mid_file_sent_is_not_kept(tmp_path, hub):
    """A peer that drops the connection halfway: its bytes are cut from the part (nothing
    vouches for them), and the file comes whole from the Hub."""
    data = weights(hub).read_bytes()
    half = HalfPeer(data)
    try:
        async with running_host(peer_settings(tmp_path / "h1", hub.url, [half.url])) as h1:
            res = await pull(h1)
            assert Path(res["path"], "w.safetensors").read_bytes() == data
            assert half.served == [SIZE // 2]  # asked first, and failed halfway
            assert hub.bytes_sent["w.safetensors"] == SIZE
    finally:
        half.stop()

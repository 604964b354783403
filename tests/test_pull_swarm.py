# ruff: noqa: ASYNC240  (tests inspect files on disk between awaits; a child is killed)
"""Pulling in a swarm (issue 42, fleet scale): hosts that pull one model at once share its
pieces as they arrive (model_store/swarm.py). Real hosts on loopback (uvicorn, the real peer
routes) and the loopback Hub: the Hub serves the model once for all of them; a peer that sends
pieces that are not the file is named and the pull succeeds from the source; a peer that dies
in the middle costs nothing but its pieces; a killed pull resumes with the pieces it had."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from solar_host.model_store.pieces import PIECE_BYTES, piece_count
from tests.fixtures.fakehub import sha256_of
from tests.fixtures.host import running_host
from tests.fixtures.loopback_http import LoopbackHTTP
from tests.fixtures.peers import (
    BODY,
    CONFIG,
    PEER_TOKEN,
    hub_bytes,
    introduce,
    origins,
    peer_settings,
    pull,
    pull_at_once,
    running_hosts,
    serving_model,
    weights,
)
from tests.fixtures.pull_child import kill_mid_pull

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="loopback servers need Linux")

SIZE = 5 * PIECE_BYTES + 12345  # six pieces, the last one short


@pytest.fixture
def hub(tmp_path):
    with serving_model(tmp_path / "hub", SIZE) as h:
        yield h


class PiecePeer(LoopbackHTTP):
    """A 'host' speaking the piece protocol for one file: it claims every piece and serves
    `serve_piece(index)` for each; `stop()` kills it (connections refused from then on)."""

    def __init__(self, data: bytes, serve_piece: Callable[[int], bytes], digest: str) -> None:
        n = piece_count(len(data))
        bits = bytearray((n + 7) // 8)
        for i in range(n):
            bits[i >> 3] |= 1 << (i & 7)
        self.answer = json.dumps(
            {
                "host_id": "f" * 32,
                "size_bytes": len(data),
                "piece_bytes": PIECE_BYTES,
                "pieces": n,
                "have": base64.b64encode(bytes(bits)).decode(),
                "complete": True,
                "fetching": [],
            }
        ).encode()
        self.serve_piece = serve_piece
        self.digest = digest
        self.served: list[int] = []
        self.serve()

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        parts = request.path.split("/")
        if self.digest not in request.path.replace("%3A", ":"):
            body, status = b"{}", 404
        elif parts[-2] == "pieces":  # .../pieces/<digest>: the map
            body, status = self.answer, 200
        else:
            index = int(parts[-1])
            body, status = self.serve_piece(index), 200
            self.served.append(index)
        request.send_response(status)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)


def piece(data: bytes, i: int) -> bytes:
    return data[i * PIECE_BYTES : (i + 1) * PIECE_BYTES]


async def test_hosts_pulling_at_once_take_the_model_from_the_hub_once(tmp_path, hub):
    data = weights(hub).read_bytes()
    hub.bytes_per_s = 8e6  # a connection of the Hub: the pulls overlap
    names = ("h1", "h2", "h3")
    async with running_hosts(peer_settings(tmp_path / n, hub.url) for n in names) as hosts:
        # The hosts started first, then each is told of the others (MODEL_PEERS is read per pull).
        introduce(hosts)
        results, events = await pull_at_once(hosts)
        for res in results:
            assert Path(res["path"], "w.safetensors").read_bytes() == data
        # The Hub served each byte of the model once, for the three of them.
        assert hub_bytes(hub) <= 1.01 * (SIZE + len(CONFIG))
        assert hub.bytes_sent["w.safetensors"] == SIZE
        for ev in events:
            assert [e["phase"] for e in ev].count("completed") == 1
            assert not [e for e in ev if e["phase"] == "failed"]
            assert sum(origins(ev).values()) >= SIZE
        # Every host took pieces from its peers, and (two pieces each) from the Hub.
        froms = [origins(ev) for ev in events]
        for got in froms:
            assert any(k.startswith("peer ") for k in got), got
        assert sum(got.get("source", 0) for got in froms) <= SIZE + len(CONFIG) * 3


async def test_a_corrupt_peer_in_a_swarm_is_named_and_the_pull_succeeds(tmp_path, hub):
    data = weights(hub).read_bytes()
    digest = "sha256:" + sha256_of(weights(hub))
    bad = PiecePeer(data, lambda i: os.urandom(len(piece(data, i))), digest)
    try:
        async with running_hosts(
            peer_settings(tmp_path / n, hub.url) for n in ("h1", "h2")
        ) as hosts:
            introduce(hosts, first=[bad.url])
            results, events = await pull_at_once(hosts)
            assert bad.served  # its pieces were taken, and found out
            for res, ev in zip(results, events, strict=True):
                assert Path(res["path"], "w.safetensors").read_bytes() == data
                skipped = [e["skipped_peers"] for e in ev if e.get("skipped_peers")]
                assert skipped and skipped[-1][bad.url].startswith("sent ")
                assert "not its digest" in skipped[-1][bad.url]
                for other, why in skipped[-1].items():  # an honest host at most passed them on
                    assert other == bad.url or why.startswith("passed on "), why
    finally:
        bad.stop()


async def test_a_peer_that_dies_in_the_middle_of_a_swarm_costs_only_its_pieces(tmp_path, hub):
    data = weights(hub).read_bytes()
    digest = "sha256:" + sha256_of(weights(hub))
    hub.bytes_per_s = 8e6

    def serve(i: int) -> bytes:
        time.sleep(0.2)
        if len(dying.served) == 1:  # dies after its second piece (no connection from then on)
            threading.Thread(target=dying.stop, daemon=True).start()
        return piece(data, i)

    dying = PiecePeer(data, serve, digest)
    async with running_hosts(peer_settings(tmp_path / n, hub.url) for n in ("h1", "h2")) as hosts:
        introduce(hosts, first=[dying.url])
        results, _ = await pull_at_once(hosts)
        for res in results:
            assert Path(res["path"], "w.safetensors").read_bytes() == data
        assert 2 <= len(dying.served) < 2 * piece_count(SIZE)
        assert hub.bytes_sent["w.safetensors"] < 2 * SIZE  # the rest came once per host at most


async def test_a_killed_swarm_pull_resumes_with_the_pieces_it_had(tmp_path, hub):
    """A host killed in the middle of a swarm keeps the pieces it recorded: the next pull
    fetches only the others."""
    hub.bytes_per_s = 8e6
    models = tmp_path / "c" / "models"
    env = {**os.environ, "MODEL_PEERS": "http://127.0.0.1:9", "PEER_TOKEN": PEER_TOKEN}
    record = models / ".partial" / "hf--acme--m" / ".cache" / "solar-host"
    record = record / "w.safetensors.swarm.pieces"
    kept = 0

    def a_piece_kept() -> bool:
        nonlocal kept
        try:
            kept = sum(c != "." for c in json.loads(record.read_text())["pieces"])
        except (OSError, ValueError, KeyError):
            kept = 0
        return kept >= 1

    await asyncio.to_thread(
        kill_mid_pull, models, hub.url, BODY, a_piece_kept, poll_s=0.02, env=env
    )
    assert 1 <= kept < piece_count(SIZE)
    marks = json.loads(record.read_text())["pieces"]
    lengths = [min(PIECE_BYTES, SIZE - i * PIECE_BYTES) for i in range(piece_count(SIZE))]
    missing = sum(n for n, c in zip(lengths, marks, strict=True) if c == ".")
    before = -1
    for _ in range(50):  # the Hub's thread of the killed connection writes until it notices
        if hub.bytes_sent.get("w.safetensors", 0) == before:
            break
        before = hub.bytes_sent.get("w.safetensors", 0)
        await asyncio.sleep(0.2)
    async with running_host(peer_settings(tmp_path / "c", hub.url, ["http://127.0.0.1:9"])) as h:
        res = await pull(h)
    data = weights(hub).read_bytes()
    assert Path(res["path"], "w.safetensors").read_bytes() == data
    assert hub.bytes_sent["w.safetensors"] - before == missing  # the recorded ones are kept


async def test_the_piece_routes_take_the_peer_token_and_keep_the_upload_cap(tmp_path, hub):
    import httpx

    data = weights(hub).read_bytes()
    digest = "sha256:" + sha256_of(weights(hub))
    cap = 8_000_000
    async with running_host(
        peer_settings(tmp_path / "h1", hub.url, peer_max_upload_bytes_per_s=cap)
    ) as h1:
        await pull(h1)
        base = f"{h1.url}/peer/v1/pieces/{digest}"
        peer = {"Authorization": f"Bearer {PEER_TOKEN}"}
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.get(base)).status_code == 401
            m = (await c.get(base, headers=peer)).json()
            assert (m["pieces"], m["complete"], m["size_bytes"]) == (6, True, SIZE)
            assert (await c.get(f"{base}/1", headers=peer)).content == piece(data, 1)
            assert (await c.get(f"{base}/5", headers=peer)).content == piece(data, 5)
            assert (await c.get(f"{base}/6", headers=peer)).status_code == 404
            assert (await c.get(f"{base}/-1", headers=peer)).status_code == 404
            assert (await c.get(f"{base}/x", headers=peer)).status_code == 422
            bad = f"{h1.url}/peer/v1/pieces/sha256:..%2F/0"
            assert (await c.get(bad, headers=peer)).status_code in (404, 422)
            # Two pieces at once, and the whole file by its digest: one cap for all of them.
            began = time.monotonic()
            got = await asyncio.gather(
                c.get(f"{base}/2", headers=peer),
                c.get(f"{base}/3", headers=peer),
                c.get(f"{h1.url}/peer/v1/files/{digest}", headers=peer),
            )
            took = time.monotonic() - began
            assert [r.content for r in got] == [piece(data, 2), piece(data, 3), data]
            sent = 2 * PIECE_BYTES + SIZE
            assert took >= 0.9 * sent / cap, took
            r = await c.get(
                f"{h1.url}/peer/v1/files/{digest}", headers={**peer, "Range": f"bytes={SIZE - 10}-"}
            )
            assert r.status_code == 206 and r.content == data[-10:]


async def test_hosts_that_join_one_that_has_the_model_pass_its_pieces_on(tmp_path, hub):
    """One host has the model, three want it at once, every upload capped: the three take
    pieces from one another too, not all from the one that has it, and the Hub sends nothing."""
    data = weights(hub).read_bytes()
    cap = {"peer_max_upload_bytes_per_s": 6_000_000}
    names = ("h1", "h2", "h3", "h4")
    async with running_hosts(peer_settings(tmp_path / n, hub.url, **cap) for n in names) as hosts:
        seed, joiners = hosts[0], hosts[1:]
        await pull(seed)
        sent = hub_bytes(hub)
        introduce(joiners, among=hosts)
        results, events = await pull_at_once(joiners)
        for res in results:
            assert Path(res["path"], "w.safetensors").read_bytes() == data
        assert hub_bytes(hub) == sent  # nothing more from the Hub
        froms = [origins(ev) for ev in events]
        passed_on = sum(v for got in froms for k, v in got.items() if k != f"peer {seed.url}")
        assert passed_on >= PIECE_BYTES, froms


async def test_hosts_pulling_a_registry_artifact_at_once_share_its_file_layers(tmp_path):
    """The swarm works for an OCI artifact's file layers too: the registry serves each piece
    of the weights once for both hosts (ranges of the blob)."""
    from tests.fixtures.hostile_peers import HostileOCI

    registry = HostileOCI()
    data = os.urandom(2 * PIECE_BYTES + 777)
    registry.add_artifact("proj/m", "v1", {"m.gguf": data, "config.json": b"{}"})
    body = {"source": "harbor", "source_uri": "repo://m:v1", "harbor_ref": "proj/m:v1"}

    def for_registry(name: str):
        return peer_settings(tmp_path / name, None, harbor_url=registry.url)

    try:
        async with running_hosts(for_registry(n) for n in ("h1", "h2")) as hosts:
            introduce(hosts)
            answers = await asyncio.wait_for(
                asyncio.gather(*(h.client.post("/models/pull", json=body) for h in hosts)), 120
            )
            for r in answers:
                assert r.status_code == 200, r.text
                assert Path(r.json()["path"], "m.gguf").read_bytes() == data
            pieces = [r for r in registry.ranges if r.count("-") == 1 and not r.endswith("-")]
            assert sorted(pieces) == sorted(set(pieces))  # no piece twice
            assert len(pieces) == piece_count(len(data))  # each piece once, for both hosts
    finally:
        registry.stop()

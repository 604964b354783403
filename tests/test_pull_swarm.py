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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from solar_host.events import PullProgress
from solar_host.model_store.pieces import PIECE_BYTES, piece_count
from tests.fixtures.fakehub import FakeHub, sha256_of
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.pull_child import kill_mid_pull

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="loopback servers need Linux")

TOKEN = "peer-secret-0123456789"
URI = "huggingface://acme/m"
BODY = {"source": "huggingface", "model_id": "acme/m", "source_uri": URI}
SIZE = 5 * PIECE_BYTES + 12345  # six pieces, the last one short
CONFIG = b'{"model_type": "llama"}'


@pytest.fixture
def hub(tmp_path):
    repo = tmp_path / "hub" / "acme" / "m"
    repo.mkdir(parents=True)
    (repo / "config.json").write_bytes(CONFIG)
    (repo / "w.safetensors").write_bytes(os.urandom(SIZE))
    h = FakeHub(tmp_path / "hub").start()
    yield h
    h.stop()


def settings(tmp_path: Path, name: str, hub: FakeHub, peers: list[str], **extra):
    return host_settings(
        tmp_path / name,
        hf_endpoint=hub.url,
        min_free_disk_gb=0,
        pull_progress_interval_s=0.05,
        peer_token=TOKEN,
        model_peers=",".join(peers),
        **extra,
    )


def hub_bytes(hub: FakeHub) -> int:
    return sum(hub.bytes_sent.values())


async def pull(h, events: list[dict]) -> dict:
    h.host.bus.subscribe(lambda e: events.append(e.payload), PullProgress)
    r = await h.client.post("/models/pull", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


class PiecePeer:
    """A 'host' speaking the piece protocol for one file: it claims every piece and serves
    `serve(index)` for each; `stop()` kills it (connections refused from then on)."""

    def __init__(self, data: bytes, serve, digest: str) -> None:
        n = piece_count(len(data))
        bits = bytearray((n + 7) // 8)
        for i in range(n):
            bits[i >> 3] |= 1 << (i & 7)
        answer = json.dumps(
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
        self.served: list[int] = []
        served = self.served

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                parts = self.path.split("/")
                if digest not in self.path.replace("%3A", ":"):
                    body, status = b"{}", 404
                elif parts[-2] == "pieces":  # .../pieces/<digest>: the map
                    body, status = answer, 200
                else:
                    index = int(parts[-1])
                    body, status = serve(index), 200
                    served.append(index)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def piece(data: bytes, i: int) -> bytes:
    return data[i * PIECE_BYTES : (i + 1) * PIECE_BYTES]


async def test_hosts_pulling_at_once_take_the_model_from_the_hub_once(tmp_path, hub):
    data = (hub.root / "acme" / "m" / "w.safetensors").read_bytes()
    hub.bytes_per_s = 8e6  # a connection of the Hub: the pulls overlap
    names = ("h1", "h2", "h3")
    hosts = []
    try:
        # Start the hosts first, then tell each of the others (MODEL_PEERS is read per pull).
        stack = [running_host(settings(tmp_path, n, hub, [])) for n in names]
        hosts = [await cm.__aenter__() for cm in stack]
        for h in hosts:
            h.host.settings.model_peers = ",".join(o.url for o in hosts if o is not h)
        events: list[list[dict]] = [[] for _ in hosts]
        results = await asyncio.wait_for(
            asyncio.gather(*(pull(h, ev) for h, ev in zip(hosts, events, strict=True))), 120
        )
        for res in results:
            assert Path(res["path"], "w.safetensors").read_bytes() == data
        # The Hub served each byte of the model once, for the three of them.
        assert hub_bytes(hub) <= 1.01 * (SIZE + len(CONFIG))
        assert hub.bytes_sent["w.safetensors"] == SIZE
        for ev in events:
            assert [e["phase"] for e in ev].count("completed") == 1
            assert not [e for e in ev if e["phase"] == "failed"]
            last = [e for e in ev if e.get("bytes_from")][-1]["bytes_from"]
            assert sum(last.values()) >= SIZE
        # Every host took pieces from its peers, and (two pieces each) from the Hub.
        froms = [[e for e in ev if e.get("bytes_from")][-1]["bytes_from"] for ev in events]
        for got in froms:
            assert any(k.startswith("peer ") for k in got), got
        assert sum(got.get("source", 0) for got in froms) <= SIZE + len(CONFIG) * 3
    finally:
        for cm in reversed(stack if hosts else []):
            await cm.__aexit__(None, None, None)


async def test_a_corrupt_peer_in_a_swarm_is_named_and_the_pull_succeeds(tmp_path, hub):
    data = (hub.root / "acme" / "m" / "w.safetensors").read_bytes()
    digest = "sha256:" + sha256_of(hub.root / "acme" / "m" / "w.safetensors")
    bad = PiecePeer(data, lambda i: os.urandom(len(piece(data, i))), digest)
    stack = [running_host(settings(tmp_path, n, hub, [])) for n in ("h1", "h2")]
    hosts = []
    try:
        hosts = [await cm.__aenter__() for cm in stack]
        for h in hosts:
            h.host.settings.model_peers = ",".join([bad.url] + [o.url for o in hosts if o is not h])
        events: list[list[dict]] = [[], []]
        results = await asyncio.wait_for(
            asyncio.gather(*(pull(h, ev) for h, ev in zip(hosts, events, strict=True))), 120
        )
        assert bad.served  # its pieces were taken, and found out
        for res, ev in zip(results, events, strict=True):
            assert Path(res["path"], "w.safetensors").read_bytes() == data
            skipped = [e["skipped_peers"] for e in ev if e.get("skipped_peers")]
            assert skipped and skipped[-1][bad.url].startswith("sent ")
            assert "not its digest" in skipped[-1][bad.url]
            for other, why in skipped[-1].items():  # an honest host at most passed them on
                assert other == bad.url or why.startswith("passed on "), why
    finally:
        for cm in reversed(stack[: len(hosts)]):
            await cm.__aexit__(None, None, None)
        bad.stop()


async def test_a_peer_that_dies_in_the_middle_of_a_swarm_costs_only_its_pieces(tmp_path, hub):
    data = (hub.root / "acme" / "m" / "w.safetensors").read_bytes()
    digest = "sha256:" + sha256_of(hub.root / "acme" / "m" / "w.safetensors")
    hub.bytes_per_s = 8e6

    def serve(i: int) -> bytes:
        time.sleep(0.2)
        if len(dying.served) == 1:  # dies after its second piece (no connection from then on)
            threading.Thread(target=dying.stop, daemon=True).start()
        return piece(data, i)

    dying = PiecePeer(data, serve, digest)
    stack = [running_host(settings(tmp_path, n, hub, [])) for n in ("h1", "h2")]
    hosts = []
    try:
        hosts = [await cm.__aenter__() for cm in stack]
        for h in hosts:
            h.host.settings.model_peers = ",".join(
                [dying.url] + [o.url for o in hosts if o is not h]
            )
        events: list[list[dict]] = [[], []]
        results = await asyncio.wait_for(
            asyncio.gather(*(pull(h, ev) for h, ev in zip(hosts, events, strict=True))), 120
        )
        for res in results:
            assert Path(res["path"], "w.safetensors").read_bytes() == data
        assert 2 <= len(dying.served) < 2 * piece_count(SIZE)
        assert hub.bytes_sent["w.safetensors"] < 2 * SIZE  # the rest came once per host at most
    finally:
        for cm in reversed(stack[: len(hosts)]):
            await cm.__aexit__(None, None, None)


async def test_a_killed_swarm_pull_resumes_with_the_pieces_it_had(tmp_path, hub):
    """A host killed in the middle of a swarm keeps the pieces it recorded: the next pull
    fetches only the others."""
    hub.bytes_per_s = 8e6
    models = tmp_path / "c" / "models"
    env = {**os.environ, "MODEL_PEERS": "http://127.0.0.1:9", "PEER_TOKEN": TOKEN}
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
    async with running_host(settings(tmp_path, "c", hub, ["http://127.0.0.1:9"])) as h:
        res = await pull(h, [])
    data = (hub.root / "acme" / "m" / "w.safetensors").read_bytes()
    assert Path(res["path"], "w.safetensors").read_bytes() == data
    assert hub.bytes_sent["w.safetensors"] - before == missing  # the recorded ones are kept


async def test_the_piece_routes_take_the_peer_token_and_keep_the_upload_cap(tmp_path, hub):
    import httpx

    data = (hub.root / "acme" / "m" / "w.safetensors").read_bytes()
    digest = "sha256:" + sha256_of(hub.root / "acme" / "m" / "w.safetensors")
    cap = 8_000_000
    async with running_host(
        settings(tmp_path, "h1", hub, [], peer_max_upload_bytes_per_s=cap)
    ) as h1:
        await pull(h1, [])
        base = f"{h1.url}/peer/v1/pieces/{digest}"
        peer = {"Authorization": f"Bearer {TOKEN}"}
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
    data = (hub.root / "acme" / "m" / "w.safetensors").read_bytes()
    cap = {"peer_max_upload_bytes_per_s": 6_000_000}
    stack = [running_host(settings(tmp_path, n, hub, [], **cap)) for n in ("h1", "h2", "h3", "h4")]
    hosts = []
    try:
        hosts = [await cm.__aenter__() for cm in stack]
        seed, joiners = hosts[0], hosts[1:]
        await pull(seed, [])
        sent = hub_bytes(hub)
        for h in joiners:
            h.host.settings.model_peers = ",".join(o.url for o in hosts if o is not h)
        events: list[list[dict]] = [[] for _ in joiners]
        results = await asyncio.wait_for(
            asyncio.gather(*(pull(h, ev) for h, ev in zip(joiners, events, strict=True))), 120
        )
        for res in results:
            assert Path(res["path"], "w.safetensors").read_bytes() == data
        assert hub_bytes(hub) == sent  # nothing more from the Hub
        froms = [[e for e in ev if e.get("bytes_from")][-1]["bytes_from"] for ev in events]
        passed_on = sum(v for got in froms for k, v in got.items() if k != f"peer {seed.url}")
        assert passed_on >= PIECE_BYTES, froms
    finally:
        for cm in reversed(stack[: len(hosts)]):
            await cm.__aexit__(None, None, None)


async def test_hosts_pulling_a_registry_artifact_at_once_share_its_file_layers(tmp_path):
    """The swarm works for an OCI artifact's file layers too: the registry serves each piece
    of the weights once for both hosts (ranges of the blob)."""
    from tests.fixtures.hostile_peers import HostileOCI

    registry = HostileOCI()
    data = os.urandom(2 * PIECE_BYTES + 777)
    registry.add_artifact("proj/m", "v1", {"m.gguf": data, "config.json": b"{}"})
    body = {"source": "harbor", "source_uri": "repo://m:v1", "harbor_ref": "proj/m:v1"}

    def for_registry(name: str):
        return host_settings(
            tmp_path / name,
            harbor_url=registry.url,
            min_free_disk_gb=0,
            pull_progress_interval_s=0.05,
            peer_token=TOKEN,
        )

    stack = [running_host(for_registry(n)) for n in ("h1", "h2")]
    hosts = []
    try:
        hosts = [await cm.__aenter__() for cm in stack]
        for h in hosts:
            h.host.settings.model_peers = ",".join(o.url for o in hosts if o is not h)
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
        for cm in reversed(stack[: len(hosts)]):
            await cm.__aexit__(None, None, None)
        registry.stop()

"""Pulling from other solar-hosts (MODEL_PEERS) before the source, and serving them ours.

A host serves its peers, read-only, the files its pulls placed and checked: looked up by the
digest the source published (or the sha256 the pull recorded), only while the file on disk is
the size recorded, and only inside MODELS_DIR (api/peers.py serves them, with Range, to
requests bearing PEER_TOKEN; never the API key, ruling 26). A pulling host asks its peers in
the order MODEL_PEERS gives for each file, by digest, and checks every byte against the digest
the source published: a peer whose bytes do not match is skipped for the rest of the pull and
named in the log and the pull's progress; a peer that has not the file, or cannot be reached,
is passed over; the source is the fallback. When the source cannot be reached at all, a peer's
record of the snapshot (files, sizes, the digests its own pull checked) stands in for the
source's listing, and is recorded as such.

Everything here blocks; the client side runs in the pull's worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from solar_host.model_store.manifest import Manifest, ManifestEntry
from solar_host.model_store.pacing import Waiting
from solar_host.model_store.pieces import Bitmap, Board, piece_count, piece_map, piece_span
from solar_host.model_store.progress import ByteCounter
from solar_host.model_store.pull import LowSpeedGuard, PullError
from solar_host.model_store.sources import SourceError, confine
from solar_host.model_store.streaming import Cancelled, CancelToken
from solar_host.model_store.transfer import Want, fetch_file

log = logging.getLogger(__name__)

PREFIX = "/peer/v1"
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
MIN_RATE_BPS = 1024.0
RATE_WINDOW_S = 30.0
MAX_LISTING_BYTES = 16 << 20


# --- serving ------------------------------------------------------------------------------------


def _recorded_files(entry: ManifestEntry) -> Iterator[tuple[str, int, str, str | None]]:
    """(path, size, recorded sha256 digest, the source's digest) of each checked file."""
    sizes = entry.file_sizes or {}
    published = entry.source_digests or {}
    for rel, digest in (entry.file_digests or {}).items():
        if rel in sizes:
            yield rel, sizes[rel], digest, published.get(rel)


def find_file(manifest: Manifest, digest: str) -> Path | None:
    """The file of a recorded model whose digest (recorded or published) is `digest`, while it
    is the size its pull recorded and inside MODELS_DIR; None otherwise."""
    for entry in manifest.entries():
        for rel, size, recorded, published in _recorded_files(entry):
            if digest not in (recorded, published):
                continue
            try:
                path = confine(rel, Path(entry.path), what="model file")
                confine(path, manifest.models_dir, what="model file")
                if path.is_file() and path.stat().st_size == size:
                    return path
            except (SourceError, OSError):
                continue
    return None


def piece_answer(board: Board, manifest: Manifest, digest: str) -> dict[str, Any] | None:
    """The piece map of `digest` a peer is told: of the pull fetching it here, else every piece
    of the checked file; None when this host has neither."""
    found = board.answer(digest)
    if found is not None:
        return found
    path = find_file(manifest, digest)
    if path is None:
        return None
    size = path.stat().st_size
    return piece_map(board.host_id, size, Bitmap.all(piece_count(size)), [])


def piece_location(
    board: Board, manifest: Manifest, digest: str, index: int
) -> tuple[Path, int, int] | None:
    """(file, offset, length) of piece `index` of `digest` when this host offers it (inside
    MODELS_DIR); None otherwise."""
    at = board.piece_at(digest, index)
    if at is not None:
        try:
            path = confine(at[0], manifest.models_dir, what="model file")
            if path.is_file() and path.stat().st_size >= at[1] + at[2]:
                return path, at[1], at[2]
        except (SourceError, OSError):
            pass  # placed meanwhile: the manifest has it now
    path = find_file(manifest, digest)
    if path is None:
        return None
    size = path.stat().st_size
    if not 0 <= index < piece_count(size):
        return None
    return (path, *piece_span(index, size))


def snapshot(manifest: Manifest, source_uri: str) -> dict[str, Any] | None:
    """What a peer tells of its copy of `source_uri`: the revision and each checked file."""
    entry = manifest.get(source_uri)
    if entry is None:
        return None
    files = [
        {"path": rel, "size_bytes": size, "digest": recorded, "source_digest": published}
        for rel, size, recorded, published in _recorded_files(entry)
    ]
    return {
        "source_uri": entry.source_uri,
        "revision": (entry.metadata or {}).get("revision"),
        "file_filters": entry.file_filters,
        "files": files,
    }


# --- asking -------------------------------------------------------------------------------------


class Peers:
    """The peers one pull asks (blocking; in the pull's worker thread)."""

    def __init__(
        self,
        urls: list[str],
        token: str,
        cancel: CancelToken,
        *,
        pace: Callable[[int], None] | None = None,
        waiting: Waiting | None = None,
        board: Board | None = None,
    ) -> None:
        import requests

        self.board = board  # this host's files in flight: a swarm offers its pieces there
        self.urls = [u.rstrip("/") for u in urls]
        self.token = token
        self.cancel = cancel
        self.pace = pace
        self.waiting = waiting
        self.skipped: dict[str, str] = {}  # peer -> why it is no longer asked
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "solar-host peer"
        # A swarm asks every peer from a dozen threads (maps, pieces) for each file in flight.
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=64)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def close(self) -> None:
        self.session.close()

    def usable(self) -> list[str]:
        return [u for u in self.urls if u not in self.skipped]

    def get(self, url: str, headers: dict[str, str] | None = None) -> Any:
        import requests

        h = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        if self.cancel.is_set():
            raise Cancelled()
        try:
            return self.session.get(
                url, headers=h, stream=True, timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
            )
        except requests.exceptions.RequestException as err:
            raise _Unavailable(
                str(err).splitlines()[0] if str(err) else type(err).__name__
            ) from None

    def fetch(
        self, want: Want, part: Path, final: Path, counter: ByteCounter
    ) -> tuple[str, str] | None:
        """`want` from the first peer that has it with the right bytes: (peer, sha256 hex);
        None when none has."""
        for peer in self.usable():
            url = f"{peer}{PREFIX}/files/{quote(want.digest, safe='')}"

            def send(headers: dict[str, str], url: str = url) -> Any:
                resp = self.get(url, headers)
                if resp.status_code in (200, 206):
                    return resp
                resp.close()
                raise _Unavailable(f"answered {resp.status_code}")

            guard = LowSpeedGuard(f"Peer {peer}", MIN_RATE_BPS, RATE_WINDOW_S)
            done = counter.done
            before = part.stat().st_size if part.is_file() else 0
            if self.waiting is not None:
                self.waiting.origin = f"peer {peer}"
            try:
                sha = fetch_file(
                    send, want, part, final, counter, self.cancel, guard, self.pace, resumes=0
                )
                if self.waiting is not None:
                    self.waiting.count(f"peer {peer}", want.size - before)
                return peer, sha
            except _Unavailable as err:
                counter.set(done)
                _forget_bytes(part, before)
                log.info("peer %s has no %s (%s)", peer, want.name, err)
            except PullError as err:
                counter.set(done)
                _forget_bytes(part, before)
                if err.error == "model_pull_failed":  # bytes that are not the digest
                    self.skip(peer, f"sent {want.name} with bytes that are not its digest")
                else:
                    log.info("peer %s failed for %s: %s", peer, want.name, err.detail)
        return None

    def skip(self, peer: str, why: str) -> None:
        self.skipped[peer] = why
        log.warning("peer %s %s; not asked again in this pull", peer, why)
        if self.waiting is not None:
            self.waiting.skipped = dict(self.skipped)

    def snapshot(self, source_uri: str) -> tuple[str, dict[str, Any]] | None:
        """The first peer's record of `source_uri`: (peer, record); None when none has it."""
        import json

        for peer in self.usable():
            url = f"{peer}{PREFIX}/models?source_uri={quote(source_uri, safe='')}"
            try:
                resp = self.get(url)
            except _Unavailable as err:
                log.info("peer %s unreachable: %s", peer, err)
                continue
            try:
                if resp.status_code != 200:
                    continue
                body = resp.raw.read(MAX_LISTING_BYTES + 1, decode_content=True)
                if len(body) > MAX_LISTING_BYTES:
                    self.skip(peer, "sent a listing over 16 MiB")
                    continue
                record = json.loads(body)
            except (ValueError, OSError) as err:
                log.info("peer %s sent no usable listing: %s", peer, err)
                continue
            finally:
                resp.close()
            if isinstance(record, dict) and isinstance(record.get("files"), list):
                return peer, record
        return None


def _forget_bytes(part: Path, keep: int) -> None:
    """Cut what a peer that failed wrote to `part`: only the bytes before it are resumed."""
    try:
        if part.is_file() and part.stat().st_size > keep:
            with open(part, "r+b") as f:
                f.truncate(keep)
    except OSError as err:
        log.warning("cannot cut %s back to %d bytes (%s); removing it", part, keep, err)
        part.unlink(missing_ok=True)


class _Unavailable(Exception):
    """A peer that cannot give a file now (unreachable, or it has not the file)."""


def peer_urls(raw: str) -> list[str]:
    """MODEL_PEERS (comma-separated) as base URLs (http or https with a host); anything else
    is dropped with a warning."""
    out = []
    for url in (u for u in raw.split(",") if u.strip()):
        parts = urlsplit(url.strip())
        if parts.scheme in ("http", "https") and parts.netloc:
            out.append(f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}")
        else:
            log.warning("MODEL_PEERS entry %r is not an http(s) URL; ignored", url)
    return out

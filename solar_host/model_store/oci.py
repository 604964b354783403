"""OCI artifacts (Harbor) fetched over the registry API: manifest, then one blob per layer.

The oras package supplies the registry session, reference parsing and the Bearer token flow
(auth backend "token" with HARBOR_USERNAME/PASSWORD); the requests themselves are made here
without oras' retry decorator (it sleeps for minutes on a refused login). Blobs are streamed to
`<partial>/blobs/sha256-<hex>.part` while a second thread hashes the same chunks, so the digest
is checked without reading a file twice or holding it in memory; a verified blob loses its
`.part` suffix and is skipped when an interrupted pull runs again, and a partial one is resumed
with an HTTP Range request. Everything here blocks and runs in worker threads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from solar_host.model_store.progress import ByteCounter
from solar_host.model_store.pull import PullError, safe_relative

log = logging.getLogger(__name__)

CHUNK = 1 << 20
TITLE = "org.opencontainers.image.title"
UNPACK = "io.deis.oras.content.unpack"
DIR_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"  # oras: a pushed directory
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)


class CancelToken:
    """A cancel flag that can also close what a blocked thread is reading from."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._closers: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self.event.is_set()

    def cancel(self) -> None:
        self.event.set()
        with self._lock:
            closers, self._closers = self._closers, []
        for close in closers:
            try:
                close()
            except Exception:
                pass

    def on_cancel(self, close: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._closers.append(close)

        def forget() -> None:
            with self._lock:
                if close in self._closers:
                    self._closers.remove(close)

        return forget


class Cancelled(Exception):
    pass


@dataclass(frozen=True)
class Layer:
    digest: str
    size: int
    title: str
    unpack: bool

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]


def parse_registry_url(url: str) -> tuple[str, str]:
    """HARBOR_URL (`https://reg:port`, `http://...` or bare `reg:port`) -> (scheme, host)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "https://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise PullError(500, "credentials_missing", f"HARBOR_URL '{url}' is not a registry URL")
    return parts.scheme, parts.netloc


class Registry:
    def __init__(
        self, url: str, username: str, password: str, *, read_timeout_s: float = 60.0
    ) -> None:
        import oras.client

        self.scheme, self.host = parse_registry_url(url)
        self.client = oras.client.OrasClient(
            hostname=self.host, insecure=self.scheme == "http", auth_backend="token"
        )
        self.auth = self.client.auth
        self.session = self.client.session
        self._basic = False
        if username or password:
            self.auth.set_basic_auth(username, password)
            self._basic = True
        self.timeout = (10.0, read_timeout_s)

    # --- requests ---------------------------------------------------------------------------

    def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, stream: bool = False
    ) -> Any:
        import requests

        url = f"{self.scheme}://{self.host}{path}"
        headers = dict(headers or {})
        try:
            headers.update(self.auth.get_auth_header())
            resp = self.session.request(
                method, url, headers=headers, stream=stream, timeout=self.timeout
            )
            if resp.status_code in (401, 403):
                challenge = resp.headers.get("Www-Authenticate", "")
                resp.close()
                if challenge.lower().startswith("basic"):
                    if not self._basic:
                        raise PullError(401, "auth_failed", "Registry requires credentials")
                    headers["Authorization"] = f"Basic {self.auth._basic_auth}"
                else:
                    self.auth.token = None
                    headers, changed = self.auth.authenticate_request(resp, headers)
                    if not changed:
                        raise PullError(401, "auth_failed", "Registry authentication failed")
                resp = self.session.request(
                    method, url, headers=headers, stream=stream, timeout=self.timeout
                )
                if resp.status_code in (401, 403):
                    resp.close()
                    raise PullError(
                        401, "auth_failed", "Registry authentication failed (check credentials)"
                    )
            return resp
        except requests.exceptions.SSLError as err:
            raise PullError(
                502, "source_unreachable", f"TLS error talking to {self.host}: {err}"
            ) from None
        except requests.exceptions.RequestException as err:
            raise PullError(
                502, "source_unreachable", f"Registry {self.host} unreachable: {err}"
            ) from None

    def manifest(self, repository: str, reference: str) -> tuple[list[Layer], str | None]:
        resp = self.request(
            "GET", f"/v2/{repository}/manifests/{reference}", {"Accept": ", ".join(MANIFEST_TYPES)}
        )
        if resp.status_code == 404:
            raise PullError(404, "not_found", f"Artifact {repository}:{reference} not found")
        if resp.status_code != 200:
            raise PullError(
                502,
                "source_unreachable",
                f"Registry answered {resp.status_code} for the manifest of {repository}",
            )
        try:
            body = resp.json()
        except ValueError:
            raise PullError(
                502, "model_pull_failed", "Registry sent an unreadable manifest"
            ) from None
        return parse_layers(body), resp.headers.get("Docker-Content-Digest")

    def fetch_blob(
        self, repository: str, layer: Layer, blobs: Path, counter: ByteCounter, cancel: CancelToken
    ) -> Path:
        """Download one blob into `blobs/`, verified; resume or skip what is already there."""
        final = blobs / f"sha256-{layer.hex}"
        if final.is_file() and final.stat().st_size == layer.size:
            counter.add(layer.size)
            return final
        blobs.mkdir(parents=True, exist_ok=True)
        part = blobs / f"sha256-{layer.hex}.part"
        have = part.stat().st_size if part.is_file() else 0
        if have > layer.size:
            part.unlink()
            have = 0
        hasher = hashlib.sha256()
        if have:
            with open(part, "rb") as f:
                while block := f.read(CHUNK * 4):
                    hasher.update(block)
        headers = {"Range": f"bytes={have}-"} if have else {}
        resp = self.request("GET", f"/v2/{repository}/blobs/{layer.digest}", headers, stream=True)
        forget = cancel.on_cancel(lambda: _abort(resp))
        try:
            if resp.status_code == 404:
                raise PullError(404, "not_found", f"Blob {layer.digest} of {repository} not found")
            if resp.status_code == 200 and have:
                have, hasher = 0, hashlib.sha256()  # the registry ignored the Range: start over
            elif resp.status_code not in (200, 206):
                raise PullError(
                    502,
                    "source_unreachable",
                    f"Registry answered {resp.status_code} for blob {layer.digest}",
                )
            counter.add(have)
            got = have + _stream(resp, part, have, hasher, counter, cancel)
        finally:
            forget()
            resp.close()
        if cancel.is_set():
            raise Cancelled()
        if got != layer.size or hasher.hexdigest() != layer.hex:
            part.unlink(missing_ok=True)
            raise PullError(
                502,
                "model_pull_failed",
                f"Pulled artifact integrity check failed: {layer.title or layer.digest}: digest "
                f"mismatch (got sha256:{hasher.hexdigest()} / {got} bytes, "
                f"want {layer.digest} / {layer.size} bytes)",
            )
        os.replace(part, final)
        return final


def _stream(
    resp: Any, part: Path, offset: int, hasher: Any, counter: ByteCounter, cancel: CancelToken
) -> int:
    """Write the body to `part` from `offset` while a second thread hashes the same chunks."""
    q: queue.Queue[bytes | None] = queue.Queue(maxsize=32)

    def hash_chunks() -> None:
        while (chunk := q.get()) is not None:
            hasher.update(chunk)

    hasher_thread = threading.Thread(target=hash_chunks, name="blob-hash", daemon=True)
    hasher_thread.start()
    written = 0
    try:
        with open(part, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.truncate()
            raw = resp.raw
            while not cancel.is_set():
                try:
                    # read1: whatever has arrived (up to CHUNK), so a stalled source leaves
                    # every byte it sent on disk for the resume.
                    chunk = raw.read1(CHUNK, decode_content=False)
                except Exception:
                    if cancel.is_set():
                        break
                    raise
                if not chunk:
                    break
                q.put(chunk)
                f.write(chunk)
                written += len(chunk)
                counter.add(len(chunk))
    except OSError:
        raise
    except PullError:
        raise
    except Exception as err:
        raise PullError(502, "source_unreachable", f"Download interrupted: {err}") from err
    finally:
        q.put(None)
        hasher_thread.join()
    return written


def _abort(resp: Any) -> None:
    """Wake a thread blocked reading `resp` (close() alone does not interrupt a recv)."""
    import socket

    conn = getattr(resp.raw, "_connection", None)
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    resp.close()


def parse_layers(manifest: dict[str, Any]) -> list[Layer]:
    layers = []
    for raw in manifest.get("layers") or []:
        if not isinstance(raw, dict):
            continue
        digest = str(raw.get("digest") or "")
        if not digest.startswith("sha256:") or len(digest) != 71:
            raise PullError(502, "model_pull_failed", f"unsupported layer digest {digest!r}")
        ann = raw.get("annotations") or {}
        title = ann.get(TITLE)
        if not title:
            log.warning("layer %s has no title annotation; skipped", digest)
            continue
        layers.append(
            Layer(
                digest=digest,
                size=int(raw.get("size") or 0),
                title=safe_relative(str(title)),
                unpack=str(ann.get(UNPACK, "")).lower() == "true"
                or raw.get("mediaType") == DIR_LAYER,
            )
        )
    if not layers:
        raise PullError(502, "model_pull_failed", "artifact has no files (no titled layers)")
    return layers


def assemble(layers: list[Layer], blobs: Path, tree: Path) -> None:
    """Place verified blobs under their titles in `tree` (unpacking directory layers)."""
    tree.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    for layer in layers:
        blob = blobs / f"sha256-{layer.hex}"
        if layer.unpack:
            # Like oras: the archive holds the directory named by the title.
            dest_dir = (tree / layer.title).parent
            dest_dir.mkdir(parents=True, exist_ok=True)
            with tarfile.open(blob, "r:*") as tf:
                tf.extractall(dest_dir, filter="data")
            continue
        dest = tree / layer.title
        dest.parent.mkdir(parents=True, exist_ok=True)
        if layer.digest in used or sum(1 for x in layers if x.digest == layer.digest) > 1:
            import shutil

            shutil.copyfile(blob, dest)
            used.add(layer.digest)
        else:
            os.replace(blob, dest)

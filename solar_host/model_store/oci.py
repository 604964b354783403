"""OCI artifacts (Harbor) fetched over the registry API: manifest, then one blob per layer.

The oras package supplies the registry session, reference parsing and the Bearer token flow
(auth backend "token" with HARBOR_USERNAME/PASSWORD, anonymous when they are unset); the
requests themselves are made here without oras' retry decorator (it sleeps for minutes on a
refused login). Blobs are streamed to `<partial>/blobs/sha256-<hex>.part` while a second thread
hashes the same buffers, so the digest is checked without reading a file twice or holding it in
memory; a verified blob is fsynced, loses its `.part` suffix and is skipped when an interrupted
pull runs again, and a partial one is resumed with an HTTP Range request. Everything here
blocks and runs in worker threads.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import re
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from solar_host.model_store.progress import ByteCounter
from solar_host.model_store.pull import LowSpeedGuard, PullError, safe_relative

log = logging.getLogger(__name__)

TITLE = "org.opencontainers.image.title"
UNPACK = "io.deis.oras.content.unpack"
DIR_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"  # oras: a pushed directory
# Every request to the registry (and to the token endpoint its challenge names) is bounded.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
# A blob body that keeps arriving at under MIN_RATE_BPS over RATE_WINDOW_S fails the pull (the
# read timeout alone lets a peer trickle a byte a minute for ever); the part stays for a resume.
MIN_RATE_BPS = 1024.0
RATE_WINDOW_S = 60.0
# distribution refuses manifests over 4 MiB; a bigger (or endless) one is not read.
MAX_MANIFEST_BYTES = 4 << 20
# Any other answer read whole (the token endpoint's, oras' own calls) is small JSON: a bigger
# or endless body is refused before it fills the host's memory.
MAX_RESPONSE_BYTES = 4 << 20
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


def _read_capped(resp: Any, limit: int) -> Any:
    """`resp` (a requests response opened with stream=True) with its body read, or a 502 when
    the body runs past `limit` bytes."""
    parts, size = [], 0
    try:
        for chunk in resp.iter_content(64 * 1024):
            size += len(chunk)
            if size > limit:
                raise PullError(
                    502,
                    "model_pull_failed",
                    f"{urlsplit(resp.url).netloc} sent an answer over {limit >> 20} MiB for "
                    f"{urlsplit(resp.url).path}; refusing to read it",
                )
            parts.append(chunk)
    except PullError:
        resp.close()
        raise
    resp._content = b"".join(parts)  # what requests keeps for .content, .text and .json()
    resp._content_consumed = True
    return resp


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
        self, url: str, username: str, password: str, *, read_timeout_s: float | None = None
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
        self.timeout = (CONNECT_TIMEOUT_S, read_timeout_s or READ_TIMEOUT_S)
        # oras' token flow requests the realm without a timeout: give every request one.
        plain = self.session.request

        def bounded(method: str, url: str, **kw: Any) -> Any:
            if kw.get("timeout") is None:
                kw["timeout"] = self.timeout
            if kw.get("stream"):  # blobs and manifests: their readers bound what they read
                return plain(method, url, **kw)
            kw["stream"] = True
            return _read_capped(plain(method, url, **kw), MAX_RESPONSE_BYTES)

        self.session.request = bounded  # type: ignore[method-assign]

    def _auth_message(self, what: str) -> str:
        """An auth failure naming the registry and the settings that fix it."""
        if self._basic:
            fix = "check HARBOR_USERNAME and HARBOR_PASSWORD (a robot account needs pull access)"
        else:
            fix = "set HARBOR_USERNAME and HARBOR_PASSWORD (anonymous pulls were refused)"
        return f"Registry {self.host} {what}: {fix}"

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
                        raise PullError(401, "auth_failed", self._auth_message("requires a login"))
                    headers["Authorization"] = f"Basic {self.auth._basic_auth}"
                else:
                    self.auth.token = None
                    headers, changed = self.auth.authenticate_request(resp, headers)
                    if not changed:
                        raise PullError(401, "auth_failed", self._auth_message("refused the login"))
                resp = self.session.request(
                    method, url, headers=headers, stream=stream, timeout=self.timeout
                )
                if resp.status_code in (401, 403):
                    resp.close()
                    raise PullError(401, "auth_failed", self._auth_message("refused the login"))
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
        import json

        import requests

        resp = self.request(
            "GET",
            f"/v2/{repository}/manifests/{reference}",
            {"Accept": ", ".join(MANIFEST_TYPES)},
            stream=True,
        )
        try:
            if resp.status_code == 404:
                raise PullError(404, "not_found", f"Artifact {repository}:{reference} not found")
            if resp.status_code != 200:
                raise PullError(
                    502,
                    "source_unreachable",
                    f"Registry answered {resp.status_code} for the manifest of {repository}",
                )
            data = bytearray()
            try:
                for chunk in resp.iter_content(64 << 10):
                    data += chunk
                    if len(data) > MAX_MANIFEST_BYTES:
                        raise PullError(
                            502,
                            "model_pull_failed",
                            f"Registry sent a manifest over {MAX_MANIFEST_BYTES >> 20} MiB",
                        )
            except requests.exceptions.RequestException as err:
                raise PullError(
                    502, "source_unreachable", f"Registry {self.host} unreachable: {err}"
                ) from None
        finally:
            resp.close()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if reference.startswith("sha256:") and reference != digest:
            raise PullError(
                502,
                "model_pull_failed",
                f"Pulled artifact integrity check failed: manifest digest mismatch "
                f"(got {digest}, want {reference})",
            )
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            raise PullError(
                502, "model_pull_failed", "Registry sent an unreadable manifest"
            ) from None
        return parse_layers(body), digest

    def fetch_blob(
        self, repository: str, layer: Layer, blobs: Path, counter: ByteCounter, cancel: CancelToken
    ) -> Path:
        """Download one blob into `blobs/`, verified and fsynced; resume or skip what is there.

        A blob is renamed to its final name only once its digest matched and its bytes are on
        disk (fsync before rename): a later pull skips a blob by name and size alone, so a name
        that survived a crash must never point at a file whose data did not.
        """
        final = blobs / f"sha256-{layer.hex}"
        if final.is_file() and final.stat().st_size == layer.size:
            counter.add(layer.size)
            return final
        blobs.mkdir(parents=True, exist_ok=True)
        part = blobs / f"sha256-{layer.hex}.part"
        started = part.is_file()
        have = part.stat().st_size if started else 0
        if have > layer.size:
            part.unlink()
            have, started = 0, False
        hasher = hashlib.sha256()
        if have:
            with open(part, "rb") as f:
                while block := f.read(BUF_SIZE * 4):
                    hasher.update(block)
        if started and have == layer.size:
            # Whole but not renamed (interrupted between the last byte and the rename): a Range
            # request would be refused (416), so check it here and keep it or start over.
            if hasher.hexdigest() == layer.hex:
                _durable_rename(part, final)
                counter.add(have)
                return final
            part.unlink()
            have, hasher = 0, hashlib.sha256()
        headers = {"Range": f"bytes={have}-"} if have else {}
        resp = self.request("GET", f"/v2/{repository}/blobs/{layer.digest}", headers, stream=True)
        forget = cancel.on_cancel(lambda: _abort(resp))
        fd = -1
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
            fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
            got = have + _stream(resp, fd, have, layer.size - have, hasher, counter, cancel)
            if cancel.is_set():
                raise Cancelled()
            if got != layer.size or hasher.hexdigest() != layer.hex:
                os.close(fd)
                fd = -1
                part.unlink(missing_ok=True)
                raise PullError(
                    502,
                    "model_pull_failed",
                    f"Pulled artifact integrity check failed: {layer.title or layer.digest}: "
                    f"digest mismatch (got sha256:{hasher.hexdigest()} / {got} bytes, "
                    f"want {layer.digest} / {layer.size} bytes)",
                )
            make_durable(fd)
        finally:
            if fd >= 0:
                os.close(fd)
            forget()
            resp.close()
        os.replace(part, final)
        return final


# Streaming is a pipeline of three threads over a ring of preallocated buffers: the receiver
# fills a buffer from the socket, the hasher hashes it, the writer os.writes it and hands it back.
# recv, sha256 (~0.4 CPU-s per 500 MB that curl does not spend) and the copy into the page cache
# run in parallel (hashlib and os.write release the GIL), a write stalled by the disk does not
# stop the socket, and no bytes object is allocated per chunk. The ring bounds memory
# (BUFFERS * BUF_SIZE per blob in flight) and makes the receiver wait when a stage falls behind.
# Sizes measured on a loaded 2-core machine: a deep ring (16 MiB) absorbs the stalls of the disk
# and the scheduler; 256 KiB buffers cost less CPU than 1-4 MiB ones (likelier still in cache
# when hashed and written).
BUF_SIZE = 256 << 10
BUFFERS = 64
# Start the disk writes of what was written every this many bytes, so the fsync that makes the
# blob durable finds little left to flush instead of the whole file.
WRITEBACK_EVERY = 32 << 20


def make_durable(fd: int) -> None:
    """fsync one finished blob (a module function so bench/pull_throughput.py can time it)."""
    os.fsync(fd)


def _durable_rename(part: Path, final: Path) -> None:
    fd = os.open(part, os.O_RDONLY)
    try:
        make_durable(fd)
    finally:
        os.close(fd)
    os.replace(part, final)


class _Pipeline:
    """Hash, then write to `fd` at `offset`, each buffer given in order; `take()` a free one."""

    def __init__(self, hasher: Any, fd: int, offset: int, counter: ByteCounter) -> None:
        self.hasher = hasher
        self.fd = fd
        self.counter = counter
        self.start = self.flushed = self.end = offset
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._to_hash: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self._to_write: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self._allocated = 0  # buffers are made on demand: a small blob needs only a few
        self.error: BaseException | None = None  # the first failure of a stage (ENOSPC, ...)
        self._threads = [
            threading.Thread(target=self._hash, name="blob-hash", daemon=True),
            threading.Thread(target=self._write, name="blob-write", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _hash(self) -> None:
        while (item := self._to_hash.get()) is not None:
            if self.error is None:
                try:
                    self.hasher.update(memoryview(item[0])[: item[1]])
                except BaseException as err:
                    self.error = err
            self._to_write.put(item)
        self._to_write.put(None)

    def _write(self) -> None:
        while (item := self._to_write.get()) is not None:
            buf, n = item
            if self.error is None:
                try:
                    _write_all(self.fd, memoryview(buf)[:n])
                    self.end += n
                    self.counter.add(n)
                    if self.end - self.flushed >= WRITEBACK_EVERY:
                        _start_writeback(self.fd, self.flushed, self.end - self.flushed)
                        self.flushed = self.end
                except BaseException as err:
                    self.error = err
            self._free.put(buf)  # also after a failure: the receiver must never wait forever

    def take(self) -> bytearray:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            if self._allocated < BUFFERS:
                self._allocated += 1
                return bytearray(BUF_SIZE)
            return self._free.get()

    def give(self, buf: bytearray, n: int) -> None:
        self._to_hash.put((buf, n))

    def close(self) -> int:
        """Wait until every buffer given is hashed and written; return the bytes written."""
        self._to_hash.put(None)
        for t in self._threads:
            t.join()
        if self.error is not None:
            raise self.error
        return self.end - self.start


def _body_reader(resp: Any, length: int) -> Callable[[memoryview], int]:
    """readinto() for the raw body: straight from the socket when the length is known.

    urllib3 would return each chunk as a new bytes object (an allocation and a copy per MiB);
    with a Content-Length body the socket file under http.client is read into our buffer
    instead. Anything else (chunked, unknown length) falls back to urllib3.
    """
    fp = getattr(resp.raw, "_fp", None)  # http.client.HTTPResponse
    sock_file = getattr(fp, "fp", None)
    declared = getattr(fp, "length", None)
    if (
        getattr(fp, "chunked", True) is False
        and isinstance(declared, int)
        and declared == length
        and hasattr(sock_file, "readinto1")
    ):
        left = declared

        def read_socket(view: memoryview) -> int:
            nonlocal left
            if not left:
                return 0
            n = sock_file.readinto1(view[:left] if len(view) > left else view)
            left -= n
            return n

        return read_socket

    raw = resp.raw

    def read_urllib3(view: memoryview) -> int:
        data = raw.read1(len(view), decode_content=False)
        view[: len(data)] = data
        return len(data)

    return read_urllib3


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _stream(
    resp: Any,
    fd: int,
    offset: int,
    expected: int,
    hasher: Any,
    counter: ByteCounter,
    cancel: CancelToken,
) -> int:
    """Write the body (`expected` bytes) to `fd` from `offset`, hashing it on the way.

    Every byte received is written before this returns, whatever ends the stream (a cancel
    closes the socket under a blocked read), so a resume continues exactly where it stopped.
    """
    os.ftruncate(fd, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    read = _body_reader(resp, expected)
    guard = LowSpeedGuard("The registry's blob download", MIN_RATE_BPS, RATE_WINDOW_S)
    pipe = _Pipeline(hasher, fd, offset, counter)
    received = 0
    failure: BaseException | None = None
    try:
        while not cancel.is_set() and pipe.error is None:
            buf = pipe.take()
            view = memoryview(buf)[: min(BUF_SIZE, expected - received)]
            n = 0
            try:
                # Fill the buffer (a read returns what has arrived): one hash and one write per
                # buffer, however the network splits the stream.
                while n < len(view):
                    got = read(view[n:])
                    if not got:
                        break
                    n += got
                    guard.feed(got)
            except Exception as err:
                failure = err
            if n:
                pipe.give(buf, n)
                received += n
            if failure is not None or not n or received >= expected:
                break
    finally:
        written = pipe.close()  # a write error (ENOSPC) is raised from here as is
    if cancel.is_set():
        return written
    if isinstance(failure, PullError):
        raise failure
    if failure is not None:
        raise PullError(502, "source_unreachable", f"Download interrupted: {failure}") from failure
    if written < expected:
        raise PullError(
            502,
            "source_unreachable",
            f"Download interrupted: the registry closed the connection after "
            f"{offset + written} of {offset + expected} bytes",
        )
    return written


_sync_file_range: Any = None


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Queue the disk writes of a written range without waiting (Linux sync_file_range)."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            from solar_host.platform.libc import libc

            fn = libc().sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError):
            pass
    if _sync_file_range:
        _sync_file_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; a failure is harmless


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


def parse_layers(manifest: Any) -> list[Layer]:
    def bad(what: str) -> PullError:
        return PullError(502, "model_pull_failed", f"Registry sent a malformed manifest: {what}")

    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers") or [], list):
        raise bad("not an object with a list of layers")
    layers = []
    for raw in manifest.get("layers") or []:
        if not isinstance(raw, dict):
            continue
        digest = str(raw.get("digest") or "")
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise PullError(502, "model_pull_failed", f"unsupported layer digest {digest!r}")
        size = raw.get("size") or 0
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"layer {digest} has size {size!r}")
        ann = raw.get("annotations") or {}
        if not isinstance(ann, dict):
            raise bad(f"layer {digest} has annotations {ann!r}")
        title = ann.get(TITLE)
        if not title:
            log.warning("layer %s has no title annotation; skipped", digest)
            continue
        layers.append(
            Layer(
                digest=digest,
                size=size,
                title=safe_relative(str(title)),
                unpack=str(ann.get(UNPACK, "")).lower() == "true"
                or raw.get("mediaType") == DIR_LAYER,
            )
        )
    if not layers:
        raise PullError(502, "model_pull_failed", "artifact has no files (no titled layers)")
    titles = {x.title for x in layers}
    if len(titles) < len(layers):
        twice = next(t for t in titles if sum(1 for x in layers if x.title == t) > 1)
        raise PullError(502, "model_pull_failed", f"artifact names the file {twice!r} twice")
    for t in titles:
        parts = t.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in titles:
                raise PullError(
                    502,
                    "model_pull_failed",
                    f"artifact file names {'/'.join(parts[:i])!r} and {t!r} collide",
                )
    return layers


def _safe_member(room: Callable[[int], None] | None) -> Callable[[Any, str], Any]:
    """The tarfile 'data' filter, plus what it misses on older Pythons (CVE-2025-4517: links
    that os.path.realpath gives up expanding): no `..` in any member name or link target, so
    nothing can climb out of the destination whatever links it makes; and `room(size)` before
    each file, so an archive that inflates past the disk floor stops."""

    def check(member: Any, dest: str) -> Any:
        name = member.name
        if ".." in name.replace("\\", "/").split("/"):
            raise PullError(
                502, "model_pull_failed", f"archive member {name!r} escapes the model directory"
            )
        if member.issym() or member.islnk():
            link = member.linkname
            if link.startswith("/") or ".." in link.replace("\\", "/").split("/"):
                raise PullError(
                    502,
                    "model_pull_failed",
                    f"archive link {name!r} -> {link!r} escapes the model directory",
                )
        member = tarfile.data_filter(member, dest)
        if room is not None and member.isfile():
            room(member.size)
        return member

    return check


def assemble(
    layers: list[Layer], blobs: Path, tree: Path, room: Callable[[int], None] | None = None
) -> None:
    """Place verified blobs under their titles in `tree` (unpacking directory layers).

    `room(n)` is called before `n` more bytes are unpacked and raises when they do not fit.
    A file that cannot be placed (an archive that made a directory where a layer's file goes)
    is the artifact's fault: a 502, as any other content the host will not store.
    """
    try:
        _assemble(layers, blobs, tree, room)
    except tarfile.TarError as err:
        raise PullError(502, "model_pull_failed", f"unreadable directory layer: {err}") from err
    except OSError as err:
        if err.errno not in _COLLISIONS:  # the machine's (a full disk, a read-only mount)
            raise
        raise PullError(
            502, "model_pull_failed", f"the artifact's files cannot be placed: {err}"
        ) from err


# A name taken twice within the artifact: one entry where another needs a directory, or the
# reverse.
_COLLISIONS = frozenset({errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY})


def _assemble(
    layers: list[Layer], blobs: Path, tree: Path, room: Callable[[int], None] | None
) -> None:
    tree.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    for layer in layers:
        blob = blobs / f"sha256-{layer.hex}"
        if layer.unpack:
            # Like oras: the archive holds the directory named by the title.
            dest_dir = (tree / layer.title).parent
            dest_dir.mkdir(parents=True, exist_ok=True)
            with tarfile.open(blob, "r:*") as tf:
                tf.extractall(dest_dir, filter=_safe_member(room))
            continue
        dest = tree / layer.title
        dest.parent.mkdir(parents=True, exist_ok=True)
        if layer.digest in used or sum(1 for x in layers if x.digest == layer.digest) > 1:
            import shutil

            shutil.copyfile(blob, dest)
            used.add(layer.digest)
        else:
            os.replace(blob, dest)

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

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from solar_host.model_store import swarm
from solar_host.model_store.layers import Layer, parse_layers
from solar_host.model_store.pacing import Waiting, send_politely
from solar_host.model_store.progress import ByteCounter
from solar_host.model_store.pull import Interrupted, LowSpeedGuard, PullError
from solar_host.model_store.streaming import Cancelled, CancelToken
from solar_host.model_store.transfer import Want, fetch_file

__all__ = ["CancelToken", "Cancelled", "Layer", "Registry", "parse_registry_url"]

log = logging.getLogger(__name__)

# Every request to the registry (and to the token endpoint its challenge names) is bounded.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
# A blob body that keeps arriving at under MIN_RATE_BPS over RATE_WINDOW_S fails the pull.
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
        self,
        url: str,
        username: str,
        password: str,
        *,
        read_timeout_s: float | None = None,
        pace: Callable[[int], None] | None = None,
        waiting: Waiting | None = None,
        cancel: CancelToken | None = None,
    ) -> None:
        import oras.client

        self.pace = pace  # told of every byte of a blob read (the host's rate cap)
        self.waiting = waiting  # where a wait the registry asked for is reported
        self.cancel = cancel or CancelToken()
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
            raise Interrupted(f"Registry {self.host} unreachable: {err}") from None

    def manifest(self, repository: str, reference: str) -> tuple[list[Layer], str | None]:
        import json

        import requests

        resp = send_politely(
            lambda: self.request(
                "GET",
                f"/v2/{repository}/manifests/{reference}",
                {"Accept": ", ".join(MANIFEST_TYPES)},
                stream=True,
            ),
            f"Registry {self.host}",
            self.cancel,
            self.waiting,
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

    def blob_range(
        self, repository: str, layer: Layer, start: int, end: int, cancel: CancelToken
    ) -> Any:
        """An open response of bytes `start`..`end` of a blob (a piece of a swarm)."""
        resp = self._get_blob(repository, layer, {"Range": f"bytes={start}-{end}"}, cancel)
        if swarm.range_usable(resp, start, f"The registry's range of blob {layer.digest}"):
            return resp
        raise self._blob_refused(resp, repository, layer, f"to a range of blob {layer.digest}")

    def _get_blob(
        self, repository: str, layer: Layer, headers: dict[str, str], cancel: CancelToken
    ) -> Any:
        """The registry's response to a GET of a blob (whole or a range), sent politely."""
        path = f"/v2/{repository}/blobs/{layer.digest}"
        return send_politely(
            lambda: self.request("GET", path, headers, stream=True),
            f"Registry {self.host}",
            cancel,
            self.waiting,
        )

    @staticmethod
    def _blob_refused(resp: Any, repository: str, layer: Layer, asked: str) -> PullError:
        """Close an unusable blob response; the error that names it (`asked`: what was asked)."""
        resp.close()
        if resp.status_code == 404:
            return PullError(404, "not_found", f"Blob {layer.digest} of {repository} not found")
        return PullError(502, "source_unreachable", f"Registry answered {resp.status_code} {asked}")

    def fetch_blob(
        self, repository: str, layer: Layer, blobs: Path, counter: ByteCounter, cancel: CancelToken
    ) -> Path:
        """Download one blob into `blobs/`, verified and fsynced; resume or skip what is there.

        A blob is renamed to its final name only once its digest matched and its bytes are on
        disk (fsync before rename): a later pull skips a blob by name and size alone, so a name
        that survived a crash must never point at a file whose data did not.
        """
        final = blobs / f"sha256-{layer.hex}"

        def send(headers: dict[str, str]) -> Any:
            resp = self._get_blob(repository, layer, headers, cancel)
            if resp.status_code in (200, 206):
                return resp
            raise self._blob_refused(resp, repository, layer, f"for blob {layer.digest}")

        want = Want(layer.title or layer.digest, layer.size, layer.digest)
        guard = LowSpeedGuard("The registry's blob download", MIN_RATE_BPS, RATE_WINDOW_S)
        part = blobs / f"sha256-{layer.hex}.part"
        fetch_file(send, want, part, final, counter, cancel, guard, self.pace)
        return final

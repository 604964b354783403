"""HuggingFace Hub snapshots, fetched over the Hub's HTTP API with our own client.

huggingface_hub (2.x) downloads each file to a temporary file of its own process and starts it
over after any interruption, and checks no digest. Here a pull asks the Hub for the commit of
the revision (`/api/models/<id>/revision/main`), lists its files with their digests
(`/api/models/<id>/tree/<commit>?recursive=true`, paged: the sha256 of every LFS file, the git
blob id of the others), checks each file's metadata (`HEAD .../resolve/<commit>/<path>`: the
`X-Linked-Etag` and `X-Linked-Size` of an LFS file, or its `ETag` and length) against the
listing, and fetches each file with `transfer.fetch_file`: resumable with Range requests,
checked against its digest before it gets its name. Everything here blocks and runs in worker
threads; every request is bounded (timeouts, answer sizes, listing pages, a rate floor).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from solar_host.model_store import swarm
from solar_host.model_store.pacing import Waiting, send_politely
from solar_host.model_store.peers import Peers
from solar_host.model_store.progress import ByteCounter
from solar_host.model_store.pull import Interrupted, LowSpeedGuard, PullError, safe_relative
from solar_host.model_store.streaming import Cancelled, CancelToken
from solar_host.model_store.transfer import Want, check_in_place, fetch_file

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
# Every request is bounded; a file body's read timeout is huggingface_hub's own setting
# (HF_HUB_DOWNLOAD_TIMEOUT, 10 s by default), read when the body is asked for.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
# The file listing comes in pages of up to 1,000 entries, each linking to the next: a Hub that
# always links to another page would hold the pull (and a worker thread) for ever. A million
# files is far beyond any model repository.
MAX_LISTING_PAGES = 1000
# The Hub's API answers (repository info, file listing pages) are read whole into memory:
# one past this is refused. File downloads are not API answers, and are not capped.
MAX_METADATA_BYTES = 64 << 20
# A body that keeps arriving at under MIN_RATE_BPS over RATE_WINDOW_S fails the pull: the read
# timeout only catches silence (a peer trickling bytes would hold the pull for days).
MIN_RATE_BPS = 1024.0
RATE_WINDOW_S = 60.0
# Where a file is written while it arrives (under the partial directory; never listed).
INCOMPLETE_DIR = Path(".cache") / "solar-host"


@dataclass(frozen=True)
class HubFile:
    path: str  # relative posix path in the repository (checked: no escape)
    want: Want  # size and the digest the Hub publishes (or a peer recorded)
    source_digest: str | None = None  # the digest the Hub publishes, when it is not want's

    def __post_init__(self) -> None:
        if self.source_digest is None:
            object.__setattr__(self, "source_digest", self.want.digest)


def bytes_on_disk(local_dir: Path) -> int:
    """Bytes of regular files under `local_dir` (in-progress `.incomplete` files included)."""
    total = 0
    meta = os.path.join(str(local_dir), ".cache")
    for dirpath, _dirs, files in os.walk(local_dir):
        in_meta = dirpath == meta or dirpath.startswith(meta + os.sep)
        for fn in files:
            if in_meta and not fn.endswith(".incomplete"):
                continue  # bookkeeping, not model bytes
            try:
                st = os.lstat(os.path.join(dirpath, fn))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def stored_token() -> str | None:
    """The token huggingface_hub would use (HF_TOKEN, or the one `hf auth login` stored)."""
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token()


def matches(path: str, patterns: list[str] | None) -> bool:
    """huggingface_hub's allow_patterns: fnmatch globs, a trailing "/" meaning the folder."""
    if not patterns:
        return True
    return any(fnmatch.fnmatch(path, p + "*" if p.endswith("/") else p) for p in patterns)


class Hub:
    """One pull's conversation with the Hub (blocking; run in a worker thread)."""

    def __init__(
        self,
        endpoint: str | None,
        token: str | None,
        cancel: CancelToken,
        *,
        pace: Callable[[int], None] | None = None,
        waiting: Waiting | None = None,
        peers: Peers | None = None,
    ) -> None:
        import requests

        self.peers = peers  # asked for each file before the Hub
        self.endpoint = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        self.host = urlsplit(self.endpoint).netloc
        self.token = token
        self.cancel = cancel
        self.pace = pace
        self.waiting = waiting
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "solar-host"

    def close(self) -> None:
        self.session.close()

    # --- requests ------------------------------------------------------------------------------

    def _send(self, method: str, url: str, **kw: Any) -> Any:
        """One request, its 429/503 answers waited out; transport failures as a 502."""
        import requests

        headers = dict(kw.pop("headers", None) or {})
        # The token goes to the Hub only: requests drops it on a redirect to another host.
        if self.token and urlsplit(url).netloc == self.host:
            headers["Authorization"] = f"Bearer {self.token}"
        kw.setdefault("timeout", (CONNECT_TIMEOUT_S, READ_TIMEOUT_S))

        def once() -> Any:
            if self.cancel.is_set():
                raise Cancelled()
            try:
                return self.session.request(method, url, headers=headers, stream=True, **kw)
            except requests.exceptions.RequestException as err:
                if self.cancel.is_set():
                    raise Cancelled() from err
                raise Interrupted(f"HuggingFace Hub unreachable: {_first_line(err)}") from None

        return send_politely(once, f"The Hub ({self.host})", self.cancel, self.waiting)

    def _api(self, url: str) -> tuple[Any, Any]:
        """GET an API answer: (its JSON, the response), read whole within MAX_METADATA_BYTES."""
        resp = self._send("GET", url)
        try:
            _refuse(resp, url)
            path = urlsplit(url).path
            declared = resp.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > MAX_METADATA_BYTES:
                raise _too_big(path)
            guard = LowSpeedGuard(f"The Hub's answer for {path}", MIN_RATE_BPS, RATE_WINDOW_S)
            data = bytearray()
            forget = self.cancel.on_cancel(resp.close)
            try:
                for chunk in resp.iter_content(64 << 10):
                    data += chunk
                    guard.feed(len(chunk))
                    if len(data) > MAX_METADATA_BYTES:
                        raise _too_big(path)
            except PullError:
                raise
            except Exception as err:
                if self.cancel.is_set():
                    raise Cancelled() from err
                raise PullError(
                    502, "source_unreachable", f"HuggingFace Hub unreachable: {_first_line(err)}"
                ) from None
            finally:
                forget()
        finally:
            resp.close()
        try:
            return json.loads(data), resp
        except (ValueError, RecursionError):
            raise PullError(
                502, "model_pull_failed", f"The Hub sent an unreadable answer for {path}"
            ) from None

    # --- the snapshot --------------------------------------------------------------------------

    def commit(self, repo_id: str, revision: str = "main") -> str:
        body, _ = self._api(f"{self.endpoint}/api/models/{repo_id}/revision/{quote(revision)}")
        sha = body.get("sha") if isinstance(body, dict) else None
        if not isinstance(sha, str) or not sha.isalnum():
            raise PullError(502, "model_pull_failed", f"The Hub named no commit for {repo_id}")
        return sha

    def listing(self, repo_id: str, commit: str, patterns: list[str] | None) -> list[HubFile]:
        """The repository's files at `commit` that `patterns` select, with their digests."""
        url: str | None = f"{self.endpoint}/api/models/{repo_id}/tree/{commit}?recursive=true"
        out: list[HubFile] = []
        pages = 0
        while url:
            if pages >= MAX_LISTING_PAGES:
                raise PullError(
                    502,
                    "model_pull_failed",
                    f"The Hub's file listing of this repository ran past {MAX_LISTING_PAGES} "
                    f"pages ({MAX_LISTING_PAGES * 1000} files); refusing to list further",
                )
            pages += 1
            items, resp = self._api(url)
            if not isinstance(items, list):
                raise PullError(502, "model_pull_failed", "The Hub sent a malformed file listing")
            for item in items:
                f = _hub_file(item)
                if f is not None and matches(f.path, patterns):
                    out.append(f)
            url = resp.links.get("next", {}).get("url")
        return out

    def check_metadata(self, repo_id: str, commit: str, f: HubFile) -> None:
        """The file's own metadata (HEAD of its resolve URL) must agree with the listing."""
        url = self._resolve_url(repo_id, commit, f.path)
        identity = {"Accept-Encoding": "identity"}
        resp = self._send("HEAD", url, allow_redirects=False, headers=identity)
        resp.close()
        if resp.status_code >= 400:
            _refuse(resp, url)
        h = resp.headers
        etag = _etag(h.get("X-Linked-Etag") or h.get("ETag") or "")
        size = h.get("X-Linked-Size") or (None if resp.is_redirect else h.get("Content-Length"))
        if size is not None and size.isdigit() and int(size) != f.want.size:
            raise PullError(
                502,
                "model_pull_failed",
                f"The Hub's metadata of {f.path} disagree: the listing says {f.want.size} bytes, "
                f"the file {size}",
            )
        if etag and len(etag) == len(f.want.hex) and etag != f.want.hex:
            raise PullError(
                502,
                "model_pull_failed",
                f"The Hub's metadata of {f.path} disagree: the listing says {f.want.digest}, "
                f"the file {etag}",
            )

    def fetch(
        self, repo_id: str, commit: str, f: HubFile, local_dir: Path, counter: ByteCounter
    ) -> str:
        """Put `f` at `local_dir/<path>`, checked; return its sha256 hex. A file already there
        that matches the digest (kept from an interrupted pull, or linked from the model on
        disk) is kept; any other is fetched again: from a peer that has it, else the Hub."""
        final = local_dir / f.path
        found = check_in_place(final, f.want)
        if found is not None:
            counter.add(f.want.size)
            return found
        final.unlink(missing_ok=True)
        url = self._resolve_url(repo_id, commit, f.path)
        from huggingface_hub import constants

        timeout = (CONNECT_TIMEOUT_S, float(constants.HF_HUB_DOWNLOAD_TIMEOUT))
        if self.peers is not None and swarm.applies(self.peers, f.want):
            # Shared piece by piece with the peers that pull it too (and those that have it).
            def piece(start: int, end: int) -> Any:
                return self._range(url, f, start, end, timeout)

            part = local_dir / INCOMPLETE_DIR / f"{f.path}.swarm"
            return swarm.Swarm(
                self.peers, f.want, part, final, local_dir, counter, piece, self.pace
            ).run()
        part = local_dir / INCOMPLETE_DIR / f"{f.path}.incomplete"
        if self.peers is not None:
            got = self.peers.fetch(f.want, part, final, counter)
            if got is not None:
                return got[1]
        if self.waiting is not None:
            self.waiting.origin = "source"
        before = part.stat().st_size if part.is_file() else 0

        def send(headers: dict[str, str]) -> Any:
            resp = self._send("GET", url, headers=headers, timeout=timeout)
            if resp.status_code in (200, 206):
                return resp
            resp.close()
            _refuse(resp, url)
            raise PullError(
                502, "source_unreachable", f"The Hub answered {resp.status_code} for {f.path}"
            )

        guard = LowSpeedGuard(f"The Hub's body of {f.path}", MIN_RATE_BPS, RATE_WINDOW_S)
        sha = fetch_file(send, f.want, part, final, counter, self.cancel, guard, self.pace)
        if self.waiting is not None:
            self.waiting.count("source", max(0, f.want.size - before))
        return sha

    def _range(self, url: str, f: HubFile, start: int, end: int, timeout: Any) -> Any:
        """An open response of bytes `start`..`end` of `f` (a piece of a swarm)."""
        resp = self._send("GET", url, headers={"Range": f"bytes={start}-{end}"}, timeout=timeout)
        if swarm.range_usable(resp, start, f"The Hub's range of {f.path}"):
            return resp
        resp.close()
        _refuse(resp, url)
        raise PullError(
            502,
            "source_unreachable",
            f"The Hub answered {resp.status_code} to a range of {f.path} (the pieces of a "
            "swarm need ranges)",
        )

    def _resolve_url(self, repo_id: str, commit: str, path: str) -> str:
        return f"{self.endpoint}/{repo_id}/resolve/{commit}/{quote(path)}"


def files_of_record(record: dict[str, Any], patterns: list[str] | None) -> list[HubFile]:
    """The files of a peer's record of a snapshot that `patterns` select (peers.snapshot)."""
    out = []
    for item in record.get("files") or []:
        if not isinstance(item, dict):
            continue
        path, size, digest = item.get("path"), item.get("size_bytes"), item.get("digest")
        if not (isinstance(path, str) and isinstance(size, int) and isinstance(digest, str)):
            raise PullError(
                502, "model_pull_failed", f"A peer listed a malformed file: {item!r:.200}"
            )
        if not digest.startswith("sha256:") or len(digest) != 71:
            raise PullError(
                502, "model_pull_failed", f"A peer listed {path} with digest {digest!r:.80}"
            )
        path = safe_relative(path)
        if matches(path, patterns):
            published = item.get("source_digest")
            published = published if isinstance(published, str) else None
            out.append(HubFile(path, Want(path, size, digest), published))
    return out


def _hub_file(item: Any) -> HubFile | None:
    """A listing entry as a HubFile (None for a directory); a malformed one is a 502."""
    if not isinstance(item, dict) or item.get("type") != "file":
        return None
    path, size, lfs = item.get("path"), item.get("size"), item.get("lfs")
    if not isinstance(path, str) or not isinstance(size, int) or size < 0:
        raise PullError(502, "model_pull_failed", f"The Hub listed a malformed file: {item!r:.200}")
    path = safe_relative(path)
    if isinstance(lfs, dict) and isinstance(lfs.get("oid"), str):
        digest, lfs_size = f"sha256:{lfs['oid']}", lfs.get("size", size)
        if lfs_size != size:
            raise PullError(
                502, "model_pull_failed", f"The Hub listed {path} at {size} and {lfs_size} bytes"
            )
    elif isinstance(item.get("oid"), str):
        digest = f"gitsha1:{item['oid']}"
    else:
        raise PullError(502, "model_pull_failed", f"The Hub listed {path} with no digest")
    hexd = digest.split(":", 1)[1]
    if not all(c in "0123456789abcdef" for c in hexd) or len(hexd) not in (40, 64):
        raise PullError(502, "model_pull_failed", f"The Hub listed {path} with digest {digest}")
    return HubFile(path, Want(path, size, digest))


def _refuse(resp: Any, url: str) -> None:
    """Raise the contract's error for a Hub answer that is not a success."""
    status = resp.status_code
    if status < 400:
        return
    code = resp.headers.get("X-Error-Code", "")
    what = urlsplit(url).path
    if code == "GatedRepo":
        raise PullError(401, "auth_failed", f"Access to the repository is restricted ({what})")
    if status in (401, 403):
        raise PullError(401, "auth_failed", f"Authentication failed: the Hub answered {status}")
    if status == 404:
        if code in ("RepoNotFound", ""):
            raise PullError(404, "not_found", f"Repository not found: {what}")
        raise PullError(404, "not_found", f"{code}: {what}")
    raise PullError(502, "source_unreachable", f"HuggingFace Hub error: {status} for {what}")


def _etag(value: str) -> str:
    return value.strip().removeprefix("W/").strip('"')


def _too_big(path: str) -> PullError:
    return PullError(
        502,
        "model_pull_failed",
        f"The Hub sent an answer over {MAX_METADATA_BYTES >> 20} MiB for {path}; refusing to "
        "read it",
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__

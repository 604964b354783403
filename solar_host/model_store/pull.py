"""The pull request, pull errors, and the pure checks and file helpers a pull uses.

Nothing here does network I/O: `huggingface.py` and `oci.py` download, `service.py` orchestrates.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from solar_host.model_store.sources import (
    HF_PREFIX,
    REPO_RE,
    SourceError,
    repo_base_uri,
    repo_subpath,
    slug_for,
)


class PullError(Exception):
    """A pull failed; carries the flat error body of the contract (error, detail, status)."""

    def __init__(self, status_code: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.error = error
        self.detail = detail

    def body(self, source_uri: str) -> dict[str, Any]:
        return {
            "error": self.error,
            "detail": self.detail,
            "source_uri": source_uri,
            "status_code": self.status_code,
        }


class Interrupted(PullError):
    """A transfer cut short by the network (a dropped connection, a read that timed out): what
    arrived is kept, and the transfer may be resumed from it."""

    def __init__(self, detail: str) -> None:
        super().__init__(502, "source_unreachable", detail)


class LowSpeedGuard:
    """curl's --speed-limit/--speed-time for one response body: a body that keeps coming, but
    at under `min_bps` bytes/s over `window_s` seconds, fails the pull.

    A read timeout only catches a peer that sends nothing: one that sends a byte every few
    seconds (a trickle) never trips it and holds the pull, and its worker thread, for days.
    """

    def __init__(
        self,
        what: str,
        min_bps: float,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.min_bps = min_bps
        self.window_s = window_s
        self._clock = clock
        self._start = clock()
        self._bytes = 0

    def feed(self, n: int) -> None:
        """Count `n` bytes received; raise a 502 when the window closed under the rate."""
        self._bytes += n
        now = self._clock()
        elapsed = now - self._start
        if elapsed < self.window_s:
            return
        if self._bytes < self.min_bps * elapsed:
            raise PullError(
                502,
                "source_unreachable",
                f"{self.what} stalled: {self._bytes} bytes in {elapsed:.0f} s, under "
                f"{self.min_bps:.0f} bytes/s; giving up",
            )
        self._start, self._bytes = now, 0


def invalid(detail: str) -> PullError:
    return PullError(400, "invalid_request", detail)


def mismatch(detail: str) -> PullError:
    return PullError(422, "source_mismatch", detail)


class PullRequest(BaseModel):
    """Body of POST /models/pull (control-contract 3.7). Unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore")

    source: Literal["harbor", "huggingface"]
    source_uri: str = Field(min_length=1, max_length=2048)
    harbor_ref: str | None = None
    model_id: str | None = None
    digest: str | None = None
    size_bytes: int | None = Field(default=None, ge=0)
    category: str | None = None
    name: str | None = None
    version: str | None = None
    checksum: str | None = None
    metadata: dict[str, Any] | None = None
    backend_type: str | None = None
    file_filters: list[str] | None = None

    @model_validator(mode="after")
    def _required_per_source(self) -> PullRequest:
        if self.source == "harbor" and not (self.harbor_ref or "").strip():
            raise ValueError("harbor_ref is required for harbor source")
        if self.source == "huggingface" and not (self.model_id or "").strip():
            raise ValueError("model_id is required for huggingface source")
        if self.file_filters is not None and any(
            not isinstance(f, str) or not f.strip() or "\x00" in f for f in self.file_filters
        ):
            raise ValueError("file_filters must be non-empty glob strings")
        return self

    @property
    def base_uri(self) -> str:
        return repo_base_uri(self.source_uri)

    @property
    def subpath(self) -> str:
        return repo_subpath(self.source_uri)

    @property
    def filters(self) -> list[str] | None:
        """Allow-patterns for HF (sorted, unique); other sources ignore filters."""
        if self.source != "huggingface" or not self.file_filters:
            return None
        return sorted(set(self.file_filters))

    @property
    def select_gguf(self) -> bool:
        return self.backend_type == "llamacpp" and not self.subpath


# A file name holds 255 bytes; a model directory's name also gets ".kept-<time>" (22 bytes)
# when files the store did not record are moved aside for it.
MAX_NAME_BYTES = 255
MAX_SLUG_BYTES = MAX_NAME_BYTES - 32


def check_request(req: PullRequest, harbor_host: str | None) -> str:
    """Validate the request's URIs against each other; return the slug.

    Refuses (422) a `model_id`/`harbor_ref` naming another artifact than `source_uri`, so a pull
    can never record one artifact under another's name.
    """
    uri = req.source_uri
    if req.source == "harbor":
        m = REPO_RE.match(uri)
        if not m:
            raise invalid(
                f"source_uri '{uri}' does not match source type 'harbor' "
                "(expected 'repo://<name>:<version>[/<subpath>]')"
            )
        sub = repo_subpath(uri)
        if (sub and any(p in ("", ".", "..") for p in sub.split("/"))) or "\\" in sub:
            raise invalid(f"subpath '{sub}' of source_uri must be a plain relative path")
        _registry, repo, tag, _digest = split_ref(req.harbor_ref or "", harbor_host)
        name = repo.rsplit("/", 1)[-1]
        if name.lower() != m["name"].lower():
            raise mismatch(
                f"harbor_ref '{req.harbor_ref}' names artifact '{name}', "
                f"but source_uri names '{m['name']}'"
            )
        if tag is not None and tag != m["version"]:
            raise mismatch(
                f"harbor_ref '{req.harbor_ref}' has tag '{tag}', "
                f"but source_uri names version '{m['version']}'"
            )
    else:
        if not uri.startswith(HF_PREFIX):
            raise invalid(
                f"source_uri '{uri}' does not match source type 'huggingface' "
                f"(expected prefix '{HF_PREFIX}')"
            )
        model_id = (req.model_id or "").strip().strip("/")
        if uri[len(HF_PREFIX) :].strip("/") != model_id:
            raise mismatch(
                f"model_id '{req.model_id}' does not match source_uri '{uri}' "
                f"(expected '{HF_PREFIX}{model_id}')"
            )
        _check_repo_id(model_id)
    try:
        slug = slug_for(req.base_uri)
    except SourceError as err:
        raise invalid(str(err)) from None
    if len(os.fsencode(slug)) > MAX_SLUG_BYTES:
        raise invalid(
            f"source_uri '{uri}' names a model directory of {len(os.fsencode(slug))} bytes; "
            f"at most {MAX_SLUG_BYTES} fit a file name beside the host's own suffixes"
        )
    for part in repo_subpath(uri).split("/"):
        if len(os.fsencode(part)) > MAX_NAME_BYTES:
            raise invalid(f"subpath of source_uri has a part over {MAX_NAME_BYTES} bytes")
    return slug


def _check_repo_id(model_id: str) -> None:
    """Refuse, naming model_id, what the Hub client would refuse in the middle of the pull
    (a 500 then, with an empty .partial directory left behind)."""
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # without the client the pull fails anyway, and says why
        return
    try:
        validate_repo_id(model_id)
    except HFValidationError as err:
        raise invalid(f"model_id '{model_id}' is not a Hub repository id: {err}") from None


_REF_RE = re.compile(
    r"^(?P<repo>[A-Za-z0-9]+(?:[._/-]+[A-Za-z0-9]+)*)(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[a-f0-9]{64}))?$"
)


def split_ref(ref: str, harbor_host: str | None) -> tuple[str | None, str, str | None, str | None]:
    """`[registry/]project/name[:tag][@digest]` -> (registry, repository, tag, digest).

    A registry other than HARBOR_URL's host is refused: Harbor credentials go only to Harbor.
    """
    ref = ref.strip()
    registry = None
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, ref = first, rest
        if harbor_host is not None and registry != harbor_host:
            raise mismatch(
                f"harbor_ref '{registry}/{ref}' names registry '{registry}', "
                f"but HARBOR_URL is '{harbor_host}'"
            )
    m = _REF_RE.match(ref)
    if not m:
        raise invalid(f"harbor_ref '{ref}' is not a valid OCI reference")
    if not m["tag"] and not m["digest"]:
        raise invalid(f"harbor_ref '{ref}' names neither a tag nor a digest")
    return registry, m["repo"], m["tag"], m["digest"]


# --- files --------------------------------------------------------------------------------------

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
SKIP_DIRS = {".cache"}  # huggingface_hub's local_dir metadata


def inventory(root: Path) -> list[tuple[str, int]]:
    """(relative posix path, size) of every regular file under `root`, sorted; [] if no dir."""
    out: list[tuple[str, int]] = []
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for fn in filenames:
            p = Path(dirpath) / fn
            try:
                if p.is_symlink() or not p.is_file():
                    continue
                out.append((p.relative_to(root).as_posix(), p.stat().st_size))
            except OSError:
                continue
    out.sort()
    return out


def sync_tree(root: Path) -> None:
    """fsync every regular file and directory under `root` (symlinks are not followed).

    Run before a finished tree is renamed into place: a model whose name survived a crash must
    have whole files. Files already fsynced (OCI blobs) cost almost nothing here; the others
    (unpacked or copied layers, HuggingFace downloads) are flushed now.
    """
    for dirpath, _dirnames, filenames in os.walk(root):
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            _fsync_path(p, os.O_RDONLY)
        _fsync_path(dirpath, os.O_RDONLY | os.O_DIRECTORY)


def _fsync_path(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def largest_gguf(root: Path) -> Path | None:
    """The model file of a llama.cpp artifact: the largest *.gguf (root first, then anywhere),
    the trailing shards of a split GGUF dropped so the first shard is what llama.cpp opens."""
    for candidates in (
        [p for p in root.glob("*.gguf") if p.is_file() and not p.is_symlink()],
        [p for p in root.rglob("*.gguf") if p.is_file() and not p.is_symlink()],
    ):
        if not candidates:
            continue
        firsts = [p for p in candidates if not _is_trailing_shard(p)]
        pool = firsts or candidates
        return max(pool, key=lambda p: (p.stat().st_size, str(p)))
    return None


def _is_trailing_shard(p: Path) -> bool:
    m = _SHARD.search(p.name)
    return bool(m) and int(m.group(1)) != 1


def safe_relative(title: str) -> str:
    """A layer title must be a plain relative POSIX path (no `..`, no absolute, no drive)."""
    if not title or "\x00" in title or "\\" in title:
        raise PullError(502, "model_pull_failed", f"artifact file name {title!r} is not allowed")
    p = PurePosixPath(title)
    if (
        p.is_absolute()
        or re.match(r"^[A-Za-z]:", title)
        or not p.parts
        or any(x in ("..", ".") for x in p.parts)
    ):
        raise PullError(
            502, "model_pull_failed", f"artifact file name {title!r} escapes the model directory"
        )
    if any(len(os.fsencode(x)) > 255 for x in p.parts):
        raise PullError(
            502, "model_pull_failed", f"artifact file name {title[:80]!r}... is too long"
        )
    return p.as_posix()


def filters_satisfied(stored: list[str] | None, requested: list[str] | None) -> bool:
    """A full snapshot satisfies anything; a filtered one only requests within its filters."""
    if stored is None:
        return True
    if requested is None:
        return False
    return set(requested) <= set(stored)

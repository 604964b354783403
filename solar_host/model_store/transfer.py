"""One file fetched over HTTP, resumable and checked: the mechanism every source shares.

A file is written to a `.part` (or `.incomplete`) beside where it goes, hashed as it streams,
and renamed to its final name only once its size and the digest its source publishes match
(fsync before the rename: a name that survived a crash never points at data that did not).
A part left by an interrupted pull (a killed host, a dropped connection) is hashed again and
continued with an HTTP Range request, so only what never arrived is fetched; a source that
ignores the Range sends the whole file, and the part starts over. A mismatch removes the part
and fails the pull naming the file.

Digests are `sha256:<hex>` (an OCI layer, a Hub LFS file) or `gitsha1:<hex>` (a Hub file kept
in git: the sha1 of its git blob). The sha256 of every file is computed on the way whatever
its source publishes, and returned: it is what the manifest records and `verify` checks.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solar_host.model_store import streaming
from solar_host.model_store.progress import ByteCounter
from solar_host.model_store.pull import Interrupted, LowSpeedGuard, PullError
from solar_host.model_store.streaming import Cancelled, CancelToken

log = logging.getLogger(__name__)

READ_BLOCK = 4 << 20  # reading a part or a file back to hash it

# send(headers) -> an open streamed response, already past the source's 429/503 waits and
# its status checks: 200 or 206.
Send = Callable[[dict[str, str]], Any]


@dataclass(frozen=True)
class Want:
    """A file as its source publishes it."""

    name: str  # how messages name it (its path in the model, or the layer's title)
    size: int
    digest: str  # "sha256:<hex>" or "gitsha1:<hex>"

    @property
    def algorithm(self) -> str:
        return self.digest.split(":", 1)[0]

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]


class Hashes:
    """The published digest's hash and a sha256 (the same one when it is a sha256), fed
    together: one pass over the bytes gives both."""

    def __init__(self, want: Want) -> None:
        self.sha256 = hashlib.sha256()
        if want.algorithm == "sha256":
            self.published = self.sha256
        elif want.algorithm == "gitsha1":
            self.published = hashlib.sha1(b"blob %d\0" % want.size, usedforsecurity=False)
        else:
            raise PullError(
                502, "model_pull_failed", f"{want.name}: unsupported digest {want.digest!r}"
            )

    def update(self, data: Any) -> None:
        self.sha256.update(data)
        if self.published is not self.sha256:
            self.published.update(data)

    def matches(self, want: Want) -> bool:
        return self.published.hexdigest() == want.hex


def hash_file(path: Path, hashes: Any, limit: int | None = None) -> int:
    """Feed the bytes of `path` (the first `limit`) to `hashes`; return how many."""
    done = 0
    with open(path, "rb") as f:
        while limit is None or done < limit:
            block = f.read(READ_BLOCK if limit is None else min(READ_BLOCK, limit - done))
            if not block:
                break
            hashes.update(block)
            done += len(block)
    return done


def hash_sha256(path: Path) -> str:
    h = hashlib.sha256()
    hash_file(path, h)
    return h.hexdigest()


def check_in_place(path: Path, want: Want) -> str | None:
    """The sha256 of `path` when it is `want` (size and published digest), else None."""
    try:
        if path.is_symlink() or path.stat().st_size != want.size:
            return None
    except OSError:
        return None
    hashes = Hashes(want)
    hash_file(path, hashes)
    return hashes.sha256.hexdigest() if hashes.matches(want) else None


# A transfer cut short by the network is resumed from what arrived this many times more, after
# 1, 2, 4 ... seconds, before the pull fails (its part stays for the next pull to resume).
RESUMES = 3
RESUME_BACKOFF_S = 1.0


def fetch_file(
    send: Send,
    want: Want,
    part: Path,
    final: Path,
    counter: ByteCounter,
    cancel: CancelToken,
    guard: LowSpeedGuard,
    pace: Callable[[int], None] | None = None,
    resumes: int = RESUMES,
) -> str:
    """Fetch `want` to `final` through `part`, resuming the part; return its sha256 hex.

    A dropped connection is resumed from the bytes on disk (`resumes` times at most); a file
    already at `final` is taken as is: only a checked file is renamed there.
    """
    backoff = RESUME_BACKOFF_S
    for attempt in range(resumes + 1):
        done = counter.done
        try:
            return _fetch_once(send, want, part, final, counter, cancel, guard, pace)
        except Interrupted as err:
            if attempt == resumes or cancel.is_set():
                raise
            counter.set(done)  # what the part holds is counted again when it is resumed
            log.warning("%s: %s; resuming in %.0f s", want.name, err.detail, backoff)
        if cancel.event.wait(backoff):
            raise Cancelled()
        backoff *= 2
    raise AssertionError("unreachable")


def _fetch_once(
    send: Send,
    want: Want,
    part: Path,
    final: Path,
    counter: ByteCounter,
    cancel: CancelToken,
    guard: LowSpeedGuard,
    pace: Callable[[int], None] | None = None,
) -> str:
    if final.is_file() and final.stat().st_size == want.size:
        counter.add(want.size)
        return want.hex if want.algorithm == "sha256" else hash_sha256(final)
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.is_file() else 0
    if have > want.size:
        part.unlink()
        have = 0
    hashes = Hashes(want)
    if have:
        have = hash_file(part, hashes, have)
    if have and have == want.size:
        # Whole but not renamed (interrupted between the last byte and the rename): a Range
        # request would be refused (416), so check it here and keep it or start over.
        if hashes.matches(want):
            streaming.durable_rename(part, final)
            counter.add(have)
            return hashes.sha256.hexdigest()
        part.unlink()
        have, hashes = 0, Hashes(want)
    resp = send({"Range": f"bytes={have}-"} if have else {})
    forget = cancel.on_cancel(lambda: streaming.abort_response(resp))
    fd = -1
    try:
        if have and not _continues(resp, have, want.name):
            have, hashes = 0, Hashes(want)  # the source sent the whole file: start over
        counter.add(have)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
        got = have + streaming.stream_body(
            resp, fd, have, want.size - have, hashes, counter, cancel, guard, pace
        )
        if cancel.is_set():
            raise Cancelled()
        if got != want.size or not hashes.matches(want):
            os.close(fd)
            fd = -1
            part.unlink(missing_ok=True)
            raise PullError(
                502,
                "model_pull_failed",
                f"Pulled artifact integrity check failed: {want.name}: digest mismatch "
                f"(got {want.algorithm}:{hashes.published.hexdigest()} / {got} bytes, "
                f"want {want.digest} / {want.size} bytes); the file was removed",
            )
        streaming.make_durable(fd)
    finally:
        if fd >= 0:
            os.close(fd)
        forget()
        resp.close()
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, final)
    return hashes.sha256.hexdigest()


def _continues(resp: Any, have: int, name: str) -> bool:
    """Whether `resp` is the rest of the file from byte `have` (a 206 starting there); False
    when it is the whole file (a 200: the Range was ignored)."""
    if resp.status_code != 206:
        return False
    start = (resp.headers.get("Content-Range") or "").removeprefix("bytes ").split("-", 1)[0]
    if start.strip() and not (start.strip().isdigit() and int(start) == have):
        raise PullError(
            502,
            "model_pull_failed",
            f"{name}: asked for the bytes from {have}, the source sent {start.strip()}-",
        )
    return True

"""A file cut into pieces, what this host has of each, and what it may serve its peers.

A swarm (swarm.py) fetches a file of many pieces from the source and from the other hosts that
pull it at the same time. A piece is PIECE_BYTES of the file (the last one shorter), numbered
from 0; a file is named by the digest its source publishes. `Board` is the one record, per
host, of the files its pulls are fetching piece by piece: the peer routes read it to tell other
hosts which pieces they may take (`answer`) and where to read one (`piece_at`).

A host offers its peers every piece it has written, as soon as it is written: a piece it took
from another peer is passed on (marked `relayed` in its map until the whole file matched the
source's digest), so pieces spread from every host that has them, not only from the one that
fetched each from the source, and a host that has the whole file is not the one uploader of a
fleet that joins later. Nothing a peer sends is trusted: the digest decides (swarm.py).

`Record` is the same knowledge on disk, beside the part (`<part>.pieces`): which pieces are
written, and where each came from, so a pull killed in the middle resumes with the pieces it
had, and a digest mismatch can still tell which peer sent what.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PIECE_BYTES = 4 << 20  # every host of a swarm must use the same; a map of another is ignored
SOURCE = "source"  # the origin of a piece fetched from the source (else the peer's URL)
MAX_PIECES = 1 << 22  # 16 TiB at 4 MiB: a map announcing more is refused


def piece_count(size: int, piece_bytes: int = PIECE_BYTES) -> int:
    return max(1, -(-size // piece_bytes))


def piece_span(index: int, size: int, piece_bytes: int = PIECE_BYTES) -> tuple[int, int]:
    """(offset, length) of piece `index` of a file of `size` bytes."""
    start = index * piece_bytes
    return start, max(0, min(piece_bytes, size - start))


class Bitmap:
    """One bit per piece (bit i: byte i >> 3, mask 1 << (i & 7)); base64 on the wire."""

    def __init__(self, n: int, data: bytes | None = None) -> None:
        self.n = n
        self.bits = bytearray(data) if data is not None else bytearray((n + 7) // 8)

    def has(self, i: int) -> bool:
        return bool(self.bits[i >> 3] & (1 << (i & 7)))

    def set(self, i: int) -> None:
        self.bits[i >> 3] |= 1 << (i & 7)

    def count(self) -> int:
        return sum(bin(b).count("1") for b in self.bits)

    def full(self) -> bool:
        return self.count() == self.n

    @classmethod
    def all(cls, n: int) -> Bitmap:
        m = cls(n)
        for i in range(n):
            m.set(i)
        return m

    def encode(self) -> str:
        return base64.b64encode(bytes(self.bits)).decode()

    @classmethod
    def decode(cls, text: str, n: int) -> Bitmap:
        """A peer's bitmap of `n` pieces; ValueError when it is not one."""
        data = base64.b64decode(text.encode(), validate=True)
        if len(data) != (n + 7) // 8:
            raise ValueError(f"a bitmap of {n} pieces is {(n + 7) // 8} bytes, not {len(data)}")
        return cls(n, data)


@dataclass
class Holding:
    """What this host has of one file a pull is fetching in pieces (owned by that pull's
    swarm; read by the peer routes under the board's lock)."""

    digest: str
    size: int
    path: Path  # the part while pieces arrive, the file once it is whole and checked
    partial: Path  # the pull's partial directory (what `Board.forget_under` drops)
    offered: Bitmap  # pieces peers may take (see the module's docstring)
    fetching: set[int] = field(default_factory=set)  # taken from the source right now
    relayed: Bitmap | None = None  # offered pieces taken from peers, not checked yet
    incoming: set[int] = field(default_factory=set)  # coming from peers right now

    def __post_init__(self) -> None:
        if self.relayed is None:
            self.relayed = Bitmap(self.offered.n)


class Board:
    """This host's files in flight, piece by piece (one per host, in its model store)."""

    def __init__(self) -> None:
        # How the hosts of a swarm tell one another apart and agree on who fetches which piece
        # from the source: a random id per process (a URL is how one host names another, not
        # necessarily how that one is named by the rest).
        self.host_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._files: dict[str, Holding] = {}

    def hold(self, holding: Holding) -> None:
        with self._lock:
            self._files[holding.digest] = holding

    def update(self, digest: str, **changes: Any) -> None:
        """Change what one file offers (offered=, fetching=, path=), atomically for readers."""
        with self._lock:
            h = self._files.get(digest)
            if h is None:
                return
            for k, v in changes.items():
                setattr(h, k, v)

    def offer(self, digest: str, index: int, *, relayed: bool = False) -> None:
        with self._lock:
            h = self._files.get(digest)
            if h is not None:
                h.offered.set(index)
                if relayed and h.relayed is not None:
                    h.relayed.set(index)

    def forget_under(self, partial: Path) -> None:
        """Drop the files of the pull whose partial directory is `partial` (it ended)."""
        with self._lock:
            for d in [d for d, h in self._files.items() if h.partial == partial]:
                del self._files[d]

    def answer(self, digest: str) -> dict[str, Any] | None:
        """The piece map peers are told for `digest`; None when no pull here fetches it."""
        with self._lock:
            h = self._files.get(digest)
            if h is None:
                return None
            m = piece_map(self.host_id, h.size, h.offered, sorted(h.fetching), h.relayed)
            m["incoming"] = sorted(h.incoming)
            return m

    def piece_at(self, digest: str, index: int) -> tuple[Path, int, int] | None:
        """(file, offset, length) of a piece this host offers; None when it does not."""
        with self._lock:
            h = self._files.get(digest)
            if h is None or not 0 <= index < h.offered.n or not h.offered.has(index):
                return None
            return (h.path, *piece_span(index, h.size))


def piece_map(
    host_id: str,
    size: int,
    offered: Bitmap,
    fetching: list[int],
    relayed: Bitmap | None = None,
) -> dict[str, Any]:
    return {
        "relayed": (relayed or Bitmap(offered.n)).encode(),
        "host_id": host_id,
        "size_bytes": size,
        "piece_bytes": PIECE_BYTES,
        "pieces": offered.n,
        "have": offered.encode(),
        "complete": offered.full(),
        "fetching": fetching,
    }


# --- the record beside a part -------------------------------------------------------------------


class Record:
    """Which pieces of a part are written and where each came from (`<part>.pieces`, JSON)."""

    def __init__(self, path: Path, digest: str, size: int) -> None:
        self.path = path
        self.digest = digest
        self.size = size
        self.n = piece_count(size)
        self.origins: list[str | None] = [None] * self.n

    def load(self) -> None:
        """The pieces a killed pull left (nothing when the record is not this file's)."""
        try:
            data = json.loads(self.path.read_text())
            if (data["digest"], data["size_bytes"], data["piece_bytes"]) != (
                self.digest,
                self.size,
                PIECE_BYTES,
            ):
                return
            names: list[str] = data["origins"]
            marks: str = data["pieces"]
            if len(marks) != self.n:
                return
            self.origins = [None if c == "." else names[int(c, 36)] for c in marks]
        except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
            if self.path.exists():
                log.warning("%s is not a piece record (%s); the file starts over", self.path, err)

    def save(self) -> None:
        """Write the record (the caller made the pieces it names durable first)."""
        names = sorted({o for o in self.origins if o is not None})
        if len(names) > 36:  # one character per piece: the rest are fetched again on resume
            names = names[:36]
        index = {name: i for i, name in enumerate(names)}
        marks = "".join(
            "." if o is None or o not in index else "0123456789abcdefghijklmnopqrstuvwxyz"[index[o]]
            for o in self.origins
        )
        body = {
            "digest": self.digest,
            "size_bytes": self.size,
            "piece_bytes": PIECE_BYTES,
            "origins": names,
            "pieces": marks,
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

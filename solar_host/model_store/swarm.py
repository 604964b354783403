"""One file fetched by a swarm: the hosts that pull it at the same time share its pieces.

When tens of hosts want one model at once, nobody has it yet: asking peers for the whole file
(peers.py) finds none, and each host would take it all from the source. Here the file is cut
into pieces (pieces.py) and the hosts pulling it share them as they arrive:

- The swarm of a file is this host and the peers (MODEL_PEERS) that answer a piece map for its
  digest: a pull fetching it now, or a host that has it whole. The maps are asked again every
  POLL_S; a peer that stops answering leaves the swarm.
- Each piece nobody offers has an owner, the same for every host: the member at `index mod N`
  of the swarm's host ids, sorted. The owner fetches it from the source (one piece at a time,
  announced in its map as `fetching`); the others wait for it and take it from whoever offers
  it. A piece whose owner makes no progress for STEAL_AFTER_S is fetched from the source by
  whoever needs it, and an owner that leaves the swarm leaves its pieces to the next owner. No
  piece is claimed from the source before the second round of maps, so hosts that start within
  POLL_S of one another see one another before they split the work: without faults the source
  serves each piece once.
- Pieces others offer are taken rarest first, from a holder chosen among those this host asks
  least (then the one with the fewest pieces: a host with the whole file gives what only it
  has), at most PER_HOLDER at once each. A host offers every piece it has written, as soon as
  it is written: every host uploads, none is the bottleneck, also when one host has the file
  and many join it.
- Trust: a piece from a peer is never trusted. The whole file is hashed (in piece order, as
  the pieces arrive) and must match the digest the source publishes. On a mismatch, every piece
  that came from a peer is fetched again from the source and compared: a peer that sent bytes
  that differ is named (as one that passed them on, when its map said the piece was relayed),
  skipped for the rest of the pull, and the file is whole from the source.
- Resume: pieces are written in place into a sparse part and recorded beside it with where each
  came from (pieces.Record, saved at most every SAVE_EVERY_S after an fdatasync), so a killed
  pull resumes with what it had.

Everything here blocks; it runs in the pull's worker thread plus WORKERS + 1 threads of its own.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from solar_host.model_store import streaming
from solar_host.model_store.peers import PREFIX, Peers
from solar_host.model_store.pieces import (
    MAX_PIECES,
    PIECE_BYTES,
    SOURCE,
    Bitmap,
    Holding,
    Record,
    piece_count,
    piece_span,
)
from solar_host.model_store.progress import ByteCounter
from solar_host.model_store.pull import Interrupted, LowSpeedGuard, PullError
from solar_host.model_store.streaming import Cancelled
from solar_host.model_store.transfer import RESUME_BACKOFF_S, RESUMES, Hashes, Want

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the swarm's piece maps are asked again
WORKERS = 6  # pieces in flight at once: from the source (see below), the others from peers
# Pieces in flight from the source at once: one while peers pull the file too (the source's
# rate is shared among the owners anyway, and the pieces in flight at the end are what the
# swarm waits for), a few when this host is alone (a request per piece, each a round trip).
SOURCE_AT_ONCE_ALONE = 3
PER_HOLDER = 1  # pieces in flight from one peer at once
SAMPLE = 32  # missing pieces weighed for "rarest first" at each pick (of thousands, maybe)
STEAL_AFTER_S = 20.0  # an owner that shows no progress this long loses its pieces to the rest
HOLDER_BACKOFF_S = 2.0  # a peer that failed a piece is not asked again this long
SAVE_EVERY_S = 1.0  # the piece record is written at most this often
WAIT_S = 0.25  # a worker with nothing to do looks again at least this often
MAX_MAP_BYTES = (MAX_PIECES // 8) * 2 + (64 << 10)
MIN_RATE_BPS = 1024.0
RATE_WINDOW_S = 30.0
READ_CHUNK = 256 << 10

# source(start, end) -> an open streamed response of bytes start..end (inclusive) of the file.
SourceRange = Callable[[int, int], Any]


def range_usable(resp: Any, start: int, what: str) -> bool:
    """Whether an answer to `Range: bytes=start-end` holds the piece from its first byte: a 206
    from `start` (one that runs past `end` too: only the piece is read), or the whole body when
    `start` is 0. False for another answer, whose status the caller reports; a 206 from
    elsewhere is a 502 naming `what`."""
    if resp.status_code == 200:
        return start == 0
    if resp.status_code != 206:
        return False
    got = (resp.headers.get("Content-Range") or "").removeprefix("bytes ").split("-", 1)[0]
    if got.strip() != str(start):
        resp.close()
        raise PullError(
            502, "model_pull_failed", f"{what}: asked for the bytes from {start}, got {got}-"
        )
    return True


def applies(peers: Peers | None, want: Want) -> bool:
    """Whether `want` is fetched by a swarm: there are peers, and it is over one piece (a file
    of one piece cannot be split among hosts; it comes whole from a peer that has it, else the
    source)."""
    return peers is not None and peers.board is not None and want.size > PIECE_BYTES


@dataclass
class _View:
    """One peer's piece map, as last asked (pieces as bits of an int: bit i, piece i)."""

    url: str
    host_id: str
    offered: int
    fetching: int
    changed_at: float  # when its map last changed (its progress)
    relayed: int = 0  # offered pieces it took from peers and has not checked yet
    incoming: int = 0  # pieces coming to it from peers now (it will offer them soon)


class _Swarm:
    """The swarm as the last round of maps saw it (the lock is held to read or replace it)."""

    def __init__(self, me: str, views: list[_View], n: int) -> None:
        self.views = views
        self.offered = 0  # pieces some peer offers
        self.claimed = 0  # pieces some peer fetches from the source now
        for v in views:
            self.offered |= v.offered
            self.claimed |= v.fetching
        self.members = sorted({me} | {v.host_id for v in views})
        self.by_id = {v.host_id: v for v in views}
        self.n = n
        self._owned: dict[str, int] = {}

    def owned(self, host_id: str) -> int:
        """The pieces `host_id` fetches from the source when nobody offers them."""
        if host_id not in self._owned:
            k, step = self.members.index(host_id), len(self.members)
            bits = bytearray((self.n + 7) // 8)
            for i in range(k, self.n, step):
                bits[i >> 3] |= 1 << (i & 7)
            self._owned[host_id] = int.from_bytes(bits, "little")
        return self._owned[host_id]


def _lowest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _sample(mask: int, n: int, k: int) -> list[int]:
    """Up to `k` set bits of `mask`, from a random place on (wrapping)."""
    off = random.randrange(n)
    out: list[int] = []
    for part, base in ((mask >> off, off), (mask & ((1 << off) - 1), 0)):
        while part and len(out) < k:
            low = part & -part
            out.append(base + low.bit_length() - 1)
            part ^= low
    return out


class _BadPeer(Exception):
    """A peer that broke the protocol (a map or a piece that is not what was asked)."""


class Swarm:
    """Fetch one file with the hosts that pull it too (`run`)."""

    def __init__(
        self,
        peers: Peers,
        want: Want,
        part: Path,
        final: Path,
        partial: Path,
        counter: ByteCounter,
        source: SourceRange,
        pace: Callable[[int], None] | None = None,
    ) -> None:
        assert peers.board is not None
        self.peers = peers
        self.board = peers.board
        self.me = self.board.host_id
        self.want = want
        self.part = part
        self.final = final
        self.partial = partial
        self.counter = counter
        self.source = source
        self.pace = pace
        self.cancel = peers.cancel
        self.n = piece_count(want.size)
        self.record = Record(part.with_name(part.name + ".pieces"), want.digest, want.size)
        self.full = (1 << self.n) - 1
        self.have = 0  # pieces written here (bit i: piece i)
        self.inflight_mask = 0
        self.swarm = _Swarm(self.me, [], self.n)
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.views: dict[str, _View] = {}
        self.polls = 0
        self.inflight: dict[int, str] = {}  # piece -> origin being fetched
        self.backoff: dict[str, float] = {}  # peer -> not asked before this time
        self.source_fails = 0
        self.source_after = 0.0
        self.error: BaseException | None = None
        self.fd = -1
        self.hash_lock = threading.Lock()
        self.hashes = Hashes(want)
        self.hashed = 0  # pieces hashed, in order
        self.saved_at = 0.0
        self.open: set[Any] = set()  # responses being read (aborted when the swarm stops)
        self.origins: set[str] = set()  # where the pieces here came from
        self.via_relay: set[int] = set()  # pieces taken from a peer that passed them on
        self.save_lock = threading.Lock()

    # --- the whole file ---------------------------------------------------------------------

    def run(self) -> str:
        """Fetch the file to `final`, checked; return its sha256 hex."""
        self.part.parent.mkdir(parents=True, exist_ok=True)
        if self.part.is_file():
            self.record.load()
        else:
            self.record.remove()
        self.fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(self.fd, self.want.size)  # sparse: pieces land where they belong
            offered, relayed = Bitmap(self.n), Bitmap(self.n)
            for i, origin in enumerate(self.record.origins):
                if origin is not None:
                    self.have |= 1 << i
                    self.counter.add(piece_span(i, self.want.size)[1])
                    offered.set(i)
                    if origin != SOURCE:
                        relayed.set(i)
            self.board.hold(
                Holding(
                    self.want.digest,
                    self.want.size,
                    self.part,
                    self.partial,
                    offered,
                    relayed=relayed,
                )
            )
            self._gather()
            self._hash_forward()
            if not self.hashes.matches(self.want):
                self._repair()
            streaming.make_durable(self.fd)
        except BaseException:
            self._keep()
            raise
        finally:
            os.close(self.fd)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.part, self.final)
        self.record.remove()
        self.board.update(
            self.want.digest,
            path=self.final,
            offered=Bitmap.all(self.n),
            relayed=Bitmap(self.n),
            fetching=set(),
        )
        return self.hashes.sha256.hexdigest()

    def _gather(self) -> None:
        """Run the poller and the workers until every piece is here (or it fails)."""
        threads = [threading.Thread(target=self._poll, name="swarm-poll", daemon=True)]
        threads += [
            threading.Thread(target=self._work, name="swarm-piece", daemon=True)
            for _ in range(WORKERS)
        ]
        forget = self.cancel.on_cancel(self._wake)
        for t in threads:
            t.start()
        try:
            with self.cond:
                while not (self.have == self.full or self.error or self.cancel.is_set()):
                    self.cond.wait(1.0)
        finally:
            self._wake()
            for t in threads:
                t.join()
            forget()
        if self.cancel.is_set():
            raise Cancelled()
        if self.error is not None:
            raise self.error

    def _wake(self) -> None:
        """Stop every thread of the swarm, and the reads they are blocked in."""
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
            responses = list(self.open)
        for resp in responses:
            streaming.abort_response(resp)

    def _keep(self) -> None:
        """A pull that stops keeps its pieces for the next one (a resume)."""
        try:
            with self.save_lock:
                os.fdatasync(self.fd)
                self.record.save()
        except OSError as err:
            log.warning("cannot record the pieces of %s (%s)", self.want.name, err)

    # --- the piece maps ---------------------------------------------------------------------

    def _poll(self) -> None:
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="swarm-map") as pool:
            while not self.stop.is_set():
                urls = self.peers.usable()
                answers = list(pool.map(self._ask, urls))
                with self.cond:
                    for url, view in zip(urls, answers, strict=True):
                        old = self.views.get(url)
                        if view is None or view.host_id == self.me:
                            self.views.pop(url, None)
                            continue
                        if old is not None and (old.offered, old.fetching) == (
                            view.offered,
                            view.fetching,
                        ):
                            view.changed_at = old.changed_at
                        self.views[url] = view
                    for url in [u for u in self.views if u not in urls]:
                        del self.views[url]  # skipped meanwhile
                    self._summarize()
                    self.polls += 1
                    self.cond.notify_all()
                self.stop.wait(POLL_S)

    def _ask(self, url: str) -> _View | None:
        """`url`'s piece map of this file; None when it has none (or cannot be asked)."""
        try:
            resp = self.peers.get(f"{url}{PREFIX}/pieces/{quote(self.want.digest, safe='')}")
        except Exception as err:  # unreachable: not in the swarm now
            log.debug("peer %s: no piece map (%s)", url, err)
            return None
        try:
            if resp.status_code != 200:
                return None
            body = resp.raw.read(MAX_MAP_BYTES + 1, decode_content=True)
            if len(body) > MAX_MAP_BYTES:
                raise _BadPeer("sent a piece map over its bound")
            return self._view(url, json.loads(body))
        except _BadPeer as err:
            self.peers.skip(url, str(err))
        except (ValueError, TypeError, KeyError, OSError) as err:
            log.info("peer %s sent no usable piece map: %s", url, err)
        finally:
            resp.close()
        return None

    def _view(self, url: str, m: Any) -> _View | None:
        if not isinstance(m, dict):
            raise ValueError("not an object")
        if m["size_bytes"] != self.want.size or m["pieces"] != self.n:
            raise _BadPeer(f"announced {self.want.name} at another size")
        if m["piece_bytes"] != PIECE_BYTES:
            return None  # another cut: not of this swarm
        host_id = m["host_id"]
        if not isinstance(host_id, str) or not 0 < len(host_id) <= 64:
            raise ValueError("host_id")
        claims, coming = self._indices(m.get("fetching")), self._indices(m.get("incoming"))
        offered = int.from_bytes(Bitmap.decode(str(m["have"]), self.n).bits, "little")
        relayed = m.get("relayed")
        passed = 0
        if relayed is not None:
            passed = int.from_bytes(Bitmap.decode(str(relayed), self.n).bits, "little")
        return _View(url, host_id, offered, claims, time.monotonic(), passed & offered, coming)

    def _indices(self, listed: Any) -> int:
        """A map's list of piece indices as bits (at most 1024 of them)."""
        listed = listed or []
        if not isinstance(listed, list) or len(listed) > 1024:
            raise ValueError("a list of pieces over 1024 long")
        bits = 0
        for i in listed:
            if isinstance(i, int) and 0 <= i < self.n:
                bits |= 1 << i
        return bits

    def _summarize(self) -> None:
        """The swarm of the views of the peers still asked (the lock is held)."""
        live = [v for v in self.views.values() if v.url not in self.peers.skipped]
        self.swarm = _Swarm(self.me, live, self.n)

    # --- which piece, from whom ---------------------------------------------------------------

    def _next(self, now: float) -> tuple[int, str] | None:
        """The next piece to fetch and its origin (the lock is held); None: wait."""
        if self.polls < 1:
            return None
        missing = self.full & ~self.have & ~self.inflight_mask
        if not missing:
            return None
        sw = self.swarm
        # Nothing is claimed from the source before the second round of maps: hosts that
        # started together have seen one another by then. Peers' pieces are taken at once.
        from_source = sum(1 for o in self.inflight.values() if o == SOURCE)
        limit = 1 if sw.views else SOURCE_AT_ONCE_ALONE
        if from_source < limit and now >= self.source_after and self.polls >= 2:
            mine = sw.owned(self.me)
            for v in sw.views:  # an owner that shows no progress loses its pieces
                if now - v.changed_at > STEAL_AFTER_S:
                    mine |= sw.owned(v.host_id)
            cand = missing & ~sw.offered & ~sw.claimed & mine
            if cand:
                return _lowest(cand), SOURCE
        if len(self.inflight) - from_source >= WORKERS - 1:
            return None  # one worker stays for the source
        return self._from_peers(missing & sw.offered, now)

    def _from_peers(self, cand: int, now: float) -> tuple[int, str] | None:
        """The rarest of a sample of the missing pieces peers offer, and the peer least asked
        to give it."""
        if not cand:
            return None
        busy = Counter(o for o in self.inflight.values() if o != SOURCE)
        live = [v for v in self.swarm.views if v.url not in self.peers.skipped]
        best: tuple[tuple[int, float], int, list[_View]] | None = None
        for i in _sample(cand, self.n, SAMPLE):
            holders = [v for v in live if v.offered >> i & 1]
            # A piece coming to a peer now is as good as offered by it: pieces spread faster
            # when the hosts fetch different ones.
            soon = sum(1 for v in live if v.incoming >> i & 1)
            free = [
                v
                for v in holders
                if busy[v.url] < PER_HOLDER and self.backoff.get(v.url, 0.0) <= now
            ]
            if not free:
                continue
            key = (len(holders) + soon, random.random())
            if best is None or key < best[0]:
                best = (key, i, free)
        if best is None:
            return None
        _, i, free = best
        # The least asked; then the one with the fewest pieces, so that a host that has the
        # whole file gives what only it has, and the hosts that join it pass the rest around.
        least = min((busy[v.url], v.offered.bit_count()) for v in free)
        holder = random.choice([v for v in free if (busy[v.url], v.offered.bit_count()) == least])
        if holder.relayed >> i & 1:
            self.via_relay.add(i)
        else:
            self.via_relay.discard(i)
        return i, holder.url

    # --- the workers ------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            while True:
                with self.cond:
                    task = None
                    while task is None:
                        if self.stop.is_set() or self.error or self.have == self.full:
                            return
                        task = self._next(time.monotonic())
                        if task is None:
                            self.cond.wait(WAIT_S)
                    i, origin = task
                    self.inflight[i] = origin
                    self.inflight_mask |= 1 << i
                    if origin == SOURCE:
                        self._tell_fetching()
                    else:
                        self._tell_incoming()
                try:
                    data = self._fetch(i, origin)
                except (PullError, _BadPeer, OSError) as err:
                    if self.stop.is_set() or self.cancel.is_set():
                        return
                    self._failed(i, origin, err)
                    continue
                self._landed(i, origin, data)
        except BaseException as err:  # a disk that fails (ENOSPC): the pull fails with it
            with self.cond:
                if self.error is None and not isinstance(err, Cancelled):
                    self.error = err
                self.cond.notify_all()

    def _fetch(self, i: int, origin: str) -> bytearray:
        start, length = piece_span(i, self.want.size)
        if origin == SOURCE:
            resp = self.source(start, start + length - 1)
            what = f"The source's piece {i} of {self.want.name}"
        else:
            url = f"{origin}{PREFIX}/pieces/{quote(self.want.digest, safe='')}/{i}"
            try:
                resp = self.peers.get(url)
            except Exception as err:
                raise Interrupted(f"peer {origin}: {err}") from None
            if resp.status_code != 200:
                resp.close()
                raise Interrupted(f"peer {origin} answered {resp.status_code} for piece {i}")
            what = f"Peer {origin}'s piece {i} of {self.want.name}"
        with self.cond:
            self.open.add(resp)
        try:
            return self._read(resp, length, what, exact=origin != SOURCE)
        finally:
            with self.cond:
                self.open.discard(resp)
            resp.close()

    def _read(self, resp: Any, length: int, what: str, *, exact: bool) -> bytearray:
        """The first `length` bytes of the body (a peer's must be exactly that long; a source
        may send past the piece)."""
        declared = resp.headers.get("Content-Length")
        if exact and declared is not None and declared.isdigit() and int(declared) != length:
            raise _BadPeer(f"sent {declared} bytes for a piece of {length}")
        buf = bytearray(length)
        view = memoryview(buf)
        read = streaming.body_reader(resp, length)
        guard = LowSpeedGuard(what, MIN_RATE_BPS, RATE_WINDOW_S)
        got = 0
        try:
            while got < length:
                n = read(view[got : got + READ_CHUNK])
                if not n:
                    break
                got += n
                guard.feed(n)
                if self.pace is not None:
                    self.pace(n)
        except PullError:
            raise
        except Exception as err:
            raise Interrupted(f"{what}: {err}") from None
        if got < length:
            raise Interrupted(f"{what}: the connection closed after {got} of {length} bytes")
        return buf

    def _tell_fetching(self) -> None:
        """Tell peers which pieces this host takes from the source now (lock held)."""
        claims = {i for i, o in self.inflight.items() if o == SOURCE}
        self.board.update(self.want.digest, fetching=claims)

    def _tell_incoming(self) -> None:
        """Tell peers (in this host's map) which pieces come from peers now (lock held)."""
        coming = {i for i, o in self.inflight.items() if o != SOURCE}
        self.board.update(self.want.digest, incoming=coming)

    def _failed(self, i: int, origin: str, err: BaseException) -> None:
        now = time.monotonic()
        with self.cond:
            del self.inflight[i]
            self.inflight_mask &= ~(1 << i)
            self._tell_incoming()
            if origin == SOURCE:
                self._tell_fetching()
                fatal = isinstance(err, PullError) and not isinstance(err, Interrupted)
                self.source_fails += 1
                if fatal or self.source_fails > RESUMES:
                    self.error = err
                else:
                    wait = RESUME_BACKOFF_S * 2 ** (self.source_fails - 1)
                    self.source_after = now + wait
                    log.warning("%s; asking the source again in %.0f s", err, wait)
            elif isinstance(err, _BadPeer):
                self.peers.skip(origin, f"{err} ({self.want.name}, piece {i})")
                self._summarize()
            else:
                self.backoff[origin] = now + HOLDER_BACKOFF_S
                log.info("piece %d of %s from peer %s failed: %s", i, self.want.name, origin, err)
            self.cond.notify_all()

    def _landed(self, i: int, origin: str, data: bytearray) -> None:
        start, length = piece_span(i, self.want.size)
        _pwrite_all(self.fd, data, start)
        with self.cond:
            del self.inflight[i]
            self.inflight_mask &= ~(1 << i)
            self.have |= 1 << i
            self.record.origins[i] = origin
            self._tell_incoming()
            if origin == SOURCE:
                self.source_fails = 0
                self._tell_fetching()
            self.board.offer(self.want.digest, i, relayed=origin != SOURCE)
            self.cond.notify_all()
        self.counter.add(length)
        waiting = self.peers.waiting
        if waiting is not None:
            label = SOURCE if origin == SOURCE else f"peer {origin}"
            waiting.count(label, length)
            self.origins.add(origin)
            waiting.origin = "swarm" if len(self.origins) > 1 else label
        self._hash_forward()
        now = time.monotonic()
        if now - self.saved_at >= SAVE_EVERY_S:
            self.saved_at = now
            self._keep()

    def _hash_forward(self) -> None:
        """Hash the pieces that arrived, in order, as far as there is no gap."""
        with self.hash_lock:
            while self.hashed < self.n:
                with self.cond:
                    if not self.have >> self.hashed & 1:
                        return
                start, length = piece_span(self.hashed, self.want.size)
                self.hashes.update(os.pread(self.fd, length, start))
                self.hashed += 1

    # --- a digest mismatch --------------------------------------------------------------------

    def _repair(self) -> None:
        """Fetch every piece a peer sent again from the source; name the peers whose bytes
        differ. Fails the pull (the part removed) when the file still is not its digest."""
        blamed: Counter[str] = Counter()
        passed_on: Counter[str] = Counter()
        for i, origin in enumerate(self.record.origins):
            if origin is None or origin == SOURCE:
                continue
            start, length = piece_span(i, self.want.size)
            data = self._source_piece(i)
            if os.pread(self.fd, length, start) != data:
                (passed_on if i in self.via_relay else blamed)[origin] += 1
                _pwrite_all(self.fd, data, start)
            self.record.origins[i] = SOURCE
        for peer in set(blamed) | set(passed_on):
            what = [
                f"sent {blamed[peer]} pieces" if blamed[peer] else "",
                f"passed on {passed_on[peer]} pieces from its peers" if passed_on[peer] else "",
            ]
            self.peers.skip(
                peer,
                f"{' and '.join(w for w in what if w)} of {self.want.name} with bytes that are "
                "not its digest",
            )
        self.hashes = Hashes(self.want)
        self.hashed = 0
        self._hash_forward()
        if not self.hashes.matches(self.want):
            self.record.remove()
            self.part.unlink(missing_ok=True)
            raise PullError(
                502,
                "model_pull_failed",
                f"Pulled artifact integrity check failed: {self.want.name}: digest mismatch "
                f"(got {self.want.algorithm}:{self.hashes.published.hexdigest()}, want "
                f"{self.want.digest} / {self.want.size} bytes); the file was removed",
            )

    def _source_piece(self, i: int) -> bytearray:
        backoff = RESUME_BACKOFF_S
        for attempt in range(RESUMES + 1):
            try:
                return self._fetch(i, SOURCE)
            except Interrupted:
                if attempt == RESUMES:
                    raise
            if self.cancel.event.wait(backoff):
                raise Cancelled()
            backoff *= 2
        raise AssertionError("unreachable")


def _pwrite_all(fd: int, data: bytearray, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n

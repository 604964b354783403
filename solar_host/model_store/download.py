"""The shared download of one pull: fetch into `MODELS_DIR/.partial/<slug>`, check, place.

Downloads run in worker threads and only count bytes; a monitor on the event loop emits the
throttled `downloading` events of every caller and aborts the pull (507, what it fetched
removed) when free disk space falls under MIN_FREE_DISK_GB. A cancelled or interrupted pull
leaves its partial directory for the next one to resume; a pull that fails with nothing worth
resuming (401, 404, 507, or nothing fetched yet) leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solar_host.model_store import huggingface, oci, swarm
from solar_host.model_store.layers import assemble
from solar_host.model_store.manifest import Manifest, ManifestEntry, now_iso
from solar_host.model_store.pacing import RateCap, Waiting
from solar_host.model_store.peers import Peers, peer_urls
from solar_host.model_store.pieces import Board
from solar_host.model_store.placement import PARTIAL, link_snapshot, place, remove_if_empty
from solar_host.model_store.progress import ByteCounter, PullReporter
from solar_host.model_store.pull import (
    PullError,
    PullRequest,
    filters_satisfied,
    inventory,
    split_ref,
    sync_tree,
)
from solar_host.model_store.streaming import Cancelled, CancelToken
from solar_host.model_store.transfer import Want, hash_sha256
from solar_host.resources.probes import GB
from solar_host.settings import Settings

log = logging.getLogger(__name__)

# How often a pull that is resolving looks whether the source made it wait.
WAIT_POLL_S = 0.2
# Files of one Hub snapshot fetched at once (a model of many shards is not fetched one by one).
HUB_FILES_AT_ONCE = 3


@dataclass
class PullJob:
    """One download of one base URI, shared by every caller that wants the same thing."""

    key: tuple[str, tuple[str, ...] | None]
    reporters: list[PullReporter] = field(default_factory=list)
    task: asyncio.Task[ManifestEntry] | None = None
    cancel: CancelToken = field(default_factory=CancelToken)
    bytes_total: int | None = None
    waiting: Waiting = field(default_factory=Waiting)  # a wait the source asked for


@dataclass
class _Plan:
    """What one download fetches, worked out before the first byte."""

    fetch: Callable[[], None]
    filters: list[str] | None = None
    layers: list[oci.Layer] = field(default_factory=list)
    manifest_digest: str | None = None
    present: int = 0  # bytes already on disk (a resume)
    digests: dict[str, str] = field(default_factory=dict)  # path -> "sha256:<hex>", checked
    revision: str | None = None  # the Hub commit pulled
    source_digests: dict[str, str] = field(default_factory=dict)  # path -> as published
    listed_by: str | None = None  # "peer <url>" when the source could not be reached


class Download:
    """Runs the download of a `PullJob` for the store (`run`)."""

    def __init__(
        self,
        settings: Settings,
        manifest: Manifest,
        free_bytes: Callable[[], int | None],
        rate_cap: RateCap | None = None,
        *,
        board: Board | None = None,
    ) -> None:
        self.board = board  # where this host's swarms offer their pieces to peers
        self.settings = settings
        self.rate_cap = rate_cap
        self.manifest = manifest
        self.models_dir = manifest.models_dir
        self.free_bytes = free_bytes

    @property
    def floor(self) -> int:
        return int(self.settings.min_free_disk_gb * GB)

    async def run(self, job: PullJob, req: PullRequest, slug: str) -> ManifestEntry:
        partial = self.models_dir / PARTIAL / slug
        target = self.models_dir / slug
        counter = ByteCounter()
        try:
            if req.source == "harbor":
                planning = self._harbor_plan(job, req, partial, counter)
            else:
                # A size the caller announces is checked before the Hub is asked anything.
                await asyncio.to_thread(self._check_room, req.size_bytes, 0)
                planning = self._hub_plan(job, req, partial, target, counter)
            plan = await self._resolving(job, planning)
            for r in job.reporters:
                if job.bytes_total is not None:
                    r.bytes_total = job.bytes_total
            await asyncio.to_thread(self._check_room, job.bytes_total, plan.present)
            await self._run_monitored(job, plan.fetch, counter, partial)
            for r in job.reporters:
                r.phase("verifying")  # blobs were hashed while streaming; now place the files
                r.phase("finalizing")
            try:
                return await asyncio.to_thread(self._finalize, req, slug, partial, target, plan)
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise PullError(
                        507, "insufficient_storage", "Insufficient disk space."
                    ) from err
                raise
        except PullError as err:
            # Nothing worth resuming: free the disk. A top-up's partial directory holds
            # only links to the model, which stays as it was.
            drop = err.status_code in (401, 404, 507)
            await asyncio.to_thread(self._leave, partial, drop)
            raise
        finally:
            if self.board is not None:  # placed (peers find it in the manifest) or given up
                self.board.forget_under(partial)

    async def _resolving(self, job: PullJob, planning: Coroutine[Any, Any, _Plan]) -> _Plan:
        """Await the plan, telling every caller when the source makes it wait (a 429)."""
        task = asyncio.ensure_future(planning)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WAIT_POLL_S)
                if done:
                    return task.result()
                for r in job.reporters:
                    r.resolving(job.waiting.reason)
        except asyncio.CancelledError:
            task.cancel()
            raise

    def _leave(self, partial: Path, drop: bool) -> None:
        """After a failure: remove `partial` when dropped or when it holds no file at all."""
        if drop or not any(p.is_file() for p in partial.rglob("*")):
            shutil.rmtree(partial, ignore_errors=True)
        remove_if_empty(partial.parent)

    def _check_room(self, total: int | None, present: int) -> None:
        """What is still to fetch plus the floor must fit now."""
        need = max(0, (total or 0) - present)
        free = self.free_bytes()
        if free is not None and free < need + self.floor:
            raise PullError(
                507,
                "insufficient_storage",
                f"Insufficient disk space. Available: {free / GB:.2f} GB, required: "
                f"{(need + self.floor) / GB:.2f} GB (including MIN_FREE_DISK_GB "
                f"{self.settings.min_free_disk_gb:.2f}).",
            )

    async def _harbor_plan(
        self, job: PullJob, req: PullRequest, partial: Path, counter: ByteCounter
    ) -> _Plan:
        s = self.settings
        registry = oci.Registry(
            s.harbor_url,
            s.harbor_username,
            s.harbor_password,
            pace=self._pace(job),
            waiting=job.waiting,
            cancel=job.cancel,
        )
        _, repo, tag, digest = split_ref(req.harbor_ref or "", registry.host)
        layers, manifest_digest = await asyncio.to_thread(
            registry.manifest, repo, digest or tag or "latest"
        )
        if req.digest and manifest_digest and req.digest != manifest_digest:
            log.warning(
                "pull of %s: the request's digest %s is not the manifest's (%s); the "
                "manifest's is recorded",
                req.source_uri,
                req.digest,
                manifest_digest,
            )
        job.bytes_total = sum(x.size for x in layers)
        blobs = partial / "blobs"
        peers = self._peers(job)
        pace = self._pace(job)

        def fetch() -> None:
            try:
                for layer in layers:
                    if job.cancel.is_set():
                        raise Cancelled()
                    # A file layer is a file on a peer that pulled the artifact (a directory
                    # layer is unpacked there: only the registry has its blob).
                    if peers is not None and not layer.unpack:
                        name = f"sha256-{layer.hex}"
                        want = Want(layer.title, layer.size, layer.digest)
                        if swarm.applies(peers, want) and not (blobs / name).is_file():

                            def piece(start: int, end: int, layer: oci.Layer = layer) -> Any:
                                return registry.blob_range(repo, layer, start, end, job.cancel)

                            part = blobs / f"{name}.swarm"
                            swarm.Swarm(
                                peers, want, part, blobs / name, partial, counter, piece, pace
                            ).run()
                            continue
                        if peers.fetch(want, blobs / f"{name}.part", blobs / name, counter):
                            continue
                    job.waiting.origin = "source"
                    registry.fetch_blob(repo, layer, blobs, counter, job.cancel)
            finally:
                if peers is not None:
                    peers.close()

        present = await asyncio.to_thread(_bytes_present, blobs, layers)
        return _Plan(fetch, layers=layers, manifest_digest=manifest_digest, present=present)

    async def _hub_plan(
        self, job: PullJob, req: PullRequest, partial: Path, target: Path, counter: ByteCounter
    ) -> _Plan:
        old = self.manifest.get(req.base_uri)
        # Adding files to a snapshot on disk: the download reuses its files (also when an
        # earlier top-up was interrupted and left its partial directory).
        topup = (
            old is not None and Path(old.path) == target and await asyncio.to_thread(target.is_dir)
        )
        filters = req.filters
        if topup and old is not None:
            filters = (
                None
                if filters is None or old.file_filters is None
                else sorted(set(old.file_filters) | set(filters))
            )
        s = self.settings
        endpoint = s.hf_endpoint or os.environ.get("HF_ENDPOINT") or None
        token = s.hf_token or await asyncio.to_thread(huggingface.stored_token)
        # The files are fetched a few at once; the first that fails stops the others.
        stop = job.cancel.child()
        peers = self._peers(job, stop)
        hub = huggingface.Hub(
            endpoint, token, stop, pace=self._pace(job), waiting=job.waiting, peers=peers
        )
        repo_id = (req.model_id or "").strip().strip("/")
        commit, files, listed_by = await asyncio.to_thread(
            _resolve_snapshot, hub, peers, repo_id, req.base_uri, filters
        )
        job.bytes_total = sum(f.want.size for f in files)
        if topup and old is not None:
            # The model stays where it is, recorded and usable, while the download runs: its
            # files are linked into the partial directory (no disk, no copy), and only the
            # finished snapshot replaces it. A failed or killed top-up leaves it as it was.
            await asyncio.to_thread(link_snapshot, target, partial, old)
        digests: dict[str, str] = {}

        def fetch() -> None:
            try:
                # Smallest first: the configs and tokenizers a resume keeps, then the weights.
                def one(f: huggingface.HubFile) -> None:
                    digests[f.path] = "sha256:" + hub.fetch(repo_id, commit, f, partial, counter)

                ordered = sorted(files, key=lambda f: (f.want.size, f.path))
                _each_at_once(ordered, one, stop, HUB_FILES_AT_ONCE)
            finally:
                hub.close()
                if peers is not None:
                    peers.close()

        return _Plan(
            fetch,
            filters=filters,
            digests=digests,
            revision=commit,
            source_digests={f.path: f.source_digest for f in files if f.source_digest},
            listed_by=listed_by,
        )

    def _peers(self, job: PullJob, cancel: CancelToken | None = None) -> Peers | None:
        s = self.settings
        urls = peer_urls(s.model_peers)
        if not urls or not s.peer_token:
            return None
        return Peers(
            urls,
            s.peer_token,
            cancel or job.cancel,
            pace=self._pace(job),
            waiting=job.waiting,
            board=self.board,
        )

    def _pace(self, job: PullJob) -> Callable[[int], None] | None:
        cap = self.rate_cap
        if cap is None or cap.bytes_per_s <= 0:
            return None
        return lambda n: cap.take(n, job.cancel)

    async def _run_monitored(
        self,
        job: PullJob,
        fetch: Callable[[], None],
        counter: ByteCounter,
        partial: Path,
    ) -> None:
        """Run `fetch` in a thread; report progress; abort on low disk or cancellation."""
        await asyncio.to_thread(partial.mkdir, parents=True, exist_ok=True)
        fut = _in_own_thread(fetch)
        s = self.settings
        poll = min(s.pull_disk_poll_interval_s, s.pull_progress_interval_s)
        last_t, last_b = time.monotonic(), counter.done
        first = True
        low_disk = False
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=0 if first else poll)
                now = time.monotonic()
                speed = (counter.done - last_b) / (now - last_t) if now > last_t else None
                if not first:
                    last_t, last_b = now, counter.done
                notes = job.waiting
                for r in job.reporters:
                    r.downloading(
                        counter.done,
                        speed,
                        force=first or bool(done),  # the last one tells every byte
                        waiting=notes.reason,
                        origin=notes.origin,
                        skipped=notes.skipped,
                        bytes_from=notes.bytes_from(),
                    )
                first = False
                if done:
                    break
                free = await asyncio.to_thread(self.free_bytes)
                if free is not None and free < self.floor:
                    low_disk = True
                    job.cancel.cancel()
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(asyncio.shield(fut), 30)
                    break
            if low_disk:  # the caller clears what this pull fetched (see run)
                raise PullError(
                    507, "insufficient_storage", "Insufficient disk space during download."
                )
            _outcome_of(fut)
        except asyncio.CancelledError:
            # Stop the thread before giving up, so a resumed pull never races a live writer.
            job.cancel.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(fut), 30)
            raise

    def _finalize(
        self, req: PullRequest, slug: str, partial: Path, target: Path, plan: _Plan
    ) -> ManifestEntry:
        layers = plan.layers
        if layers:
            tree = partial / "tree"
            if tree.exists():
                shutil.rmtree(tree)
            assemble(layers, partial / "blobs", tree, self._room)
            file_digests = {x.title: x.digest for x in layers if not x.unpack}
            src = tree
        else:
            src = partial
            _drop_unchecked(partial, plan.digests)
            file_digests = dict(plan.digests)
        files = inventory(src)
        for rel, _size in files:
            if rel not in file_digests:
                # Unpacked from a checked directory layer: its sha256 is taken now, for verify.
                file_digests[rel] = "sha256:" + hash_sha256(src / rel)
        sync_tree(src)  # whole files before the rename; the manifest's fsync covers the rename
        metadata = dict(req.metadata or {})
        if req.source == "harbor":
            metadata.setdefault("harbor_ref", req.harbor_ref)
        if plan.revision:
            metadata["revision"] = plan.revision
        if plan.listed_by:
            metadata["listed_by"] = plan.listed_by
        entry = ManifestEntry(
            slug=slug,
            source_uri=req.base_uri,
            path=str(target),
            size_bytes=sum(s for _, s in files),
            # A registry artifact's digest is the one computed from its manifest; a caller's
            # digest only labels what has none (a HuggingFace snapshot).
            digest=plan.manifest_digest or req.digest,
            downloaded_at=now_iso(),
            category=req.category,
            name=req.name,
            version=req.version,
            checksum=req.checksum,
            metadata=metadata or None,
            file_digests=file_digests,
            file_sizes=dict(files),
            file_filters=plan.filters,
            source_digests=plan.source_digests or None,
        )
        place(self.models_dir, self.manifest, src, target, entry)
        if src != partial:
            shutil.rmtree(partial, ignore_errors=True)
        remove_if_empty(self.models_dir / PARTIAL)
        return entry

    def _room(self, n: int) -> None:
        """Refuse to unpack `n` more bytes when they would take the disk under the floor."""
        free = self.free_bytes()
        if free is not None and free - n < self.floor:
            raise PullError(
                507,
                "insufficient_storage",
                "Insufficient disk space while unpacking the artifact.",
            )


def _each_at_once(
    items: list[Any], fn: Callable[[Any], None], stop: CancelToken, limit: int
) -> None:
    """`fn(item)` for each item, `limit` at a time, in order of start. The first failure stops
    the others (`stop`) and is raised once they ended; a cancel of the pull is a Cancelled."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    def run(item: Any) -> None:
        if stop.is_set():
            raise Cancelled()
        fn(item)

    first: BaseException | None = None
    with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="pull-file") as pool:
        for fut in as_completed([pool.submit(run, item) for item in items]):
            err = fut.exception()
            if err is None:
                continue
            # The failure that stopped the others, not the Cancelled it caused them.
            if first is None or (isinstance(first, Cancelled) and not isinstance(err, Cancelled)):
                first = err
            stop.cancel()
    if first is not None:
        raise first


def _in_own_thread(fetch: Callable[[], None]) -> asyncio.Future[None]:
    """Run `fetch` in a thread of its own. A pull holds its thread for minutes or hours: in
    the loop's default executor (cpu count + 4 threads) a few pulls at once would leave none
    to the routes that need one, the peer routes a swarm asks every half second included."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def settle(err: BaseException | None) -> None:
        if fut.done():
            return
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)

    def run() -> None:
        err: BaseException | None = None
        try:
            fetch()
        except BaseException as e:  # handed to the loop, raised there by _outcome_of
            err = e
        try:
            loop.call_soon_threadsafe(settle, err)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for the outcome
            pass

    threading.Thread(target=run, name="pull", daemon=True).start()
    return fut


def _outcome_of(fut: asyncio.Future[None]) -> None:
    """The finished fetch's result, its failures as the contract's statuses."""
    try:
        fut.result()
    except Cancelled:
        raise asyncio.CancelledError() from None
    except PullError:
        raise
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise PullError(507, "insufficient_storage", "Insufficient disk space.") from err
        raise PullError(500, "model_pull_failed", f"{err}") from err


def _resolve_snapshot(
    hub: huggingface.Hub,
    peers: Peers | None,
    repo_id: str,
    source_uri: str,
    filters: list[str] | None,
) -> tuple[str | None, list[huggingface.HubFile], str | None]:
    """(commit, the files `filters` select, who listed them: None for the Hub itself).

    When the Hub cannot be reached, a peer's record of the snapshot stands in for its listing
    (the digests that peer's own pull checked against the Hub); the pull says so.
    """
    try:
        commit = hub.commit(repo_id)
    except PullError as err:
        if err.error != "source_unreachable" or peers is None:
            raise
        found = peers.snapshot(source_uri)
        if found is None:
            raise
        peer, record = found
        if not filters_satisfied(record.get("file_filters"), filters):
            raise
        log.warning("%s; listing %s as peer %s recorded it", err.detail, source_uri, peer)
        files = huggingface.files_of_record(record, filters)
        return record.get("revision"), files, f"peer {peer}"
    files = hub.listing(repo_id, commit, filters)
    for f in files:
        hub.check_metadata(repo_id, commit, f)
    return commit, files, None


def _drop_unchecked(partial: Path, checked: dict[str, str]) -> None:
    """Remove what the pull did not check from its partial directory before it is placed: the
    parts of files it did not fetch, and files the snapshot no longer has (a top-up's links to
    files the repository has since dropped). Nothing of the recorded model is touched: these are
    links or copies in `.partial`."""
    shutil.rmtree(partial / huggingface.INCOMPLETE_DIR, ignore_errors=True)
    for rel, _size in inventory(partial):
        if rel not in checked:
            log.warning("%s is not in the pulled snapshot; left out of it", rel)
            (partial / rel).unlink(missing_ok=True)


def _bytes_present(blobs: Path, layers: list[oci.Layer]) -> int:
    total = 0
    for x in layers:
        for name in (f"sha256-{x.hex}", f"sha256-{x.hex}.part"):
            p = blobs / name
            if p.is_file():
                total += min(p.stat().st_size, x.size)
    return total

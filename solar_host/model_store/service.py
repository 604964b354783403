"""The model store service: pulls into MODELS_DIR, lists and deletes what is there.

A pull is one asyncio task per base source URI: callers of the same artifact share it and each
gets its own progress stream and terminal event. Downloads run in worker threads into
`MODELS_DIR/.partial/<slug>` and are renamed into `MODELS_DIR/<slug>` only once complete and
verified; a cancelled or interrupted pull leaves the partial directory for the next one to
resume. A monitor on the event loop emits throttled `downloading` events and aborts the pull
(507, partial removed) when free disk space falls under MIN_FREE_DISK_GB.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fnmatch
import logging
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solar_host.events import EventBus, PullProgress
from solar_host.model_store import huggingface, oci
from solar_host.model_store.manifest import Manifest, ManifestEntry, now_iso
from solar_host.model_store.progress import ByteCounter, ProgressCallback, PullReporter
from solar_host.model_store.pull import (
    PullError,
    PullRequest,
    check_request,
    filters_satisfied,
    inventory,
    largest_gguf,
    split_ref,
    sync_tree,
)
from solar_host.model_store.sources import SourceError, confine, repo_base_uri, slug_for
from solar_host.resources.probes import GB, disk_usage
from solar_host.settings import Settings

log = logging.getLogger(__name__)

# (instance_id, backend_type, absolute model paths, file_filters) of every instance that is
# starting, running or stopping.
InUse = Callable[[], list[tuple[str, str, list[str], list[str] | None]]]
SLUG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
PARTIAL = ".partial"


class StoreError(Exception):
    """A list/delete request that cannot be served; `status_code` is the HTTP status."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail


@dataclass
class _Job:
    """One download of one base URI, shared by every caller that wants the same thing."""

    key: tuple[str, tuple[str, ...] | None]
    reporters: list[PullReporter] = field(default_factory=list)
    task: asyncio.Task[ManifestEntry] | None = None
    cancel: oci.CancelToken = field(default_factory=oci.CancelToken)
    bytes_total: int | None = None


class ModelStore:
    def __init__(
        self, settings: Settings, *, bus: EventBus | None = None, probe: Any = None
    ) -> None:
        self.settings = settings
        self.bus = bus or EventBus()
        self.probe = probe
        self.in_use: InUse | None = None
        self._jobs: dict[str, _Job] = {}
        # slug -> [lock, holders and waiters]: a delete and a pull's "is the copy on disk
        # usable" check of one model take turns (see _model_turn).
        self._turns: dict[str, list[Any]] = {}

    # --- paths -------------------------------------------------------------------------------

    @property
    def models_dir(self) -> Path:
        return Path(self.settings.models_dir).absolute()

    @property
    def manifest(self) -> Manifest:
        return Manifest(self.models_dir)

    def _partial(self, slug: str) -> Path:
        return self.models_dir / PARTIAL / slug

    async def start(self) -> None:
        await asyncio.to_thread(self.manifest.ensure)
        await asyncio.to_thread(self._recover_replaced)

    async def stop(self) -> None:
        jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel.cancel()
            if job.task is not None:
                job.task.cancel()
        for job in jobs:
            if job.task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(job.task), 15)

    def lookup_dir(self, source_uri: str) -> Path | None:
        """The directory a pull left `source_uri` (repo:// or huggingface://, base) in."""
        entry = self.manifest.get(repo_base_uri(source_uri))
        if entry is None:
            return None
        path = Path(entry.path)
        return path if path.is_dir() else None

    def _free_bytes(self) -> int | None:
        probe = getattr(self.probe, "disk", None)
        usage = probe(self.models_dir) if probe else disk_usage(self.models_dir)
        return None if usage is None else int(usage.available_bytes)

    # --- listing -----------------------------------------------------------------------------

    def list_models(self) -> list[dict[str, Any]]:
        out = []
        for e in self.manifest.entries():
            files = inventory(Path(e.path))
            out.append(
                {
                    "name": e.slug,
                    "slug": e.slug,
                    "path": e.path,
                    "size_bytes": e.size_bytes,
                    "source_uri": e.source_uri,
                    "checksum": e.checksum or e.digest,
                    "downloaded_at": e.downloaded_at,
                    "category": e.category,
                    "model_name": e.name,
                    "version": e.version,
                    "metadata": e.metadata,
                    "file_filters": e.file_filters,
                    "files": [{"name": n, "size_bytes": s} for n, s in files],
                }
            )
        return out

    # --- pull --------------------------------------------------------------------------------

    def _reporter(
        self, uri: str, total: int | None, progress_cb: ProgressCallback | None
    ) -> PullReporter:
        def emit(payload: dict[str, Any]) -> None:
            if progress_cb is not None:
                try:
                    progress_cb(dict(payload))
                except Exception:
                    log.exception("pull progress callback failed")
            self.bus.publish(PullProgress(payload=payload))

        return PullReporter(
            uri, emit, interval_s=self.settings.pull_progress_interval_s, bytes_total=total
        )

    async def pull(
        self, request: PullRequest | dict[str, Any], progress_cb: ProgressCallback | None = None
    ) -> dict[str, Any]:
        """Make the model of `request` available; returns {path, cached, source_uri}.

        Raises PullError. Every call emits exactly one terminal progress event.
        """
        req = request if isinstance(request, PullRequest) else PullRequest.model_validate(request)
        rep = self._reporter(req.source_uri, req.size_bytes, progress_cb)
        rep.phase("resolving")
        try:
            result = await self._pull(req, rep)
        except PullError as err:
            rep.failed(err.detail)
            raise
        except asyncio.CancelledError:
            rep.failed("pull cancelled")
            raise
        except Exception as err:
            log.exception("pull of %s failed", req.source_uri)
            rep.failed(str(err) or type(err).__name__)
            raise PullError(500, "model_pull_failed", str(err) or type(err).__name__) from err
        rep.completed()
        return result

    async def _pull(self, req: PullRequest, rep: PullReporter) -> dict[str, Any]:
        harbor_host = None
        if req.source == "harbor":
            s = self.settings
            # Credentials are optional: an open registry (or a public project) pulls
            # anonymously, and a refused login names the registry and the settings to set.
            if not s.harbor_url:
                raise PullError(
                    503,
                    "credentials_missing",
                    "repo:// pulls need a registry: set HARBOR_URL (and HARBOR_USERNAME / "
                    "HARBOR_PASSWORD when it needs a login).",
                )
            harbor_host = oci.parse_registry_url(s.harbor_url)[1]
        # In a thread: the first check of a Hub id imports huggingface_hub (50 ms and more).
        slug = await asyncio.to_thread(check_request, req, harbor_host)
        base = req.base_uri
        self._refuse_shared_slug(base, slug)
        # A reference pinned to a manifest digest asks for exactly that artifact: a copy pulled
        # at another digest (the tag moved since) is not it. The body's `digest` is control's
        # label, whose kind the contract does not say: recorded alone, never compared.
        pinned = None
        if req.source == "harbor":
            pinned = split_ref(req.harbor_ref or "", harbor_host)[3]
        key = (base, tuple(req.filters) if req.filters is not None else None)
        for _ in range(8):
            async with self._model_turn(slug):
                entry = await asyncio.to_thread(self._usable_entry, base, req, pinned)
                if entry is not None:
                    return self._result(req, entry, cached=True)
            job = self._jobs.get(base)
            if job is not None and job.key != key:
                # Another request of the same artifact is downloading something else (other
                # filters): let it finish, then decide again from what is on disk.
                await _outcome(job.task)
                continue
            if job is None:
                # Checked again with no await before the job is registered: another source of
                # this slug may have started while _usable_entry ran in its thread.
                self._refuse_shared_slug(base, slug)
                job = _Job(key=key)
                self._jobs[base] = job
                job.task = asyncio.create_task(self._download(job, req, slug))
                job.task.add_done_callback(lambda _t, b=base, j=job: self._forget(b, j))
            job.reporters.append(rep)
            task = job.task
            try:
                entry = await asyncio.shield(task)  # type: ignore[arg-type]
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if task is not None and task.cancelled() and not (me and me.cancelling()):
                    raise PullError(500, "model_pull_failed", "The pull was cancelled") from None
                raise
            return self._result(req, entry, cached=False)
        raise PullError(503, "busy", "The artifact is being changed by other pulls; try again")

    def _refuse_shared_slug(self, base: str, slug: str) -> None:
        """repo://a--b:c and repo://a:b--c share a slug: one must never replace the other's
        files, whether the other is recorded or still being pulled."""
        others = [e.source_uri for e in self.manifest.entries() if e.slug == slug]
        others += [b for b in self._jobs if slug_for_safe(b) == slug]
        others = [o for o in others if o != base]
        if others:
            raise PullError(
                409,
                "conflict",
                f"{base} and {others[0]} would share the model directory {slug}; "
                f"delete {slug} first",
            )

    def _forget(self, base: str, job: _Job) -> None:
        if self._jobs.get(base) is job:
            del self._jobs[base]

    def cancel(self, source_uri: str) -> bool:
        """Cancel the running download of `source_uri`; what it fetched stays for a resume."""
        job = self._jobs.get(repo_base_uri(source_uri))
        if job is None or job.task is None:
            return False
        job.cancel.cancel()
        job.task.cancel()
        return True

    def _result(self, req: PullRequest, entry: ManifestEntry, *, cached: bool) -> dict[str, Any]:
        root = Path(entry.path)
        if req.subpath:
            try:
                path = confine(req.subpath, root, what="subpath")
            except SourceError as err:
                raise PullError(400, "invalid_request", str(err)) from None
            if not path.exists():
                raise PullError(
                    404,
                    "not_found",
                    f"Subpath '{req.subpath}' not found in artifact for {req.source_uri}.",
                )
        elif req.select_gguf:
            found = largest_gguf(root)
            if found is None:
                raise PullError(
                    404,
                    "not_found",
                    f"No .gguf file found in artifact for llamacpp backend ({req.source_uri}).",
                )
            path = found
        else:
            path = root
        return {"path": str(path), "cached": cached, "source_uri": req.source_uri}

    def _usable_entry(
        self, base: str, req: PullRequest, pinned: str | None = None
    ) -> ManifestEntry | None:
        """The recorded copy of `base`, if it is whole and is what `req` asks for (its files,
        and for a registry artifact the manifest digest it is pinned to)."""
        entry = self.manifest.get(base)
        if entry is None:
            return None
        if pinned and req.source == "harbor" and entry.digest != pinned:
            log.info("%s was pulled at %s; %s is asked for: pulling it", base, entry.digest, pinned)
            return None
        root = Path(entry.path)
        if not root.is_dir():
            log.warning("model dir %s of %s is gone; pulling again", root, base)
            return None
        for rel, size in (entry.file_sizes or {}).items():
            p = root / rel
            try:
                if p.stat().st_size != size:
                    log.warning("%s changed size since the pull; pulling again", p)
                    return None
            except OSError:
                log.warning("%s is missing; pulling again", p)
                return None
        if req.source == "huggingface" and not filters_satisfied(entry.file_filters, req.filters):
            return None
        return entry

    # --- the shared download -----------------------------------------------------------------

    async def _download(self, job: _Job, req: PullRequest, slug: str) -> ManifestEntry:
        partial = self._partial(slug)
        target = self.models_dir / slug
        old = self.manifest.get(req.base_uri)
        floor = int(self.settings.min_free_disk_gb * GB)
        # Adding files to a snapshot on disk: the download reuses its files (also when an
        # earlier top-up was interrupted and left its partial directory).
        topup = (
            req.source == "huggingface"
            and old is not None
            and Path(old.path) == target
            and target.is_dir()
        )
        filters = req.filters
        if topup and old is not None:
            filters = (
                None
                if filters is None or old.file_filters is None
                else sorted(set(old.file_filters) | set(filters))
            )
        counter = ByteCounter()
        layers: list[oci.Layer] = []
        registry: oci.Registry | None = None
        repo = ""
        manifest_digest = None

        if req.source == "harbor":
            s = self.settings
            registry = oci.Registry(s.harbor_url, s.harbor_username, s.harbor_password)
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
        elif req.size_bytes:
            job.bytes_total = req.size_bytes
        for r in job.reporters:
            if job.bytes_total is not None:
                r.bytes_total = job.bytes_total

        # Disk: what is still to fetch plus the floor must fit now.
        need = job.bytes_total
        if need is not None and req.source == "harbor":
            need -= _bytes_present(partial / "blobs", layers)
        free = await asyncio.to_thread(self._free_bytes)
        if free is not None and free < (need or 0) + floor:
            raise PullError(
                507,
                "insufficient_storage",
                f"Insufficient disk space. Available: {free / GB:.2f} GB, required: "
                f"{((need or 0) + floor) / GB:.2f} GB (including MIN_FREE_DISK_GB "
                f"{self.settings.min_free_disk_gb:.2f}).",
            )

        if topup:
            assert old is not None
            # The model stays where it is, recorded and usable, while the download runs: its
            # files are linked into the partial directory (no disk, no copy), and only the
            # finished snapshot replaces it. A failed or killed top-up leaves it as it was.
            await asyncio.to_thread(_link_snapshot, target, partial, old)

        def fetch() -> None:
            if registry is not None:
                blobs = partial / "blobs"
                for layer in layers:
                    if job.cancel.is_set():
                        raise oci.Cancelled()
                    registry.fetch_blob(repo, layer, blobs, counter, job.cancel)
            else:
                endpoint = self.settings.hf_endpoint or os.environ.get("HF_ENDPOINT") or None
                huggingface.download(
                    (req.model_id or "").strip().strip("/"),
                    partial,
                    token=self.settings.hf_token or None,
                    endpoint=endpoint,
                    allow_patterns=filters,
                    cancel=job.cancel.event,
                )

        try:
            measure = None if registry is not None else partial
            await self._run_monitored(job, fetch, counter, floor, partial, measure)
            for r in job.reporters:
                r.phase("verifying")  # blobs were hashed while streaming; now place the files
                r.phase("finalizing")
            try:
                entry = await asyncio.to_thread(
                    self._finalize,
                    job,
                    req,
                    slug,
                    partial,
                    target,
                    layers,
                    filters,
                    manifest_digest,
                    floor,
                )
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise PullError(
                        507, "insufficient_storage", "Insufficient disk space."
                    ) from err
                raise
            return entry
        except PullError as err:
            if err.status_code in (401, 404, 507):
                # Nothing worth resuming: free the disk. A top-up's partial directory holds
                # only links to the model, which stays as it was.
                await asyncio.to_thread(shutil.rmtree, partial, True)
            raise

    async def _run_monitored(
        self,
        job: _Job,
        fetch: Callable[[], None],
        counter: ByteCounter,
        floor: int,
        partial: Path,
        measure: Path | None = None,
    ) -> None:
        """Run `fetch` in a thread; report progress; abort on low disk or cancellation.

        Progress is what the fetch counted, or (`measure`) the bytes on disk under that dir.
        """
        await asyncio.to_thread(partial.mkdir, parents=True, exist_ok=True)
        fut = asyncio.ensure_future(asyncio.to_thread(fetch))
        poll = min(self.settings.pull_disk_poll_interval_s, self.settings.pull_progress_interval_s)
        last_t, last_b = time.monotonic(), counter.done
        first = True
        low_disk = False
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=0 if first else poll)
                if measure is not None:
                    counter.set(await asyncio.to_thread(huggingface.bytes_on_disk, measure))
                now = time.monotonic()
                speed = (counter.done - last_b) / (now - last_t) if now > last_t else None
                if not first:
                    last_t, last_b = now, counter.done
                for r in job.reporters:
                    r.downloading(counter.done, speed, force=first)
                first = False
                if done:
                    break
                free = await asyncio.to_thread(self._free_bytes)
                if free is not None and free < floor:
                    low_disk = True
                    job.cancel.cancel()
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(asyncio.shield(fut), 30)
                    break
            if low_disk:  # the caller clears what this pull fetched (see _download)
                raise PullError(
                    507, "insufficient_storage", "Insufficient disk space during download."
                )
            try:
                fut.result()
            except (oci.Cancelled, huggingface.PullCancelled):
                raise asyncio.CancelledError() from None
            except PullError:
                raise
            except OSError as err:
                if err.errno == 28:
                    raise PullError(
                        507, "insufficient_storage", "Insufficient disk space."
                    ) from err
                raise PullError(500, "model_pull_failed", f"{err}") from err
        except asyncio.CancelledError:
            # Stop the thread before giving up, so a resumed pull never races a live writer.
            job.cancel.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(fut), 30)
            raise

    def _finalize(
        self,
        job: _Job,
        req: PullRequest,
        slug: str,
        partial: Path,
        target: Path,
        layers: list[oci.Layer],
        filters: list[str] | None,
        manifest_digest: str | None,
        floor: int = 0,
    ) -> ManifestEntry:
        file_digests: dict[str, str] | None = None
        if layers:
            tree = partial / "tree"
            if tree.exists():
                shutil.rmtree(tree)

            def room(n: int) -> None:
                free = self._free_bytes()
                if free is not None and free - n < floor:
                    raise PullError(
                        507,
                        "insufficient_storage",
                        "Insufficient disk space while unpacking the artifact.",
                    )

            oci.assemble(layers, partial / "blobs", tree, room)
            file_digests = {x.title: x.digest for x in layers if not x.unpack}
            src = tree
        else:
            src = partial
        files = inventory(src)
        sync_tree(src)  # whole files before the rename; the manifest's fsync covers the rename
        metadata = dict(req.metadata or {})
        if req.source == "harbor":
            metadata.setdefault("harbor_ref", req.harbor_ref)
        entry = ManifestEntry(
            slug=slug,
            source_uri=req.base_uri,
            path=str(target),
            size_bytes=sum(s for _, s in files),
            # A registry artifact's digest is the one computed from its manifest; a caller's
            # digest only labels what has none (a HuggingFace snapshot).
            digest=manifest_digest or req.digest,
            downloaded_at=now_iso(),
            category=req.category,
            name=req.name,
            version=req.version,
            checksum=req.checksum,
            metadata=metadata or None,
            file_digests=file_digests,
            file_sizes=dict(files),
            file_filters=filters,
        )
        self._place(src, target, entry)
        if src != partial:
            shutil.rmtree(partial, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.models_dir / PARTIAL).rmdir()
        return entry

    def _place(self, src: Path, target: Path, entry: ManifestEntry) -> None:
        """Put the finished tree `src` at `target` and record it.

        This source's older copy is renamed aside first and removed only once the new one is
        recorded; if recording fails (a full disk), the swap is undone, so the manifest never
        names a directory that is not the one it describes. A crash between the renames
        leaves the older copy aside, where `start()` puts it back.
        """
        replaced = self._replaced(entry.slug)
        if target.exists():
            previous = self.manifest.get_slug(entry.slug)
            if previous is not None and previous.source_uri == entry.source_uri:
                shutil.rmtree(replaced, ignore_errors=True)
                replaced.parent.mkdir(parents=True, exist_ok=True)
                os.replace(target, replaced)
            else:
                self._keep_aside(target, entry)
        os.replace(src, target)
        try:
            self.manifest.upsert(entry)
        except OSError:
            os.replace(target, src)  # under .partial, where the caller's cleanup finds it
            if replaced.exists():
                os.replace(replaced, target)
            raise
        shutil.rmtree(replaced, ignore_errors=True)
        with contextlib.suppress(OSError):
            replaced.parent.rmdir()

    def _replaced(self, slug: str) -> Path:
        # Under a name no slug can take (slugs never start with "."): see _place.
        return self.models_dir / PARTIAL / ".replaced" / slug

    def _keep_aside(self, target: Path, entry: ManifestEntry) -> None:
        """A directory this store did not record (someone's own files, or a pull killed between
        placing its files and recording them): kept aside, never erased."""
        aside = target.with_name(f"{entry.slug}.kept-{time.strftime('%Y%m%dT%H%M%S')}")
        os.replace(target, aside)
        log.warning(
            "%s held files this store did not record; moved to %s before the pull of %s took "
            "its place",
            target,
            aside,
            entry.source_uri,
        )

    def _recover_replaced(self) -> None:
        """Put back an older copy a crash left aside between the renames of `_place`."""
        aside_dir = self.models_dir / PARTIAL / ".replaced"
        if not aside_dir.is_dir():
            return
        for aside in aside_dir.iterdir():
            target = self.models_dir / aside.name
            if target.exists() or self.manifest.get_slug(aside.name) is None:
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(aside, target)
                log.warning("restored %s, left aside by a pull that was interrupted", target)
        with contextlib.suppress(OSError):
            aside_dir.rmdir()

    # --- delete ------------------------------------------------------------------------------

    def _entry_for_slug(self, slug: str) -> tuple[ManifestEntry, Path]:
        if not SLUG_RE.match(slug) or slug in (".", "..") or slug == PARTIAL:
            raise StoreError(400, f"Invalid model name '{slug}'")
        entry = self.manifest.get_slug(slug)
        if entry is None:
            raise StoreError(404, f"Model '{slug}' not found")
        try:
            root = confine(entry.path, self.models_dir, what="model directory")
        except SourceError as err:
            raise StoreError(409, f"{err}; refusing to delete it") from None
        if root == self.models_dir.resolve():
            raise StoreError(409, "model entry points at MODELS_DIR itself; refusing to delete it")
        return entry, root

    def _users(self, root: Path) -> list[tuple[str, list[Path], list[str] | None]]:
        """Active instances with a model path inside `root`: (id, those paths, filters)."""
        if self.in_use is None:
            return []
        out = []
        for instance_id, _bt, paths, filters in self.in_use():
            inside = []
            for p in paths:
                try:
                    rp = Path(p).resolve()
                except (OSError, RuntimeError):
                    continue
                if rp == root or root in rp.parents:
                    inside.append(rp)
            if inside:
                out.append((instance_id, inside, filters))
        return out

    @contextlib.asynccontextmanager
    async def _model_turn(self, slug: str) -> AsyncIterator[None]:
        """One at a time per model: a delete, and a pull's check of the copy on disk. A pull
        that arrived while a delete removed files found them half gone and answered "cached"
        with a directory about to vanish, or started a download into it."""
        turn = self._turns.setdefault(slug, [asyncio.Lock(), 0])
        turn[1] += 1
        try:
            async with turn[0]:
                yield
        finally:
            turn[1] -= 1
            if turn[1] == 0:
                self._turns.pop(slug, None)

    async def delete(self, slug: str, filters: list[str] | None = None) -> dict[str, Any]:
        async with self._model_turn(slug):
            # Checked in the turn: a pull that found no usable copy registers its download
            # right after its turn, before any other task runs (nothing is awaited between).
            if any(slug_for_safe(base) == slug for base in self._jobs):
                raise StoreError(409, f"Model '{slug}' is being pulled")
            return await asyncio.to_thread(self._delete, slug, filters)

    def _delete(self, slug: str, filters: list[str] | None) -> dict[str, Any]:
        entry, root = self._entry_for_slug(slug)
        files = inventory(root)
        if filters:
            return self._delete_filtered(entry, root, files, filters)
        users = self._users(root)
        if users:
            raise StoreError(
                409, f"Model is in use by instance {users[0][0]}. Stop the instance first."
            )
        if root.is_dir():
            shutil.rmtree(root)
        elif root.exists():
            root.unlink()
        self.manifest.remove_slug(slug)
        return {
            "detail": "Model deleted",
            "name": slug,
            "removed": [n for n, _ in files],
            "freed_bytes": sum(s for _, s in files),
            "remaining": 0,
        }

    def _delete_filtered(
        self, entry: ManifestEntry, root: Path, files: list[tuple[str, int]], patterns: list[str]
    ) -> dict[str, Any]:
        slug = entry.slug
        if not files:
            shutil.rmtree(root, ignore_errors=True)
            self.manifest.remove_slug(slug)
            return {
                "detail": "Model deleted",
                "name": slug,
                "removed": [],
                "freed_bytes": 0,
                "remaining": 0,
            }
        matched = [(n, s) for n, s in files if any(fnmatch.fnmatch(n, p) for p in patterns)]
        if not matched:
            return {
                "detail": "No files match the requested filters",
                "name": slug,
                "removed": [],
                "freed_bytes": 0,
                "remaining": len(files),
            }
        names = {n for n, _ in matched}
        for instance_id, paths, inst_filters in self._users(root):
            if _overlaps(root, names, paths, inst_filters):
                raise StoreError(
                    409,
                    f"Model files are in use by instance {instance_id}. Stop the instance first.",
                )
        for n in sorted(names):
            (root / n).unlink(missing_ok=True)
        for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -len(t[0])):
            d = Path(dirpath)
            if (
                d != root
                and d.name not in (".cache",)
                and ".cache" not in d.relative_to(root).parts
            ):
                with contextlib.suppress(OSError):
                    d.rmdir()
        remaining = [(n, s) for n, s in files if n not in names]
        freed = sum(s for _, s in matched)
        removed = sorted(names)
        if not remaining:
            shutil.rmtree(root, ignore_errors=True)
            self.manifest.remove_slug(slug)
            return {
                "detail": f"Deleted {len(removed)} file(s)",
                "name": slug,
                "removed": removed,
                "freed_bytes": freed,
                "remaining": 0,
            }
        entry.file_filters = sorted(n for n, _ in remaining)
        entry.size_bytes = sum(s for _, s in remaining)
        keep = {n for n, _ in remaining}
        if entry.file_digests:
            entry.file_digests = {k: v for k, v in entry.file_digests.items() if k in keep}
        if entry.file_sizes:
            entry.file_sizes = {k: v for k, v in entry.file_sizes.items() if k in keep}
        self.manifest.upsert(entry)
        return {
            "detail": f"Deleted {len(removed)} file(s), {len(remaining)} remaining",
            "name": slug,
            "removed": removed,
            "freed_bytes": freed,
            "remaining": len(remaining),
        }


async def _outcome(task: asyncio.Task[Any] | None) -> None:
    """Wait for another caller's `task`, whatever it ends with; a cancellation of the waiter
    itself (its client went away) is not swallowed with the task's own failure."""
    if task is None:
        return
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise
    except Exception:
        pass  # that pull's failure is its callers' to report: this one decides anew


def _overlaps(root: Path, names: set[str], paths: list[Path], filters: list[str] | None) -> bool:
    """Whether deleting `names` (relative to `root`) takes files an instance uses."""
    for p in paths:
        if p.is_dir() or p == root:
            rel_dir = "" if p == root else p.relative_to(root).as_posix() + "/"
            under = [n for n in names if n.startswith(rel_dir)]
            if not under:
                continue
            if filters is None:
                return True
            if any(
                fnmatch.fnmatch(n, f) or fnmatch.fnmatch(n[len(rel_dir) :], f)
                for n in under
                for f in filters
            ):
                return True
        else:
            if p.relative_to(root).as_posix() in names:
                return True
    return False


def _bytes_present(blobs: Path, layers: list[oci.Layer]) -> int:
    total = 0
    for x in layers:
        for name in (f"sha256-{x.hex}", f"sha256-{x.hex}.part"):
            p = blobs / name
            if p.is_file():
                total += min(p.stat().st_size, x.size)
    return total


def slug_for_safe(uri: str) -> str | None:
    try:
        return slug_for(uri)
    except SourceError:
        return None


def _link_snapshot(target: Path, partial: Path, entry: ManifestEntry) -> None:
    """Give `partial` the recorded files of the snapshot in `target`, as hard links, with the
    metadata huggingface_hub keeps of them (copied: it rewrites those files in place), so that
    a download into `partial` fetches only what is missing.

    A recorded file whose size changed is damaged: neither it nor its metadata is carried over
    (huggingface_hub would keep it, its metadata saying it is complete), so it is fetched
    again. What `partial` already holds (an interrupted top-up) is kept.
    """
    meta = Path(".cache") / "huggingface" / "download"
    for rel, size in (entry.file_sizes or {}).items():
        try:
            src = confine(rel, target, what="recorded file")
            dst = confine(rel, partial, what="recorded file")
        except SourceError:
            continue  # not a name this store writes (a hand-edited manifest): left alone
        try:
            if src.is_symlink() or src.stat().st_size != size:
                log.warning("%s is damaged (not the size it was pulled at); fetching it again", src)
                continue
        except OSError:
            continue  # missing: fetched again
        _carry(src, dst, copy=False)
        _carry(target / meta / f"{rel}.metadata", partial / meta / f"{rel}.metadata", copy=True)


def _carry(src: Path, dst: Path, *, copy: bool) -> None:
    """Link (or copy) `src` to `dst` unless `dst` exists; a file that cannot be linked (a
    filesystem without hard links) is left to be fetched again."""
    if dst.exists() or not src.is_file():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        if copy:
            shutil.copy2(src, dst)
        else:
            os.link(src, dst)
    except OSError as err:
        log.warning("cannot reuse %s for the pull (%s); fetching it again", src, err)

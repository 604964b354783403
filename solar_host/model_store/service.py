"""The model store service: pulls into MODELS_DIR, lists, verifies and deletes what is there.

A pull is one asyncio task per base source URI: callers of the same artifact share it and each
gets its own progress stream and terminal event; `download.py` runs that task (fetch into
`.partial/<slug>`, check, place). Deletes and a pull's check of the copy on disk take turns
per model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from solar_host.events import EventBus, PullProgress
from solar_host.model_store.catalog import SLUG_RE, StoreError, local_models, recorded
from solar_host.model_store.deletion import InUse, delete_model
from solar_host.model_store.manifest import Manifest, ManifestEntry
from solar_host.model_store.pacing import RateCap
from solar_host.model_store.pieces import Board
from solar_host.model_store.placement import PARTIAL, recover_replaced, replaced_path
from solar_host.model_store.progress import ProgressCallback, PullReporter
from solar_host.model_store.pull import (
    PullError,
    PullRequest,
    check_request,
    filters_satisfied,
    largest_gguf,
    split_ref,
)
from solar_host.model_store.sources import SourceError, confine, repo_base_uri, slug_for
from solar_host.model_store.verify import MISMATCH, MISSING, verify_model
from solar_host.resources.probes import SystemProbe, disk_usage
from solar_host.settings import Settings

if TYPE_CHECKING:
    # Imported by the first pull (download and oci bring the Hub and registry clients, tar
    # and the layer code): 10-15 ms of every host start that pulls nothing.
    from solar_host.model_store.download import Download, PullJob

log = logging.getLogger(__name__)

DAMAGED = (MISMATCH, MISSING)  # verify results that make the next pull fetch the file again

__all__ = ["InUse", "ModelStore", "StoreError"]


class ModelStore:
    def __init__(
        self, settings: Settings, *, bus: EventBus | None = None, probe: Any = None
    ) -> None:
        self.settings = settings
        self.bus = bus or EventBus()
        self.probe = probe
        self.in_use: InUse | None = None
        self._jobs: dict[str, PullJob] = {}
        # One cap for every pull of this host (PULL_MAX_BYTES_PER_S).
        self._rate_cap = RateCap(settings.pull_max_bytes_per_s)
        # One cap for everything this host sends its peers (PEER_MAX_UPLOAD_BYTES_PER_S), and
        # the record of the files its pulls fetch piece by piece, which peers may take from.
        self.upload_cap = RateCap(settings.peer_max_upload_bytes_per_s)
        self.board = Board()
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

    def _download(self) -> Download:
        from solar_host.model_store.download import Download

        return Download(
            self.settings, self.manifest, self._free_bytes, self._rate_cap, board=self.board
        )

    async def start(self) -> None:
        await asyncio.to_thread(self.manifest.ensure)
        await asyncio.to_thread(recover_replaced, self.models_dir, self.manifest)

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
        probe: SystemProbe | None = self.probe
        usage = probe.disk(self.models_dir) if probe is not None else disk_usage(self.models_dir)
        return None if usage is None else int(usage.available_bytes)

    # --- listing -----------------------------------------------------------------------------

    def list_models(self) -> list[dict[str, Any]]:
        """Recorded models, then model files found in the model roots that no pull recorded."""
        entries = self.manifest.entries()
        out = [recorded(e) for e in entries]
        dirs = set()
        for e in entries:
            with contextlib.suppress(OSError, RuntimeError):
                dirs.add(Path(e.path).resolve())
        return out + local_models(self.settings.model_root_dirs, dirs)

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
        from solar_host.model_store import oci
        from solar_host.model_store.download import PullJob

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
                job = PullJob(key=key)
                self._jobs[base] = job
                job.task = asyncio.create_task(self._download().run(job, req, slug))
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

    def _forget(self, base: str, job: PullJob) -> None:
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
        if entry.damaged:
            log.warning("verify found %s of %s damaged; pulling again", entry.damaged, base)
            return None
        return entry

    def _replaced(self, slug: str) -> Path:
        return replaced_path(self.models_dir, slug)

    # --- delete ------------------------------------------------------------------------------

    def _entry_for_slug(self, slug: str, doing: str = "delete") -> tuple[ManifestEntry, Path]:
        if not SLUG_RE.match(slug) or slug in (".", "..") or slug == PARTIAL:
            raise StoreError(400, f"Invalid model name '{slug}'")
        entry = self.manifest.get_slug(slug)
        if entry is None:
            raise StoreError(404, f"Model '{slug}' not found")
        try:
            root = confine(entry.path, self.models_dir, what="model directory")
        except SourceError as err:
            raise StoreError(409, f"{err}; refusing to {doing} it") from None
        if root == self.models_dir.resolve():
            raise StoreError(
                409, f"model entry points at MODELS_DIR itself; refusing to {doing} it"
            )
        return entry, root

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

    async def verify(self, slug: str) -> dict[str, Any]:
        """Read a recorded model's files again and check them against the recorded digests;
        what is damaged is noted in the manifest, so that the next pull fetches it again."""
        async with self._model_turn(slug):
            if any(slug_for_safe(base) == slug for base in self._jobs):
                raise StoreError(409, f"Model '{slug}' is being pulled")
            return await asyncio.to_thread(self._verify, slug)

    def _verify(self, slug: str) -> dict[str, Any]:
        entry, root = self._entry_for_slug(slug, "verify")
        report = verify_model(entry, root)
        damaged = sorted(f["name"] for f in report["files"] if f["result"] in DAMAGED)
        if damaged != sorted(entry.damaged or []):
            entry.damaged = damaged or None
            self.manifest.upsert(entry)
        return report

    def _delete(self, slug: str, filters: list[str] | None) -> dict[str, Any]:
        entry, root = self._entry_for_slug(slug)
        return delete_model(self.manifest, entry, root, filters, self.in_use)


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


def slug_for_safe(uri: str) -> str | None:
    try:
        return slug_for(uri)
    except SourceError:
        return None

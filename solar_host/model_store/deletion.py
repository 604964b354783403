"""Deleting a recorded model, whole or only the files matching some globs.

A model (or a file) an active instance uses is refused with a 409 naming the instance; the
manifest is updated after the files go, so a crash in between leaves a record whose files are
missing (pulled again on use) rather than files no record names.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from solar_host.model_store.catalog import StoreError
from solar_host.model_store.manifest import Manifest, ManifestEntry
from solar_host.model_store.pull import inventory

# (instance_id, backend_type, absolute model paths, file_filters) of every instance that is
# starting, running or stopping.
InUse = Callable[[], list[tuple[str, str, list[str], list[str] | None]]]


def users_of(in_use: InUse | None, root: Path) -> list[tuple[str, list[Path], list[str] | None]]:
    """Active instances with a model path inside `root`: (id, those paths, filters)."""
    if in_use is None:
        return []
    out = []
    for instance_id, _bt, paths, filters in in_use():
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


def delete_model(
    manifest: Manifest,
    entry: ManifestEntry,
    root: Path,
    filters: list[str] | None,
    in_use: InUse | None,
) -> dict[str, Any]:
    slug = entry.slug
    files = inventory(root)
    if filters:
        return _delete_filtered(manifest, entry, root, files, filters, in_use)
    users = users_of(in_use, root)
    if users:
        raise StoreError(
            409, f"Model is in use by instance {users[0][0]}. Stop the instance first."
        )
    if root.is_dir():
        shutil.rmtree(root)
    elif root.exists():
        root.unlink()
    manifest.remove_slug(slug)
    return {
        "detail": "Model deleted",
        "name": slug,
        "removed": [n for n, _ in files],
        "freed_bytes": sum(s for _, s in files),
        "remaining": 0,
    }


def _delete_filtered(
    manifest: Manifest,
    entry: ManifestEntry,
    root: Path,
    files: list[tuple[str, int]],
    patterns: list[str],
    in_use: InUse | None,
) -> dict[str, Any]:
    slug = entry.slug
    if not files:
        shutil.rmtree(root, ignore_errors=True)
        manifest.remove_slug(slug)
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
    for instance_id, paths, inst_filters in users_of(in_use, root):
        if _overlaps(root, names, paths, inst_filters):
            raise StoreError(
                409,
                f"Model files are in use by instance {instance_id}. Stop the instance first.",
            )
    for n in sorted(names):
        (root / n).unlink(missing_ok=True)
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -len(t[0])):
        d = Path(dirpath)
        if d != root and d.name not in (".cache",) and ".cache" not in d.relative_to(root).parts:
            with contextlib.suppress(OSError):
                d.rmdir()
    remaining = [(n, s) for n, s in files if n not in names]
    freed = sum(s for _, s in matched)
    removed = sorted(names)
    if not remaining:
        shutil.rmtree(root, ignore_errors=True)
        manifest.remove_slug(slug)
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
    manifest.upsert(entry)
    return {
        "detail": f"Deleted {len(removed)} file(s), {len(remaining)} remaining",
        "name": slug,
        "removed": removed,
        "freed_bytes": freed,
        "remaining": len(remaining),
    }


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

"""Putting a finished pull in place: the rename into MODELS_DIR, the older copy set aside and
put back after a crash, and the files of a model on disk lent to a pull that adds to it.

Every step renames or links; nothing here erases a directory the store did not record (an
operator's own files are moved aside under `<slug>.kept-<time>`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

from solar_host.model_store.manifest import Manifest, ManifestEntry
from solar_host.model_store.sources import SourceError, confine

log = logging.getLogger(__name__)

PARTIAL = ".partial"


def replaced_path(models_dir: Path, slug: str) -> Path:
    # Under a name no slug can take (slugs never start with "."): see place().
    return models_dir / PARTIAL / ".replaced" / slug


def place(
    models_dir: Path, manifest: Manifest, src: Path, target: Path, entry: ManifestEntry
) -> None:
    """Put the finished tree `src` at `target` and record it.

    This source's older copy is renamed aside first and removed only once the new one is
    recorded; if recording fails (a full disk), the swap is undone, so the manifest never
    names a directory that is not the one it describes. A crash between the renames
    leaves the older copy aside, where `recover_replaced()` puts it back.
    """
    replaced = replaced_path(models_dir, entry.slug)
    if target.exists():
        previous = manifest.get_slug(entry.slug)
        if previous is not None and previous.source_uri == entry.source_uri:
            shutil.rmtree(replaced, ignore_errors=True)
            replaced.parent.mkdir(parents=True, exist_ok=True)
            os.replace(target, replaced)
        else:
            keep_aside(target, entry)
    os.replace(src, target)
    try:
        manifest.upsert(entry)
    except OSError:
        os.replace(target, src)  # under .partial, where the caller's cleanup finds it
        if replaced.exists():
            os.replace(replaced, target)
        raise
    shutil.rmtree(replaced, ignore_errors=True)
    with contextlib.suppress(OSError):
        replaced.parent.rmdir()


def keep_aside(target: Path, entry: ManifestEntry) -> None:
    """A directory this store did not record (someone's own files, or a pull killed between
    placing its files and recording them): kept aside, never erased."""
    aside = target.with_name(f"{entry.slug}.kept-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(target, aside)
    log.warning(
        "%s held files this store did not record; moved to %s before the pull of %s took its place",
        target,
        aside,
        entry.source_uri,
    )


def recover_replaced(models_dir: Path, manifest: Manifest) -> None:
    """Put back an older copy a crash left aside between the renames of `place`."""
    aside_dir = models_dir / PARTIAL / ".replaced"
    if not aside_dir.is_dir():
        return
    for aside in aside_dir.iterdir():
        target = models_dir / aside.name
        if target.exists() or manifest.get_slug(aside.name) is None:
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, target)
            log.warning("restored %s, left aside by a pull that was interrupted", target)
    with contextlib.suppress(OSError):
        aside_dir.rmdir()
    remove_if_empty(models_dir / PARTIAL)


def remove_if_empty(path: Path) -> None:
    """rmdir `path` when it holds nothing (a pull that failed leaves no empty directory)."""
    with contextlib.suppress(OSError):
        path.rmdir()


def link_snapshot(target: Path, partial: Path, entry: ManifestEntry) -> None:
    """Give `partial` the recorded files of the model in `target`, as hard links, so that a
    download into `partial` fetches only what is missing.

    A recorded file whose size changed is damaged and not carried over; every file carried
    over is checked against its source's digest before it is kept (huggingface.Hub.fetch).
    What `partial` already holds (an interrupted top-up) is kept, and checked alike.
    """
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
        _carry(src, dst)


def _carry(src: Path, dst: Path) -> None:
    """Link `src` to `dst` unless `dst` exists; a file that cannot be linked (a filesystem
    without hard links) is left to be fetched again."""
    if dst.exists() or not src.is_file():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError as err:
        log.warning("cannot reuse %s for the pull (%s); fetching it again", src, err)

"""Per-instance SGLang prompt-cache directories: where they live and how they go away.

SGLang's file storage backend writes KV pages under SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR and
reads back whatever it finds there. A start must therefore never see an older run's pages
(they may belong to other weights or another config), and a stop must not wait for a
multi-gigabyte delete. So a directory is first *detached* (an O(1) rename to a sibling
`.trash-<uuid4>`, after which nothing can reach it under the instance's name) and then
*purged* on a daemon thread. The root must be dedicated to one host: the boot sweep removes
every instance-shaped directory in it.

Nothing here raises: a cache that cannot be cleaned is logged and left, never a failed stop.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import sys
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path

from solar_host.backends.base import alias_safe

log = logging.getLogger(__name__)

TRASH_PREFIX = ".trash-"
# Instance directories end with `-<instance id>`, and instance ids are uuid4 strings: the boot
# sweep only touches names of that shape (so `shared-data` and the like survive).
_UUID_SUFFIX = re.compile(r"-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]+$")

Root = str | os.PathLike[str] | None


def instance_cache_dir(root: Root, alias: str, instance_id: str) -> Path | None:
    """`<root>/<alias_safe>-<instance_id>`, or None when no cache root is configured."""
    if root is None or not str(root).strip():
        return None
    if not _SAFE_ID.match(instance_id) or instance_id in {".", ".."}:
        raise ValueError(f"instance id {instance_id!r} is not usable in a path")
    return Path(str(root).strip()) / f"{alias_safe(alias)}-{instance_id}"


def _is_real_dir(path: Path) -> bool:
    """A directory that is not a symlink (lstat: links are never followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _trash_name(parent: Path) -> Path:
    return parent / f"{TRASH_PREFIX}{uuid.uuid4()}"


def _detach_dir(path: Path) -> Path | None:
    """Rename a real directory to a `.trash-<uuid4>` sibling; None if nothing was detached."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("cannot inspect prompt cache %s: %s", path, err)
        return None
    if not stat.S_ISDIR(mode):
        # A symlink (or a loose file) is left alone: renaming or deleting through it could
        # reach data outside the cache root.
        return None
    trash = _trash_name(path.parent)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("cannot detach prompt cache %s: %s", path, err)
        return None
    return trash


def detach(root: Root, alias: str, instance_id: str) -> Path | None:
    """Detach the instance's cache directory (O(1) rename). Returns the trash path or None."""
    try:
        path = instance_cache_dir(root, alias, instance_id)
    except ValueError as err:
        log.warning("no prompt cache to detach: %s", err)
        return None
    return _detach_dir(path) if path is not None else None


def _purge_one(path: Path) -> None:
    left: list[str] = []

    def collect(_func: object, entry: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            left.append(entry)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=collect)
    else:  # pragma: no cover - exercised on 3.11 CI, same collector

        def onerror(func: object, entry: str, exc_info: tuple) -> None:
            collect(func, entry, exc_info[1])

        shutil.rmtree(path, onerror=onerror)
    if left:
        log.warning("Purge of %s left %d entries behind; first: %s", path, len(left), left[0])


def _purge_all(paths: list[Path]) -> None:
    for path in paths:
        try:
            _purge_one(path)
        except Exception:  # each directory on its own: one failure never stops the next
            log.exception("Purge of %s failed", path)


def purge_in_background(paths: Iterable[Path | None]) -> threading.Thread | None:
    """Delete detached directories on a daemon thread; returns it (tests join it) or None."""
    todo = [Path(p) for p in paths if p is not None]
    if not todo:
        return None
    thread = threading.Thread(
        target=_purge_all, args=(todo,), name="sglang-cache-purge", daemon=True
    )
    try:
        thread.start()
    except RuntimeError as err:  # interpreter shutting down, thread limit reached
        log.warning("cannot start prompt cache purge: %s", err)
        return None
    return thread


def discard(root: Root, alias: str, instance_id: str) -> Path | None:
    """Detach the instance's cache now and delete it in the background."""
    trash = detach(root, alias, instance_id)
    if trash is not None:
        purge_in_background([trash])
    return trash


def prepare(root: Root, alias: str, instance_id: str) -> Path | None:
    """A fresh, empty cache directory for a start: the old one is detached first and purged.

    Returns the directory, or None when no root is configured or it cannot be created (then
    a warning is logged and SGLang creates the directory itself or runs without it).
    """
    try:
        path = instance_cache_dir(root, alias, instance_id)
    except ValueError as err:
        log.warning("no prompt cache prepared: %s", err)
        return None
    if path is None:
        return None
    old = _detach_dir(path)
    if old is not None:
        purge_in_background([old])
    try:
        # 0700: the pages hold users' prompts.
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as err:
        log.warning("cannot create prompt cache %s: %s", path, err)
        return None
    if not _is_real_dir(path):
        log.warning("prompt cache %s is not a directory (a symlink?); not used", path)
        return None
    return path


def sweep(root: Root, keep: Iterable[str] = ()) -> list[Path]:
    """Boot: detach every instance-shaped directory and collect old trash; purge in background.

    Only real directories are touched: names ending in a uuid4 are renamed to trash, names
    starting with `.trash-` are collected as they are; files, symlinks and other directories
    stay, and so do the directories named in `keep` (those of backends re-adopted alive).
    Returns the trash paths being purged.
    """
    kept = set(keep)
    if root is None or not str(root).strip():
        return []
    base = Path(str(root).strip())
    try:
        children = sorted(os.scandir(base), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as err:
        log.warning("cannot list prompt cache root %s: %s", base, err)
        return []
    trash: list[Path] = []
    for entry in children:
        try:
            if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        path = Path(entry.path)
        if entry.name.startswith(TRASH_PREFIX):
            trash.append(path)
        elif _UUID_SUFFIX.search(entry.name) and entry.name not in kept:
            detached = _detach_dir(path)
            if detached is not None:
                trash.append(detached)
    purge_in_background(trash)
    return trash

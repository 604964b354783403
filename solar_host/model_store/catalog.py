"""What the store lists: the models its pulls recorded, and model files found on disk that no
pull recorded (a GGUF an operator copied into MODELS_DIR or a MODEL_ROOTS directory).

Found files are listed with `source: "local"` and no source URI: the store never deletes or
replaces them (a DELETE names recorded models only). The walk is bounded (depth and entries),
skips hidden names (`.partial`, `.cache`) and every recorded model directory, and never
follows a directory link (a link to `/` would walk the machine).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from solar_host.model_store.manifest import ManifestEntry
from solar_host.model_store.pull import inventory

SLUG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
# How deep under a root, and how many directory entries in all, the walk looks.
MAX_DEPTH = 4
MAX_ENTRIES = 20_000
# A directory with one of these beside a config.json is a HuggingFace-style model directory.
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


class StoreError(Exception):
    """A list/delete/verify request that cannot be served; `status_code` is the HTTP status."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail


def recorded(entry: ManifestEntry) -> dict[str, Any]:
    """A recorded model as GET /models lists it."""
    files = inventory(Path(entry.path))
    return {
        "name": entry.slug,
        "slug": entry.slug,
        "source": "pulled",
        "path": entry.path,
        "size_bytes": entry.size_bytes,
        "source_uri": entry.source_uri,
        "checksum": entry.checksum or entry.digest,
        "downloaded_at": entry.downloaded_at,
        "category": entry.category,
        "model_name": entry.name,
        "version": entry.version,
        "metadata": entry.metadata,
        "file_filters": entry.file_filters,
        "verified": bool(entry.file_digests),
        "files": [{"name": n, "size_bytes": s} for n, s in files],
    }


def local_models(roots: list[Path], recorded_dirs: set[Path]) -> list[dict[str, Any]]:
    """Model files and directories under `roots` that no pull recorded, one entry each."""
    out: list[dict[str, Any]] = []
    seen: set[Path] = set()
    budget = [MAX_ENTRIES]
    for root in roots:
        try:
            real_root = root.resolve()
        except (OSError, RuntimeError):
            continue
        if not real_root.is_dir():
            continue
        for path, files in _found(real_root, recorded_dirs, budget):
            if path in seen:
                continue
            seen.add(path)
            out.append(_local_entry(path, files, real_root))
    out.sort(key=lambda m: m["path"])
    return out


def _found(
    root: Path, recorded_dirs: set[Path], budget: list[int]
) -> Iterator[tuple[Path, list[tuple[str, int]]]]:
    """(model path, its files) under `root`: each *.gguf file, and each directory holding a
    config.json beside weights (listed as one model, not walked further)."""
    stack = [(root, 0)]
    while stack:
        d, depth = stack.pop()
        if d in recorded_dirs:
            continue
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        budget[0] -= len(entries)
        if budget[0] < 0:
            return
        names = {e.name for e in entries if _is_file(e)}
        if d != root and "config.json" in names and any(n.endswith(_WEIGHTS) for n in names):
            yield d, inventory(d)
            continue
        for e in entries:
            if e.name.startswith("."):
                continue
            if _is_file(e) and e.name.lower().endswith(".gguf"):
                yield Path(e.path), [(e.name, _size(e))]
            elif depth < MAX_DEPTH and e.is_dir(follow_symlinks=False):
                stack.append((Path(e.path), depth + 1))


def _is_file(e: os.DirEntry[str]) -> bool:
    try:
        return e.is_file(follow_symlinks=True)
    except OSError:
        return False


def _size(e: os.DirEntry[str]) -> int:
    try:
        return e.stat(follow_symlinks=True).st_size
    except OSError:
        return 0


def _local_entry(path: Path, files: list[tuple[str, int]], root: Path) -> dict[str, Any]:
    rel = path.relative_to(root).as_posix()
    try:
        mtime = datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat()
    except OSError:
        mtime = None
    return {
        "name": rel,
        "slug": None,
        "source": "local",
        "path": str(path),
        "size_bytes": sum(s for _, s in files),
        "source_uri": None,
        "checksum": None,
        "downloaded_at": None,
        "modified_at": mtime,
        "root": str(root),
        "category": None,
        "model_name": None,
        "version": None,
        "metadata": None,
        "file_filters": None,
        "verified": False,
        "files": [{"name": n, "size_bytes": s} for n, s in files],
    }

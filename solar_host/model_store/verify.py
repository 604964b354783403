"""Checking a recorded model on disk against the digests its pull recorded (no network).

Every file a pull placed was checked against its source's digest before it got its name, and
its sha256 recorded in the manifest; `verify_model` reads each file again and compares. It
only reports: a damaged file is named (and the next pull of the model, which checks sizes,
or the operator, replaces it), never removed here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from solar_host.model_store.manifest import ManifestEntry
from solar_host.model_store.pull import inventory
from solar_host.model_store.sources import SourceError, confine
from solar_host.model_store.transfer import hash_file

# Results, one per file.
OK = "ok"
MISMATCH = "mismatch"  # the bytes' digest is not the recorded one
MISSING = "missing"  # recorded, but not on disk
UNRECORDED = "unrecorded"  # on disk, but its pull recorded no digest (pulled before digests)
EXTRA = "extra"  # on disk, but no pull placed it


def verify_model(entry: ManifestEntry, root: Path) -> dict[str, Any]:
    """{name, path, ok, checked_bytes, files: [{name, size_bytes, expected, result, got?}]}."""
    recorded = dict(entry.file_digests or {})
    on_disk = dict(inventory(root))
    names = sorted(set(recorded) | set(on_disk) | set(entry.file_sizes or {}))
    files = []
    checked = 0
    for name in names:
        expected = recorded.get(name)
        row: dict[str, Any] = {
            "name": name,
            "size_bytes": on_disk.get(name),
            "expected": expected,
        }
        if name not in on_disk:
            row["result"] = MISSING
        elif expected is None:
            row["result"] = UNRECORDED if name in (entry.file_sizes or {}) else EXTRA
        else:
            got = _digest(root, name, expected)
            checked += on_disk[name]
            row["result"] = OK if got == expected else MISMATCH
            if got != expected:
                row["got"] = got
        files.append(row)
    return {
        "name": entry.slug,
        "path": entry.path,
        "source_uri": entry.source_uri,
        "ok": bool(files) and all(f["result"] == OK for f in files),
        "checked_bytes": checked,
        "files": files,
    }


def _digest(root: Path, name: str, expected: str) -> str:
    """The digest of `root/name` in the algorithm of `expected` (sha256; a file that escapes
    the model directory through a link reads as a mismatch, never followed)."""
    try:
        path = confine(name, root, what="model file")
    except SourceError:
        return "outside-the-model"
    algorithm = expected.split(":", 1)[0]
    if algorithm != "sha256":
        return f"unsupported:{algorithm}"
    h = hashlib.sha256()
    try:
        hash_file(path, h)
    except OSError as err:
        return f"unreadable:{err.strerror or err}"
    return f"sha256:{h.hexdigest()}"

"""MODELS_DIR/manifest.json: what the store holds, keyed by base source URI.

The manifest is small, so it is re-read on every access (an operator may edit it) and rewritten
whole, atomically, on every change. A missing or unreadable manifest is treated as empty and
logged: the host must never fail to start because of it. Only entries in the manifest are models;
directories without an entry are invisible (half-finished pulls live under `.partial/`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from solar_host.instances.store import atomic_write_bytes

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"


@dataclass
class ManifestEntry:
    slug: str
    source_uri: str  # the base URI (no repo subpath): the cache key
    path: str  # absolute directory
    size_bytes: int = 0
    digest: str | None = None
    downloaded_at: str | None = None
    category: str | None = None
    name: str | None = None
    version: str | None = None
    checksum: str | None = None
    metadata: dict[str, Any] | None = None
    file_digests: dict[str, str] | None = None  # relative posix path -> "sha256:<hex>"
    file_sizes: dict[str, int] | None = None  # relative posix path -> bytes (cache check)
    # relative posix path -> the digest its source published ("gitsha1:<hex>" for a Hub file
    # kept in git; an LFS file's is its sha256): what peers are asked for
    source_digests: dict[str, str] | None = None
    # files the last verify found damaged or missing: the next pull of the model fetches
    # them again instead of answering "cached" (a pull checks sizes only)
    damaged: list[str] | None = None
    file_filters: list[str] | None = None  # None: the whole repository

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ManifestEntry:
        """An entry of its own: containers are copied, so changing one never changes `raw`
        (the manifest's parsed file, kept while the file is unchanged)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: _copied(v) for k, v in raw.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _copied(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return value


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class Manifest:
    models_dir: Path
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    # The parsed file and the (inode, size, mtime) it was parsed at: every pull, create and
    # model listing asks for the entries, and a manifest of a few hundred models with their
    # file digests takes milliseconds to parse. A write renames a new file into place.
    _parsed: tuple[tuple[int, int, int], list[dict[str, Any]]] | None = field(
        default=None, repr=False
    )

    @property
    def path(self) -> Path:
        return self.models_dir / MANIFEST_NAME

    def ensure(self) -> None:
        """Create MODELS_DIR and a valid manifest; a corrupt one is set aside and rebuilt empty."""
        with self._lock:
            self.models_dir.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():
                self._write([])
                return
            if self._read_raw() is None:
                aside = self.path.with_name(f"{MANIFEST_NAME}.corrupt-{int(time.time())}")
                try:
                    self.path.replace(aside)
                    log.error(
                        "manifest %s was unreadable; kept as %s, rebuilt empty", self.path, aside
                    )
                except OSError as err:
                    log.error("manifest %s was unreadable (%s); rebuilt empty", self.path, err)
                self._write([])

    def _read_raw(self) -> list[dict[str, Any]] | None:
        try:
            st = os.stat(self.path)
            signature = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self._parsed is not None and self._parsed[0] == signature:
                return self._parsed[1]
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError):
            return None
        models = data.get("models") if isinstance(data, dict) else None
        if not isinstance(models, list):
            return None
        parsed = [m for m in models if isinstance(m, dict)]
        # Kept under the signature read before the file: a file replaced in between is read
        # again next time (its signature differs), never taken for the one stat-ed.
        self._parsed = (signature, parsed)
        return parsed

    def entries(self) -> list[ManifestEntry]:
        with self._lock:
            raw = self._read_raw()
            if raw is None:
                log.error("manifest %s is unreadable; treating it as empty", self.path)
                return []
            out = []
            for item in raw:
                try:
                    out.append(ManifestEntry.from_dict(item))
                except TypeError:
                    log.warning("manifest entry without required fields skipped: %r", item)
            return out

    def _write(self, entries: list[ManifestEntry]) -> None:
        body = {"models": [e.to_dict() for e in entries]}
        atomic_write_bytes(self.path, json.dumps(body, indent=2).encode())

    def get(self, source_uri: str) -> ManifestEntry | None:
        return next((e for e in self.entries() if e.source_uri == source_uri), None)

    def get_slug(self, slug: str) -> ManifestEntry | None:
        return next((e for e in self.entries() if e.slug == slug), None)

    def upsert(self, entry: ManifestEntry) -> None:
        with self._lock:
            rest = [e for e in self.entries() if e.source_uri != entry.source_uri]
            self._write([*rest, entry])

    def remove(self, source_uri: str) -> bool:
        with self._lock:
            current = self.entries()
            rest = [e for e in current if e.source_uri != source_uri]
            if len(rest) == len(current):
                return False
            self._write(rest)
            return True

    def remove_slug(self, slug: str) -> ManifestEntry | None:
        with self._lock:
            current = self.entries()
            found = next((e for e in current if e.slug == slug), None)
            if found is not None:
                self._write([e for e in current if e.slug != slug])
            return found

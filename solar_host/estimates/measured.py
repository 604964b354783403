"""Measured memory: what a load of one config really took, remembered per key across restarts.

A key names what decides a backend's memory: the model files (path, size, mtime), the backend
type and version (the executable's identity where the host resolves one), and every config
field except those known not to change memory (sampling defaults, names, the port). A field this
module does not know is part of the key: a new field can only make a config "never measured"
(the estimate answers), never make two configs share a measurement.

A measurement keeps, per device, the peak over the whole load and serving (what admission
needs: a load is admitted for its peak) and the last steady figure while serving. GPU figures
are kept in the order of the GPUs the instance used, not by index: the same config placed on
another GPU next time takes the same memory there.

memory-measurements.json (beside config.json) follows statefiles' rules: atomic fsynced
writes, the previous version kept as `.prev`. A file that cannot be used is not erased: it is
moved aside to `<file>.damaged-<UTC time>` (quarantined) and the last good copy is loaded
instead when it parses, else the host starts with no measurements (the estimate answers until
each config is measured again). Measurements are a cache of facts that come back with the next
load; refusing to start over one would trade availability for nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from solar_host.estimates.model import CPU
from solar_host.platform.statefiles import (
    PRIVATE,
    StateFileError,
    atomic_write_bytes,
    last_good_path,
    parse_json,
    read_regular,
    sweep_temp_files,
    tighten_mode,
)

log = logging.getLogger(__name__)

FILE_NAME = "memory-measurements.json"
FILE_VERSION = 1
# Config fields that do not change what a backend holds in memory.
NON_MEMORY_FIELDS = frozenset(
    {
        "alias",
        "host",
        "port",
        "api_key",
        "skip_fit_check",
        "model_source",
        "file_filters",
        "temp",
        "top_p",
        "top_k",
        "min_p",
        "chat_template_file",
        "chat_template_kwargs",
        "reasoning",
        "reasoning_budget",
        "threads",
        "special",
        "intent_id",
        "last_port",
    }
)
# Config fields naming files whose identity is part of the key.
FILE_FIELDS = ("model", "model_file", "mmproj", "spec_draft_model", "model_path")
# Largest figure taken from the file: a hostile one must not make every start refused forever.
MAX_BYTES = 1 << 50


def _file_identity(value: Any) -> Any:
    """(path, size, mtime_ns) of a file or, for a directory, of its regular files (a HF
    model directory: the weights decide). Unreadable: the path alone."""
    if not isinstance(value, str) or not value:
        return value
    try:
        st = os.stat(value)
    except OSError:
        return value
    if not os.path.isdir(value):
        return [value, st.st_size, st.st_mtime_ns]
    files = []
    try:
        with os.scandir(value) as entries:
            for entry in sorted(entries, key=lambda e: e.name)[:1000]:
                with contextlib.suppress(OSError):
                    if entry.is_file():
                        s = entry.stat()
                        files.append([entry.name, s.st_size, s.st_mtime_ns])
    except OSError:
        pass
    return [value, files]


def memory_key(config: Any, backend_version: str = "") -> str:
    """The key of `config` (a confined copy: file fields absolute). Stats files: blocking."""
    doc = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config)
    fields = {k: v for k, v in sorted(doc.items()) if k not in NON_MEMORY_FIELDS}
    for name in FILE_FIELDS:
        if name in fields:
            fields[name] = _file_identity(fields[name])
    text = json.dumps(
        {"backend_version": backend_version, "config": fields}, sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def backend_version(backend_type: str, llama_server_bin: str = "") -> str:
    """What names the backend's build: the llama-server executable's identity for llama.cpp;
    this host's version otherwise (the HF and SGLang servers ship with it or its image)."""
    from solar_host import __version__

    if backend_type == "llamacpp":
        from solar_host.backends.llamacpp_exec import resolve

        server = resolve(llama_server_bin)
        if server.kind == "binary" and server.argv:
            return json.dumps(_file_identity(server.argv[0]))
        return f"{server.kind}:{server.uses}"
    return f"solar-host {__version__}"


@dataclass(slots=True)
class Measurement:
    """Bytes one config took: `cpu` and one figure per GPU it used, in placement order."""

    peak_cpu: int = 0
    peak_gpus: list[int] = field(default_factory=list)
    steady_cpu: int | None = None
    steady_gpus: list[int] | None = None
    loads: int = 0
    updated_at: str = ""
    backend_type: str = ""
    model: str = ""

    @property
    def peak_total(self) -> int:
        return self.peak_cpu + sum(self.peak_gpus)

    def peak_on(self, device_names: list[str]) -> dict[str, int] | None:
        """The peak per device of a placement on `device_names` (cpu first, then its GPUs in
        order); None when the placement uses another number of GPUs than was measured."""
        gpus = [d for d in device_names if d != CPU]
        if len(gpus) != len(self.peak_gpus):
            return None
        out = {CPU: self.peak_cpu} if self.peak_cpu else {}
        out.update({name: n for name, n in zip(gpus, self.peak_gpus, strict=True) if n})
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak_cpu": self.peak_cpu,
            "peak_gpus": list(self.peak_gpus),
            "steady_cpu": self.steady_cpu,
            "steady_gpus": None if self.steady_gpus is None else list(self.steady_gpus),
            "loads": self.loads,
            "updated_at": self.updated_at,
            "backend_type": self.backend_type,
            "model": self.model,
        }


def _count(doc: dict[str, Any], name: str, optional: bool = False) -> int | None:
    value = doc.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES:
        raise ValueError(f"{name} is not a byte count: {value!r}")
    return value


def _counts(doc: dict[str, Any], name: str, optional: bool = False) -> list[int] | None:
    value = doc.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, list) or len(value) > 1024:
        raise ValueError(f"{name} is not a list of byte counts")
    return [int(_count({name: v}, name) or 0) for v in value]


def parse_measurement(doc: Any) -> Measurement:
    if not isinstance(doc, dict):
        raise ValueError("entry is not an object")
    return Measurement(
        peak_cpu=int(_count(doc, "peak_cpu") or 0),
        peak_gpus=_counts(doc, "peak_gpus") or [],
        steady_cpu=_count(doc, "steady_cpu", True),
        steady_gpus=_counts(doc, "steady_gpus", True),
        loads=int(_count(doc, "loads") or 0),
        updated_at=str(doc.get("updated_at") or ""),
        backend_type=str(doc.get("backend_type") or ""),
        model=str(doc.get("model") or ""),
    )


def parse_measurements(path: Path, raw: bytes) -> dict[str, Measurement]:
    """Every measurement in the file's bytes, oldest first; StateFileError when unusable."""
    doc = parse_json(path, raw)
    items = doc.get("measurements") if isinstance(doc, dict) else None
    if not isinstance(items, dict):
        raise StateFileError(path, "expected an object with a 'measurements' object")
    out: dict[str, Measurement] = {}
    for key, item in items.items():
        try:
            out[str(key)] = parse_measurement(item)
        except (TypeError, ValueError) as err:
            raise StateFileError(path, f"measurement {key!r}: {err}") from None
    return dict(sorted(out.items(), key=lambda kv: kv[1].updated_at))


class MeasurementStore:
    """The measurements by key, bounded to `limit` keys (the least recently updated go).

    One writer: the sampler's thread calls `record` and `flush`; admission threads call `get`.
    A lock guards the dict; the file is written outside it."""

    def __init__(self, path: Path, limit: Callable[[], int] = lambda: 500):
        self.path = path
        self._limit = limit
        self._items: dict[str, Measurement] = {}
        self._lock = threading.Lock()
        self._on_disk: bytes | None = None
        self._dirty = False
        self.quarantined: list[Path] = []

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str | None) -> Measurement | None:
        if not key:
            return None
        with self._lock:
            return self._items.get(key)

    def record(
        self,
        key: str,
        peak_cpu: int,
        peak_gpus: list[int],
        steady: tuple[int, list[int]] | None,
        *,
        new_load: bool,
        backend_type: str = "",
        model: str = "",
    ) -> None:
        """A load's figures: the key's peak becomes this load's (a later load of the same
        config is the better prediction of the next one: the backend or the host changed)."""
        stamp = datetime.now(UTC).isoformat()
        with self._lock:
            old = self._items.pop(key, None)
            m = old or Measurement(backend_type=backend_type, model=model)
            m.peak_cpu, m.peak_gpus = peak_cpu, list(peak_gpus)
            if steady is not None:
                m.steady_cpu, m.steady_gpus = steady[0], list(steady[1])
            m.loads += 1 if new_load or old is None else 0
            m.updated_at = stamp
            self._items[key] = m  # last: the newest
            while len(self._items) > max(self._limit(), 1):
                self._items.pop(next(iter(self._items)))
            self._dirty = True

    # --- the file --------------------------------------------------------------------------
    def load(self) -> None:
        """Read the file; a damaged one is quarantined (see the module docstring)."""
        try:
            raw = read_regular(self.path)
        except FileNotFoundError:
            raw = None
        except (OSError, StateFileError) as err:
            self._quarantine(str(err))
            return
        if raw is None:
            if last_good_path(self.path).is_file():
                self._from_last_good("the file is missing but its last good copy exists")
            return
        try:
            items = parse_measurements(self.path, raw)
        except StateFileError as err:
            self._quarantine(err.error)
            return
        self._take(items, raw)
        tighten_mode(self.path)
        sweep_temp_files(self.path)

    def _take(self, items: dict[str, Measurement], raw: bytes | None) -> None:
        with self._lock:
            self._items = items
            while len(self._items) > max(self._limit(), 1):
                self._items.pop(next(iter(self._items)))
        self._on_disk = raw
        if items:
            log.info("%d memory measurement(s) read from %s", len(items), self.path)

    def _quarantine(self, error: str) -> None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        aside = self.path.with_name(f"{self.path.name}.damaged-{stamp}")
        try:
            os.replace(self.path, aside)
        except OSError as err:
            log.warning("cannot move the damaged %s aside: %s", self.path, err)
            aside = self.path
        else:
            self.quarantined.append(aside)
        log.warning(
            "memory measurements in %s cannot be used (%s); moved aside to %s",
            self.path,
            error,
            aside,
        )
        self._from_last_good(error)

    def _from_last_good(self, why: str) -> None:
        prev = last_good_path(self.path)
        try:
            raw = read_regular(prev)
            items = parse_measurements(prev, raw)
        except (OSError, StateFileError) as err:
            log.warning("no usable last good copy of %s (%s): starting unmeasured", self.path, err)
            self._take({}, None)
            self._dirty = True
            return
        log.warning("%s: %s; using its last good copy %s", self.path, why, prev)
        self._take(items, None)
        self._dirty = True

    def encode(self) -> bytes:
        with self._lock:
            items = {k: m.as_dict() for k, m in self._items.items()}
        return json.dumps({"version": FILE_VERSION, "measurements": items}, indent=1).encode()

    def flush(self) -> bool:
        """Write the file when something changed (blocking). True when written."""
        if not self._dirty:
            return False
        data = self.encode()
        self._dirty = False
        if data == self._on_disk:
            return False
        try:
            atomic_write_bytes(self.path, data, PRIVATE, keep_previous=self._on_disk is not None)
        except OSError as err:
            self._dirty = True
            log.warning("cannot write memory measurements to %s: %s", self.path, err)
            return False
        self._on_disk = data
        return True

"""Finding GGUF files in a model directory by pattern (model_file, mmproj, spec_draft_model).

Order: an absolute path as is; an exact relative path; a glob at the directory root; a recursive
glob. Among several matches the trailing shards of a split GGUF are dropped and the largest
file wins. Relative patterns never leave the base directory.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def _is_trailing_shard(p: Path) -> bool:
    m = _SHARD.search(p.name)
    return bool(m) and m.group(1) != "00001"


def _inside(path: Path, base: Path) -> bool:
    try:
        rp, rb = path.resolve(), base.resolve()
    except OSError:
        return False
    return rp == rb or rb in rp.parents


def resolve_model_file(base_dir: Path, pattern: str) -> Path:
    """The file `pattern` names under `base_dir`. Raises FileNotFoundError or ValueError."""
    if "\x00" in pattern:
        raise ValueError("Invalid model file pattern: NUL character")
    # The kernel's bounds (PATH_MAX, NAME_MAX): past them every lookup is ENAMETOOLONG, an
    # OSError the checks below do not expect (a 5,000-character model_file was a 500).
    if len(os.fsencode(pattern)) >= 4096 or any(
        len(os.fsencode(part)) > 255 for part in pattern.split("/")
    ):
        raise ValueError(
            "Invalid model file pattern: too long for a path (at most 4095 bytes, 255 per name)"
        )
    p = Path(pattern)
    if p.is_absolute():
        if p.is_file():
            return p
        raise FileNotFoundError(f"No file matching '{pattern}' found (absolute path)")
    if ".." in p.parts:
        raise ValueError(f"Invalid model file pattern '{pattern}': '..' is not allowed")
    exact = base_dir / pattern
    if exact.is_file() and _inside(exact, base_dir):
        return exact
    matches: list[Path] = []
    pats = [part for part in pattern.split("/") if part not in ("", ".")]
    try:
        for part in pats:  # a malformed class is refused as glob would
            re.compile(fnmatch.translate(part))
    except re.error as err:
        raise ValueError(f"Invalid model file pattern '{pattern}': {err}") from None
    for recursive in (False, True):
        found = _search(base_dir, pats, recursive, pattern)
        matches = [m for m in found if m.is_file() and _inside(m, base_dir)]
        if matches:
            break
    if not matches:
        raise FileNotFoundError(f"No file matching '{pattern}' found under {base_dir}")
    if len(matches) > 1:
        firsts = [m for m in matches if not _is_trailing_shard(m)]
        if firsts:
            matches = firsts
    if len(matches) == 1:
        return matches[0]
    ranked = sorted(matches, key=lambda m: (-m.stat().st_size, str(m)))
    if ranked[0].stat().st_size == ranked[1].stat().st_size:
        names = ", ".join(sorted(str(m.relative_to(base_dir)) for m in matches))
        raise ValueError(f"Model file pattern '{pattern}' is ambiguous under {base_dir}: {names}")
    return ranked[0]


# Directory entries one search may look at: a model directory holds tens of files, a store of
# a few hundred models some thousands (hidden directories, such as huggingface_hub's .cache,
# are not entered); a link to / (or a link loop) made the recursive glob walk the machine,
# /proc included, on the event loop, and the host stopped answering.
MAX_SEARCH_ENTRIES = 50_000


def _name_matches(name: str, pat: str) -> bool:
    """One path component against one pattern component, as glob judges it: a wildcard does
    not match a hidden name unless the pattern starts with '.'."""
    if not glob.has_magic(pat):
        return name == pat
    if name.startswith(".") and not pat.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, pat)


def _rel_matches(names: list[str], pats: list[str], recursive: bool) -> bool:
    if not pats:
        return not names
    head = pats[0]
    if head == "**" and recursive:  # zero or more directories, none hidden
        for i in range(len(names) + 1):
            if i and names[i - 1].startswith("."):
                return False
            if _rel_matches(names[i:], pats[1:], recursive):
                return True
        return False
    if not names:
        return False
    return _name_matches(names[0], head) and _rel_matches(names[1:], pats[1:], recursive)


def _search(base_dir: Path, pats: list[str], recursive: bool, given: str) -> list[Path]:
    """Paths under `base_dir` whose relative path matches `pats` (`**/` before them when
    `recursive`), as glob would find them, with bounds glob lacks: a directory is listed once
    (a link loop ends), links to directories outside `base_dir` are not entered, and past
    MAX_SEARCH_ENTRIES entries the search is refused (ValueError) rather than left to run."""
    full = ["**", *pats] if recursive else pats
    real_base = os.path.realpath(base_dir)
    seen: set[str] = set()
    found: list[Path] = []
    budget = MAX_SEARCH_ENTRIES
    stack: list[tuple[Path, list[str]]] = [(base_dir, [])]
    while stack:
        directory, rel = stack.pop()
        real = os.path.realpath(directory)
        if real in seen or not (real == real_base or real.startswith(real_base + os.sep)):
            continue
        seen.add(real)
        try:
            with os.scandir(directory) as it:
                entries = sorted(e.name for e in it)
        except OSError:
            continue
        for name in entries:
            budget -= 1
            if budget < 0:
                raise ValueError(
                    f"Model file pattern '{given}': more than {MAX_SEARCH_ENTRIES} files and "
                    f"directories under {base_dir} to search (or links that loop); name the file"
                )
            names = [*rel, name]
            path = directory / name
            if _rel_matches(names, full, recursive):
                found.append(path)
            if recursive:  # `**` never matches a hidden directory: glob does not enter one
                deeper = not name.startswith(".") or any(p.startswith(".") for p in pats)
            else:
                deeper = len(names) < len(pats) and _name_matches(name, pats[len(rel)])
            if deeper and path.is_dir():
                stack.append((path, names))
    return found


class PatternError(ValueError):
    """A file pattern of a config did not resolve; `field` names the config field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def resolve_config_files(config: Any, base_dir: Path | None, strict: bool, models_dir: Path) -> Any:
    """Resolve model_file (into `model`), mmproj and spec_draft_model of a llama.cpp config."""
    targets: list[tuple[str, str, str]] = []  # (field read, field written, pattern)
    if config.model_file:
        targets.append(("model_file", "model", config.model_file))
    for name in ("mmproj", "spec_draft_model"):
        value = getattr(config, name)
        if value and not (Path(value).is_absolute() and Path(value).is_file()):
            targets.append((name, name, value))
    if not targets:
        return config
    if base_dir is None or not base_dir.is_dir():
        if strict:
            raise PatternError(
                targets[0][0],
                "Cannot resolve model file pattern: no model directory found for "
                f"model_source={config.model_source!r}",
            )
        log.warning("cannot resolve file patterns of %s: no model directory", config.alias)
        return config
    for read, write, pattern in targets:
        try:
            path = resolve_model_file(base_dir, pattern)
        except (FileNotFoundError, ValueError) as err:
            if strict:
                raise PatternError(read, f"Cannot resolve {read} pattern: {err}") from None
            log.warning("cannot resolve %s of %s: %s", read, config.alias, err)
            continue
        setattr(config, write, str(path))
    return config


def _is_projector(p: Path) -> bool:
    """llama.cpp's multimodal projectors (mmproj-*.gguf) sit beside the model; never the model."""
    return "mmproj" in p.name.lower()


def gguf_of_dir(model_dir: Path) -> Path:
    """The one model GGUF of a directory (split shards count as one, the first shard is it).

    Raises PatternError(field="model") when there is none or several, listing them and
    pointing at model_file.
    """
    found = sorted(
        (p for p in model_dir.rglob("*.gguf") if p.is_file() and not _is_projector(p)),
        key=lambda p: str(p),
    )
    models = [p for p in found if not _is_trailing_shard(p)]
    if len(models) == 1:
        return models[0]
    if not models:
        raise PatternError("model", f"{model_dir} is a directory with no .gguf model file in it")
    names = ", ".join(str(p.relative_to(model_dir)) for p in models)
    raise PatternError(
        "model",
        f"{model_dir} holds several GGUF models ({names}): set model_file to the one to serve "
        '(a file name, relative path or glob such as "*Q4_K_M*.gguf")',
    )


# --- preflight checks of one file (instances/preflight.py runs them before a spawn) -------------

GGUF_MAGIC = b"GGUF"


def readable_file(field: str, path: str | os.PathLike[str]) -> str | None:
    """Why `path` (the value of config field `field`) is not a readable file, or None."""
    p = Path(path)
    if not p.exists():
        return f"{field}: {p} does not exist"
    if p.is_dir():
        return f"{field}: {p} is a directory, not a file"
    if not os.access(p, os.R_OK):
        return f"{field}: {p} is not readable by the host user (uid {os.getuid()})"
    return None


def gguf_file(field: str, path: str | os.PathLike[str]) -> str | None:
    """Why `path` is not a GGUF file llama.cpp can open (missing, unreadable, wrong magic)."""
    problem = readable_file(field, path)
    if problem:
        return problem
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as err:
        return f"{field}: cannot read {path}: {err.strerror or err}"
    if magic != GGUF_MAGIC:
        return (
            # Never quote the bytes: the file may be anything the host user can read.
            f"{field}: {path} is not a GGUF file (no GGUF magic at its start); "
            "point it at the .gguf model file"
        )
    return None


def model_path(field: str, path: str | os.PathLike[str]) -> str | None:
    """Why a local model path (file or directory) cannot be read, or None."""
    p = Path(path)
    if not p.exists():
        return f"{field}: {p} does not exist"
    if not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
        return f"{field}: {p} is not readable by the host user (uid {os.getuid()})"
    return None


def local_model_problems(backend: Any, config: Any, field: str) -> list[str]:
    """Why the absolute model paths of a directory-model backend (HF, SGLang) cannot be read;
    `field` names the config field they come from."""
    found = []
    for path in backend.model_paths(config):
        if os.path.isabs(path):
            problem = model_path(field, path)
            if problem:
                found.append(problem)
    return found

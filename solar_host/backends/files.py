"""Finding GGUF files in a model directory by pattern (model_file, mmproj, spec_draft_model).

Order: an absolute path as is; an exact relative path; a glob at the directory root; a recursive
glob. Among several matches the trailing shards of a split GGUF are dropped and the largest
file wins. Relative patterns never leave the base directory.
"""

from __future__ import annotations

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
    for recursive in (False, True):
        expr = "**/" + pattern if recursive else pattern
        try:
            # root_dir keeps glob characters in the directory name ("Model[v2]") literal.
            found = [base_dir / m for m in glob.glob(expr, root_dir=base_dir, recursive=recursive)]
        except (re.error, ValueError) as err:
            raise ValueError(f"Invalid model file pattern '{pattern}': {err}") from None
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

"""Model roots: every file an instance config names stays inside MODELS_DIR or MODEL_ROOTS.

Whoever holds the host key drives the host; that must not extend to reading the machine's
files (ruling 12). So every path a config names — the model, its projector, draft model, chat
template, an SGLang model directory or a path handed through extra_args/extra_env — must
resolve, after symlinks, inside one of the allowed roots. Relative paths resolve against
MODELS_DIR (the first root). The check runs when a config is created or updated and again
right before a start, because a symlink can change in between.

Messages name the field, the value as given and the roots; never anything read from a file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# Fields that always name a file or directory, whatever backend has them.
PATH_FIELDS = ("model", "mmproj", "spec_draft_model", "chat_template_file", "model_path")
# A HuggingFace Hub id (`org/name` or `name`): not a path, fetched from the Hub instead.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


class OutsideRoots(ValueError):
    """A config field names a path outside the model roots; `field` names the field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def describe_roots(roots: Sequence[Path]) -> str:
    return ", ".join(str(r) for r in roots)


def _real(path: Path) -> Path:
    # realpath resolves every symlink of the part that exists and keeps the rest as written
    # (normalising `..`), so a path to a file not yet there is judged by where it would be.
    return Path(os.path.realpath(path))


def confine(value: str, roots: Sequence[Path], field: str) -> Path:
    """The real path of `value` (relative: under roots[0]) if it lies in a root, else raise."""
    if "\x00" in value:
        raise OutsideRoots(field, f"{field} must not contain NUL characters")
    candidate = Path(value)
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    real = _real(candidate)
    for root in roots:
        r = _real(root)
        if real == r or r in real.parents:
            return real
    raise OutsideRoots(
        field,
        f"{field} '{value}' resolves outside of MODELS_DIR and MODEL_ROOTS "
        f"(allowed roots: {describe_roots(roots)})",
    )


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "~", ".")) or ".." in Path(value).parts


def _untyped_path(value: str) -> str | None:
    """The path an untyped value (extra_args, extra_env) would open, or None.

    A bare word counts when it names something in the working directory the backend
    inherits: the backend would open that, so it is judged as an absolute path.
    """
    if "\x00" in value:
        return value
    if _looks_like_path(value):
        return value
    try:
        if os.path.lexists(value):
            return os.path.abspath(value)
    except (OSError, ValueError):
        return None
    return None


def _is_hub_id(value: str, roots: Sequence[Path]) -> bool:
    """A HuggingFace model_id that names the Hub, not a directory (none under MODELS_DIR)."""
    return bool(_HUB_ID.match(value)) and not (roots[0] / value).exists()


def _arg_values(args: Sequence[str]) -> Iterator[str]:
    """Values in an extra_args list: `--flag value` and `--flag=value` alike."""
    for arg in args:
        yield arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg


def config_paths(config: Any, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """(field, value) of every path a config names that the backend will open.

    model_source first: when the model path was derived from it, the error names the source.
    """
    source = getattr(config, "model_source", None)
    if isinstance(source, str) and source.startswith("local://"):
        yield "model_source", source[len("local://") :]
    for name in PATH_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, str) and value:
            yield name, value
    model_file = getattr(config, "model_file", None)
    if isinstance(model_file, str) and Path(model_file).is_absolute():
        # Relative patterns are matched inside the model directory (backends/files.py).
        yield "model_file", model_file
    model_id = getattr(config, "model_id", None)
    if isinstance(model_id, str) and model_id and not _is_hub_id(model_id, roots):
        yield "model_id", model_id
    # SGLang passes these through untyped: any value in them that is a path is one the
    # backend may open (--chat-template, --tokenizer-path, a cache directory, ...).
    for value in _arg_values(getattr(config, "extra_args", None) or ()):
        path = _untyped_path(value)
        if path is not None:
            yield "extra_args", path
    for name, value in (getattr(config, "extra_env", None) or {}).items():
        path = _untyped_path(value) if isinstance(value, str) else None
        if path is not None:
            yield f"extra_env.{name}", path


def check_config(config: Any, roots: Sequence[Path]) -> dict[str, Path]:
    """Raise OutsideRoots for the first path of `config` outside `roots`.

    Returns the real path of each checked field (the last value wins for repeated fields).
    """
    out: dict[str, Path] = {}
    for field, value in config_paths(config, roots):
        out[field] = confine(value, roots, field)
    return out


def anchor_relative(config: Any, models_dir: Path) -> None:
    """Make relative file fields absolute under MODELS_DIR, so the backend opens exactly the
    file that was checked (it would otherwise resolve them against its working directory).
    Applied to the copy a backend launches from: the stored config echoes what was sent."""
    for name in ("chat_template_file", "mmproj", "spec_draft_model"):
        value = getattr(config, name, None)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            setattr(config, name, str(models_dir / value))

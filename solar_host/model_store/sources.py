"""Model source URIs and the confinement of model paths to MODELS_DIR.

`local://rel` and relative paths of instance configs resolve against MODELS_DIR; absolute ones
are kept as given. Whether the result lies in MODELS_DIR or MODEL_ROOTS (ruling 12) is
model_store/roots.py's check, applied to the final config (a link from MODELS_DIR to another
root is fine, one to anywhere else is not). `confine` guards paths of pulls and the store.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

REPO_RE = re.compile(
    r"^repo://(?P<name>[A-Za-z0-9_-]+):(?P<version>[A-Za-z0-9_.-]+)(?:/(?P<sub>.*))?$"
)
HF_PREFIX = "huggingface://"
LOCAL_PREFIX = "local://"


class SourceError(ValueError):
    """A model source or path is malformed or escapes its root."""


def is_remote_source(uri: str | None) -> bool:
    return bool(uri) and (uri.startswith("repo://") or uri.startswith(HF_PREFIX))


def slug_for(uri: str) -> str:
    """The directory name of a pulled model: repo--<name>--<version> or hf--<org>--<model>."""
    m = REPO_RE.match(uri)
    if m:
        return f"repo--{m['name']}--{m['version']}"
    if uri.startswith(HF_PREFIX):
        model_id = uri[len(HF_PREFIX) :].strip("/")
        if not model_id or not re.fullmatch(r"[A-Za-z0-9._/-]+", model_id):
            raise SourceError(f"Unsupported or malformed model source URI: {uri}")
        parts = model_id.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise SourceError(f"Unsupported or malformed model source URI: {uri}")
        return "hf--" + "--".join(parts)
    if uri.startswith(LOCAL_PREFIX):
        raise SourceError("local:// URIs are not stored in the models directory")
    raise SourceError(f"Unsupported or malformed model source URI: {uri}")


def repo_subpath(uri: str) -> str:
    m = REPO_RE.match(uri)
    return (m["sub"] or "").strip("/") if m else ""


def repo_base_uri(uri: str) -> str:
    m = REPO_RE.match(uri)
    if not m:
        return uri
    return f"repo://{m['name']}:{m['version']}"


def confine(path: str | os.PathLike[str], root: Path, *, what: str = "path") -> Path:
    """Resolve `path` (relative paths against `root`) and refuse it unless it stays in `root`.

    Symlinks are resolved before the check, so a link pointing out of the root is refused.
    """
    raw = os.fspath(path)
    if "\x00" in raw:
        raise SourceError(f"{what} must not contain NUL characters")
    root_resolved = root.resolve()
    candidate = Path(raw)
    if not candidate.is_absolute():
        candidate = root_resolved / candidate
    resolved = candidate.resolve()
    if resolved != root_resolved and root_resolved not in resolved.parents:
        raise SourceError(f"{what} '{raw}' resolves outside of MODELS_DIR ({root_resolved})")
    return resolved


def _check_path_text(value: str, what: str) -> None:
    """Refuse text no file name can hold: NUL, or a lone surrogate (JSON's "\\ud800")."""
    if "\x00" in value:
        raise SourceError(f"{what} must not contain NUL characters")
    try:
        os.fsencode(value)
    except UnicodeError:
        raise SourceError(f"{what} is not a valid path (unencodable characters)") from None


def resolve_local_uri(uri: str, models_dir: Path) -> Path:
    """`local://rel` -> MODELS_DIR/rel (confined); `local:///abs` as is (roots.py checks it)."""
    if not uri.startswith(LOCAL_PREFIX):
        raise SourceError(f"not a local:// URI: {uri}")
    rest = uri[len(LOCAL_PREFIX) :]
    if not rest:
        raise SourceError("local:// URI names no path")
    _check_path_text(rest, "model_source")
    if Path(rest).is_absolute():
        return Path(rest)
    return _anchor(rest, models_dir)


def resolve_model_path(value: str, models_dir: Path, *, hub_id_allowed: bool = False) -> str:
    """Resolve a `model`/`model_id`/`model_path` value given in a config.

    Absolute paths are kept (operators keep models anywhere). Relative paths (what control sends
    for `local://` sources) resolve against MODELS_DIR and must stay inside it. With
    `hub_id_allowed`, a relative value that names nothing under MODELS_DIR is a Hub id
    (`org/name`) and is kept as is.
    """
    _check_path_text(value, "model path")
    if value.startswith(LOCAL_PREFIX):
        return str(resolve_local_uri(value, models_dir))
    p = Path(value).expanduser()
    if p.is_absolute():
        return value
    parts = Path(value).parts
    if hub_id_allowed and ".." not in parts and not (models_dir / value).exists():
        return value
    return str(_anchor(value, models_dir))


def _anchor(rel: str, models_dir: Path) -> Path:
    """A relative config path as the real path it names under MODELS_DIR (links resolved)."""
    return (models_dir.resolve() / rel).resolve()


def pulled_path(source_uri: str, lookup: Callable[[str], Path | None] | None) -> Path | None:
    """Where a previous pull put `source_uri` (its subpath inside the pulled directory for
    `repo://name:ver/sub`); None when it was never pulled."""
    if lookup is None:
        return None
    root = lookup(source_uri)
    if root is None:
        return None
    sub = repo_subpath(source_uri)
    if not sub:
        return root
    path = confine(sub, root, what="model_source subpath")
    if not path.exists():
        raise SourceError(f"{sub!r} is not in the pulled model of {repo_base_uri(source_uri)}")
    return path


def pull_hint(source_uri: str) -> str:
    """What to run so that `source_uri` can be used by name."""
    if source_uri.startswith(HF_PREFIX):
        model_id = source_uri[len(HF_PREFIX) :].strip("/")
        body = (
            f'{{"source": "huggingface", "model_id": "{model_id}", "source_uri": "{source_uri}"}}'
        )
    else:
        body = (
            f'{{"source": "harbor", "harbor_ref": "PROJECT/NAME:VERSION", '
            f'"source_uri": "{source_uri}"}}'
        )
    return (
        f"model_source {source_uri} was never pulled on this host: pull it first with "
        f"POST /models/pull {body} (or `solar-host pull {source_uri}`), or give the model path"
    )

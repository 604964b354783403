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

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# Fields that always name a file or directory, whatever backend has them.
PATH_FIELDS = ("model", "mmproj", "spec_draft_model", "chat_template_file", "model_path")
# Linux's limits (limits.h): longer names fail every system call with ENAMETOOLONG.
PATH_MAX = 4096
NAME_MAX = 255
# Files and directories a model directory may hold before the check gives up on it.
MAX_DIR_ENTRIES = 10_000
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


def confine(value: str, roots: Sequence[Path], field: str, given: str | None = None) -> Path:
    """The real path of `value` (relative: under roots[0]) if it lies in a root, else raise.

    `given`: the value as the config wrote it, for the message, when `value` is what it expands
    to (the expansion may hold an environment variable's value, which is not echoed)."""
    if "\x00" in value:
        raise OutsideRoots(field, f"{field} must not contain NUL characters")
    try:
        raw = os.fsencode(value)
    except UnicodeError:  # a lone surrogate: no file has such a name
        raise OutsideRoots(field, f"{field} is not a valid path (unencodable characters)") from None
    if len(raw) >= PATH_MAX or any(len(part) > NAME_MAX for part in raw.split(b"/")):
        raise OutsideRoots(
            field,
            f"{field} is too long for a path (at most {PATH_MAX - 1} bytes, {NAME_MAX} per name)",
        )
    candidate = Path(value)
    outside = OutsideRoots(
        field,
        f"{field} '{value if given is None else given}' resolves outside of MODELS_DIR and "
        f"MODEL_ROOTS (allowed roots: {describe_roots(roots)})",
    )
    if ".." in candidate.parts:
        # realpath folds `x/..` away whatever x is, the kernel walks through x: through a
        # file or a missing directory the two differ, and every later open of the value
        # (an estimate, a preflight, the backend) answered whether x exists.
        raise OutsideRoots(
            field,
            f"{field} '{value if given is None else given}' goes through '..', which may lead "
            f"outside of MODELS_DIR and MODEL_ROOTS (allowed roots: {describe_roots(roots)}); "
            "name the path without it",
        )
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    try:
        real = _real(candidate)
    except OSError:  # a component the host may not look into (/proc/1/root/...)
        raise outside from None
    for root in roots:
        r = _real(root)
        if real == r or r in real.parents:
            return real
    raise outside


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "~", ".")) or ".." in Path(value).parts


# `$NAME` and `${NAME}`, as os.path.expandvars reads them.
_VAR = re.compile(r"\$(\w+|\{[^}]*\})")


def expand_path(value: str, env: Mapping[str, str]) -> str:
    """`value` as a program that expands `~` and environment variables in a path (as
    huggingface_hub does for HF_HOME and friends) would open it, reading variables from the
    backend's environment `env`."""

    def var(m: re.Match[str]) -> str:
        name = m.group(1).strip("{}")
        return env.get(name, m.group(0))

    value = _VAR.sub(var, value) if "$" in value else value
    if value.startswith("~"):
        home = env.get("HOME")
        if value == "~" or value.startswith("~/"):
            value = (home or os.path.expanduser("~")) + value[1:]
        else:
            value = os.path.expanduser(value)  # ~user
    return value


def _json_strings(doc: Any) -> Iterator[str]:
    if isinstance(doc, str):
        yield doc
    elif isinstance(doc, list):
        for item in doc:
            yield from _json_strings(item)
    elif isinstance(doc, dict):
        for item in doc.values():
            yield from _json_strings(item)


def _pieces(value: str, depth: int = 0) -> Iterator[str]:
    """The parts of an untyped value that a backend may open as paths: the value itself, the
    value of `--flag=value`, and within them each part of `NAME=PATH` and of comma lists, and
    each string of a JSON document (SGLang's --lora-paths takes all three forms)."""
    yield value
    if depth >= 3:
        return
    _name, eq, rest = value.partition("=")
    if eq and rest:
        # `--flag=VALUE` and `NAME=VALUE` whole first: VALUE may be JSON with its own commas
        # and `=`, which the split below would cut into pieces that are neither.
        yield from _pieces(rest, depth + 1)
    parts = re.split(r"[=,]", value)
    if len(parts) > 1:
        for part in parts:
            if part:
                yield from _pieces(part, depth + 1)
    if value.lstrip()[:1] in ("{", "[", '"'):
        try:
            doc = json.loads(value)
        except ValueError:
            return
        for text in _json_strings(doc):
            yield from _pieces(text, depth + 1)


def _untyped_paths(
    value: str, roots: Sequence[Path], env: Mapping[str, str]
) -> Iterator[tuple[str, str]]:
    """The paths an untyped value (an extra_args item, an extra_env value) could open, each
    with the piece of the value it comes from.

    A bare word counts when it names something in MODELS_DIR, the backends' working
    directory: the backend would open that (confine() judges it there, links resolved).
    """
    if "\x00" in value:
        yield value, value
        return
    for piece in dict.fromkeys(_pieces(value)):
        for form in dict.fromkeys((piece, expand_path(piece, env))):
            if _looks_like_path(form):
                yield form, piece
            else:
                try:
                    if form and os.path.lexists(roots[0] / form):
                        yield form, piece
                except (OSError, ValueError):
                    continue


def _is_hub_id(value: str, roots: Sequence[Path]) -> bool:
    """A HuggingFace model_id that names the Hub, not a directory (none under MODELS_DIR)."""
    return bool(_HUB_ID.match(value)) and not (roots[0] / value).exists()


def config_paths(config: Any, roots: Sequence[Path]) -> Iterator[tuple[str, str, str]]:
    """(field, path, the value as written) of every path a config names that the backend will
    open.

    model_source first: when the model path was derived from it, the error names the source.
    """
    source = getattr(config, "model_source", None)
    if isinstance(source, str) and source.startswith("local://"):
        path = source[len("local://") :]
        yield "model_source", path, path
    for name in PATH_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, str) and value:
            yield name, value, value
    model_file = getattr(config, "model_file", None)
    if isinstance(model_file, str) and Path(model_file).is_absolute():
        # Relative patterns are matched inside the model directory (backends/files.py).
        yield "model_file", model_file, model_file
    model_id = getattr(config, "model_id", None)
    if isinstance(model_id, str) and model_id and not _is_hub_id(model_id, roots):
        yield "model_id", model_id, model_id
    # SGLang passes these through untyped: any value in them that is a path is one the
    # backend may open (--chat-template, --tokenizer-path, --lora-paths NAME=PATH, a cache
    # directory in HF_HOME, ...).
    extra_env = _str_values(getattr(config, "extra_env", None))
    env = {**os.environ, **extra_env}  # what the backend's `$NAME` and `~` expand to
    for value in getattr(config, "extra_args", None) or ():
        if isinstance(value, str):
            for path, given in _untyped_paths(value, roots, env):
                yield "extra_args", path, given
    for name, value in extra_env.items():
        for path, given in _untyped_paths(value, roots, env):
            yield f"extra_env.{name}", path, given


def check_config(config: Any, roots: Sequence[Path]) -> dict[str, Path]:
    """Raise OutsideRoots for the first path of `config` outside `roots`, or the first link
    out of them inside a directory it names (confine_contents), or inside the cached copy of
    the Hub repository it names (hub_cache_repo).

    Returns the real path of each checked field (the last value wins for repeated fields).
    """
    out: dict[str, Path] = {}
    # llama.cpp opens files, never a directory as a whole: a directory in `model` stands for
    # the GGUF files in it that `model_file` selects, each confined on its own (files.py).
    # The other backends read whatever a model directory holds.
    whole = getattr(config, "backend_type", None) != "llamacpp"
    for field, path, given in config_paths(config, roots):
        real = confine(path, roots, field, given)
        if whole and real.is_dir():
            confine_contents(real, roots, field, given)
        out[field] = real
    model_id = getattr(config, "model_id", None)
    if isinstance(model_id, str) and model_id and _is_hub_id(model_id, roots):
        env = {**os.environ, **_str_values(getattr(config, "extra_env", None))}
        for cache in hub_caches(env):
            repo = cache / ("models--" + model_id.replace("/", "--"))
            if os.path.lexists(repo):
                # The backend loads a Hub id from this cache, which job containers may write
                # (preparation steps mount it read-write): a link planted there is followed
                # by a backend that runs outside any container. The cache counts as a root.
                confine(str(repo), [*roots, cache], "model_id", model_id)
                confine_contents(repo, [*roots, cache], "model_id", model_id)
    return out


def hub_caches(env: Mapping[str, str]) -> list[Path]:
    """Every HuggingFace Hub cache a backend started with `env` may read a Hub id from.
    huggingface_hub takes the first of HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub and
    the XDG cache, transformers may still honour TRANSFORMERS_CACHE, and the backend's
    environment is an allowlist of the host's: all of them are judged rather than guess which
    one wins."""
    caches = [
        expand_path(env[name], env)
        for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")
        if env.get(name)
    ]
    if env.get("HF_HOME"):
        caches.append(os.path.join(expand_path(env["HF_HOME"], env), "hub"))
    xdg = env.get("XDG_CACHE_HOME") or "~/.cache"
    caches.append(os.path.join(expand_path(xdg, env), "huggingface", "hub"))
    caches.append(os.path.join(expand_path("~/.cache", env), "huggingface", "hub"))
    return list(dict.fromkeys(Path(c) for c in caches))


def _str_values(mapping: Any) -> dict[str, str]:
    return {k: v for k, v in (mapping or {}).items() if isinstance(v, str)}


def confine_contents(directory: Path, roots: Sequence[Path], field: str, given: str) -> None:
    """Raise OutsideRoots for a link inside `directory` (at any depth) that resolves outside
    the roots. A backend opens the files of the directory it is given (config.json, weights,
    a chat template, a tokenizer), so a link among them takes it out of the roots as surely as
    a config naming the file itself. Links into the roots are followed and their contents
    judged too; the walk stops at MAX_DIR_ENTRIES (a link loop ends there)."""
    seen = 0
    for top, dirs, files in os.walk(directory, followlinks=True):
        for name in dirs + files:
            seen += 1
            if seen > MAX_DIR_ENTRIES:
                raise OutsideRoots(
                    field,
                    f"{field} '{given}' holds more than {MAX_DIR_ENTRIES} files and directories "
                    "(or links that loop): not a model directory",
                )
            entry = os.path.join(top, name)
            if not os.path.islink(entry):
                continue
            try:
                confine(entry, roots, field)
            except OutsideRoots:
                inner = os.path.relpath(entry, directory)
                raise OutsideRoots(
                    field,
                    f"{field} '{given}' holds '{inner}', a link that resolves outside of "
                    f"MODELS_DIR and MODEL_ROOTS (allowed roots: {describe_roots(roots)})",
                ) from None


# The file fields a backend opens relative to its working directory (MODELS_DIR).
LAUNCH_FILE_FIELDS = ("chat_template_file", "mmproj", "spec_draft_model")
# Every field the host itself opens (estimates, preflight): relative, each means what it
# means to the backend, MODELS_DIR/<value>, never the host's own working directory. A Hub id
# in model_id becomes a directory under MODELS_DIR that is not there (no local estimate).
HOST_OPENED_FIELDS = (*PATH_FIELDS, "model_id")


def anchor_relative(
    config: Any, models_dir: Path, fields: Sequence[str] = LAUNCH_FILE_FIELDS
) -> None:
    """Make relative file fields absolute under MODELS_DIR, so the backend opens exactly the
    file that was checked (it would otherwise resolve them against its working directory).
    Applied to the copy a backend launches from: the stored config echoes what was sent."""
    for name in fields:
        value = getattr(config, name, None)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            setattr(config, name, str(models_dir / value))

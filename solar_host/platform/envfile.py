"""Reading a dotenv file, and the rule an API key follows: both shared by the settings loader
and the command-line client (which must not pay for importing pydantic)."""

from __future__ import annotations

import io
import os
from pathlib import Path

# Where no --env-file is given, this one is read if it is there.
DEFAULT_ENV_FILE = ".env"


class EnvFileError(Exception):
    """The env file cannot be used; `str()` is one line naming the file."""


def read_env_file(path: str | Path, *, required: bool = False) -> dict[str, str]:
    """KEY=value pairs of an env file (dotenv syntax: quotes, `export`, comments), keys as
    written. A file that does not exist gives {} unless it is `required` (named by the
    operator: a typo must not start a host on defaults); /dev/null is an empty one. Raises
    EnvFileError for a required file that is missing, a path that is not a regular file, and
    text that is not UTF-8.

    `$VAR` and `${VAR}` are kept as written (no interpolation): a secret may hold a `$`.
    """
    p = Path(path)
    if str(p) == os.devnull:  # `--env-file /dev/null`: the usual way to say "no file"
        return {}
    if not p.exists():
        if required:
            raise EnvFileError(f"env file {p} does not exist")
        return {}
    if not p.is_file():
        raise EnvFileError(f"env file {p} is not a regular file")
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise EnvFileError(f"cannot read env file {p}: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise EnvFileError(
            f"env file {p} is not UTF-8 text (line {line}, byte {err.start})"
        ) from None
    from dotenv import dotenv_values

    values = dotenv_values(stream=io.StringIO(text), interpolate=False)
    return {k: v for k, v in values.items() if v is not None}


def api_key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key, or None. It travels in an HTTP header (X-API-Key,
    Bearer), which carries printable ASCII only: anything else no client can send."""
    if not key.isascii() or any(c.isspace() or not c.isprintable() for c in key):
        return "must be printable ASCII without spaces or control characters"
    return None

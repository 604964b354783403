"""Reading the settings: the environment, then the env file, into one validated Settings.

The environment is read by hand rather than with pydantic-settings: every field is a scalar,
and pydantic-settings costs about 70 ms of start-up (it imports its CLI, cloud and secrets
providers) for a job that is a dictionary merge. `.env` is read only when load_settings()
(the command line, `solar_host.main`) asks for it, never at import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from solar_host.platform.envfile import DEFAULT_ENV_FILE, EnvFileError, read_env_file
from solar_host.settings.schema import Settings, _items

# Environment variables every machine has: never "did you mean" material.
_COMMON_ENV = frozenset(
    {"PATH", "HOME", "USER", "SHELL", "TERM", "PWD", "LANG", "LOGNAME", "HOSTNAME", "OLDPWD"}
)
# Not settings of the host, but read from the same env file by the command line (cli.py).
CLIENT_ONLY_NAMES = frozenset({"SOLAR_HOST_URL"})


def settings_warnings(file_values: Mapping[str, str], environ: Mapping[str, str]) -> list[str]:
    """Unknown names in the env file (with the nearest setting), and environment variables one
    or two edits away from a setting's name (a typo the host would silently ignore)."""
    from solar_host.platform.spelling import nearest

    names = [n.upper() for n in Settings.model_fields]
    known = set(names) | CLIENT_ONLY_NAMES
    out = []
    for key in file_values:
        if key.upper() in known:
            continue
        guess = nearest(key.upper(), names)
        hint = f": did you mean {guess}?" if guess else " (ignored)"
        out.append(f"unknown setting {key} in the env file{hint}")
    for key in environ:
        up = key.upper()
        if up in known or up in _COMMON_ENV or key in file_values:
            continue
        # Short names are one edit from many words: allow two edits only from 8 characters on.
        guess = nearest(up, names, max_edits=2 if len(up) >= 8 else 1)
        if guess:
            out.append(f"environment variable {key} is not a setting: did you mean {guess}?")
    return out


# Settings that name paths; the lists among them are comma-separated.
PATH_SETTINGS = (
    "config_file",
    "log_dir",
    "models_dir",
    "jobs_dir",
    "hf_cache_dir",
    "llama_server_bin",
    "sglang_venv_path",
    "sglang_prompt_cache_dir",
)
PATH_LIST_SETTINGS = ("model_roots", "backend_read_paths", "backend_write_paths")
NO_EXPANSION = "neither the env file nor the host expands ~ or $VARIABLES; write the full path"


def unexpanded_paths(settings: Settings) -> list[tuple[str, str]]:
    """(NAME, value) for each path setting that starts with ~ or holds a $: a shell would
    have expanded them, the env file does not, so the host would make a directory named `~`
    (or `$HOME`) in its working directory. MODEL_ROOTS alone expands a leading ~."""
    found = []
    for name in (*PATH_SETTINGS, *PATH_LIST_SETTINGS):
        raw = getattr(settings, name, None)
        if raw is None:
            continue
        items = _items(raw) if name in PATH_LIST_SETTINGS else [str(raw)]
        for item in items:
            tilde = item.startswith("~") and name != "model_roots"
            if tilde or "$" in item:
                found.append((name.upper(), item))
    return found


class SettingsError(Exception):
    """Start-up configuration is invalid; the message is one line naming the variable."""


def describe_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        name = str(e["loc"][0]).upper() if e["loc"] else "?"
        parts.append(f"{name}: {e['msg']}")
    return "Invalid setting " + "; ".join(parts)


def setting_values(sources: Mapping[str, str]) -> dict[str, str]:
    """The values in `sources` (env-style names, any case) that name a setting, by field name.

    An empty value for a setting whose default is None (HF_CACHE_DIR=) means "not set".
    """
    by_lower = {k.lower(): v for k, v in sources.items()}
    values: dict[str, str] = {}
    for name, field in Settings.model_fields.items():
        if name not in by_lower:
            continue
        value = by_lower[name]
        if value == "" and field.default is None:
            continue
        values[name] = value
    return values


def load_settings(
    env_file: str | Path | None = DEFAULT_ENV_FILE,
    environ: Mapping[str, str] | None = None,
    *,
    env_file_required: bool = False,
    **overrides: object,
) -> Settings:
    """Settings from, lowest to highest: defaults, `env_file`, the environment, `overrides`.

    `env_file_required`: the operator named the file, so it must exist (only the implicit
    ./.env may be absent). Raises SettingsError (one line naming the variable, or the env
    file) on a bad value or an env file that cannot be read.
    """
    merged: dict[str, object] = {}
    try:
        file_values = (
            read_env_file(env_file, required=env_file_required) if env_file is not None else {}
        )
    except EnvFileError as err:
        raise SettingsError(str(err)) from None
    merged.update(setting_values(file_values))
    env = os.environ if environ is None else environ
    merged.update(setting_values(env))
    merged.update(overrides)
    try:
        settings = Settings(**merged)
    except ValidationError as err:
        raise SettingsError(describe_validation_error(err)) from None
    settings._load_warnings = settings_warnings(file_values, env) + [
        f"{name}={value} is taken as written: {NO_EXPANSION}"
        for name, value in unexpanded_paths(settings)
    ]
    if env_file is not None and os.path.isfile(env_file):
        settings._env_file = Path(env_file).absolute()
    return settings

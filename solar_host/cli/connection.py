"""Where a client command finds its host and key: flags, the environment, the env file,
then the key the host stored beside CONFIG_FILE."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path


class UsageError(Exception):
    pass


def env_file_choice(args: argparse.Namespace) -> tuple[str, bool]:
    """(env file, whether it must exist): one named by --env-file must; ./.env may be absent."""
    from solar_host.platform.envfile import DEFAULT_ENV_FILE

    named = getattr(args, "env_file", None)
    return (DEFAULT_ENV_FILE, False) if named is None else (named, True)


def _read_env_file(args: argparse.Namespace) -> dict[str, str]:
    """KEY=value pairs of the env file (keys upper-cased); {} when ./.env does not exist."""
    from solar_host.platform.envfile import EnvFileError, read_env_file

    path, required = env_file_choice(args)
    try:
        values = read_env_file(path, required=required)
    except EnvFileError as err:
        raise UsageError(str(err)) from None
    return {k.upper(): v for k, v in values.items()}


def resolve_connection(args: argparse.Namespace) -> tuple[str, str]:
    """(url, api_key) from flags, the environment, the env file, then the stored key."""
    file_values = _read_env_file(args)

    def setting(name: str) -> str:
        value = os.environ.get(name)
        if value is None:
            value = file_values.get(name, "")
        return value.strip()

    url = getattr(args, "url", None) or setting("SOLAR_HOST_URL")
    if not url:
        port = setting("PORT") or "8001"
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UsageError(f"PORT must be a port number, not {port!r}")
        url = f"http://127.0.0.1:{int(port)}"
    key = getattr(args, "api_key", None) or setting("API_KEY")
    if not key:
        config_file = Path(setting("CONFIG_FILE") or "config.json")
        key_file = config_file.parent / "api_key"
        with contextlib.suppress(OSError):
            key = key_file.read_text(encoding="utf-8").strip()
    if not key:
        raise UsageError(
            "no API key: pass --api-key, set API_KEY, or run beside the host's CONFIG_FILE "
            "(its generated key is stored next to it)"
        )
    return url, key


# The options every client command takes, before the command or after it (their `dest`s).
CLIENT_OPTIONS = ("url", "api_key", "env_file", "json", "timeout")


def add_client_options(p: argparse.ArgumentParser, *, env_file: bool = True) -> None:
    """--url, --api-key, --env-file, --json, --timeout on `p`.

    SUPPRESS defaults: an option given before the subcommand is not reset by the subparser
    (argparse copies a subparser's defaults over what the main parser read), and one that was
    given at all can be told from one that was not.
    """
    g = p.add_argument_group("connection (client commands; before or after the command)")
    g.add_argument("--url", default=argparse.SUPPRESS, help="host URL (default: SOLAR_HOST_URL)")
    g.add_argument(
        "--api-key", default=argparse.SUPPRESS, help="API key (default: API_KEY or stored key)"
    )
    if env_file:
        g.add_argument(
            "--env-file", default=argparse.SUPPRESS, help="settings file (default: ./.env)"
        )
    g.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,
        help="seconds to wait for connecting and short calls (default: 10)",
    )


def client_options() -> argparse.ArgumentParser:
    """A parent parser holding the client options (for each client subcommand)."""
    p = argparse.ArgumentParser(add_help=False)
    add_client_options(p)
    return p

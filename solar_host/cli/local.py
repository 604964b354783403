"""Commands that work on this machine without a running host: serve (the default),
handover and restore-state."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from solar_host.cli.connection import env_file_choice
from solar_host.cli.exits import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
)
from solar_host.cli.format import (
    print_error,
)

HANDOVER_TIMEOUT_S = 120.0


def serve_arguments(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: `solar-host --port 1 serve` keeps the port given before the subcommand.
    p.add_argument("--host", default=argparse.SUPPRESS, help="bind address")
    p.add_argument("--port", type=int, default=argparse.SUPPRESS, help="port")
    p.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file")


def handover_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file")
    p.add_argument(
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,  # given before the command too
        help=f"seconds to wait for the host to exit (default: {HANDOVER_TIMEOUT_S:g})",
    )


def restore_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file")
    p.add_argument("--dry-run", action="store_true", help="only show what would be replaced")


# --- handover -----------------------------------------------------------------------------------


def handover(args: argparse.Namespace) -> int:
    from solar_host.platform.handover import HandOverError, hand_over
    from solar_host.settings import SettingsError, load_settings

    try:
        env_file, required = env_file_choice(args)
        settings = load_settings(env_file, env_file_required=required)
    except SettingsError as err:
        print_error(str(err))
        return EXIT_USAGE
    state_dir = settings.config_file.absolute().parent
    try:
        pid = hand_over(state_dir, timeout=getattr(args, "timeout", HANDOVER_TIMEOUT_S))
    except HandOverError as err:
        print_error(f"{err}{_relative_hint(settings, ('config_file',))}")
        return EXIT_FAILED
    print(f"host pid {pid} exited; its backends keep serving until the next host adopts them")
    return EXIT_OK


# --- serve --------------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    import gc

    # Off for all of start-up, imports included; serving.serve turns it back on once the host
    # serves (and says why there).
    gc.disable()
    try:
        return _serve(args)
    finally:
        gc.enable()


def _serve(args: argparse.Namespace) -> int:
    from solar_host.platform.logging_setup import configure_logging
    from solar_host.serving import serve as run_host
    from solar_host.settings import SettingsError, load_settings

    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    try:
        env_file, required = env_file_choice(args)
        settings = load_settings(env_file, env_file_required=required, **overrides)
    except SettingsError as err:
        print(f"solar-host: {err}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(settings)
    return run_host(settings)


def _relative_hint(settings: Any, fields: tuple[str, ...] = ("config_file", "jobs_dir")) -> str:
    """What to say when the state was looked for through a relative CONFIG_FILE or JOBS_DIR:
    they are relative to the working directory, which may not be the host's."""
    relative = [
        f"{name.upper()}={getattr(settings, name)}"
        for name in fields
        if not getattr(settings, name).is_absolute()
    ]
    if not relative:
        return ""
    them = "them as absolute paths" if len(relative) > 1 else "it as an absolute path"
    return (
        f" ({', '.join(relative)} relative to {Path.cwd()}: run this in the host's working "
        f"directory, or set {them} in the env file)"
    )


def _absolute_state_paths(settings: Any) -> Any:
    """`settings` with its state paths made absolute, so that what is said names them whole."""
    return settings.model_copy(
        update={
            name: getattr(settings, name).absolute()
            for name in ("config_file", "log_dir", "models_dir", "jobs_dir")
        }
    )


def restore_state(args: argparse.Namespace) -> int:
    from solar_host.cli.restore import restore_state as restore
    from solar_host.cli.restore import state_files
    from solar_host.platform.statefiles import last_good_path
    from solar_host.settings import SettingsError, load_settings

    try:
        env_file, required = env_file_choice(args)
        settings = load_settings(env_file, env_file_required=required)
    except SettingsError as err:
        print(f"solar-host: {err}", file=sys.stderr)
        return EXIT_USAGE
    absolute = _absolute_state_paths(settings)
    paths = [path for path, _ in state_files(absolute)]
    if not any(os.path.lexists(p) or os.path.lexists(last_good_path(p)) for p in paths):
        # Nothing to repair here: most likely not where the host keeps its state (a relative
        # CONFIG_FILE run from another directory), where saying "ok" would mislead.
        dirs = ", ".join(dict.fromkeys(str(p.parent) for p in paths))
        print_error(
            f"no state files in {dirs}: is this the host's working directory or env file?"
            f"{_relative_hint(settings)}"
        )
        return EXIT_FAILED
    return restore(absolute, dry_run=args.dry_run)

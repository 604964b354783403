"""The `solar-host` command: serve (the default) and client subcommands against a running host.

    solar-host [--host H] [--port P] [--env-file F]      serve (also: solar-host serve ...)
    solar-host --version
    solar-host status | instances | models
    solar-host create --backend-type T --model M --alias A [...] | create --file F.json
    solar-host start I | stop I | restart I | delete I
    solar-host logs I [--follow] [--tail N]
    solar-host pull URI [--backend-type T] [--harbor-ref REF] [--filter GLOB ...]
    solar-host jobs [list] | jobs show J | jobs cancel J | jobs logs J [--step S]

An instance I is named by its alias, its id, or a unique prefix of its id. Client commands
find the host at --url, else SOLAR_HOST_URL (environment, then the env file), else
http://127.0.0.1:$PORT; the key is --api-key, else API_KEY, else the key the host generated
beside CONFIG_FILE. Output is a table (or --json for scripts); errors go to stderr.

Exit codes: 0 ok, 1 the operation failed (or no instance has that name), 2 usage or
configuration error (or the name is ambiguous), 3 host unreachable (or what answered is not a
solar-host: not JSON, or JSON of another shape), 4 the host refused the key, 141 the reader of
the output went away early (`solar-host logs I | head`: quietly, as SIGPIPE ends other tools).

Text the host sends (aliases, statuses, error details) is shown with its control characters
spelled as \\xNN, so that it cannot drive the terminal; `logs` and --json output are left as
sent.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from solar_host.cli import instances, jobs, local, models
from solar_host.cli.connection import (
    CLIENT_OPTIONS,
    UsageError,
    add_client_options,
    client_options,
    resolve_connection,
)
from solar_host.cli.exits import (
    EXIT_AUTH,
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from solar_host.cli.format import (
    print_error,
    print_json,
    visible,
)

# --- commands: one entry each ------------------------------------------------------------------


@dataclass(frozen=True)
class ClientCommand:
    """A subcommand that talks to a running host: `run(client, args)`.

    Adding one is one entry in CLIENT_COMMANDS (bottom of the file): it gets the connection
    options, --json, and the exit codes of run_client.
    """

    name: str
    help: str
    run: Callable[[Any, argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None


@dataclass(frozen=True)
class LocalCommand:
    """A subcommand that works on this machine without a running host: `run(args)`.

    Adding one is one entry in LOCAL_COMMANDS (bottom of the file); `serve` is the default.
    """

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    # Which of the client options (connection.CLIENT_OPTIONS) it takes, before it or after it.
    takes: tuple[str, ...] = ("env_file",)


def build_parser() -> argparse.ArgumentParser:
    from solar_host import __version__

    p = argparse.ArgumentParser(
        prog="solar-host",
        description="solar-host agent: serve (default), or talk to a running host.",
        epilog="Instances are named by alias, id or unique id prefix. Exit codes: 0 ok, "
        "1 operation failed or no such instance, 2 usage or config error or ambiguous name, "
        "3 host unreachable or not a solar-host, 4 API key refused, 141 output pipe closed.",
    )
    p.add_argument("--version", action="version", version=f"solar-host {__version__}")
    p.add_argument("--host", help="bind address of serve (overrides HOST)")
    p.add_argument("--port", type=int, help="port of serve (overrides PORT)")
    # --env-file absent: the implicit ./.env, which may be absent; a file named must exist.
    add_client_options(p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for entry in LOCAL_COMMANDS:
        sp = sub.add_parser(entry.name, help=entry.help)
        if entry.arguments is not None:
            entry.arguments(sp)
    opts = client_options()
    for command in CLIENT_COMMANDS:
        sp = sub.add_parser(command.name, parents=[opts], help=command.help)
        if command.arguments is not None:
            command.arguments(sp)
    from solar_host.cli import doctor

    doctor.register(sub)  # subcommands that bring their own handler (args.handler)
    return p


# --- registry and dispatch --------------------------------------------------------------------

LOCAL_COMMANDS: tuple[LocalCommand, ...] = (
    LocalCommand("serve", "run the host (the default)", local.serve, local.serve_arguments),
    LocalCommand(
        "handover",
        "restart the host leaving its backends serving (the next host re-adopts them)",
        local.handover,
        local.handover_arguments,
        takes=("env_file", "timeout"),
    ),
    LocalCommand(
        "restore-state",
        "replace damaged state files (config.json, jobs store, reservations, api_key) by their "
        "last good copies (<file>.prev); the damaged ones are kept aside",
        local.restore_state,
        local.restore_arguments,
    ),
)

CLIENT_COMMANDS: tuple[ClientCommand, ...] = (
    ClientCommand("status", "host health, version and instance counts", instances.cmd_status),
    ClientCommand("instances", "list instances", instances.cmd_instances),
    ClientCommand(
        "create",
        "create an instance (flags or --file JSON)",
        instances.cmd_create,
        instances.create_arguments,
    ),
    ClientCommand(
        "start",
        "start an instance; shows its phases until ready",
        instances.cmd_with_phases("start"),
        instances.instance_arg,
    ),
    ClientCommand("stop", "stop an instance", instances.cmd_stop, instances.instance_arg),
    ClientCommand(
        "restart",
        "restart an instance; shows its phases until ready",
        instances.cmd_with_phases("restart"),
        instances.instance_arg,
    ),
    ClientCommand(
        "delete",
        "delete an instance (stops it first if it runs)",
        instances.cmd_delete,
        instances.instance_arg,
    ),
    ClientCommand("logs", "an instance's log lines", instances.cmd_logs, instances.logs_arguments),
    ClientCommand(
        "pull", "download a model into MODELS_DIR", models.cmd_pull, models.pull_arguments
    ),
    ClientCommand("models", "list pulled models and model files found on disk", models.cmd_models),
    ClientCommand(
        "verify",
        "check a pulled model's files against their recorded digests",
        models.cmd_verify,
        models.verify_arguments,
    ),
    ClientCommand(
        "jobs", "list, show, cancel jobs and read their logs", jobs.cmd_jobs, jobs.jobs_arguments
    ),
)


def run_client(args: argparse.Namespace) -> int:
    from solar_host.cli.client import (
        AmbiguousInstance,
        AuthFailed,
        ConfigError,
        HostClient,
        HostUnreachable,
        NoSuchInstance,
        OperationFailed,
    )

    args.json = getattr(args, "json", False)
    commands = {command.name: command for command in CLIENT_COMMANDS}
    try:
        url, key = resolve_connection(args)
        with HostClient(url, key, timeout=getattr(args, "timeout", 10.0)) as c:
            return commands[args.command].run(c, args)
    except (UsageError, ConfigError) as err:
        print_error(str(err))
        return EXIT_USAGE
    except AmbiguousInstance as err:
        if args.json:
            print_json(
                {"error": "ambiguous", "ref": err.ref, "matches": [i["id"] for i in err.matches]}
            )
        print_error(str(err))
        return EXIT_USAGE
    except NoSuchInstance as err:
        if args.json:
            print_json({"error": "not_found", "ref": err.ref, "detail": str(err)})
        print_error(str(err))
        return EXIT_FAILED
    except HostUnreachable as err:
        print_error(str(err))
        return EXIT_UNREACHABLE
    except AuthFailed as err:
        print_error(str(err))
        return EXIT_AUTH
    except OperationFailed as err:
        if args.json:
            print_json({"status_code": err.status, **err.body})
        print_error(str(err))
        tail = err.body.get("log_tail")
        if tail and isinstance(tail, list) and not args.json:
            print("last log lines:", file=sys.stderr)
            for line in tail:
                print(f"  {visible(line)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    skip_pydantic_plugins()
    # The cyclic collector is off while the command line is parsed: that imports the settings
    # (pydantic), tens of thousands of long-lived objects its passes rescanned, 8-15 ms of every
    # host start. Serve keeps it off until the router is built (serving.py); others turn it on.
    gc.disable()
    try:
        code = _main(argv)
        # Flushed here, not at exit, so that a reader gone away is caught below.
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        gc.enable()
    return code


def skip_pydantic_plugins() -> None:
    """Tell pydantic (before its first model) that this process uses no plugin of its. It
    looks for them in the entry points of every installed distribution, once, when the first
    model is built: a hundred-odd dist-info files beside torch and transformers, 30-70 ms of
    every start of the host and of every CLI call. PYDANTIC_DISABLE_PLUGINS is pydantic's own
    switch; one set in the environment is kept."""
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")


def _silence_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the closed pipe would raise again
    when the interpreter flushes it at exit."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _serve_flags_elsewhere(args: argparse.Namespace) -> str | None:
    """Why the global --host/--port cannot go with this command (they set where `serve`
    listens, and would otherwise be dropped without a word); None when they may."""
    if args.command in (None, "serve") or (args.host is None and args.port is None):
        return None
    given = " and ".join(
        flag for flag, v in (("--host", args.host), ("--port", args.port)) if v is not None
    )
    if args.command in {command.name for command in CLIENT_COMMANDS}:
        return (
            f"{given} set where `serve` listens, not the host {args.command} talks to: "
            "pass --url http://HOST:PORT (or set SOLAR_HOST_URL)"
        )
    verb = "only apply" if " and " in given else "only applies"
    return (
        f"{given} {verb} to `serve`; {args.command} takes HOST and PORT from the settings "
        "(the env file or the environment)"
    )


# Commands registered apart from LOCAL_COMMANDS, and the client options they take.
_OWN_HANDLER_TAKES = {"doctor": ("env_file", "json")}


def _client_options_elsewhere(args: argparse.Namespace) -> str | None:
    """Why a client option given before a command that does not take it cannot stand (it
    would be dropped without a word: `solar-host --url X` serves); None when it may."""
    command = args.command or "serve"
    if command in {c.name for c in CLIENT_COMMANDS}:
        return None
    local_takes = {c.name: c.takes for c in LOCAL_COMMANDS} | _OWN_HANDLER_TAKES
    given = [
        "--" + dest.replace("_", "-")
        for dest in CLIENT_OPTIONS
        if dest in vars(args) and dest not in local_takes.get(command, ())
    ]
    if not given:
        return None
    return f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} not an option of {command}"


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in (None, "serve"):
        gc.enable()
    refused = _serve_flags_elsewhere(args) or _client_options_elsewhere(args)
    if refused is not None:
        print_error(refused)
        return EXIT_USAGE
    if getattr(args, "handler", None) is not None:
        return int(args.handler(args))
    if args.command is None:
        return local.serve(args)
    for entry in LOCAL_COMMANDS:
        if entry.name == args.command:
            return entry.run(args)
    return run_client(args)

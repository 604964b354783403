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
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solar_host.cli_format import human_bytes, print_json, table, visible

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_AUTH = 4
# What a shell reports for a tool ended by SIGPIPE (128 + 13): the pipe's reader went away.
EXIT_BROKEN_PIPE = 141

INSTANCE_HELP = "alias, id or unique id prefix"


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


def _client_options() -> argparse.ArgumentParser:
    # SUPPRESS defaults: an option given before the subcommand is not reset by the subparser.
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument("--url", default=argparse.SUPPRESS, help="host URL (default: SOLAR_HOST_URL)")
    g.add_argument(
        "--api-key", default=argparse.SUPPRESS, help="API key (default: API_KEY or stored key)"
    )
    g.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file (default: ./.env)")
    g.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,
        help="seconds to wait for connecting and short calls (default: 10)",
    )
    return p


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
    # None: the implicit ./.env, which may be absent; a file named here must exist.
    p.add_argument("--env-file", default=None, help="settings file (default: ./.env)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for local in LOCAL_COMMANDS:
        sp = sub.add_parser(local.name, help=local.help)
        if local.arguments is not None:
            local.arguments(sp)
    opts = _client_options()
    for command in CLIENT_COMMANDS:
        sp = sub.add_parser(command.name, parents=[opts], help=command.help)
        if command.arguments is not None:
            command.arguments(sp)
    from solar_host import doctor

    doctor.register(sub)  # subcommands that bring their own handler (args.handler)
    return p


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: `solar-host --port 1 serve` keeps the port given before the subcommand.
    p.add_argument("--host", default=argparse.SUPPRESS, help="bind address")
    p.add_argument("--port", type=int, default=argparse.SUPPRESS, help="port")
    p.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file")


def _instance_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("instance", metavar="INSTANCE", help=INSTANCE_HELP)


def _handover_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the host to exit"
    )


def _restore_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file")
    p.add_argument("--dry-run", action="store_true", help="only show what would be replaced")


# --- handover -----------------------------------------------------------------------------------


def handover(args: argparse.Namespace) -> int:
    from solar_host.handover import HandOverError, hand_over
    from solar_host.settings import SettingsError, load_settings

    try:
        env_file, required = env_file_choice(args)
        settings = load_settings(env_file, env_file_required=required)
    except SettingsError as err:
        _err(str(err))
        return EXIT_USAGE
    state_dir = settings.config_file.absolute().parent
    try:
        pid = hand_over(state_dir, timeout=args.timeout)
    except HandOverError as err:
        _err(f"{err}{_relative_hint(settings, ('config_file',))}")
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
    from solar_host.logging_setup import configure_logging
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
    from solar_host.restore import restore_state as restore
    from solar_host.restore import state_files
    from solar_host.settings import SettingsError, load_settings
    from solar_host.statefiles import last_good_path

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
        _err(
            f"no state files in {dirs}: is this the host's working directory or env file?"
            f"{_relative_hint(settings)}"
        )
        return EXIT_FAILED
    return restore(absolute, dry_run=args.dry_run)


# --- client configuration -------------------------------------------------------------------


class UsageError(Exception):
    pass


def env_file_choice(args: argparse.Namespace) -> tuple[str, bool]:
    """(env file, whether it must exist): one named by --env-file must; ./.env may be absent."""
    from solar_host.envfile import DEFAULT_ENV_FILE

    named = getattr(args, "env_file", None)
    return (DEFAULT_ENV_FILE, False) if named is None else (named, True)


def _read_env_file(args: argparse.Namespace) -> dict[str, str]:
    """KEY=value pairs of the env file (keys upper-cased); {} when ./.env does not exist."""
    from solar_host.envfile import EnvFileError, read_env_file

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


# --- output helpers ---------------------------------------------------------------------------


def _err(msg: str) -> None:
    print(f"solar-host: {msg}", file=sys.stderr)


def _warn_all(body: dict[str, Any]) -> None:
    warnings = body.get("warnings")
    if not warnings:
        return
    for w in warnings if isinstance(warnings, list) else (warnings,):
        print(f"solar-host: warning: {visible(w)}", file=sys.stderr)


def _record(body: dict[str, Any], key: str, default: Any = None) -> dict[str, Any]:
    """body[key] when it is an object (an instance record in an answer), else `default`."""
    value = body.get(key)
    return value if isinstance(value, dict) else (default if default is not None else {})


def _where(inst: dict[str, Any]) -> str:
    if not inst.get("pid"):
        return ""
    return f" (port {visible(inst.get('port'))}, pid {visible(inst.get('pid'))})"


def _label(inst: dict[str, Any]) -> str:
    alias = _record(inst, "config").get("alias")
    iid = visible(inst.get("id"))
    return f"{iid} ({visible(alias)})" if alias else iid


def _state_line(inst: dict[str, Any]) -> str:
    """`ID: STATUS (port P, pid N)` of an instance record, for humans."""
    return f"{visible(inst.get('id'))}: {visible(inst.get('status'))}{_where(inst)}"


# --- host and instances ------------------------------------------------------------------------


def cmd_status(c: Any, args: argparse.Namespace) -> int:
    health = c.health()
    info = c.info()
    instances = c.instances()  # needs the key: checks it, where /health does not
    counts: dict[str, int] = {}
    for inst in instances:
        status = str(inst.get("status", "?"))
        counts[status] = counts.get(status, 0) + 1
    backends = info.get("supported_backends")
    doc = {
        "url": c.url,
        "status": health.get("status"),
        "version": health.get("version"),
        "supported_backends": backends if isinstance(backends, list) else [],
        "instances": counts,
        "disk": health.get("disk"),
    }
    if args.json:
        print_json(doc)
        return EXIT_OK
    print(f"host       {c.url}")
    print(f"status     {visible(doc['status'])} (solar-host {visible(doc['version'])})")
    print(f"backends   {', '.join(visible(b) for b in doc['supported_backends']) or '-'}")
    summary = ", ".join(f"{n} {visible(s)}" for s, n in sorted(counts.items())) or "none"
    print(f"instances  {len(instances)} ({summary})")
    disk = health.get("disk")
    if isinstance(disk, dict) and disk.get("available_gb") is not None:
        free, total = visible(disk["available_gb"]), visible(disk.get("total_gb"))
        print(f"disk       {free} GiB free of {total} GiB (models)")
    return EXIT_OK


def cmd_instances(c: Any, args: argparse.Namespace) -> int:
    instances = c.instances()
    if args.json:
        print_json(instances)
        return EXIT_OK
    rows = [
        (
            i.get("id"),
            _record(i, "config").get("alias"),
            _record(i, "config").get("backend_type"),
            i.get("status"),
            i.get("port"),
            i.get("pid"),
        )
        for i in instances
    ]
    if not rows:
        print("no instances")
        return EXIT_OK
    print(table(rows, ("ID", "ALIAS", "BACKEND", "STATUS", "PORT", "PID")))
    return EXIT_OK


# Flags of `create` -> config fields (the host validates every value and names bad fields).
CREATE_FIELDS: tuple[tuple[str, str, Any, str], ...] = (
    ("--backend-type", "backend_type", str, "llamacpp, huggingface_causal, sglang, ..."),
    ("--alias", "alias", str, "routing name of the model, e.g. qwen3:8b"),
    (
        "--model",
        "model",
        str,
        "model file, directory or id (sent as `model` for llamacpp, `model_path` for sglang, "
        "`model_id` for huggingface_*)",
    ),
    ("--model-file", "model_file", str, "file (or glob) inside a model directory"),
    ("--model-source", "model_source", str, "a pulled model: huggingface://... or repo://..."),
    ("--ctx-size", "ctx_size", int, "context size in tokens"),
    ("--port", "port", int, "port the backend listens on (default: the next free one)"),
    ("--bind-host", "host", str, "address the backend binds to (config field `host`)"),
    ("--n-gpu-layers", "n_gpu_layers", int, "layers offloaded to the GPU (llamacpp)"),
    ("--threads", "threads", int, "CPU threads (llamacpp)"),
    ("--model-type", "model_type", str, "llm, embedding or reranker (llamacpp)"),
    ("--instance-api-key", "api_key", str, "a key the backend accepts besides the host's"),
)


def _create_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--file", help="instance JSON: a config object, or {config, priority, ...}; - for stdin"
    )
    for flag, dest, kind, what in CREATE_FIELDS:
        metavar = flag.removeprefix("--").replace("-", "_").upper()
        p.add_argument(flag, dest=f"cfg_{dest}", type=kind, metavar=metavar, help=what)
    p.add_argument(
        "--set",
        dest="cfg_set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other config field (VALUE is JSON if it parses, else a string); repeatable",
    )
    p.add_argument("--priority", help="production (default), development or ephemeral")
    p.add_argument("--start", action="store_true", help="start it once created")


class NonFiniteNumber(ValueError):
    """JSON text holding NaN, Infinity or a number too large for a float (1e999)."""


def _refuse_constant(name: str) -> Any:
    raise NonFiniteNumber(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(f"{text} is too large for a number")
    return value


def strict_json(text: str) -> Any:
    """json.loads as JSON is written: Python's parser takes NaN and Infinity, and turns 1e999
    into infinity, none of which can be sent (the body is encoded as strict JSON)."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def model_field(backend_type: str) -> str:
    """The config field that names the model for `backend_type` (schemas.model_field_of, which
    the command line does not import: it pulls in every backend's config)."""
    if backend_type == "sglang":
        return "model_path"
    return "model_id" if backend_type.startswith("huggingface") else "model"


def create_body(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /instances body from --file, then the flags (a flag wins over the file)."""
    body: dict[str, Any] = {}
    if args.file:
        try:
            text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text("utf-8")
            loaded = strict_json(text)
        except OSError as err:
            raise UsageError(f"--file: cannot read {args.file}: {err.strerror or err}") from None
        except NonFiniteNumber as err:
            raise UsageError(f"--file: {args.file}: {err}") from None
        except (ValueError, RecursionError) as err:
            why = "nested too deeply" if isinstance(err, RecursionError) else err
            raise UsageError(f"--file: {args.file} is not valid JSON: {why}") from None
        if not isinstance(loaded, dict):
            raise UsageError("--file: a JSON object is required")
        body = dict(loaded) if isinstance(loaded.get("config"), dict) else {"config": loaded}
    config: dict[str, Any] = dict(body.get("config") or {})
    for item in args.cfg_set:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            value: Any = strict_json(raw)
        except NonFiniteNumber as err:
            raise UsageError(f"--set {item!r}: {err}") from None
        except (ValueError, RecursionError):
            value = raw
        config[name.strip()] = value
    for _, dest, _, _ in CREATE_FIELDS:
        value = getattr(args, f"cfg_{dest}")
        if value is not None:
            config[dest] = value
    if not config.get("backend_type"):
        raise UsageError("create needs --backend-type (or a config with backend_type in --file)")
    if args.cfg_model is not None:
        # --model names the model whatever the backend calls the field.
        field = model_field(str(config["backend_type"]))
        if field != "model":
            config[field] = config.pop("model")
    body["config"] = config
    if args.priority:
        body["priority"] = args.priority
    return body


def cmd_create(c: Any, args: argparse.Namespace) -> int:
    body = create_body(args)
    created = c.create(body)
    _warn_all(created)
    inst = _record(created, "instance")
    if not args.start:
        if args.json:
            print_json(created)
        else:
            print(f"created {_label(inst)}")
        return EXIT_OK
    if not args.json:
        print(f"created {_label(inst)}")
    return _lifecycle_with_phases(c, args, inst, "start", created=created)


# Statuses in which the host deletes an instance; in any other it must be stopped first.
DELETABLE = ("stopped", "failed")


def cmd_delete(c: Any, args: argparse.Namespace) -> int:
    inst = c.find_instance(args.instance)
    stopped = None
    if inst.get("status") not in DELETABLE:
        stopped = c.stop(inst["id"])
        if not args.json:
            print(_state_line(_record(stopped, "instance", inst)), flush=True)
    body = c.delete(inst["id"])
    if args.json:
        print_json(body if stopped is None else {**body, "stopped": stopped})
    else:
        print(f"deleted {_label(inst)}")
    return EXIT_OK


def cmd_stop(c: Any, args: argparse.Namespace) -> int:
    inst = c.find_instance(args.instance)
    body = c.stop(inst["id"])
    if args.json:
        print_json(body)
        return EXIT_OK
    print(_state_line(_record(body, "instance", inst)))
    return EXIT_OK


def _lifecycle_with_phases(
    c: Any,
    args: argparse.Namespace,
    inst: dict[str, Any],
    action: str,
    created: dict[str, Any] | None = None,
) -> int:
    from solar_host.cli_phases import PhaseLog, run_with_phases

    stream = None if args.json else sys.stdout
    log = PhaseLog(stream, live=bool(stream is not None and stream.isatty()))
    body = asyncio.run(run_with_phases(c, inst["id"], action, log))
    elapsed = log.elapsed()
    ready = next((p.at_s for p in log.phases if p.text == "ready"), None)
    if args.json:
        doc = {**body, "phases": [p.as_dict() for p in log.phases], "elapsed_s": round(elapsed, 3)}
        if created is not None:
            doc["warnings"] = created.get("warnings") or []
        print_json(doc)
        return EXIT_OK
    after = _record(body, "instance", inst)
    if log.spawned:
        how = f", ready in {ready if ready is not None else elapsed:.1f} s"
    else:
        how = " (already running)" if action == "start" else ""
    print(f"{_state_line(after)}{how}", flush=True)
    return EXIT_OK


def _cmd_with_phases(action: str) -> Callable[[Any, argparse.Namespace], int]:
    def run(c: Any, args: argparse.Namespace) -> int:
        return _lifecycle_with_phases(c, args, c.find_instance(args.instance), action)

    return run


# --- logs ------------------------------------------------------------------------------------


def _logs_arguments(p: argparse.ArgumentParser) -> None:
    _instance_arg(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep streaming new lines")
    p.add_argument("-n", "--tail", type=int, default=None, help="only the last N lines")


def _print_entry(entry: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(entry, ensure_ascii=False), flush=True)
    elif "gap" in entry:
        gap = entry["gap"]
        print(
            f"[... lines {gap.get('from_seq')}-{gap.get('to_seq')} were dropped: "
            "this client read too slowly ...]",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(entry.get("line", ""), flush=True)


def cmd_logs(c: Any, args: argparse.Namespace) -> int:
    if args.tail is not None and args.tail < 0:
        raise UsageError("--tail must be 0 or more")
    iid = c.find_instance(args.instance)["id"]
    everything = c.logs(iid)
    entries = everything
    if args.tail is not None:
        entries = everything[-args.tail :] if args.tail else []
    for e in entries:
        _print_entry(e, args.json)
    if not args.follow:
        return EXIT_OK
    from solar_host.client import next_seq

    # Continue right after what was printed (or from the oldest line kept, if none was there).
    since = next_seq(everything)

    async def follow() -> None:
        async for msg in c.follow_logs(iid, since_seq=since):
            _print_entry(msg, args.json)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(follow())
    return EXIT_OK


# --- models ------------------------------------------------------------------------------------


def _pull_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", metavar="URI", help="huggingface://ORG/MODEL or repo://NAME:VERSION")
    p.add_argument("--backend-type", help="backend the model is for (llamacpp, sglang, ...)")
    p.add_argument("--harbor-ref", help="OCI reference for repo:// URIs, e.g. project/name:version")
    p.add_argument(
        "--filter",
        dest="file_filters",
        action="append",
        help="only files matching this glob (repeatable)",
    )


def pull_body(args: argparse.Namespace) -> dict[str, Any]:
    uri = args.uri.strip()
    body: dict[str, Any] = {"source_uri": uri}
    if uri.startswith("huggingface://"):
        body["source"] = "huggingface"
        body["model_id"] = uri[len("huggingface://") :].strip("/")
    elif uri.startswith("repo://"):
        if not args.harbor_ref:
            raise UsageError(
                "repo:// pulls need --harbor-ref PROJECT/NAME:VERSION (the artifact in Harbor)"
            )
        body["source"] = "harbor"
        body["harbor_ref"] = args.harbor_ref
    else:
        raise UsageError(
            f"cannot pull {uri!r}: expected huggingface://ORG/MODEL or repo://NAME:VERSION"
        )
    if args.backend_type:
        body["backend_type"] = args.backend_type
    if args.file_filters:
        body["file_filters"] = args.file_filters
    return body


PULL_POLL_S = 0.25


async def _pull_with_display(c: Any, body: dict[str, Any], display: Any) -> dict[str, Any]:
    """POST the pull; meanwhile poll GET /metrics for its progress and feed the display."""
    from solar_host.cli_pull import read_pull_progress
    from solar_host.cli_threads import in_daemon_thread
    from solar_host.client import ClientError, HostClient

    puller = HostClient(c.url, c.api_key, timeout=c.timeout)
    task = asyncio.ensure_future(in_daemon_thread(puller.pull, body))
    ok = False
    try:
        while not task.done():
            try:
                text = await asyncio.to_thread(c.metrics_text)
            except ClientError:
                text = None  # metrics off or refused: the bar shows the clock only
            if text is not None:
                display.update(*read_pull_progress(text, body["source_uri"]))
            await asyncio.wait({task}, timeout=PULL_POLL_S)
        result = task.result()
        ok = True
        return result
    finally:
        display.close(ok)
        puller.close()


def cmd_pull(c: Any, args: argparse.Namespace) -> int:
    from solar_host.cli_pull import pull_display

    body = pull_body(args)
    started = time.monotonic()
    if args.json:
        result = c.pull(body)
        print_json(result)
        return EXIT_OK
    result = asyncio.run(_pull_with_display(c, body, pull_display(body["source_uri"], sys.stdout)))
    how = "already present" if result.get("cached") else f"in {time.monotonic() - started:.0f} s"
    print(f"{visible(result.get('source_uri'))}: {visible(result.get('path'))} ({how})")
    return EXIT_OK


def cmd_models(c: Any, args: argparse.Namespace) -> int:
    models = c.models()
    if args.json:
        print_json(models)
        return EXIT_OK
    if not models:
        print("no models")
        return EXIT_OK
    rows = [
        (m.get("slug"), human_bytes(m.get("size_bytes")), m.get("source_uri"), m.get("path"))
        for m in models
    ]
    print(table(rows, ("SLUG", "SIZE", "SOURCE", "PATH")))
    return EXIT_OK


# --- jobs ------------------------------------------------------------------------------------


def _jobs_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="jobs_action", metavar="ACTION")
    opts = _client_options()
    actions.add_parser("list", parents=[opts], help="list jobs (the default)")
    for name, what in (("show", "one job's state and steps"), ("cancel", "cancel a job")):
        ap = actions.add_parser(name, parents=[opts], help=what)
        ap.add_argument("job_id", metavar="JOB")
    lp = actions.add_parser("logs", parents=[opts], help="recent log lines of a job's steps")
    lp.add_argument("job_id", metavar="JOB")
    lp.add_argument("--step", help="only this step")


def cmd_jobs(c: Any, args: argparse.Namespace) -> int:
    action = getattr(args, "jobs_action", None) or "list"
    if action == "list":
        jobs = c.jobs()
        if args.json:
            print_json(jobs)
        elif not jobs:
            print("no jobs")
        else:
            rows = [
                (
                    j.get("job_id"),
                    j.get("status"),
                    _current_step(j),
                    j.get("created_at"),
                    j.get("error_message") or "",
                )
                for j in jobs
            ]
            print(table(rows, ("JOB", "STATUS", "STEP", "CREATED", "ERROR")))
        return EXIT_OK
    if action == "cancel":
        body = c.cancel_job(args.job_id)
        if args.json:
            print_json(body)
        else:
            print(f"{args.job_id}: cancelled")
        return EXIT_OK
    job = c.job(args.job_id)
    if action == "show":
        _show_job(job, args.json)
        return EXIT_OK
    steps = steps_of(job)
    if args.step:
        steps = [s for s in steps if s.get("name") == args.step]
        if not steps:
            names = ", ".join(visible(s.get("name", "?")) for s in steps_of(job)) or "none"
            raise UsageError(f"job {args.job_id} has no step {args.step!r} (steps: {names})")
    for step in steps:
        for e in step.get("recent_logs") or ():
            if args.json:
                print(json.dumps({"step": step.get("name"), **e}, ensure_ascii=False))
            elif not e.get("completed"):
                prefix = f"[{step.get('name')}] " if len(steps) > 1 else ""
                print(f"{prefix}{e.get('line', '')}", file=_stream(e))
    if not args.json:
        for step in steps:
            name, log_file = visible(step.get("name")), visible(step.get("log_file"))
            print(f"(full log of {name}: {log_file})", file=sys.stderr)
    return EXIT_OK


def steps_of(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The step records of a job answer (those that are objects)."""
    steps = job.get("steps")
    return [s for s in steps if isinstance(s, dict)] if isinstance(steps, list) else []


def _stream(entry: dict[str, Any]) -> Any:
    return sys.stderr if entry.get("stream") == "stderr" else sys.stdout


def _current_step(job: dict[str, Any]) -> str:
    steps = steps_of(job)
    i = job.get("current_step_index", -1)
    if isinstance(i, int) and 0 <= i < len(steps):
        return f"{i + 1}/{len(steps)} {steps[i].get('name')}"
    return f"-/{len(steps)}"


def _show_job(job: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(job)
        return
    print(f"job        {visible(job.get('job_id'))} ({visible(job.get('name'))})")
    print(f"status     {visible(job.get('status'))}")
    if job.get("error_message"):
        print(f"error      {visible(job['error_message'])}")
    print(f"created    {visible(job.get('created_at'))}")
    print(f"workspace  {visible(job.get('workspace_path'))}")
    rows = [
        (s.get("name"), s.get("status"), s.get("exit_code"), s.get("duration_s"))
        for s in steps_of(job)
    ]
    if rows:
        print()
        print(table(rows, ("STEP", "STATUS", "EXIT", "SECONDS")))


# --- registry and dispatch --------------------------------------------------------------------

LOCAL_COMMANDS: tuple[LocalCommand, ...] = (
    LocalCommand("serve", "run the host (the default)", serve, _serve_arguments),
    LocalCommand(
        "handover",
        "restart the host leaving its backends serving (the next host re-adopts them)",
        handover,
        _handover_arguments,
    ),
    LocalCommand(
        "restore-state",
        "replace damaged state files (config.json, jobs store, reservations, api_key) by their "
        "last good copies (<file>.prev); the damaged ones are kept aside",
        restore_state,
        _restore_arguments,
    ),
)

CLIENT_COMMANDS: tuple[ClientCommand, ...] = (
    ClientCommand("status", "host health, version and instance counts", cmd_status),
    ClientCommand("instances", "list instances", cmd_instances),
    ClientCommand(
        "create", "create an instance (flags or --file JSON)", cmd_create, _create_arguments
    ),
    ClientCommand(
        "start",
        "start an instance; shows its phases until ready",
        _cmd_with_phases("start"),
        _instance_arg,
    ),
    ClientCommand("stop", "stop an instance", cmd_stop, _instance_arg),
    ClientCommand(
        "restart",
        "restart an instance; shows its phases until ready",
        _cmd_with_phases("restart"),
        _instance_arg,
    ),
    ClientCommand(
        "delete", "delete an instance (stops it first if it runs)", cmd_delete, _instance_arg
    ),
    ClientCommand("logs", "an instance's log lines", cmd_logs, _logs_arguments),
    ClientCommand("pull", "download a model into MODELS_DIR", cmd_pull, _pull_arguments),
    ClientCommand("models", "list pulled models", cmd_models),
    ClientCommand("jobs", "list, show, cancel jobs and read their logs", cmd_jobs, _jobs_arguments),
)


def run_client(args: argparse.Namespace) -> int:
    from solar_host.client import (
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
        _err(str(err))
        return EXIT_USAGE
    except AmbiguousInstance as err:
        if args.json:
            print_json(
                {"error": "ambiguous", "ref": err.ref, "matches": [i["id"] for i in err.matches]}
            )
        _err(str(err))
        return EXIT_USAGE
    except NoSuchInstance as err:
        if args.json:
            print_json({"error": "not_found", "ref": err.ref, "detail": str(err)})
        _err(str(err))
        return EXIT_FAILED
    except HostUnreachable as err:
        _err(str(err))
        return EXIT_UNREACHABLE
    except AuthFailed as err:
        _err(str(err))
        return EXIT_AUTH
    except OperationFailed as err:
        if args.json:
            print_json({"status_code": err.status, **err.body})
        _err(str(err))
        tail = err.body.get("log_tail")
        if tail and isinstance(tail, list) and not args.json:
            print("last log lines:", file=sys.stderr)
            for line in tail:
                print(f"  {visible(line)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        # Flushed here, not at exit, so that a reader gone away is caught below.
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    return code


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


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    refused = _serve_flags_elsewhere(args)
    if refused is not None:
        _err(refused)
        return EXIT_USAGE
    if getattr(args, "handler", None) is not None:
        return int(args.handler(args))
    if args.command is None:
        return serve(args)
    for local in LOCAL_COMMANDS:
        if local.name == args.command:
            return local.run(args)
    return run_client(args)

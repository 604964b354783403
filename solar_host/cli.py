"""The `solar-host` command: serve (the default) and client subcommands against a running host.

    solar-host [--host H] [--port P] [--env-file F]      serve (also: solar-host serve ...)
    solar-host status | instances | models
    solar-host start ID | stop ID
    solar-host logs ID [--follow] [--tail N]
    solar-host pull URI [--backend-type T] [--harbor-ref REF] [--filter GLOB ...]

Client commands find the host at --url, else SOLAR_HOST_URL (environment, then the env file),
else http://127.0.0.1:$PORT; the key is --api-key, else API_KEY, else the key the host generated
beside CONFIG_FILE. Output is a table (or --json for scripts); errors go to stderr.

Exit codes: 0 ok, 1 the operation failed, 2 usage or configuration error, 3 host unreachable,
4 the host refused the key.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_AUTH = 4

CLIENT_COMMANDS = ("status", "instances", "start", "stop", "logs", "pull", "models")


# --- argument parsing -----------------------------------------------------------------------


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
    p = argparse.ArgumentParser(
        prog="solar-host",
        description="solar-host agent: serve (default), or talk to a running host.",
        epilog="Exit codes: 0 ok, 1 operation failed, 2 usage or config error, "
        "3 host unreachable, 4 API key refused.",
    )
    p.add_argument("--host", help="bind address (overrides HOST)")
    p.add_argument("--port", type=int, help="port (overrides PORT)")
    p.add_argument("--env-file", default=".env", help="settings file (default: ./.env)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    opts = _client_options()

    serve_p = sub.add_parser("serve", help="run the host (the default)")
    serve_p.add_argument("--host", default=argparse.SUPPRESS, help="bind address")
    serve_p.add_argument("--port", type=int, default=argparse.SUPPRESS, help="port")
    serve_p.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file")

    sub.add_parser("status", parents=[opts], help="host health, version and instance counts")
    sub.add_parser("instances", parents=[opts], help="list instances")
    for name, what in (
        ("start", "start an instance (waits until ready)"),
        ("stop", "stop an instance"),
    ):
        sp = sub.add_parser(name, parents=[opts], help=what)
        sp.add_argument("instance_id", metavar="ID")
    lp = sub.add_parser("logs", parents=[opts], help="an instance's log lines")
    lp.add_argument("instance_id", metavar="ID")
    lp.add_argument("-f", "--follow", action="store_true", help="keep streaming new lines")
    lp.add_argument("-n", "--tail", type=int, default=None, help="only the last N lines")
    pp = sub.add_parser("pull", parents=[opts], help="download a model into MODELS_DIR")
    pp.add_argument("uri", metavar="URI", help="huggingface://ORG/MODEL or repo://NAME:VERSION")
    pp.add_argument("--backend-type", help="backend the model is for (llamacpp, sglang, ...)")
    pp.add_argument(
        "--harbor-ref", help="OCI reference for repo:// URIs, e.g. project/name:version"
    )
    pp.add_argument(
        "--filter",
        dest="file_filters",
        action="append",
        help="only files matching this glob (repeatable)",
    )
    sub.add_parser("models", parents=[opts], help="list pulled models")
    hp = sub.add_parser(
        "handover",
        help="restart the host leaving its backends serving (the next host re-adopts them)",
    )
    hp.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file")
    hp.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the host to exit"
    )
    rp = sub.add_parser(
        "restore-state",
        help="replace damaged state files (config.json, jobs store, reservations, api_key) "
        "by their last good copies (<file>.prev); the damaged ones are kept aside",
    )
    rp.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file")
    rp.add_argument("--dry-run", action="store_true", help="only show what would be replaced")
    from solar_host import doctor

    doctor.register(sub)  # subcommands that bring their own handler (args.handler)
    return p


# --- handover -----------------------------------------------------------------------------------


def handover(args: argparse.Namespace) -> int:
    from solar_host.handover import HandOverError, hand_over
    from solar_host.settings import SettingsError, load_settings

    try:
        settings = load_settings(args.env_file)
    except SettingsError as err:
        _err(str(err))
        return EXIT_USAGE
    state_dir = settings.config_file.parent
    try:
        pid = hand_over(state_dir, timeout=args.timeout)
    except HandOverError as err:
        _err(str(err))
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
        settings = load_settings(args.env_file, **overrides)
    except SettingsError as err:
        print(f"solar-host: {err}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(settings)
    return run_host(settings)


def restore_state(args: argparse.Namespace) -> int:
    from solar_host.restore import restore_state as restore
    from solar_host.settings import SettingsError, load_settings

    try:
        settings = load_settings(args.env_file)
    except SettingsError as err:
        print(f"solar-host: {err}", file=sys.stderr)
        return EXIT_USAGE
    return restore(settings, dry_run=args.dry_run)


# --- client configuration -------------------------------------------------------------------


class UsageError(Exception):
    pass


def _read_env_file(path: str) -> dict[str, str]:
    """KEY=value pairs of the env file (keys upper-cased); {} when it does not exist."""
    from solar_host.envfile import read_env_file

    return {k.upper(): v for k, v in read_env_file(path).items()}


def resolve_connection(args: argparse.Namespace) -> tuple[str, str]:
    """(url, api_key) from flags, the environment, the env file, then the stored key."""
    env_file = getattr(args, "env_file", ".env")
    file_values = _read_env_file(env_file)

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


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False, default=str))


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, v in enumerate(row):
            widths[i] = max(widths[i], len(v))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _err(msg: str) -> None:
    print(f"solar-host: {msg}", file=sys.stderr)


# --- client commands ------------------------------------------------------------------------


def cmd_status(c: Any, args: argparse.Namespace) -> int:
    health = c.health()
    info = c.info()
    instances = c.instances()  # needs the key: checks it, where /health does not
    counts: dict[str, int] = {}
    for inst in instances:
        counts[inst.get("status", "?")] = counts.get(inst.get("status", "?"), 0) + 1
    doc = {
        "url": c.url,
        "status": health.get("status"),
        "version": health.get("version"),
        "supported_backends": info.get("supported_backends", []),
        "instances": counts,
        "disk": health.get("disk"),
    }
    if args.json:
        print_json(doc)
        return EXIT_OK
    print(f"host       {c.url}")
    print(f"status     {doc['status']} (solar-host {doc['version']})")
    print(f"backends   {', '.join(doc['supported_backends']) or '-'}")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"
    print(f"instances  {len(instances)} ({summary})")
    disk = health.get("disk")
    if isinstance(disk, dict) and disk.get("available_gb") is not None:
        print(f"disk       {disk['available_gb']} GiB free of {disk.get('total_gb')} GiB (models)")
    return EXIT_OK


def cmd_instances(c: Any, args: argparse.Namespace) -> int:
    instances = c.instances()
    if args.json:
        print_json(instances)
        return EXIT_OK
    rows = [
        (
            i.get("id"),
            (i.get("config") or {}).get("alias"),
            (i.get("config") or {}).get("backend_type"),
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


def _cmd_lifecycle(action: str) -> Callable[[Any, argparse.Namespace], int]:
    def run(c: Any, args: argparse.Namespace) -> int:
        body = getattr(c, action)(args.instance_id)
        inst = body.get("instance", {})
        if args.json:
            print_json(body)
            return EXIT_OK
        where = f" (port {inst.get('port')}, pid {inst.get('pid')})" if inst.get("pid") else ""
        print(f"{inst.get('id', args.instance_id)}: {inst.get('status')}{where}")
        return EXIT_OK

    return run


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
    everything = c.logs(args.instance_id)  # also checks the key and that the instance exists
    entries = everything
    if args.tail is not None:
        entries = everything[-args.tail :] if args.tail else []
    for e in entries:
        _print_entry(e, args.json)
    if not args.follow:
        return EXIT_OK
    # Continue right after what was printed (or from the oldest line kept, if none was there).
    since = everything[-1]["seq"] + 1 if everything else None
    import asyncio

    async def follow() -> None:
        async for msg in c.follow_logs(args.instance_id, since_seq=since):
            _print_entry(msg, args.json)

    try:
        asyncio.run(follow())
    except KeyboardInterrupt:
        pass
    return EXIT_OK


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


SPINNER = "|/-\\"


def read_pull_progress(metrics_text: str, uri: str) -> tuple[str | None, int | None, int | None]:
    """(phase, bytes_done, bytes_total) of the running pull of `uri`, from GET /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    phase = done = total = None
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.labels.get("source_uri") != uri:
                continue
            if s.name == "solar_host_model_pull_progress_bytes":
                phase, done = s.labels.get("phase"), int(s.value)
            elif s.name == "solar_host_model_pull_expected_bytes":
                total = int(s.value)
    return phase, done, total


class PullProgressLine:
    """A one-line live display on stderr: spinner, elapsed time, and the host's pull progress.

    The host reports bytes every PULL_PROGRESS_INTERVAL_S through GET /metrics; between
    reports only the spinner and the clock move. Without a terminal nothing is drawn.
    """

    def __init__(self, c: Any, uri: str, stream: Any = sys.stderr):
        self.c = c
        self.uri = uri
        self.stream = stream
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.progress: tuple[str | None, int | None, int | None] = (None, None, None)
        self.metrics_ok = True

    def poll(self) -> None:
        if not self.metrics_ok:
            return
        try:
            self.progress = read_pull_progress(self.c.metrics_text(), self.uri)
        except Exception:
            self.metrics_ok = False  # an older host, or metrics off: spinner and clock only

    def text(self, tick: int) -> str:
        elapsed = time.monotonic() - self.started
        phase, done, total = self.progress
        parts = [f"{SPINNER[tick % len(SPINNER)]} pulling {self.uri}", f"{elapsed:5.0f} s"]
        if phase:
            parts.append(phase)
        if done:
            if total:
                parts.append(f"{human_bytes(done)} / {human_bytes(total)} ({done / total:.0%})")
            else:
                parts.append(human_bytes(done))
        return "  ".join(parts)

    def run(self) -> None:
        tick = 0
        next_poll = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_poll:
                self.poll()
                next_poll = now + 1.0
            self.stream.write("\r\x1b[K" + self.text(tick))
            self.stream.flush()
            tick += 1
            self.stop.wait(0.2)
        self.stream.write("\r\x1b[K")
        self.stream.flush()


def cmd_pull(c: Any, args: argparse.Namespace) -> int:
    body = pull_body(args)
    display = None
    thread = None
    if sys.stderr.isatty() and not args.json:
        from solar_host.client import HostClient

        poller = HostClient(c.url, c.api_key, timeout=c.timeout)
        display = PullProgressLine(poller, body["source_uri"])
        thread = threading.Thread(target=display.run, daemon=True)
        thread.start()
    started = time.monotonic()
    try:
        result = c.pull(body)
    finally:
        if display is not None and thread is not None:
            display.stop.set()
            thread.join(timeout=2)
            display.c.close()
    if args.json:
        print_json(result)
        return EXIT_OK
    how = "already present" if result.get("cached") else f"in {time.monotonic() - started:.0f} s"
    print(f"{result.get('source_uri')}: {result.get('path')} ({how})")
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


COMMANDS: dict[str, Callable[[Any, argparse.Namespace], int]] = {
    "status": cmd_status,
    "instances": cmd_instances,
    "start": _cmd_lifecycle("start"),
    "stop": _cmd_lifecycle("stop"),
    "logs": cmd_logs,
    "pull": cmd_pull,
    "models": cmd_models,
}


def run_client(args: argparse.Namespace) -> int:
    from solar_host.client import (
        AuthFailed,
        ConfigError,
        HostClient,
        HostUnreachable,
        OperationFailed,
    )

    args.json = getattr(args, "json", False)
    try:
        url, key = resolve_connection(args)
        with HostClient(url, key, timeout=getattr(args, "timeout", 10.0)) as c:
            return COMMANDS[args.command](c, args)
    except (UsageError, ConfigError) as err:
        _err(str(err))
        return EXIT_USAGE
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
        if tail and not args.json:
            print("last log lines:", file=sys.stderr)
            for line in tail:
                print(f"  {line}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "handler", None) is not None:
        return int(args.handler(args))
    if args.command in (None, "serve"):
        return serve(args)
    if args.command == "handover":
        return handover(args)
    if args.command == "restore-state":
        return restore_state(args)
    return run_client(args)

"""Client commands about the host and its instances: status, instances, create, start,
stop, restart, delete, logs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from solar_host.cli.connection import UsageError
from solar_host.cli.exits import (
    EXIT_OK,
)
from solar_host.cli.format import (
    label,
    print_json,
    print_warnings,
    record,
    state_line,
    table,
    visible,
)

INSTANCE_HELP = "alias, id or unique id prefix"


def instance_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("instance", metavar="INSTANCE", help=INSTANCE_HELP)


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
            record(i, "config").get("alias"),
            record(i, "config").get("backend_type"),
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


def create_arguments(p: argparse.ArgumentParser) -> None:
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
    print_warnings(created)
    inst = record(created, "instance")
    if not args.start:
        if args.json:
            print_json(created)
        else:
            print(f"created {label(inst)}")
        return EXIT_OK
    if not args.json:
        print(f"created {label(inst)}")
    return _lifecycle_with_phases(c, args, inst, "start", created=created)


# Statuses in which the host deletes an instance; in any other it must be stopped first.
DELETABLE = ("stopped", "failed")


def cmd_delete(c: Any, args: argparse.Namespace) -> int:
    inst = c.find_instance(args.instance)
    stopped = None
    if inst.get("status") not in DELETABLE:
        stopped = c.stop(inst["id"])
        if not args.json:
            print(state_line(record(stopped, "instance", inst)), flush=True)
    body = c.delete(inst["id"])
    if args.json:
        print_json(body if stopped is None else {**body, "stopped": stopped})
    else:
        print(f"deleted {label(inst)}")
    return EXIT_OK


def cmd_stop(c: Any, args: argparse.Namespace) -> int:
    inst = c.find_instance(args.instance)
    body = c.stop(inst["id"])
    if args.json:
        print_json(body)
        return EXIT_OK
    print(state_line(record(body, "instance", inst)))
    return EXIT_OK


def _lifecycle_with_phases(
    c: Any,
    args: argparse.Namespace,
    inst: dict[str, Any],
    action: str,
    created: dict[str, Any] | None = None,
) -> int:
    from solar_host.cli.phases import PhaseLog, run_with_phases

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
    after = record(body, "instance", inst)
    if log.spawned:
        how = f", ready in {ready if ready is not None else elapsed:.1f} s"
    else:
        how = " (already running)" if action == "start" else ""
    print(f"{state_line(after)}{how}", flush=True)
    return EXIT_OK


def cmd_with_phases(action: str) -> Callable[[Any, argparse.Namespace], int]:
    def run(c: Any, args: argparse.Namespace) -> int:
        return _lifecycle_with_phases(c, args, c.find_instance(args.instance), action)

    return run


# --- logs ------------------------------------------------------------------------------------


def logs_arguments(p: argparse.ArgumentParser) -> None:
    instance_arg(p)
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
    from solar_host.cli.client import next_seq

    # Continue right after what was printed (or from the oldest line kept, if none was there).
    since = next_seq(everything)

    async def follow() -> None:
        async for msg in c.follow_logs(iid, since_seq=since):
            _print_entry(msg, args.json)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(follow())
    return EXIT_OK

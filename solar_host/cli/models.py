"""Client commands about model files: pull (with its live display) and models."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from solar_host.cli.connection import UsageError
from solar_host.cli.exits import (
    EXIT_FAILED,
    EXIT_OK,
)
from solar_host.cli.format import (
    human_bytes,
    print_json,
    table,
    visible,
)


def pull_arguments(p: argparse.ArgumentParser) -> None:
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
    from solar_host.cli.client import ClientError, HostClient
    from solar_host.cli.pull_display import read_pull_progress
    from solar_host.platform.threads import in_daemon_thread

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
    from solar_host.cli.pull_display import pull_display

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
    # A file found in the model roots has no slug: its name is the path a config gives.
    rows = [
        (
            m.get("slug") or m.get("name"),
            human_bytes(m.get("size_bytes")),
            m.get("source_uri") or m.get("source"),
            m.get("path"),
        )
        for m in models
    ]
    print(table(rows, ("SLUG", "SIZE", "SOURCE", "PATH")))
    return EXIT_OK


def verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("slug", metavar="SLUG", help="the model's name, as `solar-host models` shows")


def cmd_verify(c: Any, args: argparse.Namespace) -> int:
    """Exit 0 when every file matched its recorded digest, 1 otherwise."""
    report = c.verify(args.slug)
    if args.json:
        print_json(report)
    else:
        rows = [
            (f.get("result"), human_bytes(f.get("size_bytes")), f.get("name"))
            for f in report["files"]
        ]
        print(table(rows, ("RESULT", "SIZE", "FILE")))
        verdict = "verified" if report.get("ok") else "NOT verified"
        print(f"{visible(report.get('name'))}: {verdict}")
    return EXIT_OK if report.get("ok") else EXIT_FAILED

"""Client commands about jobs: list, show, cancel and their step logs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from solar_host.cli.connection import UsageError, client_options
from solar_host.cli.exits import (
    EXIT_OK,
)
from solar_host.cli.format import (
    print_json,
    table,
    visible,
)


def jobs_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="jobs_action", metavar="ACTION")
    opts = client_options()
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

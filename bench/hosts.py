"""Which host a bench runs: this checkout, another tree of ours, or the upstream release.

Every host bench takes `--root DIR` (the tree whose host is spawned; default: this checkout) and
`--python PY` (the interpreter that runs it; default: this one). A tree with a `solar_host/`
package runs as `python -m solar_host` with PYTHONPATH=DIR, so a `git worktree` of any revision
needs no virtual environment of its own. A tree with `app/main.py` and no `solar_host/` is the
upstream release (github.com/legekka/solar-host), run as `python -m uvicorn app.main:app` from
the host's temp dir; it needs its own interpreter with its requirements.txt (`--python`).

`--json` makes a bench print its figures as one last line, `RESULT {...}`, for
bench/compare_revisions.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fixtures.hostproc import HostProc  # noqa: E402

RESULT_PREFIX = "RESULT "


def add_tree_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree whose host runs")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs it")
    ap.add_argument("--json", action="store_true", help="print a last RESULT {json} line")


def is_upstream(root: Path) -> bool:
    return (root / "app" / "main.py").exists() and not (root / "solar_host").exists()


class TreeHost(HostProc):
    """HostProc for the host of `root`, run by `python`."""

    def __init__(self, tmp: Path, *, root: Path, python: str, **kw: Any) -> None:
        super().__init__(tmp, backend="real", **kw)
        self.root = Path(root).resolve()
        self.python = python
        self.upstream = is_upstream(self.root)

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PYTHONPATH"] = str(self.root)
        return env

    def argv(self) -> list[str]:
        if self.upstream:
            return [
                self.python,
                "-m",
                "uvicorn",
                "app.main:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
            ]
        return [self.python, "-m", "solar_host", "--env-file", os.devnull]


def tree_host(tmp: Path, args: argparse.Namespace, **kw: Any) -> TreeHost:
    return TreeHost(tmp, root=args.root, python=args.python, **kw)


def routed_path(host: TreeHost) -> str:
    """A route only the full router answers (ours serves /health and GET /instances before
    it is built); upstream builds its whole app before it listens."""
    return "/instances" if host.upstream else "/resources"


def print_result(args: argparse.Namespace, figures: dict[str, float]) -> None:
    if args.json:
        print(RESULT_PREFIX + json.dumps(figures), flush=True)

"""One bench against two trees in one run, interleaved: does a change cost performance?

The base is a git revision (default `main~1`, the previous commit of main) checked out with
`git worktree` in a temp dir beside this checkout, and run with this virtual environment's
python, PYTHONPATH pointing at that tree (no environment of its own). It may instead be a
directory (`--base-tree`): another checkout, or the upstream release's tree with the
interpreter that has its requirements (`--base-python`). The head is this checkout.

The bench (api_load, idle_memory, time_to_ready) is always this checkout's script, told which
tree's host to run (`--root`, bench/hosts.py), so both sides are measured the same way. Pairs
alternate which side runs first (base-head, head-base, ...), so a machine getting busier or
quieter over the run weighs on both. Each pair prints every figure of both sides and the ratio
head/base; the end prints each ratio's median and its spread (min-max over the pairs).

    .venv/bin/python bench/compare_revisions.py api_load --pairs 3 -- --conc 64 --duration 5
    .venv/bin/python bench/compare_revisions.py idle_memory --base f535752 -- --quick --runs 3
    .venv/bin/python bench/compare_revisions.py idle_memory \\
        --base-tree /path/to/upstream --base-python /path/to/upstream-venv/bin/python -- --quick

Arguments after `--` go to the bench. The worktree is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hosts import RESULT_PREFIX  # noqa: E402

BENCHES = ("api_load", "idle_memory", "time_to_ready")
# A run that takes longer than this is stuck (a bench of minutes is a mistake here).
RUN_TIMEOUT_S = 900


@dataclass(frozen=True)
class Side:
    name: str
    root: Path
    python: str


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A detached `git worktree` of `rev` beside this checkout, removed afterwards."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    where = Path(tempfile.mkdtemp(prefix=f".compare-{sha[:8]}-", dir=ROOT.parent))
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), sha],
        check=True,
    )
    # Compiled now, not by the first host start of the base (which would time the compiler).
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(where / "solar_host")], check=False
    )
    try:
        yield where
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False
        )
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)


def run_once(bench: str, side: Side, bench_args: list[str]) -> dict[str, float]:
    argv = [
        sys.executable,
        str(ROOT / "bench" / f"{bench}.py"),
        "--root",
        str(side.root),
        "--python",
        side.python,
        "--json",
        *bench_args,
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT, check=False
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(
        f"{bench} on {side.name} exited {proc.returncode} without a result:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


def compare(bench: str, base: Side, head: Side, pairs: int, bench_args: list[str]) -> None:
    ratios: dict[str, list[float]] = {}
    values: dict[str, dict[str, list[float]]] = {base.name: {}, head.name: {}}
    for i in range(pairs):
        order = (base, head) if i % 2 == 0 else (head, base)
        got = {side.name: run_once(bench, side, bench_args) for side in order}
        print(f"pair {i + 1} ({order[0].name} first), load {os.getloadavg()[0]:.1f}:")
        for key, b in got[base.name].items():
            h = got[head.name].get(key)
            if h is None:
                continue
            values[base.name].setdefault(key, []).append(b)
            values[head.name].setdefault(key, []).append(h)
            if b:
                ratios.setdefault(key, []).append(h / b)
            shown = f"{h / b:>6.3f}" if b else "     -"
            print(f"  {key:<28} base {b:>10.3f}  head {h:>10.3f}  head/base {shown}")
        sys.stdout.flush()
    print(f"\n{bench}: base {base.name} ({base.root}), head {head.name}; {pairs} pairs")
    print(f"  {'figure':<28} {'base median':>12} {'head median':>12} {'ratio':>7}  spread")
    for key, bs in values[base.name].items():
        b_med = statistics.median(bs)
        h_med = statistics.median(values[head.name][key])
        rs = ratios.get(key)
        spread = f"{statistics.median(rs):>7.3f}  {min(rs):.3f}-{max(rs):.3f}" if rs else ""
        print(f"  {key:<28} {b_med:>12.3f} {h_med:>12.3f} {spread}")


def main() -> int:
    argv = sys.argv[1:]
    bench_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("bench", choices=BENCHES)
    ap.add_argument("--base", default="main~1", help="git revision to compare against")
    ap.add_argument("--base-tree", type=Path, help="a directory instead of a revision")
    ap.add_argument("--base-python", default=sys.executable, help="the base's interpreter")
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args(argv)
    head = Side("head", ROOT, sys.executable)
    with contextlib.ExitStack() as stack:
        if args.base_tree is not None:
            base = Side(str(args.base_tree), args.base_tree.resolve(), args.base_python)
        else:
            tree = stack.enter_context(worktree(args.base))
            base = Side(args.base, tree, args.base_python)
        compare(args.bench, base, head, args.pairs, bench_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Suite-wide guards.

Settings' defaults are relative paths (./config.json, ./logs, ./models): a test that builds a
Settings without pointing them at its tmp_path writes into the checkout, and the next test, or
the next run, reads what it left there. This guard makes that a failure of the test that did it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Written by tools, not by the code under test.
_TOOLING = {".pytest_cache", ".hypothesis", ".ruff_cache", ".mypy_cache", ".coverage", ".venv"}


def _root_entries() -> dict[str, int]:
    """Name -> mtime of each file at the checkout's top, 0 for a directory (importing a
    module adds __pycache__ inside one, which is nobody's state)."""
    try:
        with os.scandir(ROOT) as it:
            return {
                e.name: 0 if e.is_dir(follow_symlinks=False) else e.stat().st_mtime_ns
                for e in it
                if e.name not in _TOOLING
            }
    except OSError:
        return {}


@pytest.fixture(autouse=True)
def _checkout_untouched() -> Iterator[None]:
    before = _root_entries()
    yield
    after = _root_entries()
    changed = sorted(n for n, m in after.items() if before.get(n) != m)
    assert not changed, (
        f"the test wrote into the checkout ({ROOT}): {changed}; point Settings at tmp_path"
    )

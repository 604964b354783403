"""The host's C library calls start no process.

ctypes.util.find_library("c") ran `/sbin/ldconfig -p` from the event loop at the first log
watch of every host start: the loop waited for it, and the child, until its exec, carried the
host's environment, so a scan for backends by environment (the tests', an operator's `ps e`)
found a process that was neither the host nor a backend (a CI failure: "[7864, 7874] ==
[7864]"). An audit hook sees every process Python starts, however briefly it lives.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from solar_host.instances import confinement
from solar_host.instances.logs import InotifyHub
from solar_host.model_store import streaming
from solar_host.platform.libc import libc
from solar_host.platform.log_limits import rotate_appended

_SPAWNS = ("subprocess.Popen", "os.fork", "os.posix_spawn", "os.system", "os.exec")
_seen: list[tuple[str, int]] | None = None  # set while a test records
_lock = threading.Lock()


def _hook(event: str, args: tuple[object, ...]) -> None:
    if _seen is not None and event in _SPAWNS:
        with _lock:
            _seen.append((event, threading.get_ident()))


@pytest.fixture
def spawns() -> Iterator[list[tuple[str, int]]]:
    """Every process start of this interpreter while the test runs (an audit hook cannot be
    removed, so one is installed once and switched on and off)."""
    global _seen
    if not getattr(sys, "_solar_libc_hook", False):
        sys.addaudithook(_hook)
        sys._solar_libc_hook = True  # type: ignore[attr-defined]
    _seen = []
    try:
        yield _seen
    finally:
        _seen = None


def test_following_a_log_starts_no_process(tmp_path: Path, spawns: list[object]) -> None:
    """The inotify descriptor of the first watch (every host start that follows a log)."""
    log = tmp_path / "backend.log"
    log.write_text("")
    woken = []

    async def main() -> None:
        hub = InotifyHub()
        try:
            assert hub.watch(log, lambda: woken.append(1)) is not None
            with log.open("a") as f:
                f.write("line\n")
            for _ in range(200):
                if woken:
                    break
                await asyncio.sleep(0.01)
        finally:
            hub.close()

    asyncio.run(main())
    assert woken, "inotify never reported the write"
    assert spawns == []


def test_the_other_libc_calls_start_no_process(tmp_path: Path, spawns: list[object]) -> None:
    """Landlock's probe, a log rotation (fallocate collapse, where the filesystem has it) and
    the pull writer's writeback hint go through the same opened library."""
    confinement.abi_version.cache_clear()
    confinement.abi_version()
    log = tmp_path / "big.log"
    log.write_bytes(b"x" * 3 * 65536 + b"\n" + b"y" * 100 + b"\n")
    rotation = rotate_appended(log, read_upto=3 * 65536 + 1, keep=1, chase=0)
    assert rotation.removed > 0
    with open(tmp_path / "blob", "wb") as f:
        f.write(b"z" * 8192)
        streaming.start_writeback(f.fileno(), 0, 8192)
    assert spawns == []
    assert libc().getpid() == os.getpid()

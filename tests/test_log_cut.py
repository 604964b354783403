"""A backend that writes its log faster than the host reads it (issue 39): the follower bounds
the file by where the backend writes, not by what it has parsed. The backend's way of writing
(its own O_APPEND descriptor, which the host cannot make it stop using), real files, on the
test directory's filesystem and on a tmpfs where there is one.

The flood is written while the event loop is held, so the follower's next look finds all of it:
what it does then is exact, not a matter of timing.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from solar_host.instances.logs import (
    CUT_FLOOR_BYTES,
    READ_CHUNK,
    SKIPPED_LINE,
    LogFollower,
    count_lines,
)

LIMIT = 1024 * 1024  # under CUT_FLOOR_BYTES: the floor is the bound
BOUND = max(LIMIT, CUT_FLOOR_BYTES) + READ_CHUNK


def tmpfs_dir() -> Path | None:
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[1] == "/dev/shm" and fields[2] == "tmpfs" and os.access("/dev/shm", os.W_OK):
                return Path("/dev/shm")
    return None


@pytest.fixture(params=["test-dir", "tmpfs"])
def log_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "test-dir":
        return tmp_path
    shm = tmpfs_dir()
    if shm is None:
        pytest.skip("no writable tmpfs at /dev/shm")
    d = shm / f"logcut-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()

    def remove() -> None:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()

    request.addfinalizer(remove)
    return d


def numbered(first: int, count: int, pad: int = 100) -> bytes:
    return b"".join(b"line %08d %s\n" % (i, b"x" * pad) for i in range(first, first + count))


async def until(check: Callable[[], bool], what: str, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_a_flood_between_two_looks_is_cut_to_the_bound_before_it_is_parsed(
    log_dir: Path,
) -> None:
    path = log_dir / "a_x_1.log"
    writer = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    got: list[str] = []
    moved: list[int] = []
    follower = LogFollower(
        path, got.extend, None, max_file_bytes=LIMIT, generations=2, on_rotate=moved.append
    )
    follower.start()
    try:
        head = numbered(0, 100)
        os.write(writer, head)
        await until(lambda: len(got) == 100, "the first lines")
        # 40 MiB and a last line while the loop is held: all there at the follower's next look.
        flood = numbered(100, 300_000)
        for i in range(0, len(flood), 1 << 20):
            os.write(writer, flood[i : i + (1 << 20)])
        os.write(writer, b"LAST\n")
        await until(lambda: got[-1:] == ["LAST"], "the last line")
        size_after_cut = path.stat().st_size
        # The backend goes on writing where its O_APPEND descriptor lands: the new end.
        os.write(writer, b"after the cut\n")
        await until(lambda: got[-1:] == ["after the cut"], "a line written after the cut")
    finally:
        await follower.stop(flush=True)
        os.close(writer)

    # Cut back in the first look: what was read stays, what was not goes but for its newest
    # chunk, which is parsed; the rest never is. One line says how many bytes went: all
    # between the last line before the gap and the first after it, but for the part of a
    # line the gap ends in (dropped too, uncounted).
    assert size_after_cut <= len(head) + 4096 + READ_CHUNK, size_after_cut
    assert follower.cuts == 1, follower.cuts
    gap = [i for i, x in enumerate(got) if x.startswith("[log:")]
    assert len(gap) == 1, gap
    (at,) = gap
    before = [int(x.split()[1]) for x in got[100:at]]
    newest = [int(x.split()[1]) for x in got[at + 1 : -2]]
    assert before == list(range(100, 100 + len(before)))  # at most a block's worth
    assert newest == list(range(newest[0], 300_100)), (newest[:3], newest[-3:])
    line = len(numbered(0, 1))
    lost = (newest[0] - 100 - len(before)) * line
    said = int(got[at].split()[1])
    assert got[at] == SKIPPED_LINE.format(n=said)
    assert lost - line < said <= lost, (said, lost)
    assert follower.skipped_bytes == said
    assert len(newest) * line >= READ_CHUNK - 2 * line
    # Re-adoption counts the lines in the file from seq_base: moved + in the file = delivered.
    assert sum(moved) + count_lines(path)[0] == len(got), (sum(moved), count_lines(path), len(got))


async def test_what_was_read_in_a_flood_rotates_and_the_count_holds(log_dir: Path) -> None:
    """A flood that goes on: the follower reads what it can between cuts, rotates what it read
    into generations (copied out, then the file cut: no collapse, no chase), and every look
    leaves the file within its bound."""
    path = log_dir / "a_x_1.log"
    writer = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    got: list[str] = []
    moved: list[int] = []
    follower = LogFollower(
        path, got.extend, None, max_file_bytes=LIMIT, generations=2, on_rotate=moved.append
    )
    follower.start()
    after_looks: list[int] = []
    n = 0
    try:
        for _ in range(12):
            # More than the bound while the loop is held; then a look (a cut), and 1.5 MiB the
            # follower reads whole: past LOG_FILE_MAX_BYTES, so a rotation, in a flood.
            block = numbered(n, 45_000)
            os.write(writer, block)
            n += 45_000
            await until(lambda n=n: got[-1:] == [f"line {n - 1:08d} {'x' * 100}"], "a cut")
            after_looks.append(path.stat().st_size)
            block = numbered(n, 14_000)
            os.write(writer, block)
            n += 14_000
            await until(lambda n=n: got[-1:] == [f"line {n - 1:08d} {'x' * 100}"], "a read")
        os.write(writer, b"LAST\n")
        await until(lambda: got[-1:] == ["LAST"], "the last line")
    finally:
        await follower.stop(flush=True)
        os.close(writer)

    assert follower.cuts >= 12 and follower.rotations >= 1, (follower.cuts, follower.rotations)
    assert max(after_looks) <= BOUND, after_looks
    # Lines come in order; each gap is one line saying how many bytes it holds.
    numbers = [int(x.split()[1]) for x in got[:-1] if not x.startswith("[log:")]
    assert numbers == sorted(set(numbers))
    gaps = [x for x in got if x.startswith("[log:")]
    assert len(gaps) == follower.cuts
    gens = sorted(p.name for p in log_dir.iterdir())  # noqa: ASYNC240
    assert gens == ["a_x_1.log", "a_x_1.log.1", "a_x_1.log.2"], gens
    assert all((log_dir / g).stat().st_size <= LIMIT + READ_CHUNK for g in gens)
    assert sum(moved) + count_lines(path)[0] == len(got), (sum(moved), count_lines(path), len(got))

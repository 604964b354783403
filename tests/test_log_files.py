"""Log files: retention keeps the newest file per (alias, instance); tails read backwards."""

from __future__ import annotations

import os
import time
from pathlib import Path

from solar_host.instances.logs import (
    IdleLogBuffers,
    LogRing,
    files_of,
    new_log_path,
    prune_log_files,
    tail_lines,
)


def touch(path: Path, age_s: float, text: str = "x\n") -> Path:
    path.write_text(text)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_retention_keeps_the_newest_file_of_each_instance(tmp_path: Path) -> None:
    a_old = touch(tmp_path / "m-1b_inst-a_100.log", 7200)
    a_new = touch(tmp_path / "m-1b_inst-a_200.log", 3600)
    b_only = touch(tmp_path / "m-1b_inst-b_100.log", 7200)
    recent = touch(tmp_path / "m-1b_inst-c_100.log", 10)
    recent2 = touch(tmp_path / "m-1b_inst-c_200.log", 5)
    other = touch(tmp_path / "notes.txt", 9999)
    assert prune_log_files(tmp_path, retention_s=1800) == 1
    assert not a_old.exists()
    assert a_new.exists() and b_only.exists() and recent.exists() and recent2.exists()
    assert other.exists()


def test_files_of_matches_the_instance_exactly_newest_first(tmp_path: Path) -> None:
    older = touch(tmp_path / "x_inst-1_100.log", 100)
    newer = touch(tmp_path / "x_inst-1_200.log", 10)
    touch(tmp_path / "x_inst-10_300.log", 1)
    touch(tmp_path / "x_other_300.log", 1)
    assert files_of(tmp_path, "inst-1") == [newer, older]
    assert files_of(tmp_path, "*") == []  # glob characters in an id match nothing


def test_each_attempt_gets_its_own_file(tmp_path: Path) -> None:
    first = new_log_path(tmp_path, "m", "i")
    first.write_text("")
    second = new_log_path(tmp_path, "m", "i")
    assert second != first and not second.exists()


def test_tail_reads_only_the_end(tmp_path: Path) -> None:
    big = tmp_path / "big.log"
    with open(big, "w") as f:
        for i in range(200_000):
            f.write(f"line {i}\n")
    assert tail_lines(big, 3) == ["line 199997", "line 199998", "line 199999"]
    no_newline = tmp_path / "nl.log"
    no_newline.write_text("a\nb\nc")
    assert tail_lines(no_newline, 2) == ["b", "c"]
    assert tail_lines(tmp_path / "missing.log", 5) == []


def test_ring_reports_a_gap_to_a_reader_that_fell_behind() -> None:
    ring = LogRing(size=3)
    ring.append_many([f"l{i}" for i in range(5)], "t")
    gap, entries = ring.since(0)
    assert gap == 0 and [e.seq for e in entries] == [2, 3, 4]
    gap, entries = ring.since(4)
    assert gap is None and [e.line for e in entries] == ["l4"]


async def test_a_stream_waiting_on_the_ring_sees_lines_after_an_adoption_rebases_it() -> None:
    """A log stream opened right after a host restart waits on the instance's ring before the
    adoption has re-read the backend's log file. The adoption rebases that ring (the same
    object) rather than replacing it, so the waiting stream wakes for the re-read lines and
    every later one."""
    ring = LogRing(8)
    ring.append_many(["old"], "t0")
    woken = ring.changed()
    ring.rebase(1000)
    assert ring.first_seq == 1000 and list(ring.entries) == []
    ring.append_many(["re-read 1", "re-read 2"], "t1")
    assert woken.is_set()
    gap, entries = ring.since(1)
    assert gap == 1 and [e.seq for e in entries] == [1000, 1001]
    later = ring.changed()
    ring.append_many(["new"], "t2")
    assert later.is_set() and ring.tail(1)[0].seq == 1002


def test_only_the_newest_stopped_instances_keep_their_log_buffers() -> None:
    """RETAINED_LOG_BUFFERS: past the limit, the buffer stopped longest ago is emptied (its
    seqs go on where they were); a buffer in use again leaves the retained set."""
    idle = IdleLogBuffers(2)
    rings = {name: LogRing(8) for name in "abc"}
    for name, ring in rings.items():
        ring.append_many([f"{name}1", f"{name}2"], "t")
        idle.idle(name, ring)
    assert list(rings["a"].entries) == [] and rings["a"].next_seq == 2
    assert len(rings["b"].entries) == 2 and len(rings["c"].entries) == 2
    idle.busy("b")  # started again
    idle.idle("a", rings["a"])
    assert len(idle) == 2 and len(rings["b"].entries) == 2 and len(rings["c"].entries) == 2
    idle.idle("d", LogRing(8))
    assert list(rings["c"].entries) == []  # the oldest idle one now
    idle0 = IdleLogBuffers(0)
    idle0.idle("a", rings["b"])
    assert list(rings["b"].entries) == []

"""Log files: retention keeps the newest file per (alias, instance); tails read backwards."""

from __future__ import annotations

import os
import time
from pathlib import Path

from solar_host.instances.logs import (
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

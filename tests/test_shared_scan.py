"""SharedScan: threads that ask for a /proc scan at the same time share one, and none gets an
answer older than its question (concurrent stops read /proc a few times, not once each)."""

from __future__ import annotations

import threading
import time

import pytest

from solar_host.instances.ownership import SharedScan


def test_concurrent_callers_share_scans_that_began_after_they_asked() -> None:
    begun = 0
    lock = threading.Lock()

    def scan() -> int:
        nonlocal begun
        with lock:
            begun += 1
            number = begun
        time.sleep(0.05)
        return number

    shared = SharedScan(scan)
    results: list[tuple[int, int]] = []  # (scans begun when asking, answer)

    def ask() -> None:
        with lock:
            before = begun
        results.append((before, shared()))

    threads = [threading.Thread(target=ask) for _ in range(40)]
    for t in threads:
        t.start()
        time.sleep(0.002)  # questions spread over about two scans
    for t in threads:
        t.join(10)
    assert len(results) == 40
    assert all(answer > before for before, answer in results), results
    assert shared.scans == begun
    assert 2 <= shared.scans <= 20, shared.scans  # not 40


def test_an_error_reaches_the_callers_of_that_scan_and_the_next_scan_runs() -> None:
    calls = 0

    def scan() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("/proc went away")
        return "ok"

    shared = SharedScan(scan)
    with pytest.raises(OSError, match="/proc went away"):
        shared()
    assert shared() == "ok"
    assert calls == 2

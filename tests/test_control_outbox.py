"""The outbox alone: bounds, what is dropped first, what is never dropped, batching order."""

from __future__ import annotations

import time

from solar_host.control.client import normalize_url
from solar_host.control.outbox import Outbox


def log(i: int) -> dict:
    return {"instance_id": "a", "seq": i, "line": f"line {i}", "timestamp": "t"}


def test_closed_outbox_drops_and_counts_everything():
    box = Outbox(10)
    box.put_log(log(1))
    box.put_state("a", {"instance_id": "a"})
    box.put_step_log({"job_id": "j", "seq": 0, "line": "", "completed": True})
    box.put_pull_progress({"source_uri": "repo://m:1", "phase": "completed"}, timestamp="t")
    box.put_event("job_started", {"job_id": "j"})
    assert len(box) == 0
    assert box.drain() == []
    assert box.dropped == {
        "log": 1,
        "state": 1,
        "step_marker": 1,
        "pull_terminal": 1,
        "job_lifecycle": 1,
    }


def test_closing_drops_what_waits():
    box = Outbox(10)
    box.set_accepting(True)
    for i in range(3):
        box.put_log(log(i))
    box.put_event("job_failed", {"job_id": "j"})
    box.set_accepting(False)
    assert len(box) == 0
    assert box.dropped["log"] == 3 and box.dropped["job_lifecycle"] == 1


def test_full_outbox_drops_oldest_logs_first_and_keeps_critical_events():
    box = Outbox(10)
    box.set_accepting(True)
    box.put_event("job_started", {"job_id": "j"})
    box.put_pull_progress({"source_uri": "repo://m:1", "phase": "completed"}, timestamp="t")
    box.put_step_log({"job_id": "j", "seq": 5, "line": "", "completed": True})
    box.put_state("a", {"instance_id": "a", "data": {"busy": True}})
    for i in range(100):
        box.put_log(log(i))
    assert len(box) == 10
    # The critical three and the state stayed; the 6 newest log lines are what is left.
    emits = dict(box.drain())
    assert [e["seq"] for e in emits["log_batch"]["entries"]] == list(range(94, 100))
    assert box.dropped["log"] == 94
    assert "job_started" in emits and emits["pull_progress"]["data"]["phase"] == "completed"
    assert emits["step_log"]["entries"][0]["completed"] is True
    assert emits["instance_state_batch"]["entries"][0]["data"] == {"busy": True}


def test_critical_events_are_kept_beyond_the_bound():
    box = Outbox(10)
    box.set_accepting(True)
    for i in range(15):
        box.put_event("step_completed", {"job_id": "j", "step_index": i})
    box.put_log(log(1))  # no room and nothing droppable: the log line goes
    assert len(box) == 15
    assert box.dropped == {"log": 1}


def test_states_keep_only_the_latest_per_instance():
    box = Outbox(100)
    box.set_accepting(True)
    for i in range(50):
        box.put_state("a", {"instance_id": "a", "data": {"n": i}})
        box.put_state("b", {"instance_id": "b", "data": {"n": i}})
    ((event, payload),) = box.drain()
    assert event == "instance_state_batch"
    assert [(e["instance_id"], e["data"]["n"]) for e in payload["entries"]] == [
        ("a", 49),
        ("b", 49),
    ]


def test_step_logs_batch_between_lifecycle_events_in_order():
    box = Outbox(100)
    box.set_accepting(True)
    box.put_event("step_started", {"job_id": "j", "step_index": 0})
    box.put_step_log({"job_id": "j", "seq": 0, "line": "a"})
    box.put_step_log({"job_id": "j", "seq": 1, "line": "b"})
    box.put_step_log({"job_id": "j", "seq": 2, "line": "", "completed": True, "exit_code": 0})
    box.put_event("step_completed", {"job_id": "j", "step_index": 0})
    names = [e for e, _ in box.drain()]
    assert names == ["step_started", "step_log", "step_completed"]


def test_pull_progress_coalesces_per_uri_but_never_swallows_terminal():
    box = Outbox(100)
    box.set_accepting(True)
    for done in range(5):
        box.put_pull_progress(
            {"source_uri": "repo://m:1", "phase": "downloading", "bytes_done": done}, timestamp="t"
        )
    box.put_pull_progress({"source_uri": "repo://m:1", "phase": "completed"}, timestamp="t")
    box.put_pull_progress({"source_uri": "repo://m:1", "phase": "resolving"}, timestamp="t")
    out = box.drain()
    phases = [(p["data"]["phase"], p["data"].get("bytes_done")) for _, p in out]
    assert phases == [("downloading", 4), ("completed", None), ("resolving", None)]
    assert all(e == "pull_progress" and set(p) == {"timestamp", "data"} for e, p in out)


def test_put_is_cheap_under_a_flood():
    box = Outbox(1000)
    box.set_accepting(True)
    t0 = time.perf_counter()
    for i in range(100_000):
        box.put_log(log(i))
    per_put = (time.perf_counter() - t0) / 100_000
    assert len(box) == 1000 and box.dropped["log"] == 99_000
    assert per_put < 20e-6, per_put


def test_normalize_url():
    assert normalize_url("ws://127.0.0.1:8000/ws/host-channel") == "http://127.0.0.1:8000"
    assert normalize_url("wss://control.example:443/x") == "https://control.example:443"
    assert normalize_url("control:8000") == "http://control:8000"
    assert normalize_url("https://c.example/") == "https://c.example"

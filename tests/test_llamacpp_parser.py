"""llama-server log parser on real logs: runtime state changes and per-request token counts."""

from __future__ import annotations

import itertools
import time
from datetime import datetime
from pathlib import Path

from solar_host.backends.base import GenerationMetrics, RuntimeState
from solar_host.backends.llamacpp import BACKEND, LlamaCppLogParser
from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.events import EventBus
from solar_host.instances.telemetry import Telemetry

FIXTURES = Path(__file__).parent / "fixtures"
EVAL_LINE = (
    "slot print_timing: id  0 | task {task} | eval time = 1.0 ms / 4 tokens "
    "(0.25 ms per token, 4000.00 tokens per second)"
)


def lines_of(name: str) -> list[str]:
    return (FIXTURES / name).read_text(encoding="utf-8").splitlines()


def replay(lines: list[str], parser: LlamaCppLogParser | None = None):
    parser = parser or LlamaCppLogParser()
    states: list[RuntimeState] = []
    gens: list[GenerationMetrics] = []
    for line in lines:
        r = parser.feed(line)
        if r is None:
            continue
        if r.state is not None:
            states.append(r.state)
        if r.generation is not None:
            gens.append(r.generation)
    return parser, states, gens


def test_fixture_yields_five_records_with_exact_counts():
    _, _, gens = replay(lines_of("llamacpp_server.log"))
    got = [
        (
            g.task_id,
            g.prompt_tokens,
            g.prompt_eval_tokens,
            g.cached_tokens,
            g.generated_tokens,
            g.total_tokens,
        )
        for g in gens
    ]
    assert got == [
        (25257, 36886, 4755, 32131, 1382, 38268),
        (26645, 24370, 24371, 0, 2057, 26427),
        (28718, 2727, 2728, 0, 336, 3063),
        (29059, 341, 59, 282, 72, 413),
        (29133, 341, 59, 282, 55, 396),
    ]
    third = gens[3]
    assert (third.task_id, third.slot_id, third.source) == (29059, 1, "log")
    assert third.decode_tps == 172.88 and third.decode_ms_per_token == 5.78
    for g in gens:
        started = datetime.fromisoformat(g.started_at)
        finished = datetime.fromisoformat(g.finished_at)
        assert started.tzinfo is not None and finished >= started


def test_fixture_phase_sequence():
    _, states, _ = replay(lines_of("llamacpp_server.log"))
    phases = [s.phase for s in states]
    assert phases[0] == "generating" and phases[-1] == "idle"
    assert phases.count("idle") == 5
    assert phases.count("generating") >= 5
    for a, b in itertools.pairwise(phases):
        assert not (a == "generating" and b == "prefill")
    for s in states:
        assert s.busy == (s.phase != "idle")
        assert (s.active_slots == 0) == (s.phase == "idle")
    # consecutive states always differ: unchanged lines emit nothing
    assert all(a != b for a, b in itertools.pairwise(states))


def test_fixture_live_decode_updates():
    _, states, _ = replay(lines_of("llamacpp_server.log"))
    live = [(s.generated_tokens, s.decode_tps) for s in states if s.phase == "generating"]
    assert live[0] == (915, 152.26)
    assert live[2][0] == 1382
    assert live[3] == (487, 162.10)
    assert live[4][0] == 972
    first = next(s for s in states if s.phase == "generating")
    assert (first.slot_id, first.task_id) == (3, 25257)
    assert abs(first.decode_ms_per_token - 1000 / 152.26) < 0.01


def test_prefill_progress_from_prompt_processing_lines():
    _, states, _ = replay(lines_of("llamacpp_server.log"))
    progress = [s.prefill_progress for s in states if s.phase == "prefill" and s.task_id == 26645]
    assert progress == [None, 0.89, 0.97, 0.98, 1.0]


def test_newer_format_b10434():
    parser, states, gens = replay(lines_of("llamacpp_b10434.log"))
    assert [(g.task_id, g.slot_id) for g in gens] == [(0, 0), (17, 0)]
    first, second = gens
    assert first.prompt_eval_tokens == 34 and first.generated_tokens == 16
    assert first.total_tokens == 49 and first.prompt_tokens == 33 and first.cached_tokens == 0
    assert first.decode_tps == 7142.86 and first.decode_ms_per_token == 0.14
    assert (second.prompt_tokens, second.prompt_eval_tokens, second.generated_tokens) == (7, 7, 8)
    assert second.total_tokens == 15 and second.cached_tokens == 0
    assert [s.phase for s in states] == ["prefill", "generating", "idle"] * 2
    assert parser.last_generation is second
    assert sum(BACKEND.is_ready_line(line) for line in lines_of("llamacpp_b10434.log")) == 1


def test_launch_then_release_without_timing_goes_idle():
    parser = LlamaCppLogParser()
    r = parser.feed("slot launch_slot_: id  0 | task 5 | processing task")
    assert r.state.busy and r.state.phase == "prefill" and r.state.active_slots == 1
    r = parser.feed(
        "slot      release: id  0 | task 5 | stop processing: n_tokens = 12, truncated = 0"
    )
    assert r.state == RuntimeState() and not r.state.busy and r.state.phase == "idle"
    assert r.generation is None  # embeddings log no timings: nothing to report


def test_legacy_release_without_n_tokens():
    parser = LlamaCppLogParser()
    _, _, gens = replay(
        [
            "slot launch_slot_: id  0 | task 9 | processing task",
            "slot print_timing: id  0 | task 9 | prompt eval time =  10.00 ms /  5 tokens "
            "(2.00 ms per token, 500.00 tokens per second)",
            "slot print_timing: id  0 | task 9 |        eval time =  30.00 ms /  3 tokens "
            "(10.00 ms per token, 100.00 tokens per second)",
            "slot      release: id  0 | task 9 | stop processing",
        ],
        parser,
    )
    (g,) = gens
    assert (g.generated_tokens, g.prompt_eval_tokens) == (3, 5)
    assert g.prompt_tokens is None and g.total_tokens is None and g.cached_tokens is None
    assert (g.decode_tps, g.decode_ms_per_token) == (100.0, 10.0)


def test_legacy_unprefixed_lines():
    """Older builds: update_slots lines and timings on bare lines after print_timing."""
    _, states, gens = replay(
        [
            "slot launch_slot_: id  1 | task 3 | processing task",
            "slot update_slots: id  1 | task 3 | new prompt, n_ctx_slot = 4096, n_keep = 0, "
            "task.n_tokens = 21",
            "slot update_slots: id  1 | task 3 | prompt processing progress, n_tokens = 21, "
            "batch.n_tokens = 21, progress = 0.500000",
            "slot update_slots: id  1 | task 3 | created context checkpoint 1 of 8 (pos_min = 0)",
            "slot update_slots: id  1 | task 3 | prompt done, n_tokens = 21, batch.n_tokens = 21",
            "slot print_timing: id  1 | task 3 | ",
            "prompt eval time =     111.10 ms /    21 tokens (5.29 ms per token, 189.02 tokens per "
            "second)",
            "       eval time =     200.00 ms /    10 tokens (20.00 ms per token, 50.00 tokens per "
            "second)",
            "      total time =     311.10 ms /    31 tokens",
            "slot      release: id  1 | task 3 | stop processing: n_tokens = 31, truncated = 0",
            "srv  update_slots: all slots are idle",
        ]
    )
    prefill = [s for s in states if s.phase == "prefill"]
    assert prefill[1].prefill_progress == 0.0 and prefill[1].prefill_prompt_tokens == 21
    assert prefill[2].prefill_progress == 0.5
    assert (prefill[3].checkpoint_index, prefill[3].checkpoint_total) == (1, 8)
    assert states[-1].phase == "idle"
    (g,) = gens
    assert (g.prompt_tokens, g.prompt_eval_tokens, g.cached_tokens) == (21, 21, 0)
    assert (g.generated_tokens, g.total_tokens, g.decode_tps) == (10, 31, 50.0)


def test_two_slots_interleaved():
    parser = LlamaCppLogParser()
    parser.feed("slot launch_slot_: id  0 | task 1 | processing task")
    r = parser.feed("slot launch_slot_: id  1 | task 2 | processing task")
    assert r.state.active_slots == 2
    parser.feed(EVAL_LINE.format(task=1))
    r = parser.feed(
        "slot      release: id  0 | task 1 | stop processing: n_tokens = 10, truncated = 0"
    )
    assert r.generation.task_id == 1 and r.state.busy and r.state.active_slots == 1
    r = parser.feed("srv  update_slots: all slots are idle")
    assert r.state == RuntimeState()
    assert parser.pending == {}


def test_new_task_on_same_slot_replaces_pending():
    parser = LlamaCppLogParser()
    parser.feed("slot launch_slot_: id  0 | task 1 | processing task")
    parser.feed("slot print_timing: id  0 | task 1 | prompt eval time = 1.0 ms / 99 tokens (x)")
    parser.feed("slot launch_slot_: id  0 | task 2 | processing task")  # release of 1 was lost
    parser.feed(EVAL_LINE.format(task=2))
    r = parser.feed(
        "slot      release: id  0 | task 2 | stop processing: n_tokens = 10, truncated = 0"
    )
    assert r.generation.task_id == 2 and r.generation.prompt_eval_tokens is None


def test_unrelated_lines_are_ignored():
    parser = LlamaCppLogParser()
    for line in [
        "",
        "0.00.012.928 I srv    load_model: initializing, n_slots = 1, n_ctx_slot = 512",
        "0.00.015.922 I srv  llama_server: listening on http://127.0.0.1:18091",
        "slot get_availabl: id  0 | task -1 | selected slot by LRU, t_last = -1",
        "random text with slot and release words",
        "eval time without numbers",
    ]:
        assert parser.feed(line) is None
    assert parser.last_state == RuntimeState()


def test_metrics_correct_busy_flag():
    now = [100.0]
    parser = LlamaCppLogParser(clock=lambda: now[0])
    assert parser.apply_metrics({"process_cpu_seconds_total": 1.0}) is None
    assert parser.apply_metrics({"llamacpp:requests_processing": 0.0}) is None  # agrees
    r = parser.apply_metrics(
        {"llamacpp:requests_processing": 2.0, "llamacpp:kv_cache_usage_ratio": 0.1}
    )
    assert r.state.busy and r.state.phase == "generating" and r.state.active_slots == 2
    assert parser.apply_metrics({"llamacpp:requests_processing": 1.0}) is None  # still busy
    r = parser.apply_metrics({"llamacpp:requests_processing": 0.0})
    assert r.state == RuntimeState()
    # a scrape taken just before a launch line does not cancel the launch...
    parser.feed("slot launch_slot_: id  0 | task 1 | processing task")
    idle_scrape = {"llamacpp:requests_processing": 0.0, "llamacpp:prompt_tokens_total": 5}
    assert parser.apply_metrics(idle_scrape) is None
    assert parser.last_state.busy
    # ...but a release line that never came is repaired once the log has been quiet a while
    now[0] += 10
    r = parser.apply_metrics(idle_scrape)
    assert r.state.phase == "idle" and not parser.active_slots


def test_parser_through_telemetry_adds_instance_id():
    bus = EventBus()
    tel = Telemetry("inst-1", bus)
    tel.reset(BACKEND.new_parser(LlamaCppConfig(alias="a", model="/m.gguf")))
    tel.feed(lines_of("llamacpp_server.log"))
    assert len(tel.generations) == 5
    rec = list(tel.generations)[3]
    assert rec["instance_id"] == "inst-1" and rec["task_id"] == 29059 and rec["slot_id"] == 1
    assert rec["source"] == "log" and rec["started_at"] and rec["finished_at"]
    assert tel.state.phase == "idle"


def test_parser_speed():
    """A busy backend prints 200,000 lines: microseconds a line; 50 us means a regression."""
    lines = lines_of("llamacpp_server.log") + lines_of("llamacpp_b10434.log")
    noise = [f"0.00.0{i:02d}.000 I srv  params_from_: some unrelated line {i}" for i in range(50)]
    batch = (lines + noise) * 200  # ~24,000 lines
    parser = LlamaCppLogParser()
    t0 = time.perf_counter()
    for line in batch:
        parser.feed(line)
    per_line = (time.perf_counter() - t0) / len(batch)
    assert per_line < 50e-6, f"{per_line * 1e6:.1f} us per line"


def test_real_b11434_log_with_prompt_cache_hits():
    """Recorded from llama-server b11434 serving tests/test_llamacpp_real.py's requests: two
    401s, slot warnings inside a request, and requests whose prompt came from the cache."""
    lines = lines_of("llamacpp_b11434_real.log")
    _, states, gens = replay(lines)
    got = [
        (g.task_id, g.slot_id, g.prompt_tokens, g.prompt_eval_tokens, g.cached_tokens) for g in gens
    ]
    assert got == [(0, 3, 35, 36, 0), (13, 3, 7, 7, 0), (22, 2, 35, 1, 34), (35, 2, 35, 1, 34)]
    assert [g.generated_tokens for g in gens] == [12, 8, 12, 12]
    assert [s.phase for s in states] == ["prefill", "generating", "idle"] * 4
    ready = [ln for ln in lines if BACKEND.is_ready_line(ln)]
    assert ready == ["0.00.452.384 I srv  llama_server: listening on http://127.0.0.1:57383"]

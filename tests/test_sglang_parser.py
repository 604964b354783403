"""SGLang runtime state from scheduler log lines, and request ends from /metrics."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from solar_host.backends.prometheus import parse_prometheus_text
from solar_host.backends.sglang import BACKEND, SglangLogParser, usage_snapshot
from solar_host.backends.sglang_config import SglangConfig

FIXTURE = Path(__file__).parent / "fixtures" / "sglang_server.log"

PREFILL = (
    "[2026-08-15 13:17:19 TP0] Prefill batch, #new-seq: 1, #new-token: {new}, "
    "#cached-token: {cached}, full token usage: 0.03, swa token usage: 0.00, "
    "#running-req: {running}, #queue-req: 0, #pending-token: {pending}, cuda graph: False, "
    "input throughput (token/s): 68.34"
)
DECODE = (
    "[2026-08-15 13:17:19 TP0] Decode batch, #running-req: {running}, #full token: 42496, "
    "full token usage: 0.03, #swa token: 512, swa token usage: 0.00, cuda graph: True, "
    "gen throughput (token/s): {tps}, #queue-req: 0"
)


def prefill(new: int, cached: int = 0, pending: int = 0, running: int = 0) -> str:
    return PREFILL.format(new=new, cached=cached, pending=pending, running=running)


def decode(running: int, tps: float) -> str:
    return DECODE.format(running=running, tps=f"{tps:.2f}")


def make_parser() -> SglangLogParser:
    ticks = itertools.count()
    return SglangLogParser(clock=lambda: f"2026-08-15T13:17:{next(ticks):02d}+00:00")


def metrics(prompt: float, generated: float, cached: float, running: float) -> dict:
    return {
        "sglang:prompt_tokens_total": prompt,
        "sglang:generation_tokens_total": generated,
        "sglang:cached_tokens_total": cached,
        "sglang:num_running_reqs": running,
        "sglang:num_queue_reqs": 0.0,
        "sglang:token_usage": 0.03,
    }


def replay(parser: SglangLogParser) -> None:
    for line in FIXTURE.read_text().splitlines():
        parser.feed(line)


def test_backend_makes_fresh_parsers() -> None:
    config = SglangConfig(alias="a", model_path="/m")
    assert isinstance(BACKEND.new_parser(config), SglangLogParser)
    assert BACKEND.new_parser(config) is not BACKEND.new_parser(config)


def test_prefill_line_is_busy_prefill() -> None:
    p = make_parser()
    result = p.feed(prefill(512, pending=0))
    assert result is not None and result.generation is None
    state = result.state
    assert (state.busy, state.phase, state.active_slots) == (True, "prefill", 1)
    assert state.prefill_prompt_tokens == 512
    assert p.feed(prefill(8, running=3)).state.active_slots == 3


def test_decode_line_is_busy_generating_without_a_finished_request() -> None:
    p = make_parser()
    result = p.feed(decode(2, 84.21))
    state = result.state
    assert (state.busy, state.phase, state.active_slots) == (True, "generating", 2)
    assert state.decode_tps == 84.21
    assert state.decode_ms_per_token == pytest.approx(1000 / 84.21, abs=1e-3)
    assert result.generation is None and p.last_generation is None
    assert p.feed(decode(2, 84.21)) is None  # nothing changed: no update


def test_decode_with_no_running_request_is_idle() -> None:
    p = make_parser()
    p.feed(decode(1, 50.0))
    state = p.feed(decode(0, 0.0)).state
    assert (state.busy, state.phase, state.active_slots) == (False, "idle", 0)


@pytest.mark.parametrize(
    "line",
    [
        '[2026-08-15 13:17:18] INFO:     172.16.240.132:42641 - "GET /v1/models HTTP/1.1" 200 OK',
        "[2026-08-15 11:40:12] The server is fired up and ready to roll!",
        "[2026-08-15 11:40:01 TP0] Load weight end. elapsed=3.2 s, type=Qwen3ForCausalLM",
        "",
        "Prefill batch size is a tunable, see the docs",
    ],
)
def test_unrelated_lines_change_nothing(line: str) -> None:
    assert make_parser().feed(line) is None


@pytest.mark.parametrize(
    "line",
    [
        # Older builds put a period after the batch word; newer ones may add an iteration tag.
        "[2025-01-02 10:00:00 TP0] Prefill batch. #new-seq: 1, #new-token: 11, "
        "#cached-token: 0, token usage: 0.00, #running-req: 0, #queue-req: 0",
        "[2026-10-30 10:00:00 TP0] Prefill batch [1234], #new-seq: 1, #new-token: 11, "
        "#cached-token: 0, full token usage: 0.00, #running-req: 0, #queue-req: 0, "
        "#pending-token: 0, cuda graph: False, input throughput (token/s): 1.00",
    ],
)
def test_prefill_formats(line: str) -> None:
    p = make_parser()
    assert p.feed(line).state.phase == "prefill"
    assert p.pending.input_tokens == 11  # no #pending-token field: one chunk, closed


def test_period_separated_decode() -> None:
    line = (
        "[2025-01-02 10:00:01 TP0] Decode batch. #running-req: 1, #token: 120, "
        "token usage: 0.00, gen throughput (token/s): 40.00, #queue-req: 0"
    )
    state = make_parser().feed(line).state
    assert (state.phase, state.decode_tps) == ("generating", 40.0)


def test_chunked_prefill_accumulates_one_request() -> None:
    p = make_parser()
    first = p.feed(prefill(4096, cached=9472, pending=6912)).state
    assert first.prefill_prompt_tokens == 20480
    assert first.prefill_progress == pytest.approx(13568 / 20480, abs=1e-4)
    second = p.feed(prefill(4096, cached=0, pending=2816)).state
    assert second.prefill_progress > first.prefill_progress
    assert p.prefill_active and p.pending is None
    p.feed(prefill(2816, cached=0, pending=0))
    assert not p.prefill_active
    pending = p.pending
    assert (pending.input_tokens, pending.prompt_eval_tokens, pending.cached_tokens) == (
        20480,
        11008,
        9472,
    )
    assert pending.started_at == "2026-08-15T13:17:00+00:00"  # the first chunk's time
    p.feed(decode(1, 69.19))
    assert p.pending.decode_tps == 69.19
    assert not hasattr(p.pending, "generated_tokens")  # only the metrics poll knows that
    assert p.last_generation is None


def test_fixture_replay() -> None:
    p = make_parser()
    replay(p)
    pending = p.pending
    assert (pending.input_tokens, pending.prompt_eval_tokens, pending.cached_tokens) == (
        42496,
        1024,
        41472,
    )
    assert (p.state.busy, p.state.phase) == (True, "generating")
    assert list(p.recent_generations) == []  # decode lines never finish a request


def test_metrics_close_the_request() -> None:
    p = make_parser()
    replay(p)
    assert p.apply_metrics(metrics(83360, 2830, 50944, 1)) is None  # log already busy
    result = p.apply_metrics(metrics(83360, 2900, 50944, 0))
    assert (result.state.busy, result.state.phase) == (False, "idle")
    g = result.generation
    assert (g.prompt_tokens, g.generated_tokens, g.cached_tokens) == (42496, 70, 41472)
    assert (g.prompt_eval_tokens, g.total_tokens, g.source) == (1024, 42566, "metrics")
    assert g.decode_tps == pytest.approx(69.31)
    assert g.started_at is not None and g.finished_at is not None
    assert p.last_generation is g and list(p.recent_generations) == [g]
    # A decode line after the drain does not touch the finished record.
    p.feed(decode(1, 12.0))
    assert p.last_generation is g
    assert (g.generated_tokens, g.decode_tps) == (70, pytest.approx(69.31))
    assert g.finished_at is not None
    # Nothing open any more: the next idle scrape finishes nothing.
    p.feed(decode(0, 0.0))
    assert p.apply_metrics(metrics(83360, 2900, 50944, 0)) is None


def test_prompt_counter_delta_wins_when_it_moved() -> None:
    p = make_parser()
    p.apply_metrics(metrics(100, 10, 0, 0))
    p.feed(prefill(30, cached=20, pending=0))
    p.apply_metrics(metrics(100, 10, 0, 1))
    g = p.apply_metrics(metrics(150, 18, 20, 0)).generation
    assert (g.prompt_tokens, g.generated_tokens, g.cached_tokens) == (50, 8, 20)
    assert (g.prompt_eval_tokens, g.total_tokens) == (30, 58)


def test_without_log_prefill_counters_give_the_cached_tokens() -> None:
    p = make_parser()
    p.apply_metrics(metrics(0, 0, 0, 1))
    g = p.apply_metrics(metrics(64, 5, 16, 0)).generation
    assert (g.prompt_tokens, g.cached_tokens, g.prompt_eval_tokens) == (64, 16, 48)
    assert g.started_at is None and g.finished_at is not None


def test_idle_reading_during_prefill_is_not_an_idle_flash() -> None:
    p = make_parser()
    p.feed(prefill(4096, cached=0, pending=1000))
    assert p.apply_metrics(metrics(0, 0, 0, 0)) is None
    assert p.state.phase == "prefill"


def test_running_requests_with_an_idle_log_make_it_busy() -> None:
    p = make_parser()
    result = p.apply_metrics(metrics(0, 0, 0, 2))
    state = result.state
    assert (state.busy, state.phase, state.active_slots) == (True, "generating", 2)
    assert p.apply_metrics(metrics(0, 0, 0, 2)) is None


def test_metrics_end_a_busy_state_the_log_never_ends() -> None:
    """SGLang logs no request end: the last decode line leaves the log state busy."""
    p = make_parser()
    p.feed(decode(1, 60.0))
    result = p.apply_metrics(metrics(10, 10, 0, 0))
    assert result.generation is None
    assert (result.state.busy, result.state.phase) == (False, "idle")


def test_metrics_without_sglang_names_change_nothing() -> None:
    p = make_parser()
    assert p.apply_metrics({"process_cpu_seconds_total": 1.0}) is None
    assert p.apply_metrics({}) is None


def test_snapshot_named_metrics_are_accepted() -> None:
    p = make_parser()
    replay(p)
    p.apply_metrics(usage_snapshot(metrics(83360, 2830, 50944, 1)))
    g = p.apply_metrics(usage_snapshot(metrics(83360, 2900, 50944, 0))).generation
    assert (g.prompt_tokens, g.generated_tokens) == (42496, 70)


SCRAPE = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="deepseek-v4-flash-284b"} 83360.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="deepseek-v4-flash-284b"} 2830.0
sglang:cached_tokens_total{model_name="deepseek-v4-flash-284b"} 50944.0
sglang:num_running_reqs{model_name="deepseek-v4-flash-284b"} 1.0
sglang:num_queue_reqs{model_name="deepseek-v4-flash-284b"} 0.0
sglang:token_usage{model_name="deepseek-v4-flash-284b"} 0.03
process_cpu_seconds_total 12.5
"""


def test_usage_snapshot_from_a_scrape() -> None:
    snap = usage_snapshot(parse_prometheus_text(SCRAPE))
    assert snap == {
        "prompt_tokens_total": 83360.0,
        "generated_tokens_total": 2830.0,
        "cached_tokens_total": 50944.0,
        "requests_processing": 1.0,
        "requests_deferred": 0.0,
        "kv_cache_usage_ratio": 0.03,
    }
    gauges = usage_snapshot(parse_prometheus_text("sglang:num_running_reqs 0\n"))
    assert gauges["requests_processing"] == 0 and gauges["prompt_tokens_total"] is None
    assert usage_snapshot(parse_prometheus_text("process_cpu_seconds_total 1\n")) is None
    assert BACKEND.usage_snapshot({"sglang:token_usage": 0.5})["kv_cache_usage_ratio"] == 0.5

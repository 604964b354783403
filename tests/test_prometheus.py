"""Prometheus text reader and the llama.cpp usage mapping."""

from __future__ import annotations

from solar_host.backends.llamacpp import usage_snapshot
from solar_host.backends.prometheus import parse_prometheus_text

# Shape of llama-server's /metrics body (b10434), values changed.
LLAMA_BODY = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 41
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 0.004
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 24
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.125
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def test_colon_names_and_comments():
    m = parse_prometheus_text(LLAMA_BODY)
    assert m["llamacpp:prompt_tokens_total"] == 41.0
    assert m["llamacpp:kv_cache_usage_ratio"] == 0.125
    assert not any(k.startswith("#") for k in m)
    assert len(m) == 6


def test_label_sets_are_summed_and_a_repeated_series_overrides():
    m = parse_prometheus_text(
        'sglang:num_running_reqs{model_name="m",engine="a b"} 3\n'
        'sglang:num_running_reqs{model_name="m"} 4\n'
        'sglang:prompt_tokens_total{is_streaming="true"} 10\n'
        'sglang:prompt_tokens_total{is_streaming="false"} 20\n'
        'sglang:prompt_tokens_total{is_streaming="false"} 25\n'
        'http_requests_total{code="200"} 1027 1395066363000\n'
    )
    assert m == {
        "sglang:num_running_reqs": 7.0,
        "sglang:prompt_tokens_total": 35.0,
        "http_requests_total": 1027.0,
    }


def test_bad_lines_skipped():
    m = parse_prometheus_text(
        'good 1\nnovalue\nbad abc\nbroken{label="x" 5\n  \n\tspaced   2.5e3  \nneg -1\ninf +Inf\n'
    )
    assert m["good"] == 1.0 and m["spaced"] == 2500.0 and m["neg"] == -1.0
    assert m["inf"] == float("inf")
    assert "novalue" not in m and "bad" not in m and "broken" not in m


def test_empty_and_comment_only():
    assert parse_prometheus_text("") == {}
    assert parse_prometheus_text("# HELP x y\n# TYPE x counter\n\n") == {}


def test_llamacpp_snapshot_mapping():
    snap = usage_snapshot(parse_prometheus_text(LLAMA_BODY))
    assert snap == {
        "prompt_tokens_total": 41.0,
        "generated_tokens_total": 24.0,
        "requests_processing": 1.0,
        "requests_deferred": 0.0,
        "kv_cache_usage_ratio": 0.125,
    }
    assert usage_snapshot(parse_prometheus_text("process_cpu_seconds_total 3\n")) is None
    partial = usage_snapshot({"llamacpp:requests_processing": 0.0})
    assert partial["requests_processing"] == 0.0 and partial["prompt_tokens_total"] is None

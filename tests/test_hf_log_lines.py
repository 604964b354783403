"""The log lines hf_server writes and the host reads (solar_host.servers.log_lines): each kind
written by the server's own function and parsed back by the host's, field for field."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest

from solar_host.backends.huggingface import BACKEND, HFLogParser
from solar_host.servers.log_lines import (
    READY_FORMAT,
    complete_line,
    error_line,
    is_ready_line,
    is_started_line,
    parse_marker,
    ready_host,
    request_line,
    timestamp,
)


def test_request_line_round_trip() -> None:
    line = request_line("ab12cd-7", "/v1/embeddings")
    assert line == "[REQUEST] id=ab12cd-7 endpoint=/v1/embeddings"
    m = parse_marker(line)
    assert m is not None and (m.kind, m.rid) == ("REQUEST", "ab12cd-7")
    assert m.fields == {"endpoint": "/v1/embeddings"}


def test_generation_complete_line_round_trip() -> None:
    end = datetime(2026, 1, 1, 12, 0, 2, 500000, tzinfo=UTC)
    line = complete_line("ab-1", "/v1/chat/completions", 26, 50, 2.0, now=end)
    assert line == (
        "[COMPLETE] id=ab-1 endpoint=/v1/chat/completions prompt_tokens=26 "
        "completion_tokens=50 time_ms=2000.0 started_at=2026-01-01T12:00:00.500000+00:00 "
        "finished_at=2026-01-01T12:00:02.500000+00:00"
    )
    m = parse_marker("INFO: " + line)  # found anywhere on the line
    assert m is not None and (m.kind, m.rid) == ("COMPLETE", "ab-1")
    assert m.fields["endpoint"] == "/v1/chat/completions"
    assert (m.fields["prompt_tokens"], m.fields["completion_tokens"]) == ("26", "50")
    assert m.fields["time_ms"] == "2000.0"
    assert timestamp(m.fields["started_at"]) == end - timedelta(seconds=2)
    assert timestamp(m.fields["finished_at"]) == end


def test_other_complete_lines_carry_no_times() -> None:
    for endpoint in ("/v1/embeddings", "/v1/classify"):
        line = complete_line("e-2", endpoint, 9, 0, 0.01234)
        assert line == f"[COMPLETE] id=e-2 endpoint={endpoint} prompt_tokens=9 " + (
            "completion_tokens=0 time_ms=12.3"
        )
        m = parse_marker(line)
        assert m is not None and "started_at" not in m.fields and "finished_at" not in m.fields


def test_error_line_round_trip_keeps_one_line() -> None:
    line = error_line("x-3", "/v1/completions", 400, "bad\nthing " + "y" * 400)
    assert "\n" not in line and line.endswith("message=" + ("bad thing " + "y" * 400)[:300])
    m = parse_marker(line)
    assert m is not None and (m.kind, m.rid) == ("ERROR", "x-3")
    # The message's first word only: a value ends at a space (the host reads none of it).
    assert m.fields == {"endpoint": "/v1/completions", "status": "400", "message": "bad"}


def test_lines_without_a_marker() -> None:
    for line in ("", "INFO: Started server process [12]", "some [text] id=x", "[REQUEST]"):
        assert parse_marker(line) is None
    assert timestamp(None) is None and timestamp("not a time") is None
    assert timestamp("2026-01-01T00:00:00") == datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(("host", "shown"), [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_ready_line_round_trip(host: str, shown: str, caplog) -> None:
    """The ready line as the server writes it (a logging format, through uvicorn's logger)
    is the line the host waits for, and a fresh start to its parser."""
    with caplog.at_level(logging.INFO, logger="test.ready"):
        logging.getLogger("test.ready").info(READY_FORMAT, ready_host(host), 8123)
    line = "INFO: " + caplog.records[-1].getMessage()
    assert line == f"INFO: Uvicorn running on http://{shown}:8123 (Press CTRL+C to quit)"
    assert is_ready_line(line) and is_started_line(line) and BACKEND.is_ready_line(line)
    assert parse_marker(line) is None
    assert is_started_line("INFO:     Application startup complete.")
    assert not is_ready_line("INFO:     Application startup complete.")


def test_host_parser_reads_what_the_server_writes() -> None:
    """The host's runtime state and generation record from the server's own lines."""
    end = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    p = HFLogParser(clock=lambda: end + timedelta(seconds=30))  # the host reads late
    r = p.feed(request_line("s-1", "/v1/completions"))
    assert r and r.state and r.state.active_slots == 1
    r = p.feed(complete_line("s-1", "/v1/completions", 3, 40, 0.5, now=end))
    assert r and r.state and not r.state.busy
    g = r.generation
    assert g is not None and (g.prompt_tokens, g.generated_tokens, g.total_tokens) == (3, 40, 43)
    assert g.finished_at == end.isoformat()
    assert g.started_at == (end - timedelta(seconds=0.5)).isoformat()
    assert g.decode_tps == pytest.approx(80.0)
    p.feed(request_line("s-2", "/v1/embeddings"))
    r = p.feed(error_line("s-2", "/v1/embeddings", 413, "too large"))
    assert r and r.state and r.state.active_slots == 0 and r.generation is None

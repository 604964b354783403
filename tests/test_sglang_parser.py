"""SGLang runtime state from scheduler log lines, and request ends from /metrics."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from solar_host.backends.base import LaunchContext
from solar_host.backends.prometheus import parse_prometheus_text
from solar_host.backends.sglang import BACKEND, SglangLogParser, usage_snapshot
from solar_host.backends.sglang_config import SglangConfig
from solar_host.instances.backend_env import write_private_files
from tests.fixtures.fake_sglang import make_fake_sglang_venv
from tests.fixtures.ports import free_port

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


# --- The fake SGLang server, end to end ----------------------------------------------------------


class FakeServer:
    """The fake started from BACKEND.launch()'s own argv and env, its log read on a thread."""

    def __init__(self, tmp_path: Path, extra_env: dict[str, str] | None = None, **ctx_kw):
        venv = make_fake_sglang_venv(tmp_path, style=ctx_kw.pop("style", "console"))
        self.port = free_port()
        self.config = SglangConfig(
            alias="fake:model", model_path="/models/fake", host="127.0.0.1",
            chunked_prefill_size=8, **ctx_kw,
        )  # fmt: skip
        self.ctx = LaunchContext(
            instance_id="0b7c2f7e-1d2a-4c3b-9e8f-0123456789ab",
            port=self.port,
            host_api_key="host-key",
            models_dir=tmp_path,
            sglang_venv_path=str(venv),
            sglang_prompt_cache_dir=str(tmp_path / "cache"),
            gpu_type="nvidia_cuda",
            private_dir=tmp_path / "keys",
        )
        self.spec = BACKEND.launch(self.config, self.ctx)
        write_private_files(self.spec.private_files)  # as the supervisor does
        assert BACKEND.before_start(self.config, self.ctx) == []  # as the supervisor does
        env = {**os.environ, **self.spec.env, **(extra_env or {})}
        for name in self.spec.env_remove:
            env.pop(name, None)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            self.spec.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.url = f"http://127.0.0.1:{self.port}"
        self.auth = {"Authorization": "Bearer host-key"}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if BACKEND.is_ready_line(line):
                self.ready.set()

    def wait_ready(self, timeout: float = 15.0) -> None:
        assert self.ready.wait(timeout), "\n".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)

    def scrape(self) -> dict[str, float]:
        return parse_prometheus_text(httpx.get(f"{self.url}/metrics", timeout=5).text)


@pytest.fixture
def fake(tmp_path: Path):
    server = FakeServer(tmp_path, extra_env={"FAKE_SGLANG_READY_DELAY_S": "0.5"})
    try:
        yield server
    finally:
        server.stop()


def test_fake_starts_serves_counts_and_stops(fake: FakeServer, tmp_path: Path) -> None:
    # The uvicorn banner comes first, and /health says 503 until warmup is done.
    assert wait_until_true(lambda: any("Uvicorn running" in ln for ln in fake.lines))
    early = httpx.get(f"{fake.url}/health", timeout=5).status_code
    assert early == 503 or (early == 200 and fake.ready.wait(5))  # 200 only once warmed up
    fake.wait_ready()
    banner = next(i for i, ln in enumerate(fake.lines) if "Uvicorn running" in ln)
    ready = next(i for i, ln in enumerate(fake.lines) if BACKEND.is_ready_line(ln))
    assert banner < ready
    assert any("Load weight end." in ln for ln in fake.lines[:banner])
    assert httpx.get(f"{fake.url}/health", timeout=5).status_code == 200

    # Auth: the host key as Bearer; nothing else.
    assert httpx.get(f"{fake.url}/v1/models", timeout=5).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert httpx.get(f"{fake.url}/v1/models", headers=bad, timeout=5).status_code == 401
    models = httpx.get(f"{fake.url}/v1/models", headers=fake.auth, timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]

    # The venv environment and the per-instance cache dir reached the process.
    info = httpx.get(f"{fake.url}/fake/info", headers=fake.auth, timeout=5).json()
    cache_dir = tmp_path / "cache" / f"fake-model-{fake.ctx.instance_id}"
    assert info["env"]["VIRTUAL_ENV"] == fake.ctx.sglang_venv_path
    assert info["env"]["PATH0"] == str(Path(fake.ctx.sglang_venv_path) / "bin")
    assert info["env"]["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == str(cache_dir)
    assert info["env"]["PYTHONUNBUFFERED"] == "1" and info["env"]["PYTHONHOME"] is None
    assert info["args"]["served_model_name"] == "fake-model" and info["argv"][:2] == [
        "serve",
        "--config",
    ]
    # The key came from the private file (the fake checked it on the request above).
    assert "host-key" not in " ".join(fake.spec.argv)

    # One request: log lines and /metrics feed the parser like the supervisor will.
    parser = BACKEND.new_parser(fake.config)
    seen = len(fake.lines)
    before = fake.scrape()
    assert parser.apply_metrics(before) is None
    body = {"model": "fake:model", "messages": [{"role": "user", "content": "one two three"}]}
    body["max_tokens"] = 40
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(
            httpx.post(
                f"{fake.url}/v1/chat/completions", json=body, headers=fake.auth, timeout=30
            ).json()
        )
    )
    worker.start()
    assert wait_until_true(lambda: fake.scrape()["sglang:num_running_reqs"] == 1)
    parser.apply_metrics(fake.scrape())  # the request is open
    worker.join(30)
    assert result["usage"]["completion_tokens"] == 40
    assert result["choices"][0]["message"]["content"] == "Hello from fake SGLang."
    after = fake.scrape()
    assert after["sglang:generation_tokens_total"] == before["sglang:generation_tokens_total"] + 40
    assert after["sglang:prompt_tokens_total"] > before["sglang:prompt_tokens_total"]
    assert wait_until_true(lambda: any("POST /v1/chat/completions" in ln for ln in fake.lines))
    states = [r.state for ln in fake.lines[seen:] if (r := parser.feed(ln)) and r.state]
    assert [s.phase for s in states][:1] == ["prefill"] and "generating" in [
        s.phase for s in states
    ]
    done = parser.apply_metrics(after)
    g = done.generation
    assert (g.generated_tokens, g.prompt_tokens) == (40, result["usage"]["prompt_tokens"])
    assert g.prompt_eval_tokens == g.prompt_tokens and g.cached_tokens == 0
    assert g.decode_tps == 100.0 and g.source == "metrics"
    assert (done.state.busy, done.state.phase) == (False, "idle")

    # The same prompt again hits the prefix cache.
    again = httpx.post(f"{fake.url}/v1/chat/completions", json=body, headers=fake.auth, timeout=30)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert len(list(cache_dir.iterdir())) == 2  # one page per request

    assert fake.stop() == 0
    assert "Finished server process" in fake.lines[-1]


def test_fake_as_python_module_and_its_refusals(tmp_path: Path) -> None:
    server = FakeServer(tmp_path, style="python")
    try:
        assert server.spec.argv[1:3] == ["-m", "sglang.launch_server"]
        server.wait_ready()
        assert httpx.get(f"{server.url}/metrics", timeout=5).status_code == 200
    finally:
        assert server.stop() == 0
    venv = make_fake_sglang_venv(tmp_path)
    no_key = subprocess.run(
        [str(venv / "bin" / "sglang"), "serve", "--model-path", "/m", "--port", "1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert no_key.returncode == 2 and "--api-key" in no_key.stderr
    crash = subprocess.run(
        [str(venv / "bin" / "sglang"), "serve", "--model-path", "/m", "--api-key", "k"],
        capture_output=True, text=True, timeout=30, env={**os.environ, "FAKE_SGLANG_FAIL": "load"},
    )  # fmt: skip
    assert crash.returncode == 1 and "Load weight begin" in crash.stderr
    assert not any(BACKEND.is_ready_line(ln) for ln in crash.stderr.splitlines())


def wait_until_true(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(0.02)
    return False

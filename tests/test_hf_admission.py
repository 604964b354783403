"""Admission of new chats into the decode scheduler's running batch (issue 20: a burst's time
to first token): requests that arrive while a prefill runs join the next prefill before any
step."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from solar_host.servers.hf_protocol import GenParams
from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from solar_host.servers.hf_decode import DecodeScheduler, GenRequest, GenResult  # noqa: E402
from solar_host.servers.prefill_cost import PrefillCost  # noqa: E402

WAIT_S = 60  # bound on every wait for the scheduler (a loaded 2-core machine)


@pytest.fixture(scope="module")
def model(tiny_hf_models: TinyHFModels) -> tuple[Any, Any]:  # noqa: F811
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_models.causal)
    lm = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_models.causal).eval()
    return lm, tok


class Requests:
    """Greedy requests whose pieces and results are recorded as (request, what, steps) in the
    order the scheduler delivers them."""

    def __init__(self, tok: Any, sched_of: Any):
        self.tok = tok
        self.sched_of = sched_of
        self.events: list[tuple[int, str, int]] = []
        self.results: dict[int, GenResult | BaseException] = {}
        self.done: dict[int, threading.Event] = {}

    def make(self, i: int, prompt: str, max_new: int) -> GenRequest:
        self.done[i] = threading.Event()

        def piece(_text: str) -> None:
            self.events.append((i, "piece", self.sched_of().steps))

        def finished(res: GenResult | BaseException) -> None:
            self.results[i] = res
            self.events.append((i, "done", self.sched_of().steps))
            self.done[i].set()

        ids = self.tok(prompt)["input_ids"]
        return GenRequest(ids, GenParams(temperature=0), max_new, piece, finished)

    def wait(self, ids: range) -> None:
        for i in ids:
            assert self.done[i].wait(WAIT_S), f"request {i} did not finish"


class AllPerCall(PrefillCost):
    """A prefill cost all per call (a GPU's, a tiny model's): every request that arrived
    together joins one prefill."""

    def fit(self) -> tuple[float, float]:
        return 1.0, 0.0


PROMPTS = ["the cat sat", "a man is eating", "hello", "the quick brown fox", "solar", "x", "ab"]


def test_requests_that_arrive_during_a_prefill_join_the_next_prefill_before_any_step(
    model,
) -> None:
    """The first request's prefill is handed to the loop; while that hand-over is pending,
    six more arrive (as a burst's later chats reach the scheduler while the first one's
    prefill runs). All six are prefilled together, and before the first request's first step:
    none of them waits behind a step of a row that already has its first token."""
    lm, tok = model
    sched: DecodeScheduler
    reqs = Requests(tok, lambda: sched)
    burst = len(PROMPTS) - 1
    submitted = threading.Event()

    def post(calls: list, then: Any) -> None:  # the event loop's stand-in, run in place
        for fn, arg in calls:
            fn(arg)
        if not submitted.is_set() and sched.prefills == 2:  # the warm-up's and the first's
            submitted.set()
            for i in range(1, burst + 1):
                sched.submit(reqs.make(i, PROMPTS[i], 3))
        if then is not None:
            then()

    sched = DecodeScheduler(lm, tok, "cpu", 32, post, threads=1)
    sched.start()
    try:
        sched.submit(reqs.make(-1, "warm", 2))  # rows can join a running batch from now on
        reqs.wait(range(-1, 0))
        reqs.events.clear()
        # How the burst is cut into prefill groups follows the cost fitted to the prefills so
        # far (test_hf_decode.py tests that); two prefills on a loaded machine fit any slope.
        # This test is about when the six are admitted: a cost all per call, one group.
        sched.prefill_cost = AllPerCall()
        sched.submit(reqs.make(0, PROMPTS[0], 3))
        reqs.wait(range(0, burst + 1))
        stats = sched.stats()
    finally:
        sched.stop()
    # The warm-up's prefill, the first request's, then one for the six.
    assert stats["prefills"] == 3
    assert stats["admitted"] == burst + 2
    first_pieces = {}
    for i, what, steps in reqs.events:
        if what == "piece":
            first_pieces.setdefault(i, steps)
    assert set(first_pieces) == set(range(burst + 1))
    # Every first token, the first request's and the six's, came from a prefill: no decode
    # step had run (the warm-up's steps are before the count started).
    base = first_pieces[0]
    assert all(steps == base for steps in first_pieces.values()), first_pieces
    # Usage is exact whatever the grouping.
    for i in range(burst + 1):
        res = reqs.results[i]
        assert isinstance(res, GenResult), res
        assert res.completion_tokens == 3
        assert res.prompt_tokens == len(tok(PROMPTS[i])["input_ids"])


def test_a_request_on_its_way_joins_the_prefill_of_those_queued(model, monkeypatch) -> None:
    """A request the event loop is still making ready (counted by `arriving`) is waited for:
    it joins the prefill of the one already queued instead of a prefill of its own."""
    import solar_host.servers.hf_decode as hf_decode

    monkeypatch.setattr(hf_decode, "GATHER_S", WAIT_S)  # long: only the arrival ends the wait
    lm, tok = model
    sched: DecodeScheduler
    reqs = Requests(tok, lambda: sched)
    on_its_way = [0]

    def post(calls: list, then: Any) -> None:
        for fn, arg in calls:
            fn(arg)
        if then is not None:
            then()

    sched = DecodeScheduler(lm, tok, "cpu", 32, post, threads=1, arriving=lambda: on_its_way[0])
    sched.start()
    try:
        sched.submit(reqs.make(-1, "warm", 2))
        reqs.wait(range(-1, 0))
        on_its_way[0] = 1
        sched.submit(reqs.make(0, PROMPTS[0], 3))
        assert not reqs.done[0].wait(0.3)  # held for the one on its way
        assert sched.stats()["prefills"] == 1
        sched.submit(reqs.make(1, PROMPTS[1], 3))
        on_its_way[0] = 0
        reqs.wait(range(0, 2))
        stats = sched.stats()
    finally:
        sched.stop()
    assert stats["prefills"] == 2 and stats["admitted"] == 3  # the warm-up's, then one for both
    for i in range(2):
        res = reqs.results[i]
        assert isinstance(res, GenResult) and res.completion_tokens == 3, res


def test_a_request_that_never_arrives_holds_the_batch_by_the_bound_only(model, monkeypatch) -> None:
    import time

    import solar_host.servers.hf_decode as hf_decode

    monkeypatch.setattr(hf_decode, "GATHER_S", 0.3)
    lm, tok = model
    sched: DecodeScheduler
    reqs = Requests(tok, lambda: sched)

    def post(calls: list, then: Any) -> None:
        for fn, arg in calls:
            fn(arg)
        if then is not None:
            then()

    sched = DecodeScheduler(lm, tok, "cpu", 32, post, threads=1, arriving=lambda: 1)
    sched.start()
    try:
        started = time.monotonic()
        sched.submit(reqs.make(0, PROMPTS[0], 2))
        reqs.wait(range(0, 1))
        took = time.monotonic() - started
    finally:
        sched.stop()
    res = reqs.results[0]
    assert isinstance(res, GenResult) and res.completion_tokens == 2, res
    assert took >= 0.3  # the prefill waited for the bound, once per turn (two turns here)


def test_arrivals_count_a_request_until_its_block_ends_however_it_ends() -> None:
    from solar_host.servers.hf_generation import Arrivals

    arrivals = Arrivals()
    with arrivals.one():
        assert arrivals.count == 1
        with arrivals.away():  # a long tokenization in a thread: not waited for
            assert arrivals.count == 0
        assert arrivals.count == 1
    assert arrivals.count == 0
    with pytest.raises(ValueError), arrivals.one():
        raise ValueError("a refused request")
    assert arrivals.count == 0

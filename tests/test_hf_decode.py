"""The decode scheduler in-process, on the tests' tiny GPT-2: requests that arrive together are
prefilled in groups sized by the measured prefill cost, and whatever the grouping, each
request's greedy text and usage are what it gets alone (issue 20)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from solar_host.servers.hf_protocol import GenParams
from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from solar_host.servers.hf_decode import DecodeScheduler, GenRequest, GenResult  # noqa: E402
from solar_host.servers.prefill_cost import PrefillCost  # noqa: E402

PROMPTS = [
    ("the cat sat", 9),
    ("a man is eating a piece of", 17),
    ("hello", 4),
    ("the quick brown fox jumps over the lazy dog and", 12),
    ("solar host serves", 21),
    ("x", 6),
]


@pytest.fixture(scope="module")
def model(tiny_hf_models: TinyHFModels) -> tuple[Any, Any]:  # noqa: F811
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_models.causal)
    lm = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_models.causal).eval()
    return lm, tok


def run_all(model: tuple[Any, Any], cost: tuple[float, float], together: bool) -> tuple[list, dict]:
    """Generate PROMPTS greedily: all submitted at once (after a warm-up request, so that the
    scheduler knows rows can join), or one after another. Returns (results, stats)."""
    lm, tok = model
    done: dict[int, threading.Event] = {}
    results: dict[int, GenResult | BaseException] = {}
    order: list[int] = []  # which request got its first piece, in order

    def post(calls: list, then: Any) -> None:  # on the scheduler thread: run them right there
        for fn, arg in calls:
            fn(arg)
        if then is not None:
            then()

    sched = DecodeScheduler(lm, tok, "cpu", 32, post, threads=1)
    sched.start()
    try:

        def request(i: int, prompt: str, max_new: int) -> GenRequest:
            done[i] = threading.Event()

            def finished(res: GenResult | BaseException) -> None:
                results[i] = res
                done[i].set()

            def piece(_text: str) -> None:
                if i not in order:
                    order.append(i)

            ids = tok(prompt)["input_ids"]
            return GenRequest(ids, GenParams(temperature=0), max_new, piece, finished)

        sched.submit(request(-1, "warm", 2))
        assert done[-1].wait(60)
        # The prefill cost the grouping sees, whatever the tiny model's own prefills say.
        sched.prefill_cost = cost_of(*cost)
        if together:
            with sched._cond:  # all pending at the same turn of the scheduler
                for i, (prompt, n) in enumerate(PROMPTS):
                    sched._pending.append(request(i, prompt, n))
                sched._cond.notify()
            for i in range(len(PROMPTS)):
                assert done[i].wait(60)
        else:
            for i, (prompt, n) in enumerate(PROMPTS):
                sched.submit(request(i, prompt, n))
                assert done[i].wait(60)
        return [results[i] for i in range(len(PROMPTS))], {**sched.stats(), "order": order}
    finally:
        sched.stop()


def test_prefill_groups_minimise_the_mean_wait_at_the_fitted_cost(model) -> None:
    lm, tok = model
    sched = DecodeScheduler(lm, tok, "cpu", 32, lambda calls, then: None)
    reqs = [GenRequest([0] * n, GenParams(), 1, None, lambda r: None) for n in (4, 5, 2, 12, 1)]
    sched._mergeable = True

    def sizes() -> list[list[int]]:
        return [[len(r.ids) for r in g] for g in sched._prefill_groups(reqs)]

    # Nothing measured yet: one prefill for all.
    assert sizes() == [[4, 5, 2, 12, 1]]
    # Prefills of one size only: per call and per token cannot be told apart yet.
    sched.prefill_cost.record(40, 0.05)
    sched.prefill_cost.record(40, 0.05)
    assert len(sizes()) == 1
    # 4.8 tokens a prompt at 1 ms each, 5 ms a call: groups of round(sqrt(5 * 5 / 4.8)) = 2.
    sched.prefill_cost = cost_of(per_call=0.005, per_token=0.001)
    assert sizes() == [[4, 5], [2, 12], [1]]
    # Nearly all per token: one prompt a group.
    sched.prefill_cost = cost_of(per_call=0.0001, per_token=0.001)
    assert sizes() == [[4], [5], [2], [12], [1]]
    # A cost per call, not per token (a GPU, a tiny model): one prefill, however long the
    # call. A single figure per token (40 ms / 10 tokens) made that one prefill each.
    sched.prefill_cost = cost_of(per_call=0.040, per_token=0.0)
    assert len(sizes()) == 1
    # The hand-over to the event loop after each prefill is a cost per group too: at 5 ms a
    # call plus 15 ms a hand-over, groups of round(sqrt(5 * 20 / 4.8)) = 5.
    sched.prefill_cost = cost_of(per_call=0.005, per_token=0.001)
    sched.handoff_s = 0.015
    assert sizes() == [[4, 5, 2, 12, 1]]
    sched.handoff_s = None
    sched.prefill_cost = cost_of(per_call=0.0001, per_token=0.001)
    sched._mergeable = False  # static batching: the first prefill is the batch
    assert len(sizes()) == 1
    # What the scheduler reports.
    sched.prefill_cost = cost_of(per_call=0.005, per_token=0.001)
    stats = sched.stats()
    assert stats["prefill_ms_per_call"] == pytest.approx(5.0)
    assert stats["prefill_ms_per_token"] == pytest.approx(1.0)


def cost_of(per_call: float, per_token: float) -> PrefillCost:
    cost = PrefillCost()
    for tokens in (10, 40, 25, 80, 12):
        cost.record(tokens, per_call + per_token * tokens)
    return cost


def test_prefill_cost_separates_the_cost_per_call_from_the_cost_per_token() -> None:
    assert PrefillCost().fit() is None
    per_call, per_token = cost_of(0.006, 0.0022).fit()  # type: ignore[misc]
    assert per_call == pytest.approx(0.006) and per_token == pytest.approx(0.0022)
    assert cost_of(0.030, 0.0).fit() == pytest.approx((0.030, 0.0))
    # Bigger prefills measured faster (noise on a per-call cost): all of it per call.
    noisy = PrefillCost()
    noisy.record(10, 0.031)
    noisy.record(100, 0.029)
    assert noisy.fit() == pytest.approx((0.030, 0.0), rel=0.01)
    # Recent prefills weigh more: the machine got twice as slow.
    cost = cost_of(0.006, 0.0022)
    for tokens in (10, 40, 25, 80, 12) * 8:
        cost.record(tokens, 2 * (0.006 + 0.0022 * tokens))
    per_call, per_token = cost.fit()  # type: ignore[misc]
    assert per_call == pytest.approx(0.012, rel=0.1) and per_token == pytest.approx(0.0044, rel=0.1)


def test_grouped_prefills_give_each_request_what_it_gets_alone(model) -> None:
    per_call = (1.0, 0.0)  # (seconds per call, per token): one prefill for all
    alone, _ = run_all(model, per_call, together=False)
    one_prefill, wide = run_all(model, per_call, together=True)
    grouped, narrow = run_all(model, (0.0, 0.001), together=True)  # one request a group
    for ref, a, b in zip(alone, one_prefill, grouped, strict=True):
        assert isinstance(ref, GenResult), ref
        assert (a.text, a.prompt_tokens, a.completion_tokens) == (
            ref.text,
            ref.prompt_tokens,
            ref.completion_tokens,
        )
        assert (b.text, b.prompt_tokens, b.completion_tokens) == (
            ref.text,
            ref.prompt_tokens,
            ref.completion_tokens,
        )
    # The warm-up and the six in one prefill, or the six one by one.
    assert wide["prefills"] == 2
    assert narrow["prefills"] == 1 + len(PROMPTS)
    assert narrow["prefill_ms_per_token"] is not None  # the fit knows both parts
    assert narrow["max_rows"] == len(PROMPTS)  # the groups still shared the decode steps
    # The first group's first pieces go out first (before the later groups are prefilled).
    assert next(i for i in narrow["order"] if i >= 0) == 0


def handoff_trace(
    model, monkeypatch, hand_back_after: float | None, bound_s: float
) -> tuple[list, dict]:
    """One request of 4 tokens; the event loop's stand-in hands back after a prefill's post
    only after `hand_back_after` seconds (None: never). Returns (what, steps, time) events and
    the scheduler's stats."""
    import solar_host.servers.hf_decode as hf_decode

    monkeypatch.setattr(hf_decode, "HANDOFF_S", bound_s)
    lm, tok = model
    events: list[tuple[str, int, float]] = []
    finished = threading.Event()

    def post(calls: list, then: Any) -> None:
        events.append(("post", sched.steps, time.monotonic()))
        for fn, arg in calls:
            fn(arg)
        if then is not None and hand_back_after is not None:

            def hand_back() -> None:
                events.append(("handed", sched.steps, time.monotonic()))
                then()

            threading.Timer(hand_back_after, hand_back).start()

    sched = DecodeScheduler(lm, tok, "cpu", 32, post, threads=1)
    sched.start()
    try:
        done = lambda r: finished.set()  # noqa: E731
        ids = tok("the cat")["input_ids"]
        sched.submit(GenRequest(ids, GenParams(), 4, lambda piece: None, done))
        assert finished.wait(60)
    finally:
        sched.stop()
    return events, sched.stats()


def test_after_a_prefill_the_next_step_waits_for_the_loop(model, monkeypatch) -> None:
    events, stats = handoff_trace(model, monkeypatch, hand_back_after=0.2, bound_s=30.0)
    # The prefill's post (first token), then the hand-back, and only then the first step.
    assert [e[:2] for e in events[:2]] == [("post", 0), ("handed", 0)]
    assert events[2][0] == "post" and events[2][2] >= events[1][2]
    assert events[-1][1] == 3  # 4 tokens: the prefill's and three steps'
    # The wait is measured: the grouping counts it as a cost per group.
    assert 100 <= stats["handoff_ms"] < 30_000  # 200 ms less the time from post to wait


def test_a_loop_that_never_hands_back_delays_the_steps_by_the_bound_only(
    model, monkeypatch
) -> None:
    events, stats = handoff_trace(model, monkeypatch, hand_back_after=None, bound_s=0.3)
    assert events[1][2] - events[0][2] >= 0.3
    assert events[-1][1] == 3
    assert stats["handoff_ms"] >= 300


def test_every_step_waits_for_the_loop_to_take_its_tokens(model, monkeypatch) -> None:
    """After a step too, the next waits for the loop's hand-back: the loop sends the tokens
    and takes in new requests without a step running beside it for the GIL."""
    events, _stats = handoff_trace(model, monkeypatch, hand_back_after=0.05, bound_s=30.0)
    kinds = [what for what, _steps, _t in events]
    assert kinds == ["post", "handed"] * (len(kinds) // 2), kinds
    assert [steps for what, steps, _t in events if what == "post"] == [0, 1, 2, 3]


class CountingTokenizer:
    """The tokenizer, recording the ids of every decode call the scheduler makes."""

    def __init__(self, tok: Any):
        self._tok = tok
        self.decoded: list[list[int]] = []

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.decoded.append(list(ids))
        return self._tok.decode(ids, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_a_long_generation_decodes_windows_not_its_whole_text_each_step(model) -> None:
    from solar_host.servers.detokenizer import MAX_PENDING

    lm, tok = model
    counting = CountingTokenizer(tok)
    pieces: list[str] = []
    results: list[GenResult | BaseException] = []
    finished = threading.Event()

    def post(calls: list, then: Any) -> None:
        for fn, arg in calls:
            fn(arg)
        if then is not None:
            then()

    def done(res: GenResult | BaseException) -> None:
        results.append(res)
        finished.set()

    sched = DecodeScheduler(lm, counting, "cpu", 32, post, threads=1)
    sched.start()
    try:
        ids = tok("the cat")["input_ids"]
        params = GenParams(temperature=1.0, seed=3)  # sampled: any bytes, not one loop
        sched.submit(GenRequest(ids, params, 400, pieces.append, done))
        assert finished.wait(120)
    finally:
        sched.stop()
    (res,) = results
    assert isinstance(res, GenResult), res
    assert res.completion_tokens == 400
    whole = [d for d in counting.decoded if len(d) > 2 * MAX_PENDING]
    assert len(whole) == 1 and len(whole[0]) == 400  # once, at the end, not at every step
    assert res.text == tok.decode(whole[0], skip_special_tokens=True)
    assert "".join(pieces) == res.text


def test_a_request_that_fails_alone_leaves_its_batch_generating(model) -> None:
    """What fails for one row (its sampling, its seed, an empty prompt) ends that request
    only: the rows beside it, in the same prefill and the same steps, finish as they would
    alone. (The server refuses such parameters first; this is the scheduler's own guard.)"""
    lm, tok = model
    results: dict[str, GenResult | BaseException] = {}
    done: dict[str, threading.Event] = {}

    def post(calls: list, then: Any) -> None:
        for fn, arg in calls:
            fn(arg)
        if then is not None:
            then()

    def request(name: str, ids: list[int], params: GenParams, max_new: int) -> GenRequest:
        done[name] = threading.Event()

        def finished(res: GenResult | BaseException) -> None:
            results[name] = res
            done[name].set()

        return GenRequest(ids, params, max_new, None, finished)

    ids = tok("the cat sat")["input_ids"]
    sched = DecodeScheduler(lm, tok, "cpu", 32, post, threads=1)
    sched.start()
    try:
        sched.submit(request("alone", ids, GenParams(temperature=0), 40))
        assert done["alone"].wait(60)
        reqs = [
            request("greedy", ids, GenParams(temperature=0), 40),
            request("overflow", ids, GenParams(temperature=1e-300, seed=1), 40),
            request("seed", ids, GenParams(temperature=1.0, seed=2**64), 40),
            request("empty", [], GenParams(temperature=0), 40),
        ]
        with sched._cond:  # one turn of the scheduler: one prefill for all of them
            sched._pending.extend(reqs)
            sched._cond.notify()
        for name in ("greedy", "overflow", "seed", "empty"):
            assert done[name].wait(60), name
        stats = sched.stats()
    finally:
        sched.stop()
    greedy, alone = results["greedy"], results["alone"]
    assert isinstance(greedy, GenResult) and isinstance(alone, GenResult)
    assert (greedy.text, greedy.completion_tokens) == (alone.text, alone.completion_tokens)
    for name in ("overflow", "seed", "empty"):
        assert isinstance(results[name], Exception), (name, results[name])
    assert stats["failed"] == 1 and stats["rows"] == 0, stats  # the overflow row's sampling


def recording_scheduler(model: tuple[Any, Any]) -> tuple[DecodeScheduler, Any, dict, dict]:
    """A started scheduler whose deliveries run on its own thread, and a maker of requests that
    record every outcome (`outcomes[name]`: all on_done calls, in order) and first pieces."""
    lm, tok = model
    outcomes: dict[str, list[GenResult | BaseException]] = {}
    events: dict[str, threading.Event] = {}

    def post(calls: list, then: Any) -> None:
        for fn, arg in calls:
            fn(arg)
        if then is not None:
            then()

    def request(name: str, ids: list[int], max_new: int, first: threading.Event | None = None):
        outcomes[name] = []
        events[name] = threading.Event()

        def finished(res: GenResult | BaseException) -> None:
            outcomes[name].append(res)
            events[name].set()

        def piece(_text: str) -> None:
            if first is not None:
                first.set()

        return GenRequest(ids, GenParams(temperature=0), max_new, piece, finished)

    sched = DecodeScheduler(lm, tok, "cpu", 32, post, threads=1)
    sched.start()
    return sched, request, outcomes, events


def test_a_prefill_that_fails_ends_its_own_requests_only(model) -> None:
    """A new request whose prefill fails (out of memory on a long prompt, a token the model
    cannot embed) must not end the streams already generating: their cache was not touched."""
    lm, tok = model
    ids = tok("the cat sat")["input_ids"]
    sched, request, outcomes, events = recording_scheduler(model)
    try:
        sched.submit(request("alone", ids, 30))
        assert events["alone"].wait(60)
        going = threading.Event()
        sched.submit(request("running", ids, 30, first=going))
        assert going.wait(60)
        bad = [lm.config.vocab_size + 5]  # no such token: the embedding lookup fails
        sched.submit(request("bad", bad, 5))
        for name in ("running", "bad"):
            assert events[name].wait(60), name
        stats = sched.stats()
    finally:
        sched.stop()
    [alone], [running], [bad_outcome] = outcomes["alone"], outcomes["running"], outcomes["bad"]
    assert isinstance(running, GenResult), running
    assert (running.text, running.completion_tokens) == (alone.text, alone.completion_tokens)
    assert isinstance(bad_outcome, Exception) and stats["failed"] == 1


def test_a_request_that_ended_is_not_told_of_a_later_failure(model) -> None:
    """`short` ends in its prefill (max_tokens 1); the next step fails for `long`, whose
    positions run past the model's table. `short` keeps its one result; `long` gets the error."""
    lm, tok = model
    sched, request, outcomes, events = recording_scheduler(model)
    limit = lm.config.n_positions
    try:
        sched.submit(request("warm", tok("warm")["input_ids"], 2))
        assert events["warm"].wait(60)
        short = request("short", tok("the cat sat")["input_ids"], 1)
        long = request("long", [11] * limit, 5)  # its first step is past the table
        with sched._cond:  # one prefill for both
            sched._pending.extend([short, long])
            sched._cond.notify()
        assert events["long"].wait(60)
    finally:
        sched.stop()
    assert [type(o) for o in outcomes["short"]] == [GenResult]
    [failure] = outcomes["long"]
    assert isinstance(failure, Exception)


def test_batch_wide_rope_scalings_run_one_request_at_a_time(model) -> None:
    """longrope and dynamic NTK pick their factor from the longest position in the batch, so a
    long neighbour changed a row's text: such a model decodes its requests one at a time."""
    from solar_host.servers.model_facts import batch_changes_rows

    lm, tok = model

    class Cfg:
        def __init__(self, scaling: Any) -> None:
            self.rope_scaling = scaling

    assert batch_changes_rows(Cfg({"rope_type": "longrope", "short_factor": [1.0]}))
    assert batch_changes_rows(Cfg({"type": "dynamic", "factor": 2.0}))
    assert not batch_changes_rows(Cfg({"rope_type": "linear", "factor": 2.0}))
    assert not batch_changes_rows(Cfg(None))
    assert DecodeScheduler(lm, tok, "cpu", 32, lambda c, t: None).max_batch == 32
    before = getattr(lm.config, "rope_parameters", None)
    lm.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    try:
        assert DecodeScheduler(lm, tok, "cpu", 32, lambda c, t: None).max_batch == 1
    finally:
        lm.config.rope_parameters = before


def test_a_longrope_model_prefills_again_where_its_factors_switch(model) -> None:
    """Past original_max_position_embeddings a longrope model rotates with its long factors, and
    every key cached before was rotated with the short ones: generate drops the cache there and
    prefills the whole sequence again. Without that, text crossing the switch differed from
    generate's (8 of 9 prompts of a tiny Phi-3 whose switch is at 16 positions)."""
    _lm, tok = model
    torch.manual_seed(3)
    cfg = transformers.Phi3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        # Large weights: attention decides the tokens, so rotations that differ show.
        initializer_range=0.5,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [50.0] * 8,
            "rope_theta": 10000.0,
        },
        pad_token_id=tok.eos_token_id,
    )
    lm = transformers.Phi3ForCausalLM(cfg).eval()
    lm.generation_config.eos_token_id = None  # every request runs its length, both ways
    sched = DecodeScheduler(lm, tok, "cpu", 32, _run_here, threads=1)
    assert sched.rope_switch == 16
    sched.start()
    try:
        gen = torch.Generator().manual_seed(5)
        # Prompts ending before the switch, on it, and past it (no switch to cross).
        for length in (5, 12, 15, 16, 17, 30):
            ids = torch.randint(3, len(tok), (length,), generator=gen).tolist()
            with torch.no_grad():
                ref = lm.generate(
                    torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0
                )[0, length:]
            res = _alone(sched, ids, 12)
            assert isinstance(res, GenResult), res
            assert (res.text, res.completion_tokens) == (tok.decode(ref), 12), length
        # 5 + 12 ends before the switch; 12, 15 and 16 cross it; 17 and 30 start past it.
        assert sched.stats()["reprefills"] == 3
    finally:
        sched.stop()


def _alone(sched: DecodeScheduler, ids: list[int], max_new: int) -> GenResult | BaseException:
    """Generate `ids` greedily with nothing else in the scheduler."""
    import queue

    got: queue.Queue = queue.Queue()
    sched.submit(GenRequest(ids, GenParams(temperature=0), max_new, None, got.put))
    return got.get(timeout=60)


def _run_here(calls: list, then: Any) -> None:
    for fn, arg in calls:
        fn(arg)
    if then is not None:
        then()

"""OpenAI/HF sampling options of hf_server's decode scheduler: logit_bias, top_k, min_p,
repetition, frequency and presence penalties, per request in a shared batch; and the options
it cannot honour (tool calling, JSON output) refused with a 400 naming them.

Answered without them, each of these used to be a 200 with the text the request would have
had without it (issue 20 review): a client that relied on one could not tell."""

from __future__ import annotations

import asyncio
import json
import math
import queue
import sys
from typing import Any

import httpx
import pytest

from solar_host.servers.hf_protocol import APIError, GenParams, parse_gen_params
from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from solar_host.servers.hf_decode import DecodeScheduler, GenRequest, GenResult  # noqa: E402
from solar_host.servers.sampling import (  # noqa: E402
    GenerateShaping,
    LogitShaping,
    frequency_presence_penalty,
    min_p_filter,
    repetition_penalty,
    top_k_filter,
)

PROMPT = "the cat sat"


# --- parsing ----------------------------------------------------------------------------------

BAD_VALUES = [
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": "3"}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": "x"}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": 1000}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": [1]}, "frequency_penalty"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": None, "frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": "50"}, "logit_bias"),
    ({"logit_bias": {"fox": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 40: 1}}, "logit_bias"),
    ({"logit_bias": {"50": 101}}, "logit_bias"),
    ({"logit_bias": {"50": -100.5}}, "logit_bias"),
    ({"logit_bias": {"50": "1"}}, "logit_bias"),
    ({"logit_bias": {"50": True}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"response_format": "text"}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tools": "f"}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"function_call": {"name": "f"}}, "function_call"),
]


@pytest.mark.parametrize(("body", "param"), BAD_VALUES)
def test_bad_values_are_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(APIError) as err:
        parse_gen_params(body)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_off_values_pass_and_leave_the_common_path() -> None:
    """What clients send by default (OpenAI SDKs send 0 penalties, empty tools and so on)."""
    p = parse_gen_params(
        {
            "top_k": 0,
            "min_p": 0,
            "repetition_penalty": 1,
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "logit_bias": {},
            "response_format": {"type": "text"},
            "tools": [],
            "functions": None,
            "tool_choice": "none",
            "function_call": "auto",
        }
    )
    assert not p.shapes_logits()
    p = parse_gen_params({"logit_bias": {"7": 100, "0": -100.0}, "top_k": 5, "min_p": 0.25})
    assert p.logit_bias == {7: 100.0, 0: -100.0} and (p.top_k, p.min_p) == (5, 0.25)
    assert p.shapes_logits()


# --- the sampler's functions, on tensors --------------------------------------------------------


def test_repetition_penalty_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=gen) * 3
    prompt, generated = [3, 7, 7, 20], [41, 3, 0]
    for penalty in (0.5, 1.3, 2.0):
        ref = transformers.RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([prompt + generated]), logits[None].clone()
        )[0]
        seen = torch.zeros(50, dtype=torch.bool)
        seen[prompt + generated] = True
        assert torch.equal(repetition_penalty(logits, seen, penalty), ref)
        # The same through a row's state: the prompt, then each generated token as it comes.
        shaping = LogitShaping.of(GenParams(repetition_penalty=penalty), prompt, 50, "cpu")
        assert shaping is not None
        for t in generated:
            shaping.saw(t)
        assert torch.equal(shaping.apply(logits), ref)


def test_frequency_and_presence_penalties_count_the_generated_tokens_only() -> None:
    logits = torch.arange(10, dtype=torch.float32)
    params = GenParams(frequency_penalty=0.5, presence_penalty=1.5)
    shaping = LogitShaping.of(params, [1, 2, 2, 9], 10, "cpu")  # the prompt does not count
    assert shaping is not None
    for t in (4, 4, 4, 6):
        shaping.saw(t)
    want = logits.clone()
    want[4] -= 0.5 * 3 + 1.5
    want[6] -= 0.5 * 1 + 1.5
    assert torch.equal(shaping.apply(logits), want)
    counts = torch.tensor([0, 2, 0, 1.0])
    out = frequency_presence_penalty(torch.zeros(4), counts, -1.0, 2.0)  # negative: encourage
    assert out.tolist() == [0.0, 2.0 - 2.0, 0.0, 1.0 - 2.0]


def test_logit_bias_is_added_and_refused_outside_the_vocabulary() -> None:
    params = GenParams(logit_bias={0: 100.0, 9: -100.0, 5: 0.5})
    shaping = LogitShaping.of(params, [1], 10, "cpu")
    assert shaping is not None
    out = shaping.apply(torch.zeros(10))
    assert out[0] == 100 and out[9] == -100 and out[5] == 0.5 and out[1] == 0
    with pytest.raises(APIError) as err:
        LogitShaping.of(GenParams(logit_bias={10: 1.0}), [1], 10, "cpu")
    assert err.value.status == 400 and err.value.param == "logit_bias"
    # Nothing to shape: no state, the common path.
    assert LogitShaping.of(GenParams(top_k=3, min_p=0.5), [1], 10, "cpu") is None


def test_top_k_and_min_p_keep_what_transformers_keeps() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 64, generator=gen)
    for k in (1, 5, 63):
        ref = transformers.TopKLogitsWarper(k)(None, logits.clone())
        assert torch.equal(top_k_filter(logits, k), ref)
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert torch.equal(top_k_filter(logits, 1000), logits)
    probs = torch.softmax(logits, -1)
    for min_p in (0.05, 0.3, 1.0):
        ref = transformers.MinPLogitsWarper(min_p)(None, logits.clone())
        kept = min_p_filter(probs, min_p) > 0
        assert torch.equal(kept, ref > -math.inf), min_p
    assert int((min_p_filter(probs, 1.0) > 0).sum()) == 1  # the top token alone


# --- the scheduler in-process, against transformers' generate -----------------------------------


@pytest.fixture(scope="module")
def model(tiny_hf_models: TinyHFModels) -> tuple[Any, Any]:  # noqa: F811
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_models.causal)
    lm = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_models.causal).eval()
    return lm, tok


def _run_here(calls: list, then: Any) -> None:
    for fn, arg in calls:
        fn(arg)
    if then is not None:
        then()


class _OpenAIPenalties(transformers.LogitsProcessor):
    """A reference for generate: logit_bias, then frequency/presence over the generated ids."""

    def __init__(self, prompt_len: int, frequency: float, presence: float, bias: dict):
        self.prompt_len = prompt_len
        self.frequency, self.presence, self.bias = frequency, presence, bias

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[:, t] += b
        counts = torch.zeros_like(scores)
        for t in input_ids[0, self.prompt_len :].tolist():
            counts[0, t] += 1
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def test_greedy_rows_with_penalties_match_generate(model) -> None:
    """Penalties and bias apply before a greedy row's argmax: what generate gives with HF's
    repetition penalty, or with a reference processor for OpenAI's penalties and bias."""
    lm, tok = model
    ids = tok(PROMPT)["input_ids"]
    sched = DecodeScheduler(lm, tok, "cpu", 32, _run_here, threads=1)
    sched.start()
    try:
        cases: list[tuple[dict, dict]] = [
            ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
            ({"repetition_penalty": 0.8}, {"repetition_penalty": 0.8}),
            (
                {"frequency_penalty": 1.0, "presence_penalty": 0.5, "logit_bias": {"262": 3}},
                {"logits_processor": [_OpenAIPenalties(len(ids), 1.0, 0.5, {262: 3.0})]},
            ),
        ]
        for options, generate_kw in cases:
            with torch.no_grad():
                ref = lm.generate(
                    torch.tensor([ids]),
                    max_new_tokens=30,
                    do_sample=False,
                    pad_token_id=0,
                    **generate_kw,
                )[0, len(ids) :]
            got = _alone(sched, ids, 30, parse_gen_params({"temperature": 0, **options}))
            assert isinstance(got, GenResult), got
            assert got.text == tok.decode(ref), options
    finally:
        sched.stop()


def test_generate_shaping_gives_generate_what_the_scheduler_gives(model) -> None:
    """For models decoded through model.generate (vision models): the same options, the same
    greedy text as the scheduler's rows."""
    lm, tok = model
    ids = tok(PROMPT)["input_ids"]
    sched = DecodeScheduler(lm, tok, "cpu", 32, _run_here, threads=1)
    sched.start()
    try:
        for options in (
            {"frequency_penalty": 2, "logit_bias": {"262": 2.5}},
            {"presence_penalty": -1, "repetition_penalty": 1.5},
        ):
            params = parse_gen_params({"temperature": 0, **options})
            with torch.no_grad():
                ref = lm.generate(
                    torch.tensor([ids]),
                    max_new_tokens=30,
                    do_sample=False,
                    pad_token_id=0,
                    logits_processor=[GenerateShaping(params, ids, sched.vocab, "cpu")],
                )[0, len(ids) :]
            got = _alone(sched, ids, 30, params)
            assert isinstance(got, GenResult), got
            assert got.text == tok.decode(ref), options
        plain = parse_gen_params({"temperature": 0})
        scores = torch.randn(1, 10)
        assert GenerateShaping(plain, ids, 10, "cpu")(torch.tensor([ids]), scores) is scores
    finally:
        sched.stop()


def _alone(
    sched: DecodeScheduler, ids: list[int], max_new: int, params: GenParams
) -> GenResult | BaseException:
    got: queue.Queue = queue.Queue()
    sched.submit(GenRequest(ids, params, max_new, None, got.put))
    return got.get(timeout=60)


# --- the real server, over HTTP -----------------------------------------------------------------


@pytest.fixture(scope="module")
def causal(tiny_hf_models: TinyHFModels, tmp_path_factory):  # noqa: F811
    if sys.platform != "linux":
        pytest.skip("Linux only")
    from tests.test_hf_server import launch, stop, wait_ready

    log = tmp_path_factory.mktemp("hf-sampling") / "causal.log"
    server = launch("huggingface_causal", tiny_hf_models.causal, log, max_length=512)
    try:
        wait_ready([server])
        yield server
    finally:
        stop([server])


def complete(server: Any, **body: Any) -> httpx.Response:
    from tests.test_hf_server import AUTH

    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 12, **body}
    return httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_logit_bias_forces_and_bans_a_token(causal, tiny_hf_models) -> None:  # noqa: F811
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_models.causal)
    base = text_of(complete(causal))
    # A merged token (not a single byte) whose text the greedy answer never shows.
    rare = next(t for t in range(len(tok) - 1, 0, -1) if tok.decode([t]) not in base)
    forced = text_of(complete(causal, logit_bias={str(rare): 100}))
    assert forced == tok.decode([rare]) * 12
    first = tok(base)["input_ids"][0]
    banned = text_of(complete(causal, logit_bias={str(first): -100}))
    assert banned != base and first not in tok(banned)["input_ids"]
    # An id past the model's vocabulary names no token.
    r = complete(causal, logit_bias={str(len(tok) + 1000): 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    # Streamed too: refused before the stream's 200, not an error event inside it.
    r = complete(causal, logit_bias={str(len(tok) + 1000): 5}, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_top_k_1_and_min_p_1_sample_the_greedy_token(causal) -> None:
    base = text_of(complete(causal, max_tokens=24))
    for options in ({"top_k": 1}, {"min_p": 1.0}, {"min_p": 0.999, "seed": 3}):
        assert text_of(complete(causal, max_tokens=24, temperature=1.5, **options)) == base
    # Without them, that temperature does not give the greedy text.
    assert text_of(complete(causal, max_tokens=24, temperature=1.5, seed=3)) != base


def test_penalties_change_greedy_text_and_stop_repeats(causal, tiny_hf_models) -> None:  # noqa: F811
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_models.causal)
    base = text_of(complete(causal, max_tokens=60))
    ids = tok(base)["input_ids"]
    most = max(ids.count(t) for t in ids)
    assert most >= 4  # the tiny model repeats itself greedily
    freq = text_of(complete(causal, max_tokens=60, frequency_penalty=2, presence_penalty=2))
    assert max(tok(freq)["input_ids"].count(t) for t in set(ids)) < most
    assert text_of(complete(causal, max_tokens=60, repetition_penalty=1.5)) != base
    assert text_of(complete(causal, max_tokens=60, presence_penalty=2)) != base


MIXED = [
    {},
    {"frequency_penalty": 2},
    {"presence_penalty": -1.5, "logit_bias": {"262": 4}},
    {"repetition_penalty": 1.4},
    {"temperature": 1.2, "seed": 11, "top_k": 5},
    {"temperature": 1.2, "seed": 11, "min_p": 0.2, "frequency_penalty": 0.7},
    {"temperature": 0.9, "seed": 5, "top_p": 0.8, "repetition_penalty": 1.2, "top_k": 20},
    {"temperature": 1.2, "seed": 11},
]


async def test_a_mixed_batch_gives_each_request_its_solo_text_and_usage(causal) -> None:
    from tests.test_hf_server import AUTH

    # One length for all: the texts differ by their options alone.
    bodies = [{"prompt": PROMPT, "temperature": 0, "max_tokens": 20, **opts} for opts in MIXED]
    async with httpx.AsyncClient(base_url=causal.url, headers=AUTH, timeout=120) as c:
        alone = [(await c.post("/v1/completions", json=b)).json() for b in bodies]
        before = (await c.get("/v1/stats")).json()["decoding"]
        together = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
        streamed = await asyncio.gather(*(_stream_text(c, {**b, "stream": True}) for b in bodies))
        after = (await c.get("/v1/stats")).json()["decoding"]
    for b, ref, r, s in zip(bodies, alone, together, streamed, strict=True):
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["text"] == ref["choices"][0]["text"] == s, b
        assert got["usage"] == ref["usage"], b
    assert after["max_rows"] > 1 and after["admitted"] - before["admitted"] == 2 * len(bodies)
    texts = {ref["choices"][0]["text"] for ref in alone}
    assert len(texts) == len(bodies)  # every option changed the text it was added to


async def _stream_text(c: httpx.AsyncClient, body: dict) -> str:
    out = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.extend(ch["text"] for ch in json.loads(line[6:])["choices"])
    return "".join(out)


def test_every_bad_value_is_a_400_naming_the_field(causal) -> None:
    from tests.test_hf_server import AUTH

    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    for body, param in BAD_VALUES:
        for path, base in (
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
            ("/v1/chat/completions", chat),
        ):
            r = httpx.post(causal.url + path, json={**base, **body}, headers=AUTH, timeout=60)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and param in err["message"], err
    assert (
        complete(causal, tools=[], tool_choice="none", response_format={"type": "text"}).status_code
        == 200
    )

"""The known-answer canary's judgement (instances/canary.py): what is compared, with which
tolerance, and every silent fault named in the evidence. Pure: answers are built as the
backends' real HTTP bodies, parsed and judged."""

from __future__ import annotations

import json
import math
import time

import pytest

from solar_host.backends.base import CanaryAsk
from solar_host.backends.huggingface import HuggingFaceBackend
from solar_host.backends.llamacpp import LlamaCppBackend
from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.instances import canary, causes

GEN = canary.probe_for(CanaryAsk("generation", "/v1/completions"), "m")
EMB = canary.probe_for(CanaryAsk("embedding", "/v1/embeddings"), "m")
CLS = canary.probe_for(CanaryAsk("classification", "/v1/classify"), "m")
assert GEN is not None and EMB is not None and CLS is not None


def completion(text: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": "length"}]}).encode()


def embedding(vec: list[float | None]) -> bytes:
    # NaN as llama.cpp's JSON writer puts it: null.
    return json.dumps({"data": [{"object": "embedding", "embedding": vec, "index": 0}]}).encode()


def scores(pos: float) -> bytes:
    rows = [{"label": "NEG", "score": 1 - pos}, {"label": "POS", "score": pos}]
    best = max(rows, key=lambda r: r["score"])
    return json.dumps({"choices": [{"index": 0, **best, "all_scores": rows}]}).encode()


def known(probe: canary.Probe, body: bytes) -> canary.Fingerprint:
    answer = canary.read_answer(probe, 200, body)
    assert canary.judge(None, answer).ok
    return canary.fingerprint(answer, "id", "now")


def verdict(probe: canary.Probe, fp: canary.Fingerprint, body: bytes, status: int = 200):
    return canary.judge(fp, canary.read_answer(probe, status, body))


VEC = [math.sin(i) for i in range(384)]


def test_probes_are_greedy_fixed_and_per_backend() -> None:
    assert GEN.body["temperature"] == 0 and GEN.body["seed"] == canary.SEED
    assert GEN.body["max_tokens"] == canary.MAX_TOKENS
    llama = LlamaCppBackend()
    ask = llama.canary_probe(LlamaCppConfig(backend_type="llamacpp", alias="a", model="/m.gguf"))
    assert ask is not None and ask.extra == {"cache_prompt": False}
    probe = canary.probe_for(ask, "a")
    assert probe is not None and probe.body["cache_prompt"] is False
    emb = LlamaCppConfig(
        backend_type="llamacpp", alias="a", model="/m.gguf", model_type="embedding"
    )
    assert llama.canary_probe(emb) == CanaryAsk("embedding", "/v1/embeddings")
    rr = LlamaCppConfig(backend_type="llamacpp", alias="a", model="/m.gguf", model_type="reranker")
    assert llama.canary_probe(rr) is None
    hf = HuggingFaceBackend()
    kinds = {
        t: hf.canary_probe(hf.config_model(t)(backend_type=t, alias="a", model_id="/m"))
        for t in ("huggingface_causal", "huggingface_embedding", "huggingface_classification")
    }
    assert {t: a.kind if a else None for t, a in kinds.items()} == {
        "huggingface_causal": "generation",
        "huggingface_embedding": "embedding",
        "huggingface_classification": "classification",
    }
    assert GEN.digest() != EMB.digest()


def test_same_greedy_prefix_passes_later_tokens_may_differ() -> None:
    fp = known(GEN, completion(" mat and the dog ran off"))
    assert verdict(GEN, fp, completion(" mat and the dog ran off")).ok
    # Past STABLE_CHARS: a near-tie that flipped late is no fault.
    assert verdict(GEN, fp, completion(" mat and the cat sat")).ok


@pytest.mark.parametrize(
    ("got", "named"),
    [
        ("", "an empty completion"),
        ("   ", "an empty completion"),
        (" the the the the the", "one token repeated"),
        ("!!!!!!!!", "one token repeated"),
        ("x7#qz@@w0p", "a different completion"),
    ],
)
def test_text_faults_are_named_with_both_answers(got: str, named: str) -> None:
    fp = known(GEN, completion(" mat and the dog ran off"))
    v = verdict(GEN, fp, completion(got))
    assert not v.ok and v.evidence.startswith(named)
    assert repr(" mat and the dog ran off") in v.evidence and "received" in v.evidence


def test_a_model_that_always_repeats_is_not_flagged_for_it() -> None:
    fp = known(GEN, completion(" the the the the"))
    assert verdict(GEN, fp, completion(" the the the the")).ok


def test_vectors_by_cosine() -> None:
    fp = known(EMB, embedding(VEC))
    assert fp.vector is not None and len(fp.vector) == canary.VECTOR_KEPT
    noisy = [x * 1.01 + 1e-4 for x in VEC]  # batching noise, another scale: same direction
    assert verdict(EMB, fp, embedding(noisy)).ok
    other = [math.cos(3 * i) for i in range(384)]
    v = verdict(EMB, fp, embedding(other))
    assert not v.ok and "cosine similarity" in v.evidence
    short = verdict(EMB, fp, embedding(VEC[:128]))
    assert not short.ok and "128 dimensions" in short.evidence


@pytest.mark.parametrize(
    ("vec", "named"),
    [
        ([None] * 384, "NaN or infinite"),  # llama.cpp writes NaN as null
        ([0.0] * 384, "all-zero"),
        ([], "empty embedding"),
    ],
)
def test_unsound_vectors_fail_even_the_first_probe(vec: list[float | None], named: str) -> None:
    answer = canary.read_answer(EMB, 200, embedding(vec))
    v = canary.judge(None, answer)
    assert not v.ok and named in v.evidence


def test_scores_within_tolerance() -> None:
    fp = known(CLS, scores(0.7))
    assert fp.scores == {"NEG": pytest.approx(0.3), "POS": 0.7}
    assert verdict(CLS, fp, scores(0.71)).ok
    v = verdict(CLS, fp, scores(0.2))
    assert not v.ok and "POS: received 0.2000, expected 0.7000" in v.evidence
    nan = canary.read_answer(CLS, 200, scores(0.5).replace(b"0.5", b"NaN"))
    assert not canary.judge(fp, nan).ok


def test_no_answer_is_a_fault() -> None:
    fp = known(GEN, completion(" mat"))
    v = verdict(GEN, fp, b'{"error":"boom"}', status=500)
    assert not v.ok and v.evidence.startswith("HTTP 500 to /v1/completions")
    v = verdict(GEN, fp, b"<html>not json</html>")
    assert not v.ok and "not a generation response" in v.evidence


def test_identity_changes_with_config_model_build_and_probe() -> None:
    base = canary.identity("sha256:a", [("/m", 1, 2)], "b1", GEN)
    assert base == canary.identity("sha256:a", [("/m", 1, 2)], "b1", GEN)
    assert base != canary.identity("sha256:b", [("/m", 1, 2)], "b1", GEN)
    assert base != canary.identity("sha256:a", [("/m", 1, 3)], "b1", GEN)
    assert base != canary.identity("sha256:a", [("/m", 1, 2)], "b2", GEN)
    assert base != canary.identity("sha256:a", [("/m", 1, 2)], "b1", EMB)


def test_the_host_ending_it_for_a_wrong_answer_is_canary_mismatch() -> None:
    why = (
        "The backend's answer to the known-answer probe (generation, /v1/completions) is wrong: "
        "an empty completion: received '', expected ' mat'; the host ended it"
    )
    got = causes.classify(reason=why, exit_code=-9, host_killed=True)
    assert got.kind == causes.CANARY_MISMATCH
    assert got.lead(why).startswith("canary_mismatch: The backend's answer")


def test_a_users_generation_that_finishes_beside_a_probe_is_kept() -> None:
    """The probe's generation is told from a user's by its prompt's length (the answer's usage):
    a user's request that came while a probe ran, and finished first, was taken for the
    probe's and dropped, and the probe's was then kept as the user's last generation."""
    from solar_host.backends.base import GenerationMetrics
    from solar_host.events import EventBus
    from solar_host.instances.telemetry import Telemetry

    body = json.loads(completion("hi"))
    with_usage = json.dumps({**body, "usage": {"prompt_tokens": 36}}).encode()
    answer = canary.read_answer(GEN, 200, with_usage)
    assert answer.prompt_tokens == 36

    t = Telemetry("i1", EventBus())

    def kept() -> list[int]:
        return [g["prompt_tokens"] for g in t.generations]

    t.own_request(time.monotonic() + 30)  # a first probe: its length is not known yet
    t.own_request_answered(2.0, answer.prompt_tokens)
    t._add_generation(GenerationMetrics(prompt_tokens=36))
    assert kept() == []

    t.own_request(time.monotonic() + 30)  # the next probe, and a user's request beside it
    t._add_generation(GenerationMetrics(prompt_tokens=48))  # the user's finished first
    t.own_request_answered(2.0, 36)
    t._add_generation(GenerationMetrics(prompt_tokens=36))  # then the probe's
    assert kept() == [48]

    t.own_request(time.monotonic() + 30)  # one token either way is still the probe
    t._add_generation(GenerationMetrics(prompt_tokens=37))
    t._add_generation(GenerationMetrics(prompt_tokens=36))  # the window closed: a user's
    assert kept() == [48, 36]

    t.own_request(time.monotonic() - 1)  # a window that passed: the probe's lines never came
    t._add_generation(GenerationMetrics(prompt_tokens=36))
    assert kept() == [48, 36, 36] and t.own_until == 0.0

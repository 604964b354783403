"""Known-answer canaries: a fixed probe through a backend's real API, its first answer kept as
the instance's fingerprint, and later answers judged against it.

A backend that answers /health 200 while its output is garbage (a GPU fault, a corrupted
weight, null embeddings) is caught here, not by liveness. Only what is stable is compared, so
legitimate nondeterminism (batching kernels on a GPU) trips nothing:

- text generation: the greedy continuation (temperature 0, fixed seed) of a fixed prompt, at
  batch size one (the probe runs only while the backend is idle); its first STABLE_CHARS
  characters must match exactly (later tokens may flip on a near-tie);
- embeddings: the vector of a fixed text, by cosine similarity (>= MIN_COSINE) over its first
  VECTOR_KEPT dimensions, and never NaN, infinite or all zero;
- classification: the scores of a fixed text, each label within SCORE_TOLERANCE, never NaN.

Pure: the caller (canary_watch.py) sends the request and passes what came back.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from solar_host.backends.base import CanaryAsk
from solar_host.platform.tracked import Tracked

GENERATION = "generation"
EMBEDDING = "embedding"
CLASSIFICATION = "classification"

PROMPT = "The quick brown fox jumps over the lazy dog. The cat sat on the"
TEXT = "the quick brown fox jumps over the lazy dog"
MAX_TOKENS = 8
SEED = 1234
STABLE_CHARS = 12
MIN_COSINE = 0.99
SCORE_TOLERANCE = 0.02
VECTOR_KEPT = 256  # the dimensions a fingerprint keeps (config.json stays small)
ZERO_NORM = 1e-12
SHOWN_CHARS = 60  # of a text, in the evidence


@dataclass(frozen=True)
class Probe:
    kind: str
    path: str
    body: Mapping[str, Any]

    def payload(self) -> bytes:
        return json.dumps(self.body, separators=(",", ":")).encode()

    def digest(self) -> str:
        """What the probe asks: a fingerprint taken with another probe is no reference."""
        text = json.dumps([self.kind, self.path, self.body], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def probe_for(ask: CanaryAsk, model: str) -> Probe | None:
    """The full probe a backend's CanaryAsk names; None for a kind this host has no probe of."""
    if ask.kind == GENERATION:
        body: dict[str, Any] = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "seed": SEED,
            "stream": False,
        }
    elif ask.kind == EMBEDDING:
        body = {"model": model, "input": TEXT, "encoding_format": "float"}
    elif ask.kind == CLASSIFICATION:
        body = {"model": model, "input": TEXT, "return_all_scores": True}
    else:
        return None
    return Probe(ask.kind, ask.path, {**body, **ask.extra})


class Fingerprint(Tracked):
    """An instance's known answer, kept in config.json with the instance (never changed in
    place: a new one replaces it). `identity`: what it was taken for (identity())."""

    kind: str
    identity: str
    text: str | None = None
    vector: list[float] | None = None
    scores: dict[str, float] | None = None
    taken_at: str = ""


@dataclass(frozen=True)
class Answer:
    """What a probe got back: the text, vector or scores, or `fault` (no usable answer)."""

    kind: str
    text: str | None = None
    vector: tuple[float, ...] | None = None
    scores: Mapping[str, float] | None = None
    fault: str | None = None
    # A generation's prompt in tokens, as its answer's usage says: how the host tells the
    # probe's generation record from a user's that finished beside it (Telemetry.own_request).
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class Verdict:
    ok: bool
    evidence: str = ""  # what was expected and what came instead


def identity(
    config_digest: str,
    model_files: Sequence[tuple[str, int, int]],
    version: str | None,
    probe: Probe,
) -> str:
    """What a fingerprint holds for: the config (secrets left out), each model file's path, size
    and mtime, the backend's build and the probe. A restart with all four the same compares
    with the fingerprint; any change takes it afresh."""
    text = json.dumps([config_digest, [list(f) for f in model_files], version, probe.digest()])
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _number(v: Any) -> float:
    """A JSON number; null (llama.cpp writes NaN so) or anything else is NaN."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return math.nan
    return float(v)


def read_answer(probe: Probe, status: int, body: bytes) -> Answer:
    """The answer in an HTTP response to `probe` (`status`: its status code)."""
    kind = probe.kind
    if status != 200:
        text = body[:200].decode("utf-8", "replace").strip()
        return Answer(kind, fault=f"HTTP {status} to {probe.path}: {text}")
    try:
        doc = json.loads(body)
        if kind == GENERATION:
            choice = doc["choices"][0]
            text = choice.get("text")
            if text is None:  # a chat-shaped answer
                text = choice["message"]["content"]
            prompt = (doc.get("usage") or {}).get("prompt_tokens")
            prompt = prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else None
            return Answer(kind, text=str(text or ""), prompt_tokens=prompt)
        if kind == EMBEDDING:
            return Answer(kind, vector=tuple(_number(x) for x in doc["data"][0]["embedding"]))
        choice = doc["choices"][0]
        rows = choice.get("all_scores") or [{"label": choice["label"], "score": choice["score"]}]
        return Answer(kind, scores={str(r["label"]): _number(r["score"]) for r in rows})
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        shown = body[:120].decode("utf-8", "replace")
        return Answer(kind, fault=f"an answer that is not a {kind} response: {shown!r}")


def fingerprint(answer: Answer, ident: str, taken_at: str) -> Fingerprint:
    """The known answer to keep from a first answer that passed judge(None, ...)."""
    vector = None
    if answer.vector is not None:
        vector = [float(f"{x:.6g}") for x in answer.vector[:VECTOR_KEPT]]
    return Fingerprint(
        kind=answer.kind,
        identity=ident,
        text=answer.text,
        vector=vector,
        scores=dict(answer.scores) if answer.scores is not None else None,
        taken_at=taken_at,
    )


def judge(expected: Fingerprint | None, got: Answer) -> Verdict:
    """Whether `got` is a sound answer and, with a fingerprint, the same answer. Without one
    (the first probe) only soundness counts: no answer, NaN or zero vectors, NaN scores."""
    if got.fault is not None:
        return Verdict(False, got.fault)
    insane = _unsound(got)
    if insane:
        return Verdict(False, insane)
    if expected is None:
        return Verdict(True)
    if expected.kind != got.kind:
        return Verdict(False, f"a {got.kind} answer where a {expected.kind} one was expected")
    if got.kind == GENERATION:
        return _same_text(expected.text or "", got.text or "")
    if got.kind == EMBEDDING:
        return _same_vector(expected.vector or [], got.vector or ())
    return _same_scores(expected.scores or {}, got.scores or {})


def _unsound(got: Answer) -> str | None:
    if got.vector is not None:
        v = got.vector
        if not v:
            return "an empty embedding"
        bad = sum(1 for x in v if not math.isfinite(x))
        if bad:
            return f"an embedding with {bad} of {len(v)} values NaN or infinite"
        if math.sqrt(sum(x * x for x in v)) < ZERO_NORM:
            return f"an all-zero embedding ({len(v)} dimensions)"
    if got.scores is not None:
        if not got.scores:
            return "no classification scores"
        bad_labels = [k for k, s in got.scores.items() if not math.isfinite(s)]
        if bad_labels:
            return f"NaN scores for {', '.join(bad_labels[:5])}"
    return None


def repeats_one_token(text: str) -> bool:
    """One token over and over: "the the the the", "!!!!!!!!"."""
    words = text.split()
    if len(words) >= 3 and len(set(words)) == 1:
        return True
    stripped = text.strip()
    return len(stripped) >= 4 and len(set(stripped)) == 1


def _shown(text: str) -> str:
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...")


def _same_text(expected: str, got: str) -> Verdict:
    n = min(len(expected), STABLE_CHARS)
    if got[:n] == expected[:n]:
        return Verdict(True)
    if not got.strip():
        what = "an empty completion"
    elif repeats_one_token(got) and not repeats_one_token(expected):
        what = "one token repeated"
    else:
        what = "a different completion"
    return Verdict(
        False,
        f"{what}: received {_shown(got)}, expected {_shown(expected)} "
        f"(the first {n} characters must match)",
    )


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    n = min(len(a), len(b))
    dot = sum(a[i] * b[i] for i in range(n))
    na = math.sqrt(sum(a[i] * a[i] for i in range(n)))
    nb = math.sqrt(sum(b[i] * b[i] for i in range(n)))
    if na < ZERO_NORM or nb < ZERO_NORM:
        return 0.0
    return dot / (na * nb)


def _same_vector(expected: Sequence[float], got: Sequence[float]) -> Verdict:
    kept = min(len(got), VECTOR_KEPT)
    if len(expected) != kept:
        return Verdict(
            False,
            f"an embedding of {len(got)} dimensions, expected one whose first "
            f"{len(expected)} were kept",
        )
    sim = cosine(expected, got[:kept])
    if sim >= MIN_COSINE:
        return Verdict(True)
    return Verdict(
        False,
        f"a different embedding: cosine similarity {sim:.4f} to the known one (at least "
        f"{MIN_COSINE} wanted); received {_vec(got)}, expected {_vec(expected)}",
    )


def _vec(v: Sequence[float]) -> str:
    head = ", ".join(f"{x:.4g}" for x in v[:4])
    return f"[{head}, ...]" if len(v) > 4 else f"[{head}]"


def _same_scores(expected: Mapping[str, float], got: Mapping[str, float]) -> Verdict:
    if set(expected) != set(got):
        return Verdict(
            False, f"labels {sorted(got)[:8]} where {sorted(expected)[:8]} were expected"
        )
    off = {
        k: (got[k], expected[k]) for k in expected if abs(got[k] - expected[k]) > SCORE_TOLERANCE
    }
    if not off:
        return Verdict(True)
    shown = "; ".join(
        f"{k}: received {g:.4f}, expected {e:.4f}" for k, (g, e) in list(off.items())[:4]
    )
    return Verdict(False, f"different scores (tolerance {SCORE_TOLERANCE}): {shown}")

"""Sampling options of a generation, applied to one row's logits: logit_bias and the
penalties (LogitShaping, which keeps the per-token state they need; GenerateShaping for a model
that decodes through `model.generate`), then temperature, top_k, top_p and min_p (`sample`)."""

from __future__ import annotations

import math

import torch

from solar_host.servers.hf_protocol import APIError, GenParams


class LogitShaping:
    """A row's logit_bias, repetition penalty and frequency/presence penalties, with the
    per-token state they need, kept as tensors of the vocabulary's width on the row's device.

    Built only for a row that asks for one of them (`of`), so rows without pay nothing; each
    step then costs the row a few vector operations and one element write per token, whatever
    the length of its text (counts are kept, not recounted)."""

    def __init__(self, params: GenParams, prompt: list[int], vocab: int, device: str):
        self.params = params
        self.bias: torch.Tensor | None = None
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
            self.bias = torch.zeros(vocab).index_put_((ids,), values).to(device)
        # Repetition penalty (HF): every token of the prompt and of the text so far.
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.seen[[t for t in prompt if 0 <= t < vocab]] = True
            self.seen = self.seen.to(device)
        # Frequency and presence penalties (OpenAI): the generated tokens only.
        self.counts: torch.Tensor | None = None
        if params.frequency_penalty or params.presence_penalty:
            self.counts = torch.zeros(vocab, device=device)

    @classmethod
    def of(
        cls, params: GenParams, prompt: list[int], vocab: int | None, device: str
    ) -> LogitShaping | None:
        """The row's shaping, or None when it asks for none. Refuses (400) a logit_bias id
        past the model's vocabulary: it names no token, and indexing with it would fail."""
        if not params.shapes_logits():
            return None
        if vocab is None:  # no output layer and no vocab_size: nothing to size them by
            raise APIError(
                400,
                "logit_bias and the penalties are not available for this model (its "
                "vocabulary size is unknown)",
                code="unsupported_option",
                param="logit_bias" if params.logit_bias else "repetition_penalty",
            )
        check_logit_bias(params, vocab)
        return cls(params, prompt, vocab, device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (one row's, [vocab]) with the bias added, then the penalties: the order
        vLLM applies them in (a logits processor, then the sampler's penalties)."""
        p = self.params
        out = logits.float()
        if self.bias is not None:
            out = out + self.bias
        if self.seen is not None:
            out = repetition_penalty(out, self.seen, p.repetition_penalty)
        if self.counts is not None:
            out = frequency_presence_penalty(
                out, self.counts, p.frequency_penalty, p.presence_penalty
            )
        return out

    def saw(self, token: int) -> None:
        """Take in the token the row generated."""
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1


def check_logit_bias(params: GenParams, vocab: int | None) -> None:
    """Refuse (400) a logit_bias id past the model's vocabulary: it names no token, and
    indexing with it would fail. Also called before a stream's answer starts (hf_generation), so
    a stream gets the 400 too, not a 200 carrying an error."""
    outside = [t for t in params.logit_bias if vocab is not None and t >= vocab]
    if outside:
        raise APIError(
            400,
            f"'logit_bias' names token {outside[0]}, outside this model's vocabulary "
            f"of {vocab} tokens",
            code="invalid_value",
            param="logit_bias",
        )


class GenerateShaping:
    """A request's logit_bias and penalties as a transformers logits processor, for a model
    that decodes one sequence through `model.generate` instead of this scheduler (a vision
    model): the same options, applied the same way. (top_k and min_p are generate's own
    arguments.) Pass it in `logits_processor`; it is a no-op for a request without them."""

    def __init__(self, params: GenParams, prompt: list[int], vocab: int | None, device: str):
        self.shaping = LogitShaping.of(params, prompt, vocab, device)
        self.prompt_len = len(prompt)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.shaping is None:
            return scores
        # Called once a token, before it is chosen: the previous call's choice is the last id.
        if input_ids.shape[1] > self.prompt_len:
            self.shaping.saw(int(input_ids[0, -1]))
        return self.shaping.apply(scores[0])[None].to(scores.dtype)


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor: the logit of each seen token divided by
    `penalty` where positive, multiplied where negative (so > 1 always makes it less likely)."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def frequency_presence_penalty(
    logits: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI's penalties: each token's logit less `frequency` times the times it was
    generated, and less `presence` once if it was generated at all."""
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Only the `k` highest logits (and any tied with the k-th) stay; 0 keeps them all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Only the tokens at least `min_p` times as likely as the most likely one stay (which
    always does: 1.0 keeps it alone, and any tied with it)."""
    if min_p <= 0:
        return probs
    top = probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < top * min_p, 0.0)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of the most likely tokens whose mass reaches `top_p`; always the top
    token (top_p 0 keeps that one alone)."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p
    drop[..., 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def sample(logits: torch.Tensor, params: GenParams, gen: torch.Generator | None) -> int:
    """One token drawn from `logits` at the row's temperature, filtered in HF's order:
    top_k, top_p, then min_p."""
    scaled = top_k_filter(logits.float() / params.temperature, params.top_k)
    probs = torch.softmax(scaled, dim=-1)
    probs = top_p_filter(probs, params.top_p)
    probs = min_p_filter(probs, params.min_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())

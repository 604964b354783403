"""Detokenizer: a generation's text grown a token at a time, the same text as decoding all of
its ids at once, at a cost per token that does not grow with the length."""

from __future__ import annotations

import random
import string
from typing import Any

import pytest

from solar_host.servers.detokenizer import MAX_PENDING, MAX_SILENT, Detokenizer
from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "hello world, how are you?",
    "  leading and trailing spaces  ",
    "naïve café 東京 🙂 — tabs\tand\nnewlines",
    "the theory: 3 + 4 = 7. Don't stop!",
    "🙂🙂🙂 東京東京 éééé",
]


def sentencepiece_like() -> Any:
    """A Llama-style tokenizer: words start with '▁', and characters outside the vocabulary are
    spelled as byte tokens (<0xC3><0xAF> for 'ï'), so one character can take several ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "w"), ("o", "r")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tokenizers_of(models: TinyHFModels) -> dict[str, Any]:
    auto = transformers.AutoTokenizer.from_pretrained
    return {
        "byte-level BPE": auto(models.causal),
        "wordpiece": auto(models.classifier),
        "sentencepiece-like": sentencepiece_like(),
    }


class Counting:
    """A tokenizer's decode, counting the ids each call decodes."""

    def __init__(self, tok: Any):
        self.tok = tok
        self.sizes: list[int] = []

    def __call__(self, ids: list[int]) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=True)


def grow(tok: Any, ids: list[int]) -> tuple[Detokenizer, list[str], Counting]:
    decode = Counting(tok)
    d = Detokenizer(decode, frozenset(tok.all_special_ids))  # as the decode scheduler does
    return d, [d.add(t) for t in ids], decode


def test_the_text_is_the_tokenizers_own_decoding(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    for name, tok in tokenizers_of(tiny_hf_models).items():
        for text in TEXTS:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            exact = tok.decode(ids, skip_special_tokens=True)
            d, seen, _ = grow(tok, ids)
            for before, after in zip(["", *seen], seen, strict=False):
                assert after.startswith(before), (name, text, before, after)  # only grows
            for s in seen:
                assert exact.startswith(s), (name, text, s)  # never shows what is not there
                assert "\ufffd" not in s, (name, text, s)  # no half characters on the way
            assert d.finish() == exact, (name, text)
            # A token's text shows as soon as the token completes it (not a token later).
            assert seen[-1] == exact or exact.endswith("\ufffd"), (name, text, seen[-1])


def test_special_tokens_in_the_middle_are_skipped(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    for name, tok in tokenizers_of(tiny_hf_models).items():
        a = tok("hello world", add_special_tokens=False)["input_ids"]
        b = tok(" café again", add_special_tokens=False)["input_ids"]
        specials = [i for i in tok.all_special_ids if i is not None][:2]
        ids = a + specials + b + specials
        d, _, _ = grow(tok, ids)
        assert d.finish() == tok.decode(ids, skip_special_tokens=True), name


def test_random_text_gives_the_same_text(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    rng = random.Random(20261203)
    alphabet = string.ascii_letters + string.punctuation + "  \n\téïœ東京語🙂✓"
    for name, tok in tokenizers_of(tiny_hf_models).items():
        for _ in range(100):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
            ids = tok(text, add_special_tokens=False)["input_ids"]
            d, _, _ = grow(tok, ids)
            assert d.finish() == tok.decode(ids, skip_special_tokens=True), (name, text)


def test_random_ids_never_take_back_streamed_text(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    """A model can emit any ids, stray bytes and all: the streamed text is always the start of
    the final one. It is the exact decoding too, except where a byte-fallback tokenizer turns a
    run of byte tokens holding an invalid sequence into U+FFFD from the run's first byte: the
    stream has shown the valid bytes before the invalid one already, and keeps them."""
    rng = random.Random(20261203)
    for name, tok in tokenizers_of(tiny_hf_models).items():
        exact_runs = 0
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
            d, seen, _ = grow(tok, ids)
            final = d.finish()
            assert final.startswith(seen[-1]), (name, ids)
            exact_runs += final == tok.decode(ids, skip_special_tokens=True)
        if name != "sentencepiece-like":
            assert exact_runs == 200, (name, exact_runs)


def test_the_cost_of_a_token_does_not_grow_with_the_text(
    tiny_hf_models: TinyHFModels,  # noqa: F811
) -> None:
    for name, tok in tokenizers_of(tiny_hf_models).items():
        ids = tok(" ".join(TEXTS) * 40, add_special_tokens=False)["input_ids"]
        assert len(ids) > 1000
        d, _, decode = grow(tok, ids)
        # Two short windows per token, however long the text: not the whole text each time.
        assert len(decode.sizes) <= 2 * len(ids), name
        assert max(decode.sizes) <= 2 * MAX_PENDING, (name, max(decode.sizes))
        assert d.finish() == tok.decode(ids, skip_special_tokens=True), name


def test_bytes_that_never_make_a_character_are_settled_after_a_bound(
    tiny_hf_models: TinyHFModels,  # noqa: F811
) -> None:
    tok = sentencepiece_like()
    cont = tok.convert_tokens_to_ids("<0x80>")  # a UTF-8 continuation byte with no lead byte
    ids = [cont] * 50 + tok("ok", add_special_tokens=False)["input_ids"]
    d, seen, decode = grow(tok, ids)
    assert max(decode.sizes) <= 2 * MAX_PENDING
    assert seen[20].count("\ufffd") >= 10  # shown as U+FFFD, as decoding them all at once does
    assert d.finish() == tok.decode(ids, skip_special_tokens=True)
    assert d.finish().endswith("ok")


def test_an_unfinished_character_at_the_end_is_in_the_final_text(
    tiny_hf_models: TinyHFModels,  # noqa: F811
) -> None:
    tok = sentencepiece_like()
    ids = tok("ab 東", add_special_tokens=False)["input_ids"][:-1]  # its last byte cut off
    d, seen, _ = grow(tok, ids)
    assert "\ufffd" not in seen[-1]
    assert d.finish() == tok.decode(ids, skip_special_tokens=True)
    assert d.finish().endswith("\ufffd")


def test_generates_watch_streams_every_id_once(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    """model.generate's stopping criterion (the one-at-a-time path, vision models) sees the
    whole sequence at each call, and not always after every token: it takes in each new id
    once, and the final call catches up with what generate produced after the last check."""
    import threading

    import torch

    from solar_host.servers.hf_protocol import StopScanner
    from solar_host.servers.hf_runtime import _Watch

    tok = sentencepiece_like()
    prompt = tok("a prompt", add_special_tokens=False)["input_ids"]
    new = tok(" naïve café 東京 🙂 the end", add_special_tokens=False)["input_ids"]
    pieces: list[str] = []
    watch = _Watch(tok, len(prompt), StopScanner([]), pieces.append, threading.Event())
    for upto in (1, 2, 5, 6, len(new) - 2):  # two ids at a time, three, none
        seq = torch.tensor([prompt + new[:upto]])
        assert not bool(watch(seq, None)[0])
    watch.see(torch.tensor([prompt + new]))
    assert watch.text.ids == new
    exact = tok.decode(new, skip_special_tokens=True)
    assert "".join(pieces) == exact
    assert watch.text.finish() == exact


def test_ids_that_decode_to_nothing_do_not_widen_the_window(
    tiny_hf_models: TinyHFModels,  # noqa: F811
) -> None:
    """A model can emit a skipped special token again and again (a pad or end token it was
    never stopped on), or ids that decode to nothing without being special: the window stays
    short either way, and the text is the exact decoding."""
    for name, tok in tokenizers_of(tiny_hf_models).items():
        special = tok.all_special_ids[0]
        ids = tok("hello", add_special_tokens=False)["input_ids"] + [special] * 300
        ids += tok(" world again", add_special_tokens=False)["input_ids"]
        d, _, decode = grow(tok, ids)
        assert max(decode.sizes) <= 2 * MAX_PENDING, (name, max(decode.sizes))
        assert d.finish() == tok.decode(ids, skip_special_tokens=True), name
        # Not told which ids are skipped: they wait in the window, MAX_SILENT at most, and
        # make the next window at most as long again.
        plain = Counting(tok)
        d = Detokenizer(plain)
        for t in ids:
            d.add(t)
        assert max(plain.sizes) <= 2 * MAX_SILENT + MAX_PENDING, (name, max(plain.sizes))
        assert d.finish().startswith("hello"), name


def test_finishing_twice_gives_the_same_text(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    tok = sentencepiece_like()
    bad = tok.convert_tokens_to_ids(["<0x13>", "<0x56>", "<0x9B>"])  # 'V' then a stray byte
    for ids in (tok("ab 東", add_special_tokens=False)["input_ids"][:-1], bad):
        d, _, _ = grow(tok, ids)
        first = d.finish()
        assert d.finish() == first

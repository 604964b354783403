"""PromptEncoder: the same token ids as the tokenizer's own call, computed without letting go of
the GIL (hf_server tokenizes prompts on its event loop, beside the decode thread)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest

from solar_host.servers.prompt_encoder import PromptEncoder
from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "hello world, how are you?",
    "  leading and trailing spaces  ",
    "naïve café 東京 🙂 — tabs\tand\nnewlines",
    "<|user|>a chat turn<|assistant|>",
    "x" * 3000,
]


def tokenizers_of(models: TinyHFModels) -> dict[str, Any]:
    return {
        name: transformers.AutoTokenizer.from_pretrained(path)
        for name, path in (
            ("causal", models.causal),
            ("classifier", models.classifier),
            ("encoder", models.encoder),
        )
    }


def test_ids_are_the_tokenizers_own(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    for name, tok in tokenizers_of(tiny_hf_models).items():
        enc = PromptEncoder(tok)
        assert enc.direct, f"{name}: a fast tokenizer should be encoded directly"
        specials = " ".join(t for t in tok.all_special_tokens if t)
        for text in [*TEXTS, f"before {specials} after"]:
            for add in (True, False):
                want = tok(text, add_special_tokens=add)["input_ids"]
                assert enc(text, add) == want, (name, text[:40], add)


def test_a_backend_set_to_truncate_or_pad_is_reset_first(
    tiny_hf_models: TinyHFModels,  # noqa: F811
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_models.causal)
    tok.backend_tokenizer.enable_truncation(4)
    tok.backend_tokenizer.enable_padding(length=64)
    enc = PromptEncoder(tok)
    text = "the quick brown fox jumps over the lazy dog"
    assert enc(text, False) == tok(text, add_special_tokens=False)["input_ids"]
    assert len(enc(text, False)) > 4
    # Someone else truncates with the same tokenizer: the backend keeps that setting, and the
    # encoder then goes through the tokenizer's own call instead of truncating too.
    assert len(tok(text, truncation=True, max_length=3)["input_ids"]) == 3
    assert tok.backend_tokenizer.truncation is not None
    assert enc(text, False) == tok(text, add_special_tokens=False)["input_ids"]
    assert len(enc(text, False)) > 4


def test_a_tokenizer_without_a_rust_backend_keeps_its_own_call() -> None:
    calls: list[tuple[str, bool]] = []

    class Slow:
        all_special_tokens = ["</s>"]

        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            calls.append((text, add_special_tokens))
            return {"input_ids": [len(text), int(add_special_tokens)]}

    enc = PromptEncoder(Slow())
    assert not enc.direct
    assert enc("abc", False) == [3, 0]
    assert calls == [("abc", False)]


def test_a_backend_that_disagrees_is_not_used(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_models.causal)

    class Skewed:
        """The tokenizer, but its own call gives other ids than its backend would."""

        backend_tokenizer = tok.backend_tokenizer
        all_special_tokens = tok.all_special_tokens

        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            return {
                "input_ids": [7, *tok(text, add_special_tokens=add_special_tokens)["input_ids"]]
            }

    enc = PromptEncoder(Skewed())
    assert not enc.direct
    assert enc("hello", False)[0] == 7


def gil_released_during(call: Any) -> bool:
    """Whether `call()` lets another thread run. The switch interval is set far longer than the
    call takes, so the only way the spinning thread runs meanwhile is a voluntary release."""
    count = 0
    stop = False

    def spin() -> None:
        nonlocal count
        while not stop:
            count += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    spinner = threading.Thread(target=spin, daemon=True)
    try:
        spinner.start()  # returns holding the GIL, the spinner waiting to take it back
        before = count
        call()
        return count != before
    finally:
        stop = True
        sys.setswitchinterval(old)
        spinner.join(10)


def test_encoding_keeps_the_gil(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_models.causal)
    enc = PromptEncoder(tok)
    text = "the cat sat on the mat and the quick brown fox jumps over it " * 400
    # The probe sees a release: a sleep of a few milliseconds lets the spinner run.
    assert gil_released_during(lambda: time.sleep(0.005))
    assert not gil_released_during(lambda: enc(text, False))


def test_a_backend_that_fails_to_set_up_is_not_used(tiny_hf_models: TinyHFModels) -> None:  # noqa: F811
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_models.causal)

    class OldBackend:
        """A backend without encode_special_tokens (older tokenizers releases)."""

        truncation = None
        padding = None

        def __setattr__(self, name: str, value: Any) -> None:
            raise AttributeError(name)

        def encode(self, text: str, add_special_tokens: bool = True) -> Any:
            raise AssertionError("not to be called")

    class Tok:
        backend_tokenizer = OldBackend()
        all_special_tokens = tok.all_special_tokens

        def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
            return tok(text, add_special_tokens=add_special_tokens)

    enc = PromptEncoder(Tok())
    assert not enc.direct
    assert enc("hello world", False) == tok("hello world", add_special_tokens=False)["input_ids"]

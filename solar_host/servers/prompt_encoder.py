"""Token ids of a prompt, computed on the event loop without letting go of the GIL.

hf_server tokenizes each chat and completion prompt on its event loop, so that a prompt that
is too long is a 400 before the response starts. A transformers tokenizer's `__call__` goes to
its Rust backend's `encode_batch`, which releases the GIL while it works. That costs nothing
alone, but beside the decode thread, which runs Python between its torch operations, the event
loop then has to win the GIL back: its wake-up loses the race to the decode thread, which
takes the GIL again at its next operation, until the switch interval (5 ms) forces a hand-over.
Measured with a Python thread busy beside it: `tokenizer(prompt)` 5.4 ms at p50 instead of
37 us idle. The backend's single-sequence `encode` keeps the GIL throughout (24 us either way),
and each request of a burst paid that wait on the loop that every other request queues behind.

`PromptEncoder` calls that `encode` where the tokenizer has a Rust backend and it gives the same
ids as the tokenizer's own call (checked once, on a sample holding the special tokens);
anything else (a slow Python tokenizer, a backend set up differently) keeps the tokenizer's own
call.
"""

from __future__ import annotations

from typing import Any


class PromptEncoder:
    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.backend: Any = None  # the Rust tokenizer, when it can be called directly
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not callable(getattr(backend, "encode", None)):
            return
        try:
            # What tokenizer(text) sets before every call: no truncation, no padding, special
            # tokens in the text read as special tokens unless the tokenizer says otherwise.
            if getattr(backend, "truncation", None) is not None:
                backend.no_truncation()
            if getattr(backend, "padding", None) is not None:
                backend.no_padding()
            split = bool(getattr(tokenizer, "split_special_tokens", False))
            backend.encode_special_tokens = split
            self.backend = backend
            sample = _sample(tokenizer)
            same = all(self(sample, add) == self.releasing(sample, add) for add in (True, False))
        except Exception:  # a backend of another version or kind: its own call is safe
            same = False
        if not same:
            self.backend = None  # set up differently from what this module knows

    @property
    def direct(self) -> bool:
        """Whether prompts go straight to the Rust backend (keeping the GIL)."""
        return self.backend is not None

    def __call__(self, text: str, add_special_tokens: bool) -> list[int]:
        backend = self.backend
        # Another caller of the tokenizer may have asked the shared backend to truncate or pad
        # since (a call with truncation=True leaves it so): then the tokenizer's own call, which
        # sets both for itself.
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return self.releasing(text, add_special_tokens)
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def releasing(self, text: str, add_special_tokens: bool) -> list[int]:
        """The same ids through the tokenizer's own call, which lets go of the GIL while the
        Rust backend works: for a long prompt tokenized in a worker thread, and wherever the
        direct call cannot be trusted."""
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])


def _sample(tokenizer: Any) -> str:
    """Text that exercises what could differ: special tokens, spaces, and non-ASCII letters."""
    specials = [
        t
        for t in (getattr(tokenizer, "all_special_tokens", None) or [])
        if isinstance(t, str) and t
    ][:8]
    return " ".join(["Hello  world,", *specials, "naïve café 東京 🙂\n\tend"])

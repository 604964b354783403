"""The text of a generation, grown a token at a time at a cost that does not grow with it.

Decoding every generated id again at each step (`tokenizer.decode(all_new_ids)`) costs a step
time in proportion to the length generated so far: a 1,000-token answer decodes half a million
ids in all, and 32 such rows cost the decode thread milliseconds of every step, holding the
GIL the event loop needs (a tokenizer's `decode` keeps it). `Detokenizer` decodes a short
window instead, as vLLM and text-generation-inference do: the ids from the last piece of text
it settled (`_prefix`) up to the newest. The window's text minus what its settled part decodes
to is the new text. Both are decoded from the same first token, so whatever a tokenizer does
to the start of a sequence (SentencePiece drops the leading space of its first word) happens
to both and cancels out.

New text is settled only when it does not end in U+FFFD: a byte-level token that holds the
first bytes of a character decodes to U+FFFD until the rest arrive. Past `MAX_PENDING` waiting
ids it is settled anyway (no UTF-8 character has more than 4 bytes: those bytes will not make
one).

Ids that decoding skips (special tokens, with skip_special_tokens) never enter the window: a
model that emits an end or pad token again and again would otherwise widen it, and the cost of
every later token with it. Any other id that adds no text waits in the window with the next
one, for context (a decoder may put a space between two tokens), up to `MAX_SILENT` of them.

At the end, `finish` decodes all the ids once. That exact text is the result when it begins
with the text settled so far, which is what was streamed; a tokenizer whose decoding of a
window differs from the same ids in the whole sequence (a clean-up rule reaching across the
window's start) keeps the streamed text, so that a stream and its final text never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

# Ids decoded into nothing but an unfinished character, at most: past this many the text is
# settled even if it ends in U+FFFD.
MAX_PENDING = 6
# Ids in a row that add no text and are not skipped, at most: past this many they are settled
# as they are (the next token's window then starts without the text before them).
MAX_SILENT = 32


class Detokenizer:
    def __init__(self, decode: Callable[[list[int]], str], skipped: Collection[int] = ()):
        self._decode = decode
        self._skipped = skipped  # ids that `decode` leaves out
        self.ids: list[int] = []  # every id added
        self._kept: list[int] = []  # those not skipped: the windows are slices of these
        self.text = ""  # settled: it only ever grows
        self._prefix = 0  # _kept[_prefix:_read] decode to the end of `text`
        self._read = 0
        self._prefix_text = ""  # what _kept[_prefix:_read] decode to

    @classmethod
    def of(cls, tokenizer: Any) -> Detokenizer:
        """For a transformers tokenizer, as a response shows text: special tokens skipped."""
        return cls(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            frozenset(getattr(tokenizer, "all_special_ids", None) or ()),
        )

    def add(self, token: int) -> str:
        """Append one generated id; return the text settled so far (not only the new part)."""
        self.ids.append(token)
        if token in self._skipped:
            return self.text
        kept = self._kept
        kept.append(token)
        window = self._decode(kept[self._prefix :])
        waiting = len(kept) - self._read
        if len(window) > len(self._prefix_text):
            settle = not window.endswith("\ufffd") or waiting >= MAX_PENDING
        else:
            settle = waiting >= MAX_SILENT
        if settle:
            self.text += window[len(self._prefix_text) :]
            self._prefix, self._read = self._read, len(kept)
            self._prefix_text = self._decode(kept[self._prefix : self._read])
        return self.text

    def finish(self) -> str:
        """The whole text, unsettled end included (see the module docstring)."""
        exact = self._decode(self.ids)
        if not exact.startswith(self.text):
            exact = self.text + self._decode(self._kept[self._prefix :])[len(self._prefix_text) :]
        self.text = exact
        self._prefix = self._read = len(self._kept)  # all settled: finishing again adds nothing
        self._prefix_text = ""
        return self.text

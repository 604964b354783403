"""Cost per generated token of turning ids into streamed text: the Detokenizer that hf_server's
decode scheduler uses (a window of a few ids per token, then one whole decode at the end),
beside what it replaced (the whole answer decoded again at every token), for answers of
several lengths, in one run.

Both run the tokenizer's own `decode(ids, skip_special_tokens=True)`, on the decode thread's
path: its cost is paid holding the GIL, once per row per step. The ids are an English text
encoded by the tokenizer, so the windows see what a model's answers hold.

    .venv/bin/python bench/detokenize.py [--tokenizer DIR] [--lengths 32,256,1024,4096]
        [--repeat 5]

--tokenizer loads a local tokenizer directory instead of the tests' tiny byte-level BPE one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (
    "The host launches model servers, keeps a ledger of the machine's memory, and reports "
    "to the control plane, which routes each request to an instance that has the model. "
    "Naïve café owners in 東京 serve 🙂 coffee; numbers like 3.14159 and 2,718 appear too. "
)


def windowed(decode: Callable[[list[int]], str], ids: list[int]) -> str:
    from solar_host.servers.detokenizer import Detokenizer

    d = Detokenizer(decode)
    for t in ids:
        d.add(t)
    return d.finish()


def whole_each_time(decode: Callable[[list[int]], str], ids: list[int]) -> str:
    text = ""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
    return text


def per_token_us(fn, decode, ids: list[int], repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn(decode, ids)
        runs.append((time.perf_counter() - started) / len(ids) * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=None, help="a local tokenizer directory")
    p.add_argument("--lengths", default="32,256,1024,4096")
    p.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="detok-bench-") as tmp:
        if args.tokenizer:
            path = Path(args.tokenizer)
        else:
            from tests.fixtures.hf_models import build_tiny_hf_models

            path = build_tiny_hf_models(Path(tmp)).causal
        tok = AutoTokenizer.from_pretrained(path)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    lengths = [int(x) for x in args.lengths.split(",")]
    text_ids: list[int] = tok(TEXT, add_special_tokens=False)["input_ids"]
    while len(text_ids) < max(lengths):
        text_ids += text_ids
    print(f"tokenizer: {args.tokenizer or 'tests tiny byte-level BPE'}, median of {args.repeat}")
    print(f"{'tokens':>7} | {'windowed us/token':>17} | {'whole text us/token':>19} | ratio")
    for n in lengths:
        ids = text_ids[:n]
        assert windowed(decode, ids) == whole_each_time(decode, ids[:n])
        new = per_token_us(windowed, decode, ids, args.repeat)
        old = per_token_us(whole_each_time, decode, ids, args.repeat)
        print(f"{n:>7} | {new:>17.1f} | {old:>19.1f} | {old / new:>4.1f}x")


if __name__ == "__main__":
    main()

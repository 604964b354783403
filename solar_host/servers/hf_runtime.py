"""Model loading and the model work of hf_server (torch lives here and in hf_decode, sampling
and model_facts only).

Every public method of an engine is blocking and runs in the server's single worker thread:
the event loop never waits on torch. Batch methods take several requests at once and return
one result or one `APIError` per request, so one bad input never fails its batch neighbours.
"""

from __future__ import annotations

import importlib.util
import io
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jinja2 import TemplateError

from solar_host.servers.detokenizer import Detokenizer
from solar_host.servers.hf_decode import GenResult
from solar_host.servers.hf_images import to_rgb
from solar_host.servers.hf_protocol import APIError, GenParams, StopScanner
from solar_host.servers.model_facts import config_parts, vocab_size
from solar_host.servers.prompt_encoder import PromptEncoder
from solar_host.servers.sampling import GenerateShaping

MAX_IMAGE_PIXELS = 40_000_000  # a decompression bomb is refused from its header
# All the images of one request together: eight images at the limit each held the model's one
# worker for 30 s and 2.6 GB; the processors shrink them to a few hundred pixels a side anyway.
MAX_REQUEST_PIXELS = MAX_IMAGE_PIXELS


class LoadError(Exception):
    """The model cannot be loaded; the message is what the operator reads in the log."""


def pick_device(requested: str) -> str:
    """auto: cuda > mps > cpu. An explicit device that is missing is an error, not a fallback."""
    has_mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if has_mps else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise LoadError("CUDA requested but not available (device 'cuda' on a host without CUDA)")
    if requested == "mps" and not has_mps:
        raise LoadError("MPS requested but not available (device 'mps' on a host without MPS)")
    if requested not in ("cuda", "mps", "cpu"):
        raise LoadError(f"Unknown device {requested!r} (use auto, cuda, mps or cpu)")
    return requested


def pick_dtype(requested: str, device: str) -> torch.dtype:
    """auto: float16 on cuda/mps, float32 on cpu."""
    if requested == "auto":
        return torch.float16 if device in ("cuda", "mps") else torch.float32
    table = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if requested not in table:
        raise LoadError(f"Unknown dtype {requested!r} (use auto, float16, bfloat16 or float32)")
    return table[requested]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def thread_candidates(
    requested: int, environ: Mapping[str, str] = os.environ, cpus: int | None = None
) -> list[int]:
    """torch intra-op thread counts to choose from: `requested` if > 0, else OMP_NUM_THREADS if
    the operator set it, else every CPU and every CPU but one (which `ThreadTuner` picks from).

    Neither is right everywhere. On an idle 2-CPU machine two threads ran a MiniLM batch of 32
    in about half the time of one; on the same machine under load (other processes, plus our
    event loop and the clients), one thread took 250-350 ms and two 870-1050 ms with 4x the CPU
    time, as each of the forward pass's hundreds of parallel regions waited at its barrier for
    a descheduled thread.
    """
    if requested > 0:
        return [requested]
    env = environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return [int(env)]
    n = usable_cpus() if cpus is None else cpus
    return sorted({max(1, n - 1), max(1, n)})


class ThreadTuner:
    """Picks the thread count of each batch from the measured cost of the candidates.

    Cost is an exponential average of seconds per padded token. Every candidate is tried once,
    then the cheapest one runs, and the others are re-measured now and then (conditions change:
    the neighbours come and go), less often the costlier they were: exploring a count three
    times slower than the best every 48 batches costs about 4% of the time. The first run of a
    count is not recorded (it pays one-off warm-up costs that would condemn it for good).
    """

    def __init__(
        self,
        candidates: list[int],
        explore_every: int = 16,
        alpha: float = 0.5,
        min_rows: int = 1,
    ):
        self.candidates = sorted(set(candidates)) or [1]
        # Smaller batches neither explore nor count: their cost per token is mostly fixed
        # overhead, and one of them would make a thread count look several times too slow.
        self.min_rows = min_rows
        self.explore_every = explore_every
        self.alpha = alpha
        self.cost: dict[int, float | None] = dict.fromkeys(self.candidates)
        self.last_run: dict[int, int] = dict.fromkeys(self.candidates, 0)
        self.runs: dict[int, int] = dict.fromkeys(self.candidates, 0)
        self.batches = 0

    def best(self) -> int:
        known = [(c, t) for t, c in self.cost.items() if c is not None]
        return min(known)[1] if known else self.candidates[-1]

    def choose(self, rows: int) -> int:
        """The thread count for the next batch, of `rows` inputs."""
        if rows < self.min_rows:
            return self.best()
        self.batches += 1
        for t, c in self.cost.items():
            if c is None:
                return t
        best = self.best()
        best_cost = self.cost[best] or 1e-12
        for t in self.candidates:
            if t == best:
                continue
            ratio = (self.cost[t] or 0.0) / best_cost
            interval = min(64.0, self.explore_every * max(1.0, ratio))
            if self.batches - self.last_run[t] >= interval:
                return t
        return best

    def record(self, threads: int, seconds: float, tokens: int, rows: int) -> None:
        if threads not in self.cost or tokens <= 0 or rows < self.min_rows:
            return
        self.last_run[threads] = self.batches
        self.runs[threads] += 1
        if self.runs[threads] == 1:
            return
        x = seconds / tokens
        old = self.cost[threads]
        self.cost[threads] = x if old is None else old + self.alpha * (x - old)

    def stats(self) -> dict[str, Any]:
        return {
            "threads": self.best(),
            "us_per_token": {
                str(t): None if c is None else round(c * 1e6, 1) for t, c in self.cost.items()
            },
        }


def configure_threads(requested: int) -> list[int]:
    """The thread candidates (see `thread_candidates`); torch starts on the smallest."""
    candidates = thread_candidates(requested)
    torch.set_num_threads(candidates[0])
    return candidates


def flash_attention_usable(device: str) -> bool:
    return device == "cuda" and importlib.util.find_spec("flash_attn") is not None


@dataclass
class LoadOptions:
    model_id: str
    model_type: str
    device: str = "auto"
    dtype: str = "auto"
    max_length: int = 4096
    trust_remote_code: bool = False
    use_flash_attention: bool = False
    labels: list[str] | None = None
    normalize_embeddings: bool = False
    max_batch_size: int = 32
    threads: list[int] | None = None  # intra-op thread candidates (thread_candidates)


# What model configs call the longest sequence they take: max_position_embeddings for most,
# n_positions (GPT-2), max_seq_len (MPT), n_ctx, seq_length, max_sequence_length.
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "n_ctx",
    "seq_length",
    "max_sequence_length",
)


def _model_limit(model: Any, max_length: int) -> int:
    """The usable context: max_length, capped by the smallest length the model's config names
    (a prompt past it was accepted and then failed inside the model)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return max_length
    known = [
        n
        for c in config_parts(cfg)
        for key in CONTEXT_KEYS
        if isinstance(n := getattr(c, key, None), int) and not isinstance(n, bool) and n > 0
    ]
    return min([max_length, *known])


class TextEncoderBase:
    """Shared tokenisation and padded batching for the embedding and classification engines."""

    def __init__(self, model: Any, tokenizer: Any, device: str, opts: LoadOptions):
        self.model = model
        self.tok = tokenizer
        self.device = device
        self.limit = _model_limit(model, opts.max_length)
        self.max_batch = opts.max_batch_size
        self.tuner = ThreadTuner(
            opts.threads or [torch.get_num_threads()], min_rows=max(1, opts.max_batch_size // 4)
        )
        self._threads = 0  # what this (worker) thread last set; OpenMP's setting is per thread
        pad = tokenizer.pad_token_id
        self.pad_id = 0 if pad is None else int(pad)
        # A text longer than this has more than twice the context in tokens, whatever they
        # are: refused (or, to be truncated, cut) before the batch is tokenized, which every
        # request of the batch waited for (2,048 texts of 4 KB: 5 s).
        self.max_chars = self.limit * 2 * _longest_token(tokenizer)

    def _too_long(self, i: int, tokens: int | None) -> APIError:
        count = f"{tokens} tokens" if tokens is not None else "more than twice that in tokens"
        return APIError(
            400,
            f"input[{i}] has {count}, more than the maximum of {self.limit}; shorten it or "
            'send "truncate": true',
            code="context_length_exceeded",
            param="input",
        )

    def _encode(self, reqs: list[Any]) -> tuple[list[list[int]], list[int | APIError]]:
        """Token ids of all texts; per request the index of its first text, or its error."""
        early: dict[int, APIError] = {}
        for k, r in enumerate(reqs):
            if not r.truncate:
                long = next((i for i, t in enumerate(r.texts) if len(t) > self.max_chars), None)
                if long is not None:
                    early[k] = self._too_long(long, None)
        cut = self.max_chars
        texts = [t[:cut] for k, r in enumerate(reqs) if k not in early for t in r.texts]
        # (A tokenizer handed no text at all raises IndexError.)
        enc = (
            self.tok(texts, add_special_tokens=True, truncation=False)["input_ids"] if texts else []
        )
        ids: list[list[int]] = []
        starts: list[int | APIError] = []
        pos = 0
        for k, r in enumerate(reqs):
            if k in early:
                starts.append(early[k])
                continue
            chunk = enc[pos : pos + len(r.texts)]
            pos += len(r.texts)
            too_long = [i for i, x in enumerate(chunk) if len(x) > self.limit]
            if too_long and not r.truncate:
                i = too_long[0]
                starts.append(self._too_long(i, len(chunk[i])))
                continue
            if too_long:
                chunk = [x if len(x) <= self.limit else self._truncate(x) for x in chunk]
            starts.append(len(ids))
            ids.extend(chunk)
        return ids, starts

    def _truncate(self, ids: list[int]) -> list[int]:
        # Keep the closing special token (e.g. [SEP]) when the tokenizer adds one.
        sep = getattr(self.tok, "sep_token_id", None)
        if sep is not None and ids and ids[-1] == sep:
            return [*ids[: self.limit - 1], sep]
        return ids[: self.limit]

    def _forward_sorted(
        self, ids: list[list[int]], run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> np.ndarray:
        """Run `run(input_ids, mask)` over length-sorted chunks (little padding); original order."""
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        outs: list[np.ndarray] = [None] * len(ids)  # type: ignore[list-item]
        for c in range(0, len(order), self.max_batch):
            idx = order[c : c + self.max_batch]
            width = max(len(ids[i]) for i in idx)
            x = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            m = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                n = len(ids[i])
                x[row, :n] = torch.tensor(ids[i], dtype=torch.long)
                m[row, :n] = 1
            threads = self.tuner.choose(len(idx))
            if threads != self._threads:
                torch.set_num_threads(threads)
                self._threads = threads
            t0 = time.perf_counter()
            with torch.inference_mode():
                y = run(x.to(self.device), m.to(self.device)).float().cpu().numpy()
            self.tuner.record(threads, time.perf_counter() - t0, x.numel(), len(idx))
            for row, i in enumerate(idx):
                outs[i] = y[row]
        return np.stack(outs) if outs else np.zeros((0, 0), dtype=np.float32)


class EmbeddingEngine(TextEncoderBase):
    def __init__(self, model: Any, tokenizer: Any, device: str, opts: LoadOptions):
        super().__init__(model, tokenizer, device, opts)
        self.normalize = opts.normalize_embeddings

    def _pool(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        # Pooled in float32 whatever the model's dtype: a float16 sum over hundreds of tokens
        # keeps about three significant digits (and overflows past 65504).
        hidden = self.model(input_ids=x, attention_mask=m).last_hidden_state.float()
        mask = m.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    def embed_batch(self, reqs: list[Any]) -> list[tuple[np.ndarray, int] | APIError]:
        """Per request: (float32 vectors [n, d], prompt tokens) or an error."""
        ids, starts = self._encode(reqs)
        vecs = self._forward_sorted(ids, self._pool) if ids else None
        out: list[tuple[np.ndarray, int] | APIError] = []
        for r, s in zip(reqs, starts, strict=True):
            if isinstance(s, APIError):
                out.append(s)
                continue
            v = vecs[s : s + len(r.texts)].astype(np.float32)  # type: ignore[index]
            if r.dimensions is not None and r.dimensions < v.shape[1]:
                v = v[:, : r.dimensions]
            if self.normalize:
                v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
            out.append((v, sum(len(ids[s + k]) for k in range(len(r.texts)))))
        return out


class ClassifierEngine(TextEncoderBase):
    def __init__(self, model: Any, tokenizer: Any, device: str, opts: LoadOptions):
        super().__init__(model, tokenizer, device, opts)
        n = int(getattr(model.config, "num_labels", 0) or 0)
        id2label = getattr(model.config, "id2label", None) or {}
        from_cfg = [str(id2label.get(i, id2label.get(str(i), i))) for i in range(n)]
        self.labels = list(opts.labels) if opts.labels else from_cfg

    def label(self, i: int) -> str:
        return self.labels[i] if i < len(self.labels) else str(i)

    def _probs(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, attention_mask=m).logits.float().softmax(-1)

    def classify_batch(self, reqs: list[Any]) -> list[tuple[np.ndarray, int] | APIError]:
        ids, starts = self._encode(reqs)
        probs = self._forward_sorted(ids, self._probs) if ids else None
        out: list[tuple[np.ndarray, int] | APIError] = []
        for r, s in zip(reqs, starts, strict=True):
            if isinstance(s, APIError):
                out.append(s)
                continue
            tokens = sum(len(ids[s + k]) for k in range(len(r.texts)))
            out.append((probs[s : s + len(r.texts)], tokens))  # type: ignore[index]
        return out


class _Watch:
    """A StoppingCriteria that decodes each new token, streams text and applies stop strings."""

    def __init__(self, tok: Any, prompt_len: int, scanner: StopScanner, emit, cancel):
        self.prompt_len, self.scanner = prompt_len, scanner
        self.emit, self.cancel = emit, cancel
        self.text = Detokenizer.of(tok)

    def see(self, input_ids: torch.Tensor) -> None:
        """Take in the ids generated since the last call; stream the text that is now safe."""
        text = self.text.text
        for t in input_ids[0, self.prompt_len + len(self.text.ids) :].tolist():
            text = self.text.add(t)
        piece = self.scanner.update(text)
        if piece and self.emit is not None:
            self.emit(piece)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
        self.see(input_ids)
        stop = self.scanner.stopped or self.cancel.is_set()
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def _longest_token(tokenizer: Any) -> int:
    """Characters in the longest entry of the vocabulary (as the vocabulary spells it, which is
    never shorter than the text it stands for); 64 when the tokenizer does not say."""
    try:
        vocab = tokenizer.get_vocab()
        return max(64, max((len(t) for t in vocab), default=0))
    except Exception:  # a tokenizer without get_vocab
        return 64


class CausalEngine:
    def __init__(self, model: Any, tokenizer: Any, device: str, opts: LoadOptions):
        self.model, self.tok, self.device = model, tokenizer, device
        self.limit = _model_limit(model, opts.max_length)
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.encode = PromptEncoder(tokenizer)  # runs on the event loop: keeps the GIL
        # The most characters a prompt that fits the context can have: no token stands for
        # more than the longest entry of the vocabulary, and normalisers (NFC and the like)
        # at most halve a text. Past that a prompt is refused before it is tokenized, on the
        # event loop every request shares (an 8 MB prompt took 25 s there).
        self.max_prompt_chars = self.limit * 2 * _longest_token(tokenizer)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        if not self.has_template:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + "\nassistant:"
        try:
            return self.tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except TemplateError as err:  # the template's raise_exception (roles must alternate)
            raise APIError(
                400,
                f"This model's chat template refused the messages: {err}",
                code="invalid_messages",
                param="messages",
            ) from None

    def prompt_ids(self, prompt: str, chat: bool, releasing: bool = False) -> list[int]:
        """The prompt's token ids, or a 400. `releasing`: through the tokenizer's own call,
        which lets go of the GIL while it works (for a long prompt, in a worker thread: the
        event loop goes on meanwhile); otherwise through PromptEncoder, which keeps it."""
        field = "messages" if chat else "prompt"
        if len(prompt) > self.max_prompt_chars:
            raise APIError(
                400,
                f"The prompt has {len(prompt)} characters, more than fit in this model's "
                f"maximum context of {self.limit} tokens",
                code="context_length_exceeded",
                param=field,
            )
        # A chat template writes its own BOS; a raw completion prompt gets the tokenizer's.
        encode = self.encode.releasing if releasing else self.encode
        ids = encode(prompt, add_special_tokens=not chat)
        if not ids:
            raise APIError(400, f"The {field} is empty: there is nothing to continue", param=field)
        if len(ids) >= self.limit:
            raise APIError(
                400,
                f"The prompt has {len(ids)} tokens; this model's maximum context is "
                f"{self.limit} tokens, so nothing can be generated",
                code="context_length_exceeded",
                param="messages" if chat else "prompt",
            )
        return ids

    def inputs_of(self, ids: list[int]) -> dict[str, torch.Tensor]:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        return {"input_ids": x, "attention_mask": torch.ones_like(x)}

    def generate(
        self,
        inputs: dict[str, Any],
        params: GenParams,
        emit: Callable[[str], None] | None,
        cancel: threading.Event,
    ) -> GenResult:
        """Generate for one prompt; `emit` gets each new piece of text as soon as it is safe."""
        from transformers import LogitsProcessorList, StoppingCriteriaList

        n_prompt = int(inputs["input_ids"].shape[1])
        room = self.limit - n_prompt
        if room <= 0:
            raise APIError(
                400,
                f"The prompt has {n_prompt} tokens; this model's maximum context is "
                f"{self.limit} tokens",
                code="context_length_exceeded",
                param="messages",
            )
        max_new = min(params.max_tokens or room, room)
        scanner = StopScanner(params.stop)
        # The request's options, as the batched scheduler applies them, and nothing of the
        # model's generation_config (a default top_k of 50 or repetition_penalty of 1.1 there
        # would make this path's text differ from the scheduler's).
        kw: dict[str, Any] = {"do_sample": params.temperature > 0, "repetition_penalty": 1.0}
        if kw["do_sample"]:
            kw.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,  # 0: off
                min_p=params.min_p or None,
            )
            if params.seed is not None:
                torch.manual_seed(params.seed)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        # logit_bias and the penalties (repetition_penalty too); a 400 for a bad token id.
        shaping = GenerateShaping(
            params, inputs["input_ids"][0].tolist(), vocab_size(self.model), str(self.device)
        )
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        watch = _Watch(self.tok, n_prompt, scanner, emit, cancel)
        with torch.inference_mode():
            out = self.model.generate(
                **inputs,
                max_new_tokens=max_new,
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([watch]),
                logits_processor=LogitsProcessorList([shaping]),
                **kw,
            )
        watch.see(out)  # generate can end without a last call (max_new_tokens, EOS)
        new = watch.text.ids
        rest = scanner.finish(watch.text.finish())
        if rest and emit is not None:
            emit(rest)
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if scanner.stopped or (new and new[-1] in eos_ids) or len(new) < max_new:
            reason = "stop"
        else:
            reason = "length"
        return GenResult(scanner.final or "", n_prompt, len(new), reason)


# The image formats a chat may carry (what OpenAI's vision API takes, and BMP).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Longest side over shortest side. Processors scale an image's shortest edge to their target
# (32 px in the tests' tiny model, 224 or 336 in CLIP's) and its long edge with it, so a thin
# image few pixels in all became a huge one: 10x4,000,000 took 19 s and 5.7 GB in the tiny
# model's processor, 2x20,000,000 a MemoryError. 200:1 is Qwen2-VL's own limit (its
# smart_resize refuses past it); at it a CLIP-336 processor makes 336x67,200 pixels before its
# crop (0.5 s, 210 MB): bounded, whatever the image.
MAX_ASPECT_RATIO = 200
# Images are shrunk (aspect kept) to this longest edge before the processor: no real vision
# processor reads more, and one that keeps the size it is given (no resize, or a large
# max_pixels) would otherwise work on every pixel MAX_IMAGE_PIXELS lets in.
MAX_EDGE = 4096


def _image_too_large(message: str) -> APIError:
    return APIError(413, message, code="image_too_large", param="messages")


def _open_image(i: int, raw: bytes) -> Any:
    """Image `i` opened from its header (no pixel decoded), or a 4xx."""
    from PIL import Image

    try:
        with warnings.catch_warnings():  # our own limits decide, with a 413
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # Reads the header only, for these formats: some of Pillow's others decode in
            # open() (an ICO wrapping a 12000x12000 PNG took 550 MB there).
            return Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as err:
        raise _image_too_large(f"Image {i}: {err}") from None
    except Exception as err:
        raise APIError(400, f"Image {i} could not be decoded: {err}", param="messages") from None


def _check_shape(i: int, w: int, h: int) -> None:
    """Refuse image `i`, from its header, if it is too large or too thin to process."""
    if w * h > MAX_IMAGE_PIXELS:
        raise _image_too_large(
            f"Image {i} is {w}x{h} pixels, more than this server's limit of "
            f"{MAX_IMAGE_PIXELS} pixels"
        )
    if max(w, h) > MAX_ASPECT_RATIO * max(1, min(w, h)):
        raise APIError(
            400,
            f"Image {i} in 'messages' is {w}x{h} pixels; its sides may differ by a factor of "
            f"{MAX_ASPECT_RATIO} at most",
            code="image_aspect_ratio",
            param="messages",
        )


def _prepared(i: int, img: Any) -> Any:
    """Image `i` decoded as upright 8-bit RGB, its longest edge at most MAX_EDGE."""
    try:
        rgb = to_rgb(img)
        rgb.thumbnail((MAX_EDGE, MAX_EDGE))  # in place; only ever shrinks
        return rgb
    except MemoryError:
        raise _image_too_large(f"Image {i} is too large to process on this server") from None
    except Exception as err:
        raise APIError(400, f"Image {i} could not be decoded: {err}", param="messages") from None


class VisionEngine(CausalEngine):
    """Image+text chat through the model's processor. Images arrive as bytes (data: URIs)."""

    def __init__(self, model: Any, processor: Any, device: str, opts: LoadOptions):
        super().__init__(model, getattr(processor, "tokenizer", processor), device, opts)
        self.processor = processor

    def vision_inputs(self, messages: list[dict[str, Any]], images: list[bytes]) -> dict:
        if importlib.util.find_spec("PIL") is None:
            raise APIError(500, "Pillow is not installed on this host", type_="server_error")
        opened = []
        total = 0
        for i, raw in enumerate(images):
            img = _open_image(i, raw)
            w, h = img.size
            _check_shape(i, w, h)  # before any pixel is decoded
            total += w * h
            if total > MAX_REQUEST_PIXELS:  # every header read before any pixel is decoded
                raise _image_too_large(
                    f"The images of this request have {total} pixels in all (counting up to "
                    f"image {i}), more than this server's limit of {MAX_REQUEST_PIXELS}"
                )
            opened.append(img)
        pil = [_prepared(i, img) for i, img in enumerate(opened)]
        try:
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
            # The prompt is the processor's: the image placeholders are expanded to the tokens
            # the model really reads, so usage counts them as the processor does.
            inputs = self.processor(text=[text], images=pil or None, return_tensors="pt")
        except (TemplateError, ValueError) as err:
            # The messages do not fit the processor: roles out of order, or image placeholders
            # typed in the text that match no image part.
            raise APIError(
                400, f"The model's processor refused the messages: {err}", param="messages"
            ) from None
        except MemoryError:  # the request's, not the server's fault: a 413, not a 500
            raise _image_too_large(
                "The images of this request are too large for this model's processor"
            ) from None
        return {k: v.to(self.device) if hasattr(v, "to") else v for k, v in inputs.items()}


def load_engine(opts: LoadOptions) -> tuple[Any, str]:
    """Load tokenizer and model; returns (engine, device). Raises LoadError with a clear message."""
    import transformers as tf

    device = pick_device(opts.device)
    dtype = pick_dtype(opts.dtype, device)
    common: dict[str, Any] = {"trust_remote_code": opts.trust_remote_code}
    try:
        if opts.model_type in ("causal", "vision"):
            kw: dict[str, Any] = {**common, "dtype": dtype}
            if opts.use_flash_attention and flash_attention_usable(device):
                kw["attn_implementation"] = "flash_attention_2"
            if opts.model_type == "vision":
                proc = tf.AutoProcessor.from_pretrained(opts.model_id, **common)
                model = tf.AutoModelForImageTextToText.from_pretrained(opts.model_id, **kw)
                engine: Any = VisionEngine(model.to(device).eval(), proc, device, opts)
            else:
                tok = tf.AutoTokenizer.from_pretrained(opts.model_id, **common)
                if tok.pad_token is None:
                    tok.pad_token = tok.eos_token
                model = tf.AutoModelForCausalLM.from_pretrained(opts.model_id, **kw)
                engine = CausalEngine(model.to(device).eval(), tok, device, opts)
        else:
            tok = tf.AutoTokenizer.from_pretrained(opts.model_id, **common)
            if tok.pad_token is None and tok.eos_token is not None:
                tok.pad_token = tok.eos_token
            if opts.model_type == "classification":
                model = tf.AutoModelForSequenceClassification.from_pretrained(
                    opts.model_id, **common, dtype=dtype
                )
                engine = ClassifierEngine(model.to(device).eval(), tok, device, opts)
            elif opts.model_type == "embedding":
                model = tf.AutoModel.from_pretrained(opts.model_id, **common, dtype=dtype)
                engine = EmbeddingEngine(model.to(device).eval(), tok, device, opts)
            else:
                raise LoadError(f"Unknown model type {opts.model_type!r}")
    except LoadError:
        raise
    except Exception as err:  # transformers raises many types; the message is what matters
        raise LoadError(
            f"Cannot load model {opts.model_id!r}: {type(err).__name__}: {err}"
        ) from err
    return engine, device

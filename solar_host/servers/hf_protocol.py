"""Request parsing and response shapes of hf_server: Python and numpy, no torch.

Every bad input raises `APIError`, which the server turns into an OpenAI-style error body
`{"error": {"message", "type", "code", "param"}}`. Parsing is hand-written (no pydantic) to
keep per-request overhead low on the embeddings hot path.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_STOP_SEQUENCES = 4
# Texts in one embeddings or classification request (OpenAI's own limit): each is a row of the
# worker's batches, which every other request of the model waits behind.
MAX_INPUTS = 2048
# torch.Generator.manual_seed takes an unsigned 64-bit seed.
MAX_SEED = 2**64 - 1
# Below this a temperature is greedy decoding: logits divided by it overflow to infinity.
MIN_TEMPERATURE = 1e-5
# A JSON escape of a UTF-16 surrogate: the body may hold a lone one, which is no character.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class APIError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON; NaN/Infinity are refused (they are not JSON)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


# The most JSON values (objects, arrays, strings, numbers) a body may hold. Parsing holds the
# event loop and every value is an object of its own: 114 MiB of `{}` (the body a vision model
# takes, sized for its images) became 3.3 GB and held every stream for 6.6 s. No request this
# server takes comes near it (each message, part or input is a token or more, and the context
# is far shorter); 500,000 empty objects are about 45 MB and a tenth of a second.
MAX_JSON_VALUES = 500_000


def parse_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad("Request body is empty; expected a JSON object", code="invalid_json")
    # At least as many as the JSON values it holds (each value but a container's first follows
    # a comma), counted in C before anything is built; commas in text count too, which only
    # errs on the refusing side for texts longer than any context.
    if raw.count(b",") + raw.count(b"[") + raw.count(b"{") > MAX_JSON_VALUES:
        raise bad(
            f"Request body holds more than {MAX_JSON_VALUES} JSON values", code="invalid_json"
        )
    try:
        # Strict UTF-8 first: json.loads(bytes) also takes UTF-16 and UTF-32, and decodes
        # UTF-8 with "surrogatepass", so an encoded lone surrogate got past the escape check
        # below and failed the tokenizer, for every request of its batch.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad(f"Request body is not UTF-8: {err}", code="invalid_json") from None
    try:
        body = json.loads(text)
    except ValueError as err:
        raise bad(f"Request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise bad("Request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("Request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        for name, value in body.items():
            if not _encodable(name) or not _encodable(value):
                # The name as an escape: the message is encoded, and the name may be the bad
                # text itself.
                shown = name.encode("utf-8", "backslashreplace").decode()
                raise bad(
                    f"'{shown}' holds a lone UTF-16 surrogate (an escape such as \\ud800 "
                    "without its pair), which is not a character",
                    shown,
                )
    return body


def _encodable(value: Any) -> bool:
    """Whether every string in `value` is valid Unicode (json.loads lets lone surrogates in;
    a tokenizer then fails, for every request of its batch)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return True


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return v


def _number(
    body: dict[str, Any], name: str, default: float | None, lo: float, hi: float
) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number", name)
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be between {lo:g} and {hi:g}, got {v}", name)
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer", name)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad(f"'{name}' must be {rng}, got {v}", name)
    return v


def text_inputs(body: dict[str, Any], name: str = "input") -> list[str]:
    """`input` as a non-empty list of non-empty strings (a single string is a list of one)."""
    if name not in body:
        raise bad(f"'{name}' is required", name, code="missing_field")
    v = body[name]
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise bad(f"'{name}' must be a string or a list of strings", name)
    if not v:
        raise bad(f"'{name}' must not be empty", name)
    if len(v) > MAX_INPUTS:
        raise bad(f"'{name}' holds {len(v)} texts; at most {MAX_INPUTS} per request", name)
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise bad(f"'{name}[{i}]' must be a string", name)
        if not s:
            raise bad(f"'{name}[{i}]' must not be an empty string", name)
    return v


@dataclass(slots=True)
class EmbeddingRequest:
    texts: list[str]
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate: bool = False


def parse_embedding(body: dict[str, Any]) -> EmbeddingRequest:
    texts = text_inputs(body)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    return EmbeddingRequest(texts, fmt, _int(body, "dimensions", 1), _bool(body, "truncate", False))


_ROW_FORMATS: dict[int, str] = {}


def _float_row(values: list[float]) -> str:
    """A JSON array body for one float32 vector: '%.9g' round-trips every float32 exactly,
    in half the bytes of repr() and a third of json.dumps' time (one C-level format call)."""
    n = len(values)
    fmt = _ROW_FORMATS.get(n)
    if fmt is None:
        fmt = _ROW_FORMATS[n] = ",".join(["%.9g"] * n)
    return fmt % tuple(values)


def embeddings_body(vectors: Any, base64_format: bool, model: str, tokens: int) -> bytes:
    """The /v1/embeddings response for a float32 array [n, d], written directly.

    This is the hot path of a server that answers one sentence per request: building dicts of
    Python floats and json.dumps-ing them cost ~0.5 ms per 384-d vector, more than the rest of
    the request's handling. NaN/Infinity are refused as dumps() does (they are not JSON).
    """
    if base64_format:
        raw = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
        items = ['"' + r + '"' for r in raw]
    else:
        if not np.isfinite(vectors).all():
            raise ValueError("Out of range float values are not JSON compliant")
        items = ["[" + _float_row(row) + "]" for row in vectors.tolist()]
    data = ",".join(
        f'{{"object":"embedding","embedding":{e},"index":{i}}}' for i, e in enumerate(items)
    )
    tail = dumps(
        {"model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    ).decode()
    return f'{{"object":"list","data":[{data}],{tail[1:]}'.encode()


@dataclass(slots=True)
class ClassifyRequest:
    texts: list[str]
    return_all_scores: bool = False
    truncate: bool = False


def parse_classify(body: dict[str, Any]) -> ClassifyRequest:
    return ClassifyRequest(
        text_inputs(body),
        _bool(body, "return_all_scores", False),
        _bool(body, "truncate", False),
    )


@dataclass(slots=True)
class GenParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    # Logit shaping (sampling): each value here means "off".
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def shapes_logits(self) -> bool:
        """Whether the logits need more than temperature and top_p: a bias or a penalty,
        which greedy rows apply too (before their argmax), as OpenAI and vLLM do."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
        )


# OpenAI options this server does not implement.
UNSUPPORTED_OPTIONS = ("logprobs", "top_logprobs", "echo", "suffix")
# OpenAI's own limits on logit_bias: entries, and the range of each bias.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0
# A token id in a logit_bias key: digits only, at most this many (no vocabulary comes near
# 10**10; the scheduler checks the model's own size). Bounded so int() never sees a huge key.
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
# Tool calling needs a template and an output parser this server does not have: asked for,
# a 200 of plain text would read as a model that chose not to call. Their "off" values pass.
TOOL_OPTIONS = {
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"),
}


def parse_gen_params(body: dict[str, Any]) -> GenParams:
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise bad("Only n=1 is supported", "n")
    for name in UNSUPPORTED_OPTIONS:
        # Answered without them, a 200 would look like a model that gave none: say so instead.
        # Their "off" values (false, 0, null) are what clients send by default, and pass.
        if body.get(name) not in (None, False, 0, ""):
            raise bad(f"'{name}' is not supported by this server", name)
    if body.get("best_of") not in (None, 1):
        raise bad("Only best_of=1 is supported", "best_of")
    max_tokens = _int(body, "max_tokens", 1)
    mct = _int(body, "max_completion_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise bad(f"'stop' accepts at most {MAX_STOP_SEQUENCES} sequences", "stop")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    include_usage = bool(opts and opts.get("include_usage") is True)
    _refuse_tools_and_formats(body)
    temperature: float = _number(body, "temperature", 1.0, 0.0, 2.0)  # type: ignore[assignment]
    return GenParams(
        temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
        # 0 keeps only the most likely token (the sampler always keeps that one).
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),  # type: ignore[arg-type]
        max_tokens=max_tokens if max_tokens is not None else mct,
        stop=stop,
        stream=_bool(body, "stream", False),
        include_usage=include_usage,
        seed=_int(body, "seed", 0, MAX_SEED),
        top_k=_int(body, "top_k", 0) or 0,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),  # type: ignore[arg-type]
        repetition_penalty=_repetition_penalty(body),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),  # type: ignore[arg-type]
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),  # type: ignore[arg-type]
        logit_bias=_logit_bias(body),
    )


def _refuse_tools_and_formats(body: dict[str, Any]) -> None:
    """A 400 for tool calling and structured output, which this server cannot honour."""
    for name, off in TOOL_OPTIONS.items():
        if body.get(name) not in off:
            raise bad(f"'{name}' is not supported by this server (no tool calling)", name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        # json_object / json_schema need constrained decoding: a 200 of free text would pass
        # for JSON the client then fails to parse.
        raise bad(
            '\'response_format\' is not supported by this server except {"type": "text"}',
            "response_format",
        )


def _repetition_penalty(body: dict[str, Any]) -> float:
    """HF's repetition_penalty: > 0 (1 is off). Bounded above so that a penalised logit stays
    a finite number (it is multiplied by the penalty)."""
    v = _number(body, "repetition_penalty", 1.0, 0.0, 100.0)
    if v == 0.0:
        raise bad("'repetition_penalty' must be greater than 0, got 0", "repetition_penalty")
    return v  # type: ignore[return-value]


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """`logit_bias` as {token id: bias}; keys are token ids as strings (as OpenAI's are).
    Whether each id is in the model's vocabulary is the scheduler's check (it knows the model)."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' holds {len(v)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not _TOKEN_ID.fullmatch(key):
            raise bad(f"'logit_bias' key {key[:20]!r} is not a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise bad(f"'logit_bias[{key}]' must be a number", "logit_bias")
        if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            raise bad(
                f"'logit_bias[{key}]' must be between {-LOGIT_BIAS_RANGE:g} and "
                f"{LOGIT_BIAS_RANGE:g}, got {bias}",
                "logit_bias",
            )
        out[int(key)] = float(bias)
    return out


def parse_prompt(body: dict[str, Any]) -> str:
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt", code="missing_field")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise bad("'prompt' must be a string (batched prompts are not supported)", "prompt")
    return p


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" not in body:
        raise bad("'messages' is required", "messages", code="missing_field")
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"'messages[{i}]' must be an object", "messages")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise bad(f"'messages[{i}].role' must be a non-empty string", "messages")
        c = m.get("content")
        if c is not None and not isinstance(c, str | list):
            raise bad(f"'messages[{i}].content' must be a string or a list of parts", "messages")
    return msgs


def refuse_long_chat(body: dict[str, Any], max_tokens: int, max_chars: int) -> None:
    """A 400 for messages that cannot fit the context, found before anything is templated or
    tokenized: more messages than the context has tokens (a template gives each at least one),
    or more text than `max_chars` (see CausalEngine.max_prompt_chars). 250,000 empty messages
    took 3 s of the event loop to template; 30 MB of text in a vision request, a minute of
    tokenizing and 6 GB."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return  # _messages says what is wrong with it
    too_long = APIError(
        400,
        f"The messages do not fit in this model's maximum context of {max_tokens} tokens",
        code="context_length_exceeded",
        param="messages",
    )
    if len(msgs) >= max_tokens:
        raise too_long
    chars = 0
    for m in msgs:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            chars += len(c)
        elif isinstance(c, list):
            for part in c:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    chars += len(text)
        if chars > max_chars:
            raise too_long


def text_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """Chat messages for a text-only model: content parts must all be text."""
    out = []
    for i, m in enumerate(_messages(body)):
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for part in c:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(
                        "Causal model received non-text content; use a vision model",
                        "messages",
                        code="unsupported_content",
                    )
                if not isinstance(part.get("text"), str):
                    raise bad(f"'messages[{i}]' text part needs a string 'text'", "messages")
                texts.append(part["text"])
            c = "".join(texts)
        out.append({"role": m["role"], "content": c or ""})
    return out


def decode_data_uri(url: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a base64 `data:` URI, refused (413) past `max_bytes` before decoding."""
    if not isinstance(url, str) or not url:
        raise bad("'image_url.url' must be a non-empty string", "messages")
    if not url[:16].lower().startswith("data:"):
        raise bad(
            "Only data: URIs (base64) are accepted for images; remote URLs are not fetched "
            "on this server",
            "messages",
            code="unsupported_image_url",
        )
    head, sep, data = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise bad("Image data URI must be base64 encoded (data:<mime>;base64,...)", "messages")
    if max_bytes is not None and len(data) // 4 * 3 > max_bytes + 2:
        raise image_too_large(len(data) // 4 * 3, max_bytes)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad("Image data URI has invalid base64 data", "messages") from None
    if not raw:
        raise bad("Image data URI is empty", "messages")
    if max_bytes is not None and len(raw) > max_bytes:
        raise image_too_large(len(raw), max_bytes)
    return raw


def image_too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"An image in 'messages' is {size} bytes, more than this server's limit of {limit} bytes",
        code="image_too_large",
        param="messages",
    )


def vision_messages(
    body: dict[str, Any], max_images: int | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Chat messages with parts normalised to {type: text|image}, and the image URLs in order
    (data: URIs or http(s) URLs; hf_images turns them into bytes under the server's policy)."""
    out: list[dict[str, Any]] = []
    urls: list[str] = []
    for i, m in enumerate(_messages(body)):
        c = m.get("content")
        if c is None or isinstance(c, str):
            out.append({"role": m["role"], "content": [{"type": "text", "text": c or ""}]})
            continue
        parts: list[dict[str, Any]] = []
        for part in c:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                if not isinstance(url, str) or not url:
                    raise bad(
                        f"'messages[{i}]' image_url.url must be a non-empty string", "messages"
                    )
                urls.append(url)
                parts.append({"type": "image"})
            else:
                raise bad(
                    f"'messages[{i}]' has an unsupported content part (use text or image_url)",
                    "messages",
                    code="unsupported_content",
                )
        out.append({"role": m["role"], "content": parts})
    if max_images is not None and len(urls) > max_images:
        raise bad(
            f"'messages' has {len(urls)} images; this server accepts at most {max_images} per "
            "request",
            "messages",
            code="too_many_images",
        )
    return out, urls


class StopScanner:
    """Finds stop sequences in growing generated text and says how much is safe to show.

    Text that might be the start of a stop sequence, or ends in an incomplete UTF-8
    character (U+FFFD from a partial byte token), is held back until it is decided.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.sent = 0
        self.stopped = False
        self.final: str | None = None

    def update(self, text: str) -> str:
        """Feed the whole generated text so far; return the new piece safe to emit."""
        if self.stopped:
            return ""
        cut = -1
        for s in self.stops:
            i = text.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.stopped = True
            self.final = text[:cut]
            piece = text[self.sent : cut]
            self.sent = max(self.sent, cut)
            return piece
        safe = len(text)
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, safe - self.sent), hold, -1):
                if text[safe - k : safe] == s[:k]:
                    hold = k
                    break
        safe -= hold
        piece = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return piece

    def finish(self, text: str) -> str:
        """The generation ended: emit whatever was held back (minus any stop sequence)."""
        piece = self.update(text)
        if self.stopped:
            return piece
        self.final = text
        rest = text[self.sent :]
        self.sent = len(text)
        return piece + rest

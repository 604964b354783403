"""solar-host's own HuggingFace inference server, run as its own process by the host.

    python -m solar_host.servers.hf_server --model-id DIR --model-type embedding --alias a \
        --host 127.0.0.1 --port 8000 [--device auto] [--dtype auto] [--max-length 512] ...

API keys come from the environment (SOLAR_HF_API_KEYS, comma-separated), never argv: argv is
visible to every user of the machine. The model is loaded before the socket is opened, so
uvicorn's "Uvicorn running on http://..." line means "ready". Each request logs
`[REQUEST] id=.. endpoint=..` and `[COMPLETE] id=.. endpoint=.. prompt_tokens=N
completion_tokens=M time_ms=T` (generations add `started_at=.. finished_at=..`, and that line is
written before the response's last event) or `[ERROR] id=.. endpoint=.. status=S message=..`,
which the host's log parser turns into runtime state and last-generation metrics.

Causal chat and completion requests are decoded together, step by step (hf_decode): a request
joins the running batch at the next step.

Too-long inputs: a chat/completion prompt at or over the context is a 400
`context_length_exceeded` (as OpenAI does). Embedding and classification inputs over
max_length tokens are a 400 too, unless the request sends `"truncate": true`, which truncates
them to max_length tokens (keeping the closing special token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import hmac
import itertools
import json
import logging
import os
import random
import secrets
import socket
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from solar_host.platform.httpguard import guarded_protocol
from solar_host.servers.hf_batcher import DynamicBatcher
from solar_host.servers.hf_images import ImageLoader, ImagePolicy
from solar_host.servers.hf_protocol import (
    APIError,
    dumps,
    embeddings_body,
    parse_body,
    parse_classify,
    parse_embedding,
    parse_gen_params,
    parse_prompt,
    refuse_long_chat,
    text_messages,
    vision_messages,
)
from solar_host.servers.sse import EventStream, hang_up

API_KEYS_ENV = "SOLAR_HF_API_KEYS"
MODEL_TYPES = ("causal", "classification", "embedding", "vision")
CAPABILITIES = {
    "causal": ["completion"],
    "classification": ["classification"],
    "embedding": ["embedding"],
    "vision": ["completion", "multimodal"],
}
JSON = "application/json"
MIN_BODY_LIMIT = 8 * 1024 * 1024
# Longest wait for a request's body, and for a connection's request headers (the environment
# may set others: SOLAR_HF_BODY_TIMEOUT_S, SOLAR_HF_HEADER_TIMEOUT_S).
BODY_TIMEOUT_S = 30.0
HEADER_TIMEOUT_S = 15.0
# Prompts up to this many characters are tokenized on the event loop (a few ms at most).
ON_LOOP_PROMPT_CHARS = 64 * 1024


def log_line(text: str) -> None:
    """One marker line on stdout, flushed at once (stdout is a file read by the host)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class MarkerLog:
    """Marker lines on stdout, written once per event-loop turn instead of once per line.

    A batch of 32 embeddings completes 32 requests in one turn; a write and flush per marker
    line cost ~0.35 ms each on the event loop. Lines keep their order and reach the file before
    the loop does anything else (no timer), so the host's parser sees them just as promptly.
    Outside a running loop (start-up, shutdown) a line is written at once.
    """

    def __init__(self) -> None:
        self._pending: list[str] = []
        self._scheduled = False

    def line(self, text: str) -> None:
        """Queue a line, written at the end of this loop turn (see `written` for the lines a
        client may act on as soon as its response ends)."""
        self._pending.append(text)
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)

    async def written(self) -> None:
        """Return once every line queued so far is in the file. The write scheduled for this
        turn runs before this coroutine resumes (the loop runs callbacks in order), so eight
        generations that finish in one decode step cost one write, not eight: each write lets
        go of the GIL, and the loop then waits for the decode thread to hand it back."""
        if self._pending:
            await asyncio.sleep(0)
            self.flush()  # only if a line came after the scheduled write: normally a no-op

    def flush(self) -> None:
        self._scheduled = False
        if self._pending:
            text = "\n".join(self._pending) + "\n"
            self._pending.clear()
            # Never raises for what a line holds: a line that cannot be encoded (a client's
            # lone surrogate) failed the write of every other request's line with it.
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except OSError as err:  # the host's log file: nothing else to tell
                print(f"marker log write failed: {err}", file=sys.stderr)


def _seconds_from_env(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


def keys_from_env(environ: dict[str, str] | os._Environ = os.environ) -> list[bytes]:
    raw = environ.get(API_KEYS_ENV, "")
    return [k.strip().encode() for k in raw.split(",") if k.strip()]


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type=JSON)


def error_response(err: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return Response(dumps(err.body()), status_code=err.status, media_type=JSON, headers=headers)


class GenRun:
    """One generation as the event loop sees it: text pieces as they come, then the result
    (a GenResult, or the exception that ended it). Fed on the event loop only."""

    _END = object()

    def __init__(self) -> None:
        self._q: asyncio.Queue[Any] = asyncio.Queue()
        self._result: Any = None
        self.task: asyncio.Task | None = None  # keeps a one-at-a-time job referenced

    def piece(self, text: str) -> None:
        self._q.put_nowait(text)

    def done(self, result: Any) -> None:
        if self._result is not None:  # the first outcome stands (the scheduler posts one)
            return
        self._result = result
        self._q.put_nowait(self._END)

    async def pieces(self) -> AsyncIterator[list[str]]:
        """The pieces, several at a time when several are waiting (when the client or the
        loop is slower than decoding, one write carries them all)."""
        while (item := await self._q.get()) is not self._END:
            batch = [item]
            while not self._q.empty():
                nxt = self._q.get_nowait()
                if nxt is self._END:
                    self._q.put_nowait(nxt)
                    break
                batch.append(nxt)
            yield batch
        self._q.put_nowait(self._END)  # result() may still be awaited

    async def result(self) -> Any:
        while await self._q.get() is not self._END:
            pass
        self._q.put_nowait(self._END)
        if isinstance(self._result, BaseException):
            raise self._result
        return self._result


class HFServer:
    """The app's state: the engine, the worker thread, the batcher, counters and auth."""

    def __init__(self, engine: Any, args: argparse.Namespace, device: str, keys: list[bytes]):
        self.engine = engine
        self.args = args
        self.alias = args.alias
        self.model_type = args.model_type
        self.device = device
        self.keys = keys
        self.created = int(time.time())
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="hf-model")
        self.gen_lock = asyncio.Lock()
        self.batcher: DynamicBatcher | None = None
        if args.model_type == "embedding":
            self.batcher = DynamicBatcher(
                engine.embed_batch, self.worker, args.max_batch_size, args.batch_window_ms / 1000
            )
        elif args.model_type == "classification":
            self.batcher = DynamicBatcher(
                engine.classify_batch, self.worker, args.max_batch_size, args.batch_window_ms / 1000
            )
        self.images = ImageLoader(
            ImagePolicy(
                allow_urls=getattr(args, "allow_image_urls", False),
                max_images=getattr(args, "max_images", 8),
                max_bytes=getattr(args, "max_image_bytes", 10 * 1024 * 1024),
            )
        )
        # The largest body read: for a vision model, room for every allowed image as base64,
        # plus the text; for the others the text alone.
        self.max_body = MIN_BODY_LIMIT
        if args.model_type == "vision":
            policy = self.images.policy
            self.max_body += max(MIN_BODY_LIMIT, policy.max_images * policy.max_bytes * 4 // 3)
        # Causal models decode in the step-level scheduler (hf_decode), started in lifespan.
        self.decoder: Any = None
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(3)
        # Response ids: unique, not secret. secrets.token_hex reads os.urandom, a system call
        # that lets go of the GIL, and the event loop then waits for the decode thread to hand it
        # back (see prompt_encoder): once per request, on the loop every request queues behind.
        self._rand = random.Random(secrets.randbits(128))
        self.body_timeout_s = _seconds_from_env("SOLAR_HF_BODY_TIMEOUT_S", BODY_TIMEOUT_S)
        self.in_flight = 0
        self._open: set[str] = set()  # ids of the requests begun and not yet ended
        self.generating = 0
        self.completed = 0
        self.errors = 0
        self.log = MarkerLog()

    def start_decoder(self) -> None:
        if self.model_type != "causal":
            return
        from solar_host.servers.hf_decode import DecodeScheduler, Deliveries

        loop = asyncio.get_running_loop()

        def deliver(items: Deliveries, then: Callable[[], None] | None) -> None:
            for callback, arg in items:
                callback(arg)
            if then is not None:
                # After the stream tasks these callbacks woke (callbacks run in order): their
                # events have been sent by then.
                loop.call_soon(then)

        def post(items: Deliveries, then: Callable[[], None] | None) -> None:
            loop.call_soon_threadsafe(deliver, items, then)  # one wake-up per decode step

        threads = getattr(self.args, "threads", None)
        self.decoder = DecodeScheduler(
            self.engine.model,
            self.engine.tok,
            self.device,
            self.args.max_batch_size,
            post,
            threads=threads[0] if threads else None,
        )
        self.decoder.start()

    # ---- plumbing -------------------------------------------------------------------

    def authorized(self, request: Request) -> bool:
        if not self.keys:
            return True
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        given = given or request.headers.get("x-api-key", "")
        if not given:
            return False
        g = given.encode()
        ok = False
        for k in self.keys:  # compare with every key: time does not say which one matched
            ok |= hmac.compare_digest(g, k)
        return ok

    def response_id(self) -> str:
        """24 hex digits, as secrets.token_hex(12) gives, without a system call."""
        return f"{self._rand.getrandbits(96):024x}"

    def begin(self, endpoint: str) -> tuple[str, float]:
        rid = f"{self._prefix}-{next(self._ids)}"
        self._open.add(rid)
        self.in_flight += 1
        self.log.line(f"[REQUEST] id={rid} endpoint={endpoint}")
        return rid, time.perf_counter()

    def complete(self, rid: str, endpoint: str, t0: float, prompt: int, completion: int) -> None:
        """The [COMPLETE] marker. A generation's carries its own start and end times, and its
        caller awaits `log.written()` before the response's last event goes out: the host's
        last-generation record is then this request's as soon as its client has read the
        response, however late the host reads the log."""
        if not self._end(rid):
            return
        self.completed += 1
        elapsed = time.perf_counter() - t0
        line = (
            f"[COMPLETE] id={rid} endpoint={endpoint} prompt_tokens={prompt} "
            f"completion_tokens={completion} time_ms={elapsed * 1000:.1f}"
        )
        generation = endpoint in ("/v1/chat/completions", "/v1/completions")
        if generation:
            end = datetime.now(UTC)
            start = end - timedelta(seconds=elapsed)
            line += f" started_at={start.isoformat()} finished_at={end.isoformat()}"
        self.log.line(line)

    def _end(self, rid: str) -> bool:
        """Count a request's end once: an error after its [COMPLETE] (while its answer is
        built or sent) is not a second end."""
        if rid not in self._open:
            return False
        self._open.discard(rid)
        self.in_flight -= 1
        return True

    def fail(self, rid: str, endpoint: str, status: int, message: str) -> None:
        if not self._end(rid):
            return
        self.errors += 1
        msg = message.replace("\n", " ")[:300]
        self.log.line(f"[ERROR] id={rid} endpoint={endpoint} status={status} message={msg}")

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 past max_body (before it is all in memory)."""
        declared = request.headers.get("content-length", "")
        too_big = APIError(
            413,
            f"Request body is larger than this server's limit of {self.max_body} bytes",
            code="request_too_large",
        )
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_big
        parts: list[bytes] = []
        size = 0
        try:
            # A body that stops coming held the request (and the host's view of the
            # instance as busy) for ever.
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body:
                        raise too_big
                    parts.append(chunk)
        except TimeoutError:
            raise APIError(
                408,
                f"The request body did not arrive within {self.body_timeout_s:g} s",
                code="request_timeout",
            ) from None
        return b"".join(parts)

    def require(self, *types: str, what: str) -> None:
        if self.model_type not in types:
            raise APIError(
                400,
                f"{what} is not available for this {self.model_type} model "
                f"(model '{self.alias}' serves {', '.join(self.endpoints())})",
                code="unsupported_endpoint",
            )

    def endpoints(self) -> list[str]:
        return {
            "causal": ["/v1/chat/completions", "/v1/completions"],
            "vision": ["/v1/chat/completions"],
            "classification": ["/v1/classify"],
            "embedding": ["/v1/embeddings"],
        }[self.model_type]

    async def run_endpoint(
        self,
        request: Request,
        endpoint: str,
        handler: Callable[[dict[str, Any], str, float], Awaitable[Response]],
    ) -> Response:
        """Auth, JSON parsing, [REQUEST]/[COMPLETE]/[ERROR] markers and error mapping."""
        if not self.authorized(request):
            return error_response(
                APIError(
                    401,
                    "Invalid or missing API key",
                    type_="authentication_error",
                    code="invalid_api_key",
                )
            )
        rid, t0 = self.begin(endpoint)
        try:
            body = parse_body(await self.read_body(request))
            _REQUEST.set(request)
            return await handler(body, rid, t0)
        except ClientDisconnect:  # gone while its body was read: not the server's error
            err = ClientGone()
            self.fail(rid, endpoint, err.status, err.message)
            return error_response(err)
        except APIError as err:
            self.fail(rid, endpoint, err.status, err.message)
            return error_response(err)
        except Exception as err:
            status = 503 if "out of memory" in str(err).lower() else 500
            msg = f"{type(err).__name__}: {err}"
            self.fail(rid, endpoint, status, msg)
            return error_response(
                APIError(status, msg, type_="server_error", code="internal_error")
            )

    # ---- embeddings and classification ----------------------------------------------------

    async def embeddings(self, body: dict[str, Any], rid: str, t0: float) -> Response:
        self.require("embedding", what="/v1/embeddings")
        req = parse_embedding(body)
        assert self.batcher is not None
        vecs, tokens = await self.batcher.submit(req, len(req.texts))
        body = embeddings_body(vecs, req.encoding_format == "base64", self.alias, tokens)
        self.complete(rid, "/v1/embeddings", t0, tokens, 0)
        return Response(body, media_type=JSON)

    async def classify(self, body: dict[str, Any], rid: str, t0: float) -> Response:
        self.require("classification", what="/v1/classify")
        req = parse_classify(body)
        assert self.batcher is not None
        probs, tokens = await self.batcher.submit(req, len(req.texts))
        label = self.engine.label
        choices = []
        for i, row in enumerate(probs.tolist()):
            best = max(range(len(row)), key=row.__getitem__)
            all_scores = (
                [{"label": label(j), "score": s} for j, s in enumerate(row)]
                if req.return_all_scores
                else None
            )
            choices.append(
                {"index": i, "label": label(best), "score": row[best], "all_scores": all_scores}
            )
        self.complete(rid, "/v1/classify", t0, tokens, 0)
        return json_response(
            {
                "id": f"clf-{self.response_id()}",
                "object": "classification",
                "created": int(time.time()),
                "model": self.alias,
                "choices": choices,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    # ---- generation -----------------------------------------------------------------------

    async def chat(self, body: dict[str, Any], rid: str, t0: float) -> Response:
        self.require("causal", "vision", what="/v1/chat/completions")
        params = self._gen_params(body)
        refuse_long_chat(body, self.engine.limit, self.engine.max_prompt_chars)
        if self.model_type == "vision":
            messages, urls = vision_messages(body, self.images.policy.max_images)
            images = await self.images.load(urls)
            loop = asyncio.get_running_loop()
            inputs: Any = await loop.run_in_executor(
                self.worker, self.engine.vision_inputs, messages, images
            )
        else:
            prompt = self.engine.chat_prompt(text_messages(body))
            inputs = await self._prompt_ids(prompt, chat=True)
        return await self._generate(inputs, params, rid, t0, "/v1/chat/completions", chat=True)

    async def completions(self, body: dict[str, Any], rid: str, t0: float) -> Response:
        self.require("causal", what="/v1/completions")
        params = self._gen_params(body)
        ids = await self._prompt_ids(parse_prompt(body), chat=False)
        return await self._generate(ids, params, rid, t0, "/v1/completions", chat=False)

    def _gen_params(self, body: dict[str, Any]) -> Any:
        from solar_host.servers.hf_decode import check_logit_bias, vocab_size

        params = parse_gen_params(body)
        if params.logit_bias:
            check_logit_bias(params, vocab_size(self.engine.model))
        return params

    async def _prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        """Token ids on the event loop (microseconds, keeping the GIL: see prompt_encoder), but
        for a long prompt in a worker thread, with the GIL let go: tokenizing megabytes takes
        seconds, which every other stream of the server would otherwise wait out."""
        if len(prompt) <= ON_LOOP_PROMPT_CHARS:
            return self.engine.prompt_ids(prompt, chat)
        return await asyncio.to_thread(self.engine.prompt_ids, prompt, chat, True)

    def _start(self, inputs: Any, params: Any, stream: bool, cancel: threading.Event) -> GenRun:
        """Start one generation: causal prompts join the decode scheduler's running batch; a
        vision model's inputs (pixels and all) run one at a time through model.generate."""
        run = GenRun()
        self.generating += 1
        if self.decoder is not None:
            from solar_host.servers.hf_decode import GenRequest

            room = self.engine.limit - len(inputs)
            max_new = min(params.max_tokens or room, room)
            self.decoder.submit(
                GenRequest(inputs, params, max_new, run.piece if stream else None, run.done, cancel)
            )
        else:
            loop = asyncio.get_running_loop()

            def emit(piece: str) -> None:  # called in the worker thread
                loop.call_soon_threadsafe(run.piece, piece)

            async def one_at_a_time() -> None:
                try:
                    async with self.gen_lock:
                        res = await loop.run_in_executor(
                            self.worker,
                            self.engine.generate,
                            self.engine.inputs_of(inputs) if isinstance(inputs, list) else inputs,
                            params,
                            emit if stream else None,
                            cancel,
                        )
                except Exception as err:
                    run.done(err)
                else:
                    run.done(res)

            run.task = loop.create_task(one_at_a_time())
        return run

    async def _generate(
        self, inputs: Any, params: Any, rid: str, t0: float, endpoint: str, chat: bool
    ) -> Response:
        cancel = threading.Event()
        oid = ("chatcmpl-" if chat else "cmpl-") + self.response_id()
        created = int(time.time())
        if not params.stream:
            run = self._start(inputs, params, False, cancel)
            try:
                res = await _unless_disconnected(run.result(), _REQUEST.get(None))
            except BaseException:
                cancel.set()  # e.g. the request task was cancelled: free the row
                raise
            finally:
                self.generating -= 1
            self.complete(rid, endpoint, t0, res.prompt_tokens, res.completion_tokens)
            await self.log.written()
            usage = _usage(res)
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": res.text},
                    "finish_reason": res.finish_reason,
                }
            else:
                choice = {
                    "index": 0,
                    "text": res.text,
                    "logprobs": None,
                    "finish_reason": res.finish_reason,
                }
            return json_response(
                {
                    "id": oid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": created,
                    "model": self.alias,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        return EventStream(
            self._stream(inputs, params, rid, t0, endpoint, chat, oid, created, cancel),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _stream(
        self,
        inputs: Any,
        params: Any,
        rid: str,
        t0: float,
        endpoint: str,
        chat: bool,
        oid: str,
        created: int,
        cancel: threading.Event,
    ) -> AsyncGenerator[bytes, None]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if params.include_usage else {}

        def chunk(piece: str | None, finish: str | None) -> bytes:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {
                    "index": 0,
                    "text": piece or "",
                    "logprobs": None,
                    "finish_reason": finish,
                }
            body = {"id": oid, "object": obj, "created": created, "model": self.alias}
            body["choices"] = [choice]
            return b"data: " + dumps({**body, **extra}) + b"\n\n"

        # Text events differ only in the piece: one template, split around a marker, instead
        # of building and encoding the whole object for every token of every stream.
        marker = "\u0000piece\u0000"
        head_b, _, tail_b = chunk(marker, None).partition(dumps(marker))

        def text_events(pieces: list[str]) -> bytes:
            return b"".join(head_b + dumps(p) + tail_b for p in pieces)

        done = False
        run = self._start(inputs, params, True, cancel)
        try:
            try:
                if chat:
                    first = {"role": "assistant", "content": ""}
                    head = {"id": oid, "object": obj, "created": created, "model": self.alias}
                    head["choices"] = [{"index": 0, "delta": first, "finish_reason": None}]
                    yield b"data: " + dumps({**head, **extra}) + b"\n\n"
                async for pieces in run.pieces():
                    yield text_events(pieces)
                res = await run.result()
            finally:
                self.generating -= 1
            # Logged before the final events: a client that has read [DONE] finds this
            # request's record at the host (see complete()).
            done = True
            self.complete(rid, endpoint, t0, res.prompt_tokens, res.completion_tokens)
            await self.log.written()
            yield chunk(None, res.finish_reason)
            if params.include_usage:
                tail = {"id": oid, "object": obj, "created": created, "model": self.alias}
                tail.update(choices=[], usage=_usage(res))
                yield b"data: " + dumps(tail) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except APIError as err:
            done = True
            self.fail(rid, endpoint, err.status, err.message)
            yield b"data: " + dumps(err.body()) + b"\n\ndata: [DONE]\n\n"
        except Exception as err:
            if done:  # the client went away during the final events: it was logged
                raise
            done = True
            self.fail(rid, endpoint, 500, f"{type(err).__name__}: {err}")
            body = APIError(500, str(err), type_="server_error", code="internal_error").body()
            yield b"data: " + dumps(body) + b"\n\ndata: [DONE]\n\n"
        finally:
            if not done:  # the client went away mid-stream
                cancel.set()
                self.fail(rid, endpoint, 499, "client disconnected")

    # ---- plain routes ---------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {
            "status": "healthy",
            "model": self.alias,
            "model_type": self.model_type,
            "device": self.device,
        }

    def models(self) -> dict[str, Any]:
        caps = CAPABILITIES[self.model_type]
        ollama = {
            "name": self.alias,
            "model": self.alias,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": caps,
            "parameters": "",
            "details": {
                "parent_model": "",
                "format": "huggingface",
                "family": "",
                "families": [""],
                "parameter_size": "",
                "quantization_level": "",
            },
        }
        openai = {
            "id": self.alias,
            "object": "model",
            "created": self.created,
            "owned_by": "huggingface",
            "capabilities": caps,
        }
        return {"models": [ollama], "object": "list", "data": [openai]}

    def threads(self) -> dict[str, Any] | None:
        tuner = getattr(self.engine, "tuner", None)
        if tuner is not None:
            return tuner.stats()
        threads = getattr(self.args, "threads", None)
        return {"threads": threads[0], "us_per_token": {}} if threads else None

    def stats(self) -> dict[str, Any]:
        return {
            "model": self.alias,
            "model_type": self.model_type,
            "in_flight": self.in_flight,
            "generating": self.generating,
            "completed": self.completed,
            "errors": self.errors,
            "torch_threads": self.threads(),
            "batching": self.batcher.stats() if self.batcher else None,
            "decoding": self.decoder.stats() if self.decoder else None,
        }


# The request being handled, for the handlers that watch for its client leaving.
_REQUEST: contextvars.ContextVar[Request] = contextvars.ContextVar("hf_request")


class ClientGone(APIError):
    def __init__(self) -> None:
        super().__init__(499, "client disconnected", code="client_disconnected")


async def _unless_disconnected(work: Awaitable[Any], request: Request | None) -> Any:
    """`work`'s result; ClientGone (and `work` cancelled) if the client hangs up first.

    A non-streamed generation sends nothing until it ends, so only the connection closing
    says that nobody waits for it any more (ASGI's http.disconnect, once the body is read).
    """
    task = asyncio.ensure_future(work)
    if request is None:
        return await task

    watch = asyncio.ensure_future(hang_up(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


def _usage(res: Any) -> dict[str, Any]:
    return {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


def build_app(srv: HFServer) -> Starlette:
    unauthorized = APIError(
        401, "Invalid or missing API key", type_="authentication_error", code="invalid_api_key"
    )

    async def health(request: Request) -> Response:
        return json_response(srv.health())

    async def models(request: Request) -> Response:
        if not srv.authorized(request):
            return error_response(unauthorized)
        return json_response(srv.models())

    async def stats(request: Request) -> Response:
        if not srv.authorized(request):
            return error_response(unauthorized)
        return json_response(srv.stats())

    def post(endpoint: str, handler: Callable) -> Route:
        async def route(request: Request) -> Response:
            return await srv.run_endpoint(request, endpoint, handler)

        return Route(endpoint, route, methods=["POST"])

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, msg, code=code))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if srv.batcher is not None:
            srv.batcher.start()
        srv.start_decoder()
        yield
        if srv.decoder is not None:
            await asyncio.get_running_loop().run_in_executor(None, srv.decoder.stop)
        if srv.batcher is not None:
            await srv.batcher.stop()
        srv.worker.shutdown(wait=False, cancel_futures=True)
        srv.log.flush()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/stats", stats, methods=["GET"]),
        post("/v1/chat/completions", srv.chat),
        post("/v1/completions", srv.completions),
        post("/v1/classify", srv.classify),
        post("/v1/embeddings", srv.embeddings),
    ]
    return Starlette(
        routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hf_server", description=__doc__.split("\n")[0])
    p.add_argument("--model-id", required=True)
    p.add_argument("--model-type", required=True, choices=MODEL_TYPES)
    p.add_argument("--alias", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--use-flash-attention", action="store_true")
    p.add_argument("--labels-json", default=None, help='JSON list of labels, e.g. ["neg","pos"]')
    p.add_argument("--normalize-embeddings", action="store_true")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-window-ms", type=float, default=2.0)
    p.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="torch intra-op threads (0: OMP_NUM_THREADS if set, else measured per batch "
        "between all CPUs and all but one)",
    )
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="vision: fetch http(s) image URLs (public addresses only); off: data: URIs only",
    )
    p.add_argument("--max-images", type=int, default=8, help="vision: images per request")
    p.add_argument(
        "--max-image-bytes", type=int, default=10 * 1024 * 1024, help="vision: bytes per image"
    )
    args = p.parse_args(argv)
    if args.max_images < 1 or args.max_image_bytes < 1:
        p.error("--max-images and --max-image-bytes must be >= 1")
    if args.labels_json is not None:
        try:
            labels = json.loads(args.labels_json)
        except ValueError as err:
            p.error(f"--labels-json is not valid JSON: {err}")
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            p.error("--labels-json must be a JSON list of strings")
        args.labels = labels or None
    else:
        args.labels = None
    if args.max_length < 1 or args.max_batch_size < 1 or args.batch_window_ms < 0:
        p.error("--max-length and --max-batch-size must be >= 1, --batch-window-ms >= 0")
    if args.num_threads < 0:
        p.error("--num-threads must be >= 0 (0 picks a count from the CPUs)")
    return args


def _log_config() -> dict[str, Any]:
    """uvicorn's messages on stdout, next to our markers (one file for the host to read)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s: %(message)s"}},
        "handlers": {
            "out": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {
            "uvicorn": {"handlers": ["out"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
        },
    }


def bind_early(host: str, port: int) -> socket.socket:
    """Bind (not listen on) the port before the model loads, as uvicorn would bind it.

    Loading takes seconds (tens on a loaded machine): a port the host found free could be
    taken in that time by any other process that asks the kernel for a free port, and the
    backend would die at the end of its load. Bound but not listening, the port is ours from
    the first moment (against everyone but another SO_REUSEADDR binder, which main()'s listen
    then catches), and a client that connects early is refused at once rather than left
    waiting in a backlog; main() listens on it once the model has loaded.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keys = keys_from_env()
    try:
        sock = bind_early(args.host, args.port)
    except OSError as err:
        print(
            f"[FATAL] Cannot bind {args.host}:{args.port}: {err} (another process has the port)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    log_line(f"Loading {args.model_type} model {args.model_id} as '{args.alias}'")
    from solar_host.servers.hf_runtime import (
        LoadError,
        LoadOptions,
        configure_threads,
        load_engine,
    )

    args.threads = configure_threads(args.num_threads)

    opts = LoadOptions(
        model_id=args.model_id,
        model_type=args.model_type,
        device=args.device,
        dtype=args.dtype,
        max_length=args.max_length,
        trust_remote_code=args.trust_remote_code,
        use_flash_attention=args.use_flash_attention,
        labels=args.labels,
        normalize_embeddings=args.normalize_embeddings,
        max_batch_size=args.max_batch_size,
        threads=args.threads,
    )
    t0 = time.perf_counter()
    try:
        engine, device = load_engine(opts)
    except LoadError as err:
        print(f"[FATAL] Model load failed: {err}", file=sys.stderr, flush=True)
        return 1
    log_line(
        f"Model loaded on {device} in {time.perf_counter() - t0:.2f} s "
        f"(torch threads: {'/'.join(map(str, args.threads))})"
    )

    import uvicorn

    srv = HFServer(engine, args, device, keys)
    config = uvicorn.Config(
        build_app(srv),
        host=args.host,
        port=args.port,
        log_config=_log_config(),
        access_log=False,
        proxy_headers=False,  # no proxy in front; its middleware ran on every request
        # Request headers bounded in time and size.
        http=guarded_protocol(_seconds_from_env("SOLAR_HF_HEADER_TIMEOUT_S", HEADER_TIMEOUT_S)),
        lifespan="on",
        timeout_graceful_shutdown=5,
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # uvicorn logs this only for sockets it bound itself
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                    f"[{args.host}]" if ":" in args.host else args.host,
                    args.port,
                )

    # Listen here, where a conflict raises, rather than leave it to uvicorn: SO_REUSEADDR lets
    # two processes bind one port while neither listens, and the second listen(2) then fails
    # with EADDRINUSE, which uvloop's create_server does not report. Without this the second
    # backend logged "Uvicorn running" and served nothing while the first took its requests
    # (two hf_servers handed one port, seen in CI).
    try:
        sock.listen(config.backlog)
    except OSError as err:
        print(
            f"[FATAL] Cannot listen on {args.host}:{args.port}: {err} (another process bound "
            "the port while the model loaded)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    server = Server(config)
    server.run(sockets=[sock])
    if not server.started:
        print("[FATAL] HTTP server did not start (see the error above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Chat and completion requests of hf_server: prompts to token ids, generations started
(a causal model's join the decode scheduler's running batch, hf_decode; a vision model's run
one at a time through model.generate), and their answers, whole or as server-sent events.

torch is imported only once a generation starts (hf_decode): the server binds its port first.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.responses import Response

from solar_host.servers.hf_images import ImageLoader
from solar_host.servers.hf_protocol import (
    APIError,
    dumps,
    parse_gen_params,
    parse_prompt,
    refuse_long_chat,
    text_messages,
    vision_messages,
)
from solar_host.servers.http_answers import CURRENT_REQUEST, json_response, unless_disconnected
from solar_host.servers.request_log import RequestLog
from solar_host.servers.sse import EventStream

# Prompts up to this many characters are tokenized on the event loop (a few ms at most).
ON_LOOP_PROMPT_CHARS = 64 * 1024


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


class Arrivals:
    """Chat and completion requests being made ready on the event loop (parsed, tokenized):
    each reaches the scheduler within moments, and it waits for them before a prefill
    (DecodeScheduler._gather). Written on the event loop, read by the decode thread (a hint)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        """A request being made ready, counted until the block ends, however it ends: the
        generation starts right after, in the same turn of the loop."""
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """Within `one`: work that takes long (a prompt of megabytes tokenized in a thread),
        which the scheduler must not wait for."""
        self.count -= 1
        try:
            yield
        finally:
            self.count += 1


class Generations:
    """The server's generations: started, streamed or answered whole, and counted."""

    def __init__(
        self,
        engine: Any,
        device: str,
        alias: str,
        vision: bool,
        worker: ThreadPoolExecutor,
        images: ImageLoader,
        requests: RequestLog,
        max_batch_size: int,
        threads: int | None,
    ):
        self.engine = engine
        self.device = device
        self.alias = alias
        self.vision = vision
        self.worker = worker  # the model's one thread (shared with the batcher)
        self.images = images
        self.requests = requests
        self.max_batch_size = max_batch_size
        self.threads = threads  # torch threads of the decode thread (None: as configured)
        self.gen_lock = asyncio.Lock()
        # Causal models decode in the step-level scheduler (hf_decode), started in lifespan.
        self.decoder: Any = None
        self.generating = 0
        self.arrivals = Arrivals()

    def start(self) -> None:
        """Start the decode scheduler (a causal model's; a vision model needs none)."""
        if self.vision:
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

        self.decoder = DecodeScheduler(
            self.engine.model,
            self.engine.tok,
            self.device,
            self.max_batch_size,
            post,
            threads=self.threads,
            arriving=lambda: self.arrivals.count,
        )
        self.decoder.start()

    async def stop(self) -> None:
        """Stop the decode scheduler: what it still held is cancelled."""
        if self.decoder is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.decoder.stop)

    async def chat(self, body: dict[str, Any], rid: str, t0: float) -> Response:
        if self.vision:
            params = self._gen_params(body)
            refuse_long_chat(body, self.engine.limit, self.engine.max_prompt_chars)
            messages, urls = vision_messages(body, self.images.policy.max_images)
            images = await self.images.load(urls)
            loop = asyncio.get_running_loop()
            inputs: Any = await loop.run_in_executor(
                self.worker, self.engine.vision_inputs, messages, images
            )
        else:
            with self.arrivals.one():
                params = self._gen_params(body)
                refuse_long_chat(body, self.engine.limit, self.engine.max_prompt_chars)
                prompt = self.engine.chat_prompt(text_messages(body))
                inputs = await self._prompt_ids(prompt, chat=True)
        return await self._generate(inputs, params, rid, t0, "/v1/chat/completions", chat=True)

    async def completions(self, body: dict[str, Any], rid: str, t0: float) -> Response:
        with self.arrivals.one():
            params = self._gen_params(body)
            ids = await self._prompt_ids(parse_prompt(body), chat=False)
        return await self._generate(ids, params, rid, t0, "/v1/completions", chat=False)

    def _gen_params(self, body: dict[str, Any]) -> Any:
        from solar_host.servers.model_facts import vocab_size
        from solar_host.servers.sampling import check_logit_bias

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
        with self.arrivals.away():
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
        oid = ("chatcmpl-" if chat else "cmpl-") + self.requests.response_id()
        created = int(time.time())
        if not params.stream:
            run = self._start(inputs, params, False, cancel)
            try:
                res = await unless_disconnected(run.result(), CURRENT_REQUEST.get(None))
            except BaseException:
                cancel.set()  # e.g. the request task was cancelled: free the row
                raise
            finally:
                self.generating -= 1
            self.requests.complete(rid, endpoint, t0, res.prompt_tokens, res.completion_tokens)
            await self.requests.log.written()
            usage = usage_of(res)
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
            self.requests.complete(rid, endpoint, t0, res.prompt_tokens, res.completion_tokens)
            await self.requests.log.written()
            yield chunk(None, res.finish_reason)
            if params.include_usage:
                tail = {"id": oid, "object": obj, "created": created, "model": self.alias}
                tail.update(choices=[], usage=usage_of(res))
                yield b"data: " + dumps(tail) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except APIError as err:
            done = True
            self.requests.fail(rid, endpoint, err.status, err.message)
            yield b"data: " + dumps(err.body()) + b"\n\ndata: [DONE]\n\n"
        except Exception as err:
            if done:  # the client went away during the final events: it was logged
                raise
            done = True
            self.requests.fail(rid, endpoint, 500, f"{type(err).__name__}: {err}")
            body = APIError(500, str(err), type_="server_error", code="internal_error").body()
            yield b"data: " + dumps(body) + b"\n\ndata: [DONE]\n\n"
        finally:
            if not done:  # the client went away mid-stream
                cancel.set()
                self.requests.fail(rid, endpoint, 499, "client disconnected")


def usage_of(res: Any) -> dict[str, Any]:
    return {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }

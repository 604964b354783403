"""hf_server's application: its state (the engine, the model's worker thread, the batcher of
embeddings and classifications, the generations, the request log, the API keys) and its routes.

Each POST route goes through `HFServer.run_endpoint`: the API key, the body (bounded in size
and in time), the [REQUEST] marker, then the handler, whose end is logged as [COMPLETE] or
[ERROR] (log_lines) and whose refusal is an OpenAI-style error body.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from solar_host.servers.hf_batcher import DynamicBatcher
from solar_host.servers.hf_generation import Generations
from solar_host.servers.hf_images import ImageLoader, ImagePolicy
from solar_host.servers.hf_protocol import (
    APIError,
    embeddings_body,
    parse_body,
    parse_classify,
    parse_embedding,
)
from solar_host.servers.http_answers import (
    CURRENT_REQUEST,
    JSON,
    ClientGone,
    error_response,
    json_response,
)
from solar_host.servers.request_log import RequestLog

CAPABILITIES = {
    "causal": ["completion"],
    "classification": ["classification"],
    "embedding": ["embedding"],
    "vision": ["completion", "multimodal"],
}
MIN_BODY_LIMIT = 8 * 1024 * 1024
# Longest wait for a request's body (the environment may set another: hf_server).
BODY_TIMEOUT_S = 30.0


class HFServer:
    """The app's state: the engine, the worker thread, the batcher, counters and auth."""

    def __init__(
        self,
        engine: Any,
        args: argparse.Namespace,
        device: str,
        keys: list[bytes],
        body_timeout_s: float = BODY_TIMEOUT_S,
    ):
        self.engine = engine
        self.args = args
        self.alias = args.alias
        self.model_type = args.model_type
        self.device = device
        self.keys = keys
        self.created = int(time.time())
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="hf-model")
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
                allow_urls=args.allow_image_urls,
                max_images=args.max_images,
                max_bytes=args.max_image_bytes,
            )
        )
        # The largest body read: for a vision model, room for every allowed image as base64,
        # plus the text; for the others the text alone.
        self.max_body = MIN_BODY_LIMIT
        if args.model_type == "vision":
            policy = self.images.policy
            self.max_body += max(MIN_BODY_LIMIT, policy.max_images * policy.max_bytes * 4 // 3)
        self.body_timeout_s = body_timeout_s
        self.requests = RequestLog()
        self.generations: Generations | None = None
        if args.model_type in ("causal", "vision"):
            threads = args.threads  # set by the load (hf_server.load)
            self.generations = Generations(
                engine,
                device,
                self.alias,
                args.model_type == "vision",
                self.worker,
                self.images,
                self.requests,
                args.max_batch_size,
                threads[0] if threads else None,
            )

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
        rid, t0 = self.requests.begin(endpoint)
        try:
            body = parse_body(await self.read_body(request))
            CURRENT_REQUEST.set(request)
            return await handler(body, rid, t0)
        except ClientDisconnect:  # gone while its body was read: not the server's error
            err = ClientGone()
            self.requests.fail(rid, endpoint, err.status, err.message)
            return error_response(err)
        except APIError as err:
            self.requests.fail(rid, endpoint, err.status, err.message)
            return error_response(err)
        except Exception as err:
            status = 503 if "out of memory" in str(err).lower() else 500
            msg = f"{type(err).__name__}: {err}"
            self.requests.fail(rid, endpoint, status, msg)
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
        self.requests.complete(rid, "/v1/embeddings", t0, tokens, 0)
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
        self.requests.complete(rid, "/v1/classify", t0, tokens, 0)
        return json_response(
            {
                "id": f"clf-{self.requests.response_id()}",
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
        assert self.generations is not None
        return await self.generations.chat(body, rid, t0)

    async def completions(self, body: dict[str, Any], rid: str, t0: float) -> Response:
        self.require("causal", what="/v1/completions")
        assert self.generations is not None
        return await self.generations.completions(body, rid, t0)

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
        threads = self.args.threads
        return {"threads": threads[0], "us_per_token": {}} if threads else None

    def stats(self) -> dict[str, Any]:
        gen = self.generations
        return {
            "model": self.alias,
            "model_type": self.model_type,
            "in_flight": self.requests.in_flight,
            "generating": gen.generating if gen else 0,
            "completed": self.requests.completed,
            "errors": self.requests.errors,
            "torch_threads": self.threads(),
            "batching": self.batcher.stats() if self.batcher else None,
            "decoding": gen.decoder.stats() if gen and gen.decoder else None,
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
        if srv.generations is not None:
            srv.generations.start()
        yield
        if srv.generations is not None:
            await srv.generations.stop()
        if srv.batcher is not None:
            await srv.batcher.stop()
        srv.worker.shutdown(wait=False, cancel_futures=True)
        srv.requests.log.flush()

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

"""Bound request bodies before anything parses them: past `max_bytes`, or holding more JSON
values than any request of this API needs, they are a 413; not all there within `timeout_s` of
the request's start, a 408.

Every body the host takes is JSON, parsed whole (json.loads, then pydantic), on the event loop.
Bytes alone do not bound that: 8 MiB of `{},` is 2.8 million objects, which took 220 MB and held
the loop for 1.3 s per request. The values are counted as the body arrives (in C, a chunk at a
time), so such a body is refused before it is buffered, let alone parsed.

Nor does anything else bound the time a body may take: a request whose body stops coming (a
client gone quiet, or one sending a byte a minute) held its handler, and whatever that handler
held (an instance's lock, a pull's slot), for as long as the connection stayed open.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from solar_host.api.asgi_json import detail, send_json

# The most JSON values a request body may hold. The largest bodies the host takes (a job of
# many steps with their environments, an instance config) hold a few thousand; 100,000 empty
# objects are about 7 MB once parsed.
MAX_JSON_VALUES = 100_000


def json_values_at_least(chunk: bytes) -> int:
    """A count no smaller than the JSON values `chunk` adds (each value but a container's first
    follows a comma); commas inside strings count too, which only errs on the refusing side."""
    return chunk.count(b",") + chunk.count(b"[") + chunk.count(b"{")


# How long a request's body may take to arrive, from the request's start (HTTP_BODY_TIMEOUT_S).
BODY_TIMEOUT_S = 30.0


class BodyLimitMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_values: int = MAX_JSON_VALUES,
        timeout_s: float = BODY_TIMEOUT_S,
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.max_values = max_values
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        has_body = False
        for name, value in scope.get("headers") or ():
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = 1  # the server refused it; counted below all the same
                if length > self.max_bytes:
                    await _reject(send, 413, self._too_many_bytes())
                    return
                has_body = has_body or length > 0
            elif name == b"transfer-encoding":
                has_body = True
        if not has_body:
            # No Content-Length (or 0) and no Transfer-Encoding: HTTP/1.1 frames no body, so
            # there is nothing to bound (a GET polled hard passes with no wrapping).
            await self.app(scope, receive, send)
            return
        seen = 0
        values = 0
        sent_response = False
        refusal: str | None = None
        status = 413
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        body_done = False

        async def limited_receive() -> Message:
            nonlocal seen, values, refusal, status, body_done
            if body_done:
                # What comes after the body (a disconnect a streaming answer waits for) is
                # not bounded here.
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                refusal = f"The request body did not arrive within {self.timeout_s:g} s"
                status = 408
                raise _Refused from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            if message["type"] == "http.request":
                body = message.get("body", b"")
                seen += len(body)
                values += json_values_at_least(body)
                if seen > self.max_bytes:
                    refusal = self._too_many_bytes()
                elif values > self.max_values:
                    refusal = f"Request body holds more than {self.max_values} JSON values"
                if refusal is not None:
                    raise _Refused
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal sent_response
            if refusal is not None:
                # The app caught the refusal while reading (FastAPI turns any body error into
                # a 400): answer the 413 or 408 it is, once, and drop the app's own reply.
                if not sent_response:
                    sent_response = True
                    await _reject(send, status, refusal)
                return
            if message["type"] == "http.response.start":
                sent_response = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _Refused:
            if not sent_response:
                await _reject(send, status, refusal or self._too_many_bytes())

    def _too_many_bytes(self) -> str:
        return f"Request body larger than {self.max_bytes} bytes"


class _Refused(Exception):
    """The body was refused (413 or 408): raised out of the app's receive."""


async def _reject(send: Send, status: int, message: str) -> None:
    await send_json(send, status, detail(message))

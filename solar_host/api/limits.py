"""Refuse oversized request bodies with 413 before anything parses them: past `max_bytes`, or
holding more JSON values than any request of this API needs.

Every body the host takes is JSON, parsed whole (json.loads, then pydantic), on the event loop.
Bytes alone do not bound that: 8 MiB of `{},` is 2.8 million objects, which took 220 MB and held
the loop for 1.3 s per request. The values are counted as the body arrives (in C, a chunk at a
time), so such a body is refused before it is buffered, let alone parsed.
"""

from __future__ import annotations

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


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, max_values: int = MAX_JSON_VALUES):
        self.app = app
        self.max_bytes = max_bytes
        self.max_values = max_values

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers") or ():
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await _reject(send, self._too_many_bytes())
                    return
        seen = 0
        values = 0
        sent_response = False
        refusal: str | None = None

        async def limited_receive() -> Message:
            nonlocal seen, values, refusal
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                seen += len(body)
                values += json_values_at_least(body)
                if seen > self.max_bytes:
                    refusal = self._too_many_bytes()
                elif values > self.max_values:
                    refusal = f"Request body holds more than {self.max_values} JSON values"
                if refusal is not None:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal sent_response
            if refusal is not None:
                # The app caught the overflow while parsing (FastAPI turns any body error into
                # a 400): answer the 413 it should be, once, and drop the app's own reply.
                if not sent_response:
                    sent_response = True
                    await _reject(send, refusal)
                return
            if message["type"] == "http.response.start":
                sent_response = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not sent_response:
                await _reject(send, refusal or self._too_many_bytes())

    def _too_many_bytes(self) -> str:
        return f"Request body larger than {self.max_bytes} bytes"


class _TooLarge(Exception):
    pass


async def _reject(send: Send, message: str) -> None:
    await send_json(send, 413, detail(message))

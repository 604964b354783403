"""Refuse oversized request bodies with 413 before anything reads them."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from solar_host.api.asgi_json import detail, send_json


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

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
                    await _reject(send, self.max_bytes)
                    return
        seen = 0
        sent_response = False
        too_large = False

        async def limited_receive() -> Message:
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_large = True
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal sent_response
            if too_large:
                # The app caught the overflow while parsing (FastAPI turns any body error into
                # a 400): answer the 413 it should be, once, and drop the app's own reply.
                if not sent_response:
                    sent_response = True
                    await _reject(send, self.max_bytes)
                return
            if message["type"] == "http.response.start":
                sent_response = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not sent_response:
                await _reject(send, self.max_bytes)


class _TooLarge(Exception):
    pass


async def _reject(send: Send, limit: int) -> None:
    await send_json(send, 413, detail(f"Request body larger than {limit} bytes"))

"""A bound on request bodies, enforced before any route runs.

A declared Content-Length over the bound is refused at once. Otherwise the body is read here,
up to the bound, before the route is called (the API's bodies are small, so buffering costs
nothing), and a body that streams past it (chunked, without a length) is refused with 413 too;
the route then reads the buffered body as usual.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = JSONResponse(
            {"detail": f"request body larger than {self.max_bytes} bytes (api.max_request_bytes)"},
            status_code=413,
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await JSONResponse({"detail": "invalid Content-Length"}, 400)(scope, receive, send)
                return
            if declared > self.max_bytes:
                await too_large(scope, receive, send)
                return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        buffered: list[Message] = [
            {"type": "http.request", "body": bytes(body), "more_body": False}
        ]

        async def replay() -> Message:
            # The body once, then whatever the server says next (e.g. a disconnect).
            return buffered.pop() if buffered else await receive()

        await self.app(scope, replay, send)

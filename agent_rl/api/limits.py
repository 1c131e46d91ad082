"""A bound on request bodies, enforced before any route reads them.

The declared Content-Length is checked first; a body sent without one (chunked) is counted
as it streams, and reading past the bound raises the 413 the route then answers with.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> str:
        return f"request body larger than {self.max_bytes} bytes (api.max_request_bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await JSONResponse({"detail": "invalid Content-Length"}, 400)(scope, receive, send)
                return
            if declared > self.max_bytes:
                await JSONResponse({"detail": self._too_large()}, 413)(scope, receive, send)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, counted, send)

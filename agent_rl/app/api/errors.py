"""Every error the API returns is JSON `{"detail": message}`, never a traceback.

agent-rl's own errors map by the boundary they crossed: a missing row is 404, a store state
conflict 409, an unreachable engine or a broken sandbox 503, anything else the caller asked
for wrongly 400. A store fault (`StoreFault`: the database stayed unreachable through the
store's retries, or refused a statement) is 503 or 500. Validation errors are 422 with the
offending fields named in one line.

Any other exception is logged with its traceback here and answered 500 with its type and the
first line of its message, cut to `MAX_DETAIL` characters; for a database error that is the
driver's own message, never the SQL, its parameters or a link to SQLAlchemy's docs (they go to
the log). The catch-all is a middleware inside Starlette's outermost one, so that a 500 is
an ordinary response: it does not close the client's keep-alive connection.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_rl.app.api.schemas import ErrorOut
from agent_rl.kernel.errors import (
    AgentRLError,
    EngineError,
    NotFoundError,
    SandboxError,
    StoreError,
)
from agent_rl.store.base import StoreFault, one_line

log = logging.getLogger("agent_rl.app.api")

# Documented on every route so that clients (and schemathesis) know the error shape.
ERROR_RESPONSES: dict[int | str, dict] = {
    code: {"model": ErrorOut, "description": text}
    for code, text in [
        (400, "Bad request"),
        (401, "Missing or wrong bearer token"),
        (403, "Disabled: no token configured"),
        (404, "Not found"),
        (409, "Conflict with the episode's state"),
        (413, "Request body too large"),
        (422, "Invalid parameters"),
        (500, "Internal error"),
        (503, "Engine or sandbox unavailable"),
    ]
}


MAX_DETAIL = 500
"""Characters of an unexpected error's message that reach the client."""


def status_for(e: AgentRLError) -> int:
    if isinstance(e, StoreFault):
        return 503 if e.transient else status.HTTP_500_INTERNAL_SERVER_ERROR
    if isinstance(e, NotFoundError):
        return status.HTTP_404_NOT_FOUND
    if isinstance(e, StoreError):
        return status.HTTP_409_CONFLICT
    if isinstance(e, (EngineError, SandboxError)):
        return status.HTTP_503_SERVICE_UNAVAILABLE
    return status.HTTP_400_BAD_REQUEST


def describe_validation(e: RequestValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def internal_detail(e: BaseException) -> str:
    """What a client learns of an unexpected error: its type and its message's first line."""
    return f"internal error: {type(e).__name__}: {one_line(e)}"[:MAX_DETAIL]


def install_error_handlers(app: FastAPI) -> None:
    """JSON for every error; call it before adding other middleware, so that the catch-all
    sits innermost (below them, it sees exceptions before Starlette's outermost layer)."""

    @app.exception_handler(AgentRLError)
    async def agent_rl_error(request: Request, e: AgentRLError) -> JSONResponse:
        if isinstance(e, StoreFault):
            log.error("store fault on %s %s", request.method, request.url.path, exc_info=e)
        return JSONResponse({"detail": str(e)}, status_code=status_for(e))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": describe_validation(e)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": str(e.detail)}, status_code=e.status_code, headers=e.headers)

    app.add_middleware(InternalErrors)


class InternalErrors:
    """Answers an exception no handler took with a 500 (logged with its traceback), unless
    the response had already started (a stream), which only closing the connection can end."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as e:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await JSONResponse({"detail": internal_detail(e)}, status_code=500)(
                scope, receive, send
            )

"""Every error the API returns is JSON `{"detail": message}`, never a traceback.

agent-rl's own errors map by the boundary they crossed: a missing row is 404, a store state
conflict 409, an unreachable engine or a broken sandbox 503, anything else the caller asked
for wrongly 400. Validation errors are 422 with the offending fields named in one line. Any
other exception is logged with its traceback here and answered 500 with its type and message.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_rl.api.schemas import ErrorOut
from agent_rl.errors import (
    AgentRLError,
    EngineError,
    NotFoundError,
    SandboxError,
    StoreError,
)

log = logging.getLogger("agent_rl.api")

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


def status_for(e: AgentRLError) -> int:
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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AgentRLError)
    async def agent_rl_error(request: Request, e: AgentRLError) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=status_for(e))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": describe_validation(e)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": str(e.detail)}, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {type(e).__name__}: {e}"}, status_code=500)

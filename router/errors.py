"""Router-made errors: one JSON shape, OpenAI's, for every error the router itself produces.

An answer a worker gave is relayed as the worker wrote it. Anything the router decides on its own
(no route, wrong method, a missing token, a body too large, no worker, a worker that failed) is
`{"error": {"message", "type": "router_error", "param": null, "code": <status>}}`, plus `worker`
when one worker is to blame, so OpenAI SDK clients surface the message and a caller can tell the
router's verdict from the engine's. `json_errors` turns aiohttp's own errors (404, 405, 413) and
unexpected exceptions into that shape; only malformed HTTP rejected by the parser before any
handler runs keeps aiohttp's plain-text 400.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

log = logging.getLogger("agent_rl.router")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, worker: str | None = None) -> web.Response:
    """A router-made error in the OpenAI error shape."""
    err: dict[str, Any] = {"message": message, "type": "router_error", "param": None,
                           "code": status}
    if worker is not None:
        err["worker"] = worker
    return web.json_response({"error": err}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give aiohttp's errors and the router's unexpected failures the router's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        response = error_response(e.status, _message(request, e))
        if "Allow" in e.headers:
            response.headers["Allow"] = e.headers["Allow"]
        return response
    except Exception:
        if request.writer.output_size > 0:
            raise  # part of an answer is out: aiohttp closes the connection, the honest signal
        log.exception("router failed on %s %s", request.method, request.path)
        return error_response(500, "the router failed on this request (a bug: its log has "
                              "the traceback); the request may not have reached a worker")


def _message(request: web.Request, e: web.HTTPException) -> str:
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        return f"{request.path} does not take {request.method}; it takes {allowed}"
    if isinstance(e, web.HTTPNotFound):
        return (f"the router has no route {request.path}: it forwards SGLang's /generate and "
                "the OpenAI /v1 routes, and serves its own /health, /metrics, /workers and "
                "control endpoints (docs/router.md)")
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return f"{e.text} raise [router] max_body_mb to accept larger requests"
    return e.text or e.reason

"""The agent gateway over HTTP: OpenAI's `/v1/chat/completions` and `/v1/models`, one base URL
per running agent episode.

    POST /agents/{key}/v1/chat/completions    (stream or not)
    GET  /agents/{key}/v1/models

The key in the path selects the episode and must also be the request's bearer token
(`Authorization: Bearer {key}`, what an OpenAI client sends as its API key), so a program
holding one episode's key can reach that episode only. Every refusal is in OpenAI's error
shape: 400 for a malformed request or a spent budget, 401 for a wrong key, 404 for an
unknown episode, 409 for an episode that has ended, 502 when the engine failed. The scheme
`Bearer` is case-insensitive, as in the web API; two `Authorization` headers are no key.

Like the web API, the gateway answers only its own Host (its bind address and the loopback
names on its port, plus `rollout.gateway_allowed_hosts`; 421 otherwise), so a web page
in a browser on this machine cannot reach it by DNS rebinding.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_rl.config.access import HostGuard, HostRule, bearer_matches, one_header
from agent_rl.rollout.gateway import AgentSession, Gateway
from agent_rl.rollout.gateway_relay import SANDBOX_PORT
from agent_rl.rollout.openai_wire import ChatRequest, GatewayError


def gateway_app(gateway: Gateway, host: str = "127.0.0.1", allowed_hosts: Sequence[str] = ()) -> FastAPI:
    """The gateway's app for a bind on `host`, answering its Host rule plus `allowed_hosts`
    and the in-sandbox relay's `127.0.0.1:SANDBOX_PORT` (a byte pipe: the agent's Host)."""
    app = FastAPI(title="agent-rl agent gateway", docs_url=None, redoc_url=None, openapi_url=None)
    rule = HostRule(host, [*allowed_hosts, f"127.0.0.1:{SANDBOX_PORT}"])
    app.add_middleware(HostGuard, rule=rule, body=lambda message: GatewayError(421, message).body())

    @app.exception_handler(GatewayError)
    async def refused(request: Request, e: GatewayError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        error = GatewayError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(GatewayError(400, str(e.errors()[0].get("msg", e))).body(), status_code=400)

    @app.get("/agents/{key}/v1/models")
    async def models(key: str, request: Request) -> dict[str, Any]:
        _authorized(gateway, key, request)
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model",
                                            "created": int(time.time()), "owned_by": "agent-rl"}]}  # fmt: skip

    @app.post("/agents/{key}/v1/chat/completions", response_model=None)
    async def chat_completions(key: str, request: Request) -> Any:
        session = _authorized(gateway, key, request)
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise GatewayError(400, f"the request body is not JSON: {e}") from e
        req = ChatRequest.parse(body)
        if not req.stream:  # plain JSON, not FastAPI's encoder: it walks every value again
            return Response(json.dumps(await session.complete(req), separators=(",", ":")),
                            media_type="application/json")
        chunks = session.stream(req)
        first = await anext(chunks)  # refusals (budget, 409, a bad message) come before any byte
        return StreamingResponse(_sse(first, chunks), media_type="text/event-stream")

    return app


def _authorized(gateway: Gateway, key: str, request: Request) -> AgentSession:
    session = gateway.session(key)
    if not bearer_matches(one_header(request.headers.getlist("authorization")), key):
        raise GatewayError(401, "the API key must be this episode's key (the one in the URL)",
                           type="authentication_error", code="invalid_api_key")
    return session


async def _sse(first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    yield _event(first)
    try:
        async for c in rest:
            yield _event(c)
    except GatewayError as e:  # after the headers: the error is the stream's last event
        yield _event(e.body())
        return
    yield b"data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

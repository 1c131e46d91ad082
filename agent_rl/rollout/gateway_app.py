"""The agent gateway over HTTP: OpenAI's `/v1/chat/completions`, `/v1/responses` and `/v1/models`
and Anthropic's `/v1/messages` and `/v1/messages/count_tokens`, one base URL per running agent
episode.

    POST /agents/{key}/v1/chat/completions    (stream or not)
    POST /agents/{key}/v1/responses           (stream or not)
    GET  /agents/{key}/v1/models
    POST /agents/{key}/v1/messages            (stream or not; also under .../v1/v1/)
    POST /agents/{key}/v1/messages/count_tokens

The key in the path selects the episode and must also be the request's bearer token
(`Authorization: Bearer {key}`, what an OpenAI client sends as its API key) or its `x-api-key`
header (what Anthropic's client sends), so a program
holding one episode's key can reach that episode only. Every refusal is in OpenAI's error
shape: 400 for a malformed request or a spent budget, 401 for a wrong key, 404 for an
unknown episode, 409 for an episode that has ended, 502 when the engine failed. The scheme
`Bearer` is case-insensitive, as in the web API; two `Authorization` headers are no key.

Like the web API, the gateway answers only its own Host (its bind address and the loopback
names on its port, plus `rollout.gateway_allowed_hosts`; 421 otherwise), so a web page
in a browser on this machine cannot reach it by DNS rebinding.

It is a Starlette app, not a FastAPI one: every route takes the raw request and answers JSON
it builds itself, and FastAPI's per-request dependency solving and extra middlewares were a
third of the HTTP layers' CPU per call (bench/gateway.py: a call should cost serve what an SDK
turn costs).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agent_rl.config.access import HostGuard, HostRule, bearer_matches, one_header
from agent_rl.kernel import jsonfast
from agent_rl.rollout import anthropic_wire, chat_completions, responses_wire
from agent_rl.rollout.gateway import AgentSession, Gateway
from agent_rl.rollout.gateway_relay import SANDBOX_PORT
from agent_rl.rollout.openai_wire import ChatRequest, GatewayError

T = TypeVar("T")


def gateway_app(gateway: Gateway, host: str = "127.0.0.1", allowed_hosts: Sequence[str] = ()) -> Starlette:
    """The gateway's app for a bind on `host`, answering its Host rule plus `allowed_hosts`
    and the in-sandbox relay's `127.0.0.1:SANDBOX_PORT` (a byte pipe: the agent's Host)."""
    rule = HostRule(host, [*allowed_hosts, f"127.0.0.1:{SANDBOX_PORT}"])

    async def refused(request: Request, e: Exception) -> Response:
        assert isinstance(e, GatewayError)
        return _refusal(request, e)

    async def http_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, StarletteHTTPException)
        if e.status_code == 404:
            return _refusal(request, GatewayError(404, f"no such route: {request.method} {request.url.path}; "
                                                       f"the gateway serves {ROUTES}", code="not_found"))
        return _refusal(request, GatewayError(e.status_code, str(e.detail)))

    async def models(request: Request) -> Response:
        _authorized(gateway, request)
        return _json({"object": "list", "data": [{"id": gateway.model_name, "object": "model",
                                                  "created": int(time.time()), "owned_by": "agent-rl"}]})  # fmt: skip

    async def completions(request: Request) -> Response:
        session = _authorized(gateway, request)
        req = ChatRequest.parse(await _body(request))
        if not req.stream:
            return _json(await until_disconnected(request, chat_completions.complete(session, req)) or {})
        chunks = chat_completions.stream(session, req)
        first = await anext(chunks)  # refusals (budget, 409, a bad message) come before any byte
        return _Stream(_sse(first, chunks), media_type="text/event-stream")

    async def messages(request: Request) -> Response:
        session = _authorized(gateway, request)
        req = anthropic_wire.to_chat(await _body(request))
        model = req.model or gateway.model_name
        if not req.stream:
            answer = await until_disconnected(request, session.answer(req))
            return _json(anthropic_wire.message_body(answer, model) if answer is not None else {})
        events = anthropic_wire.stream(session, req, model)
        first = await anext(events)
        return _Stream(_named_sse(first, events), media_type="text/event-stream")

    async def count_tokens(request: Request) -> Response:
        session = _authorized(gateway, request)
        req = anthropic_wire.to_chat(await _body(request), counting=True)
        return _json({"input_tokens": session.count_tokens(req)})

    async def responses(request: Request) -> Response:
        session = _authorized(gateway, request)
        body = await _body(request)
        req, conversation = responses_wire.to_chat(body, session)
        model, previous = req.model or gateway.model_name, body.get("previous_response_id")
        if not req.stream:
            answer = await until_disconnected(request, session.answer(req))
            if answer is None:  # the client went away: nothing was kept
                return _json({})
            rid = responses_wire.remember(session, answer, conversation)
            return _json(responses_wire.response_body(rid, model, req, previous, answer))
        events = responses_wire.stream(session, req, conversation, model, previous)
        first = await anext(events)
        return _Stream(_named_sse(first, events, anthropic=False), media_type="text/event-stream")

    base = "/agents/{key}/v1"
    # Anthropic's client appends /v1/messages to its base URL: the episode's base URL with or
    # without its /v1 reaches the same route.
    routes = [Route(f"{base}/models", models, methods=["GET"]),
              Route(f"{base}/chat/completions", completions, methods=["POST"]),
              Route(f"{base}/responses", responses, methods=["POST"])]  # fmt: skip
    for prefix in (base, f"{base}/v1"):
        routes += [Route(f"{prefix}/messages", messages, methods=["POST"]),
                   Route(f"{prefix}/messages/count_tokens", count_tokens, methods=["POST"])]  # fmt: skip
    return Starlette(
        routes=routes,
        middleware=[Middleware(HostGuard, rule=rule, body=lambda message: GatewayError(421, message).body())],
        exception_handlers={GatewayError: refused, StarletteHTTPException: http_error},
    )


ROUTES = ("POST /agents/{key}/v1/chat/completions, GET /agents/{key}/v1/models, "
          "POST /agents/{key}/v1/responses, "
          "POST /agents/{key}/v1/messages, POST /agents/{key}/v1/messages/count_tokens")  # fmt: skip
"""What a 404 names (the Anthropic routes answer under .../v1/v1/... too)."""


def _anthropic(request: Request) -> bool:
    return "/messages" in request.url.path


def _refusal(request: Request, e: GatewayError) -> JSONResponse:
    """A refusal in the shape of the route's dialect."""
    body = anthropic_wire.error_body(e) if _anthropic(request) else e.body()
    return JSONResponse(body, status_code=e.status)


async def _body(request: Request) -> Any:
    try:
        return jsonfast.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise GatewayError(400, f"the request body is not JSON: {e}") from e


def _json(body: Any) -> Response:
    """A JSON answer, compact; orjson directly, as no encoder needs to walk it first."""
    return Response(jsonfast.dumps(body), media_type="application/json")


def _authorized(gateway: Gateway, request: Request) -> AgentSession:
    key = request.path_params["key"]
    session = gateway.session(key)
    api_key = one_header(request.headers.getlist("x-api-key"))  # what Anthropic's client sends
    if api_key and hmac.compare_digest(api_key.encode("utf-8", "surrogateescape"), key.encode()):
        return session
    if not bearer_matches(one_header(request.headers.getlist("authorization")), key):
        raise GatewayError(401, "the API key must be this episode's key (the one in the URL)",
                           type="authentication_error", code="invalid_api_key")
    return session


class _Stream(StreamingResponse):
    """A stream that stops as soon as its client goes away, its events' iterator cancelled
    (so the call is undone and the engine request aborted): uvicorn drops the writes to a
    closed connection without a word, so a plain stream would run to its end for nobody."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


async def until_disconnected(request: Request, call: Awaitable[T]) -> T | None:
    """`call`'s result, or None once the client went away first (a timeout, a closed
    connection): the call is then cancelled, so the engine request is aborted and the episode
    is left as it was (`AgentSession._save`).

    The watcher is a bare asyncio task that cancels the call's scope when the client goes
    away, and is itself cancelled as a plain task when the call ends first (the usual case):
    an anyio task group here cost more CPU than the rest of the HTTP layers together
    (spawning, and a cancel scope's cancel formats the task's repr)."""
    scope = anyio.CancelScope()

    async def watch() -> None:
        with contextlib.suppress(Exception):  # a receive that fails: nobody to tell either way
            while (await request.receive())["type"] != "http.disconnect":
                pass
            scope.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        with scope:
            return await call
        return None  # cancelled by the watcher
    finally:
        watcher.cancel()


async def _sse(first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        yield _event(first)
        try:
            async for c in rest:
                yield _event(c)
                await _let_the_watch_run()
        except GatewayError as e:  # after the headers: the error is the stream's last event
            yield _event(e.body())
            return
        yield b"data: [DONE]\n\n"
    finally:  # a client gone mid-stream: the call is abandoned (and undone) now, not at GC
        with anyio.CancelScope(shield=True):
            await rest.aclose()  # type: ignore[attr-defined]


async def _named_sse(first: dict[str, Any], rest: AsyncIterator[dict[str, Any]], *,
                     anthropic: bool = True) -> AsyncIterator[bytes]:  # fmt: skip
    """Server-sent events each named by its type (Anthropic's and the Responses API's); an
    error after the headers is the stream's last event."""
    try:
        yield _named(first)
        try:
            async for event in rest:
                yield _named(event)
                await _let_the_watch_run()
        except GatewayError as e:
            yield _named(anthropic_wire.error_body(e) if anthropic else
                         {"type": "error", "code": e.code, "message": e.message, "param": e.param})  # fmt: skip
    finally:
        with anyio.CancelScope(shield=True):
            await rest.aclose()  # type: ignore[attr-defined]


async def _let_the_watch_run() -> None:
    """A checkpoint between a stream's events, before the next is asked for (the last ask keeps
    the call): the event loop reads the client's close and `_Stream`'s watch cancels the stream.
    Without it, a stream whose engine output is all buffered already (serve starved of CPU
    while the engine wrote) ran to its end without yielding, and kept a call its client had
    abandoned after the first event."""
    await anyio.lowlevel.checkpoint()


def _named(body: dict[str, Any]) -> bytes:
    return f"event: {body['type']}\ndata: ".encode() + jsonfast.dumps(body) + b"\n\n"


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + jsonfast.dumps(body) + b"\n\n"

"""EngineClient's failures on its hot calls (generate, stream, abort, model info), which go through
the kernel's keep-alive HTTP/1.1 client, against a real uvicorn server on loopback that answers
as SGLang and the router do when things go wrong: a 503 (no engine took the request: the gateway
sends it again) is `EngineUnavailableError`, and so is a server that cannot be connected to
(nothing was sent); a 401 says to set the router's admin token, any other status is an
`EngineError` with the server's message, and a server that does not answer in time is an
`EngineError` after the client's timeout, streamed or not (the request was sent: not
`EngineUnavailableError`). A stream's pieces
arrive as SGLang writes them and its connection is reused afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from agent_rl.app.api.app import EmbeddedServer
from agent_rl.kernel.errors import EngineError, EngineUnavailableError
from agent_rl.sglang.client import EngineClient


def _piece(port: int, output_ids: list[int], finished: bool) -> dict:
    return {
        "text": "x",
        "output_ids": output_ids,
        "meta_info": {
            "id": f"port-{port}",  # the client port, one per TCP connection
            "finish_reason": {"type": "length", "length": len(output_ids)} if finished else None,
            "prompt_tokens": 3,
            "completion_tokens": len(output_ids),
            "weight_version": "v1",
            "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
        },
    }


def engine_app() -> FastAPI:
    """`/generate` fails as the request's `rid` asks; `/abort_request` wants the admin token."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):  # type: ignore[no-untyped-def]
        body = await request.json()
        assert request.client is not None
        port, rid = request.client.port, body.get("rid")
        if rid == "unavailable":
            return PlainTextResponse("no worker available", status_code=503)
        if rid == "unauthorized":
            return PlainTextResponse("missing token", status_code=401)
        if rid == "broken":
            return PlainTextResponse("scheduler crashed", status_code=500)
        if rid == "slow":
            await asyncio.sleep(3)
        if not body.get("stream"):
            return JSONResponse(_piece(port, [5, 6], True))

        async def events() -> AsyncIterator[str]:
            yield f"data: {json.dumps(_piece(port, [5], False))}\n\n"
            if rid == "stall":
                await asyncio.sleep(3)
            yield f"data: {json.dumps(_piece(port, [5, 6], True))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort(request: Request):  # type: ignore[no-untyped-def]
        if request.headers.get("authorization") != "Bearer admin":
            return PlainTextResponse("missing token", status_code=401)
        return {}

    @app.get("/model_info")
    async def model_info() -> dict[str, str]:
        return {"weight_version": "v1", "model_path": "/nowhere"}

    return app


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with EmbeddedServer.in_thread(engine_app()) as server:
        yield f"http://127.0.0.1:{server.port}"


async def _stream(client: EngineClient, rid: str) -> list[list[int]]:
    return [g.output_ids async for g in client.stream([1, 2, 3], {"max_new_tokens": 2}, rid=rid)]


@pytest.mark.parametrize("streamed", [False, True])
def test_refusals_keep_their_types_and_messages(url: str, streamed: bool) -> None:
    async def call(client: EngineClient, rid: str) -> object:
        if streamed:
            return await _stream(client, rid)
        return await client.generate([1, 2, 3], {"max_new_tokens": 2}, rid=rid)

    async def go() -> None:
        async with EngineClient(url) as client:
            with pytest.raises(EngineUnavailableError,
                               match=f"engine at {url}: /generate answered 503: no worker available"):
                await call(client, "unavailable")
            with pytest.raises(EngineError, match=r"refused /generate \(401\): set \[router\] admin_token") as e:
                await call(client, "unauthorized")
            assert not isinstance(e.value, EngineUnavailableError)
            with pytest.raises(EngineError, match="/generate answered 500: scheduler crashed") as e:
                await call(client, "broken")
            assert not isinstance(e.value, EngineUnavailableError)
            # The client still works after each refusal.
            assert await client.generate([1, 2, 3], rid="fine") is not None

    asyncio.run(go())


def test_abort_and_model_info(url: str) -> None:
    async def go() -> None:
        async with EngineClient(url) as anonymous:
            with pytest.raises(EngineError, match=r"refused /abort_request \(401\)"):
                await anonymous.abort("some-rid")
            assert (await anonymous.model_info())["weight_version"] == "v1"
        async with EngineClient(url, token="admin") as admin:
            await admin.abort("some-rid")
        async with EngineClient("http://127.0.0.1:9") as dead:
            # Nothing listens: no byte was sent, so the call may be sent again.
            with pytest.raises(EngineUnavailableError, match=r"unreachable \(/generate\): NotSent"):
                await dead.generate([1, 2, 3], rid="fine")
            with pytest.raises(EngineUnavailableError, match="/generate stream failed: NotSent"):
                await _stream(dead, "fine")

    asyncio.run(go())


def test_timeouts_end_calls_that_do_not_answer(url: str) -> None:
    async def go() -> None:
        async with EngineClient(url, timeout_s=0.5) as client:
            t = time.monotonic()
            with pytest.raises(EngineError, match=r"unreachable \(/generate\): TimeoutError") as e:
                await client.generate([1, 2, 3], rid="slow")
            assert time.monotonic() - t < 2.5
            assert not isinstance(e.value, EngineUnavailableError)  # it was sent: may have run
            # A stream that stops after its first piece: that piece arrives, then the error.
            seen: list[list[int]] = []
            t = time.monotonic()
            with pytest.raises(EngineError, match="/generate stream failed: TimeoutError") as e:
                async for gen in client.stream([1, 2, 3], rid="stall"):
                    seen.append(gen.output_ids)
            assert not isinstance(e.value, EngineUnavailableError)
            assert seen == [[5]] and time.monotonic() - t < 2.5

    asyncio.run(go())


def test_stream_pieces_and_connection_reuse(url: str) -> None:
    async def go() -> None:
        async with EngineClient(url) as client:
            first = [g async for g in client.stream([1, 2, 3], rid="a")]
            second = [g async for g in client.stream([1, 2, 3], rid="b")]
            plain = await client.generate([1, 2, 3], rid="c")
        assert [g.output_ids for g in first] == [[5], [5, 6]]
        assert first[-1].finish_reason is not None and first[0].finish_reason is None
        # The body was read to its end after [DONE]: the same connection serves what follows.
        assert first[0].meta_info["id"] == second[0].meta_info["id"] == plain.meta_info["id"]

    asyncio.run(go())

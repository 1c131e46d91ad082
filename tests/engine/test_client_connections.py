"""EngineClient's connection pool against uvicorn's keep-alive, the HTTP server SGLang runs.

uvicorn closes a connection idle for 5 s. A client that reuses connections idle for longer sends
some requests down a connection the server is closing at that moment; such a request fails with
"Server disconnected" (an episode failed that way in CI while a store restart paused serve for a
few seconds). The client must drop idle connections first, and still reuse busy ones: on both
of its transports, aiohttp's (control calls: `/server_info`) and the keep-alive client of the
hot calls (`/model_info`, as `/generate`).
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request

from agent_rl.app.api.app import EmbeddedServer
from agent_rl.sglang.client import IDLE_CONNECTION_S, EngineClient


def client_ports_app() -> FastAPI:
    app = FastAPI()

    @app.get("/server_info")
    @app.get("/model_info")
    async def port(request: Request) -> dict[str, int]:
        assert request.client is not None
        return {"port": request.client.port}  # one client port per TCP connection

    return app


@pytest.mark.parametrize("call", ["server_info", "model_info"])
def test_idle_connections_are_dropped_before_uvicorn_closes_them(call: str) -> None:
    with EmbeddedServer.in_thread(client_ports_app()) as server:
        assert server.config.timeout_keep_alive > IDLE_CONNECTION_S

        async def ports() -> list[int]:
            async with EngineClient(f"http://127.0.0.1:{server.port}") as client:
                seen = [(await getattr(client, call)())["port"]]
                await asyncio.sleep(0.2)
                seen.append((await getattr(client, call)())["port"])
                # Idle past the client's limit but not yet the server's: a new connection.
                await asyncio.sleep(IDLE_CONNECTION_S + 0.3)
                seen.append((await getattr(client, call)())["port"])
                return seen

        first, again, after_idle = asyncio.run(ports())
    assert again == first, "a connection in use is reused"
    assert after_idle != first, "a connection idle past IDLE_CONNECTION_S is not reused"

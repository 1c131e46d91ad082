"""Mounting the API in another process's event loop, as `serve` does: a borrowed store, uvicorn
started in a task group on a free loopback port, stopped by cancelling the group; the store
stays open for its owner."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from agent_rl.app.api import create_app, serve_api
from agent_rl.app.api.app import check_exposure
from agent_rl.config import ApiConfig
from agent_rl.kernel.errors import ConfigError
from agent_rl.store import Store
from tests.api.conftest import api_config
from tests.api.fill import Filled


@pytest.mark.anyio
async def test_serve_api_in_a_task_group_with_a_borrowed_store(filled: Filled) -> None:
    cfg = api_config(filled.url, port=0)
    async with await Store.open(cfg.store) as store:
        app = create_app(cfg, store=store)
        async with anyio.create_task_group() as tg:
            port = await tg.start(serve_api, app, cfg.api)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                runs = (await client.get("/api/v1/runs")).json()
                assert [r["name"] for r in runs] == ["demo"]
                assert (await client.get("/")).status_code == 200
            tg.cancel_scope.cancel()
        # The API is gone and the borrowed store still works.
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as client:
                await client.get(f"http://127.0.0.1:{port}/api/v1/runs")
        assert (await store.ledger()).admitted == 7


def test_a_public_address_needs_a_token(tmp_path: Path) -> None:
    check_exposure(ApiConfig())
    check_exposure(ApiConfig(host="::1"))
    check_exposure(ApiConfig(host="0.0.0.0", token="t"))
    for blank in (None, "", "  ", "\t\n"):
        with pytest.raises(ConfigError, match="not loopback"):
            check_exposure(ApiConfig(host="0.0.0.0", token=blank))
    # A config made without validation (model_copy) is checked the same way.
    unchecked = ApiConfig().model_copy(update={"host": "0.0.0.0", "token": SecretStr(" ")})
    with pytest.raises(ConfigError, match="unset or blank"):
        check_exposure(unchecked)


@pytest.mark.anyio
async def test_an_idle_connection_outlives_the_usual_clients_pools() -> None:
    """An agent idle between two gateway calls (a slow tool) reuses its pooled connection; if
    the server closed idle connections first (uvicorn's default: 5 s, the OpenAI client's pool
    also 5 s, aiohttp's 15 s), some of those reuses would meet a closing connection."""
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_api, app, ApiConfig(port=0))
        async with await anyio.connect_tcp("127.0.0.1", port) as conn:
            request = b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n"
            for idle_s in (0.0, 6.0):  # past uvicorn's default keep-alive
                await anyio.sleep(idle_s)
                await conn.send(request)
                with anyio.fail_after(5):
                    answer = await conn.receive()
                assert answer.startswith(b"HTTP/1.1 200"), (idle_s, answer)
        tg.cancel_scope.cancel()

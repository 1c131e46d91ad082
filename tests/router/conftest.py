"""Fixtures for the router tests: fault-injecting workers and routers, both on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from agent_rl.config import RouterConfig
from router import Router
from tests.router.fault_worker import FaultWorker

if TYPE_CHECKING:
    from agent_rl.engine.launcher import EngineServer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


WorkerFactory = Callable[..., Awaitable[FaultWorker]]
RouterFactory = Callable[..., Awaitable[Router]]


@pytest.fixture
async def make_worker() -> AsyncIterator[WorkerFactory]:
    """Start fault-injecting workers on loopback; all are stopped after the test."""
    started: list[FaultWorker] = []

    async def make(name: str = "w", **kw: Any) -> FaultWorker:
        worker = FaultWorker(name, **kw)
        await worker.start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        await worker.stop()


@pytest.fixture
async def make_router() -> AsyncIterator[RouterFactory]:
    """Start routers on an ephemeral loopback port (health checks off unless asked for)."""
    started: list[Router] = []

    async def make(workers: list[str], **overrides: Any) -> Router:
        settings: dict[str, Any] = {"port": 0, "health_interval_s": 0, "admin_token": "secret"}
        settings.update(overrides)
        router = Router(RouterConfig(**settings), workers)
        await router.start()
        started.append(router)
        return router

    yield make
    for router in started:
        await router.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session



@pytest.fixture(scope="module")
def second_sglang_moe_server(
    engine_venv: Path, tiny_moe_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """A second real SGLang server (tiny-moe, routing replay) for fan-out tests; it lives only
    for the module that asks for it, so its ~2 GB are returned before the next package runs."""
    from agent_rl.engine.launcher import EngineServer

    server = EngineServer(tiny_moe_model, venv=engine_venv, moe_routing_replay=True,
                          log_dir=tmp_path_factory.mktemp("router-engine-logs"),
                          startup_timeout_s=240.0)
    server.start()
    yield server
    server.stop()

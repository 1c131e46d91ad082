"""Fixtures for the router tests: fault-injecting workers and routers, both on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from agent_rl.config import RouterConfig
from router import Router
from tests.router.fault_worker import FaultWorker


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


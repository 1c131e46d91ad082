"""Fixtures of the API tests: a tokenizer directory, a filled store on SQLite and PostgreSQL,
an in-process client, and a live server on loopback (for the browser and schemathesis)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from fastapi.testclient import TestClient

from agent_rl.app.api import create_app
from agent_rl.app.api.app import EmbeddedServer
from agent_rl.config import Config
from agent_rl.store import Store
from agent_rl.store.migrate import upgrade
from tests._databases import fresh_database
from tests.api.fill import Filled, fill

TOKEN = "test-token-1234"
LOOPBACK = "http://127.0.0.1"
"""Base URL of in-process clients: the API answers its own Host only (TestClient's default
`testserver` gets 421)."""
T = TypeVar("T")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models' tokenizer, saved alone (the token view decodes with it)."""
    from agent_rl.models import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


def api_config(url: str, **api: Any) -> Config:
    return Config(store={"url": url}, api={"token": TOKEN, **api})


def fill_database(url: str, tokenizer_dir: Path) -> Filled:
    from agent_rl.app.api.tokens import load_tokenizer

    async def go() -> Filled:
        cfg = api_config(url)
        await upgrade(cfg.store)
        async with await Store.open(cfg.store) as store:
            filled = await fill(store, load_tokenizer(str(tokenizer_dir)), str(tokenizer_dir))
        filled.url = url
        return filled

    return in_thread(go)


def in_thread(fn: Callable[[], Awaitable[T]]) -> T:
    """`anyio.run(fn)` in a thread of its own: Playwright's sync API (and TestClient) keep an
    event loop in the test's thread."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, fn).result()


@pytest.fixture
def filled(db_url: str, tokenizer_dir: Path) -> Filled:
    """A store filled like a small run (see tests/api/fill.py), on SQLite and PostgreSQL."""
    return fill_database(db_url, tokenizer_dir)


@pytest.fixture
def client(filled: Filled) -> Iterator[TestClient]:
    with TestClient(create_app(api_config(filled.url)), base_url=LOOPBACK) as c:
        yield c


@dataclass
class LiveServer:
    url: str
    filled: Filled


@pytest.fixture(scope="module")
def live_server(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Iterator[LiveServer]:
    """The API over real HTTP on 127.0.0.1 (a free port), on a filled SQLite store."""
    with fresh_database("sqlite", tmp_path_factory.mktemp("live")) as url:
        filled = fill_database(url, tokenizer_dir)
        with EmbeddedServer.in_thread(create_app(api_config(url))) as server:
            yield LiveServer(f"http://127.0.0.1:{server.port}", filled)

"""The store's connection handling: opening, the schema check, and transactions.

`StoreBase.write()` is a write transaction (SQLite `BEGIN IMMEDIATE`, so concurrent writers
queue on the busy timeout instead of failing), `read()` a read-only one. Everything a caller
writes in one `write()` block commits or vanishes together.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from agent_rl.config import StoreConfig
from agent_rl.errors import StoreError
from agent_rl.store.db import BEGIN_OPTION, create_engine, is_sqlite
from agent_rl.store.migrate import check_schema


def now() -> float:
    return time.time()


class StoreBase:
    def __init__(self, engine: AsyncEngine, cfg: StoreConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.sqlite = is_sqlite(engine)

    @classmethod
    async def open(cls, cfg: StoreConfig, *, check: bool = True):  # type: ignore[no-untyped-def]
        """Connect, verify the schema is at head (unless `check=False`), and return the store."""
        engine = create_engine(cfg)
        try:
            if check:
                await check_schema(engine)
            else:
                async with engine.connect():
                    pass
        except StoreError:
            await engine.dispose()
            raise
        except (OperationalError, DBAPIError, OSError) as e:
            await engine.dispose()
            raise StoreError(
                f"cannot open the store at {cfg.url}: {_first_line(e)}; check store.url"
            ) from e
        return cls(engine, cfg)

    async def close(self) -> None:
        await self.engine.dispose()

    async def __aenter__(self):  # type: ignore[no-untyped-def]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        async with self.engine.connect() as conn:
            if self.sqlite:
                await conn.execution_options(**{BEGIN_OPTION: "IMMEDIATE"})
            async with conn.begin():
                yield conn

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        async with self.engine.connect() as conn:
            async with conn.begin():
                yield conn


def _first_line(e: BaseException) -> str:
    orig = getattr(e, "orig", None) or e
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__

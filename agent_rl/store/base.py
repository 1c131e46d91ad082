"""The store's connection handling: opening, the schema check, and transactions.

The store's API is async, but each transaction runs as ONE synchronous function in a worker
thread on a pooled SQLAlchemy connection. Measured here: an async SQLite driver (aiosqlite) pays
a thread hop per cursor operation, ~50 per episode written, which cost 4x the write rate of raw
inserts; one hop per transaction keeps the store near the raw rate. PostgreSQL uses psycopg 3.

Methods decorated with `@write(...)` or `@read` are written as `def m(self, conn, ...)` and called
as `await store.m(...)`. Everything in one `@write` body commits or vanishes together; SQLite
write transactions are `BEGIN IMMEDIATE`, so concurrent writers queue on the busy timeout
instead of failing, and reads never block.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from agent_rl.config import StoreConfig
from agent_rl.errors import StoreError
from agent_rl.store.db import BEGIN_OPTION, SYNC_OPTION, create_database, is_sqlite
from agent_rl.store.migrate import check_schema, create_if_new

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="StoreBase")


def now() -> float:
    return time.time()


class StoreBase:
    def __init__(self, db: Engine, cfg: StoreConfig) -> None:
        self.db = db
        """The SQLAlchemy engine (agent-rl's "engine" is the SGLang server)."""
        self.cfg = cfg
        self.sqlite = is_sqlite(db)
        # At most as many transactions in flight as the pool has connections.
        self._limiter = anyio.CapacityLimiter(cfg.pool_size)

    @classmethod
    async def open(cls: type[S], cfg: StoreConfig, *, check: bool = True, create: bool = False) -> S:
        """Connect, verify the schema is at head (unless `check=False`), and return the store.
        `create=True` first creates the schema in a SQLite database that has none yet (the
        embedded default's new file); a database behind its migrations is still refused."""
        if create:
            await create_if_new(cfg)
        db = create_database(cfg)

        def probe() -> None:
            if check:
                check_schema(db)
            else:
                with db.connect():
                    pass

        try:
            await anyio.to_thread.run_sync(probe)
        except StoreError:
            db.dispose()
            raise
        except (OperationalError, DBAPIError, OSError) as e:
            db.dispose()
            raise StoreError(
                f"cannot open the store at {cfg.url}: {_first_line(e)}; check store.url"
            ) from e
        return cls(db, cfg)

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.db.dispose)

    async def __aenter__(self: S) -> S:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run_in_transaction(
        self, fn: Callable[[Connection], R], *, write: bool, durable: bool = True
    ) -> R:
        """Run `fn(conn)` inside one transaction in a worker thread."""

        def run() -> R:
            with self.db.connect() as conn:
                if self.sqlite:
                    conn.execution_options(
                        **{
                            BEGIN_OPTION: "IMMEDIATE" if write else "DEFERRED",
                            SYNC_OPTION: "FULL" if durable else "NORMAL",
                        }
                    )
                with conn.begin():
                    return fn(conn)

        return await anyio.to_thread.run_sync(run, limiter=self._limiter)


def write(
    durable: bool = True,
) -> Callable[[Callable[Concatenate[Any, Connection, P], R]], Callable[Concatenate[Any, P], Any]]:
    """Make `def m(self, conn, ...)` an async method running in one write transaction.

    `durable=False` is for bookkeeping that a later durable commit covers (see
    `agent_rl.store.db`)."""

    def decorate(fn: Callable[Concatenate[Any, Connection, P], R]) -> Callable[Concatenate[Any, P], Any]:
        @functools.wraps(fn)
        async def method(self: StoreBase, *args: P.args, **kwargs: P.kwargs) -> R:
            return await self.run_in_transaction(
                lambda conn: fn(self, conn, *args, **kwargs), write=True, durable=durable
            )

        return method

    return decorate


def read(fn: Callable[Concatenate[Any, Connection, P], R]) -> Callable[Concatenate[Any, P], Any]:
    """Make `def m(self, conn, ...)` an async method running in one read transaction."""

    @functools.wraps(fn)
    async def method(self: StoreBase, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self.run_in_transaction(lambda conn: fn(self, conn, *args, **kwargs), write=False)

    return method


def _first_line(e: BaseException) -> str:
    orig = getattr(e, "orig", None) or e
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__

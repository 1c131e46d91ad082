"""Database engines for the store: URL normalization, SQLite pragmas, and the schema check.

SQLite runs in WAL mode with a busy timeout and `synchronous=FULL` (a committed episode survives
a crash of the process or the machine). Writers open `BEGIN IMMEDIATE` transactions so two
processes never deadlock upgrading a read lock; readers stay `DEFERRED` and never block.
PostgreSQL uses asyncpg. Plain `sqlite:///` and `postgresql://` URLs get the async driver.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from agent_rl.config import StoreConfig
from agent_rl.errors import ConfigError

BEGIN_OPTION = "agent_rl_sqlite_begin"


def async_url(url: str) -> URL:
    """The SQLAlchemy async URL for a user-facing database URL."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    try:
        parsed = make_url(url)
    except Exception as e:
        raise ConfigError(f"invalid database URL {url!r}: {e}; set store.url") from e
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite":
        if driver not in ("", "aiosqlite"):
            raise ConfigError(f"SQLite driver {driver!r} is not async: use sqlite:///PATH")
        return parsed.set(drivername="sqlite+aiosqlite")
    if backend == "postgresql":
        if driver in ("", "asyncpg"):
            return parsed.set(drivername="postgresql+asyncpg")
        if driver in ("psycopg", "psycopg_async"):
            return parsed.set(drivername="postgresql+psycopg_async")
        raise ConfigError(f"PostgreSQL driver {driver!r} is not supported: use asyncpg or psycopg")
    raise ConfigError(f"unsupported database {backend!r} in {url!r}: use sqlite or postgresql")


def is_sqlite(engine: AsyncEngine) -> bool:
    return engine.dialect.name == "sqlite"


def create_engine(cfg: StoreConfig) -> AsyncEngine:
    """An async engine for the configured store (does not connect yet)."""
    url = async_url(cfg.url)
    if url.drivername.startswith("sqlite"):
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, connect_args={"timeout": cfg.busy_timeout_s})
        _install_sqlite_hooks(engine, cfg.busy_timeout_s)
        return engine
    return create_async_engine(url, pool_size=cfg.pool_size, pool_pre_ping=True)


def _install_sqlite_hooks(engine: AsyncEngine, busy_timeout_s: float) -> None:
    sync_engine = engine.sync_engine

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        # Take transaction control from the driver so that BEGIN IMMEDIATE can be issued.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn) -> None:  # type: ignore[no-untyped-def]
        mode = conn.get_execution_options().get(BEGIN_OPTION, "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")

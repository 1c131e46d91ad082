"""The store's database connection (a SQLAlchemy `Engine`, called `db` here: in agent-rl
"engine" is the SGLang server): URL normalization and SQLite's pragmas.

SQLite runs in WAL mode with a busy timeout. Transactions that carry data (turns, terminal
states, trainer commits) run with `synchronous=FULL`: once committed they survive a crash of the
process or the machine. Bookkeeping transitions whose loss on power failure is harmless
(admission, start, heartbeats, claims, an agent's turns before its end: see the gateway) run
with `NORMAL`: they survive a process crash, and the WAL is sequential, so the next FULL commit
makes them durable too. PostgreSQL uses psycopg 3.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, event
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.engine import URL, make_url

from agent_rl.config import StoreConfig
from agent_rl.config.secrets import redact_url
from agent_rl.kernel.errors import ConfigError
from agent_rl.store.driver import run_sql

BEGIN_OPTION = "agent_rl_sqlite_begin"
SYNC_OPTION = "agent_rl_sqlite_synchronous"


def database_url(url: str) -> URL:
    """The SQLAlchemy URL (with its driver) for a user-facing database URL."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    try:
        parsed = make_url(url)
    except Exception as e:
        raise ConfigError(f"invalid database URL {redact_url(url)!r}; set store.url") from e
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise ConfigError(f"SQLite driver {driver!r} is not supported: use sqlite:///PATH")
        return parsed.set(drivername="sqlite")
    if backend == "postgresql":
        if driver not in ("", "psycopg"):
            raise ConfigError(f"PostgreSQL driver {driver!r} is not supported: use postgresql://...")
        return parsed.set(drivername="postgresql+psycopg")
    raise ConfigError(f"unsupported database {backend!r} in {redact_url(url)!r}: use sqlite or "
                      "postgresql")


def is_sqlite(db: Engine) -> bool:
    return db.dialect.name == "sqlite"


def create_database(cfg: StoreConfig) -> Engine:
    """The SQLAlchemy engine of the configured store (does not connect yet)."""
    url = database_url(cfg.url)
    if url.drivername == "sqlite":
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        db = sa_create_engine(
            url,
            # Connections move between the store's worker threads, one transaction at a time.
            connect_args={"timeout": cfg.busy_timeout_s, "check_same_thread": False},
            pool_size=cfg.pool_size,
        )
        _install_sqlite_hooks(db, cfg.busy_timeout_s)
        return db
    return sa_create_engine(url, pool_size=cfg.pool_size, pool_pre_ping=True)


def _install_sqlite_hooks(db: Engine, busy_timeout_s: float) -> None:
    @event.listens_for(db, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        # Take transaction control from the driver so that BEGIN IMMEDIATE can be issued.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(db, "begin")
    def _on_begin(conn) -> None:  # type: ignore[no-untyped-def]
        options = conn.get_execution_options()
        # synchronous can only change between transactions, so each one sets its own; the
        # connection keeps it, so the pragma is sent only when the level changes (`info` is
        # the DBAPI connection's: a new connection starts without one and gets it set).
        # Both on the driver's cursor (`run_sql`): `exec_driver_sql`'s execution machinery
        # cost several times the statement, on every transaction.
        level = options.get(SYNC_OPTION, "FULL")
        if conn.info.get(SYNC_OPTION) != level:
            run_sql(conn, f"PRAGMA synchronous={level}")
            conn.info[SYNC_OPTION] = level
        run_sql(conn, f"BEGIN {options.get(BEGIN_OPTION, 'DEFERRED')}")

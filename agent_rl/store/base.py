"""The store's connection handling: opening, the schema check, transactions and their retries.

The store's API is async, but each transaction runs as ONE synchronous function in a worker
thread on a pooled SQLAlchemy connection. Measured here: an async SQLite driver (aiosqlite) pays
a thread hop per cursor operation, ~50 per episode written, which cost 4x the write rate of raw
inserts; one hop per transaction keeps the store near the raw rate. PostgreSQL uses psycopg 3.

Methods decorated with `@write(...)` or `@read` are written as `def m(self, conn, ...)` and called
as `await store.m(...)`. Everything in one `@write` body commits or vanishes together; SQLite
write transactions are `BEGIN IMMEDIATE`, so concurrent writers queue on the busy timeout
instead of failing, and reads never block.

Faults, one policy for every transaction (`run_in_transaction`): a transient one (the connection
lost, the server shutting down or starting up, a serialization failure or deadlock, SQLite
still locked after its busy timeout) reruns the whole transaction, with backoff, for up to
`retry_window_s`. A rerun is safe because a failed transaction left nothing behind, with one
exception: a connection lost during COMMIT leaves it unknown whether the commit happened. On
PostgreSQL every write transaction therefore reads its transaction id before committing, and
after such a loss asks the server (`pg_xact_status`) what became of it: committed, the result
stands and nothing is rerun; aborted, it is rerun. So each write lands exactly once, a claim's
commit included. A fault that is not transient, or one that outlasts the window, is raised as
`StoreFault` (a `StoreError`) with a one-line message; the SQL stays in the traceback.

Group commit: write transactions submitted while another is in flight are run together, in
submission order, as ONE database transaction (one BEGIN, one COMMIT, one fsync on SQLite),
and each caller's `await` returns only once that commit is durable. A database commits one
transaction at a time per writer anyway; sharing the commit is what lets one serve persist
hundreds of turns a second without giving up "every turn durable as it completes". If one
member of a batch raises, the batch is rolled back and its members are run again one by one,
so a failure (an episode in the wrong state, say) stays its caller's; a transient fault fails
the whole batch, and each caller's retry reruns its own transaction.

The batches run on one thread of the store's own, and on SQLite on one connection kept for them
(the writes are serialized anyway): anyio's `to_thread` hop and a pool checkout, its execution
options and its reset on return cost more CPU per transaction than the BEGIN and the COMMIT.
On SQLite that thread also brings the text search index up to date after a batch, at most once
a second (`search.catch_up`), once the batch's writers are woken.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError

from agent_rl.config import StoreConfig
from agent_rl.config.secrets import redact_text, redact_url
from agent_rl.kernel.errors import StoreError
from agent_rl.store import search
from agent_rl.store.db import BEGIN_OPTION, SYNC_OPTION, create_database, database_url, is_sqlite
from agent_rl.store.driver import compile_all
from agent_rl.store.models import SCHEMA_REVISION

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="StoreBase")

log = logging.getLogger("agent_rl.store")

RETRY_WINDOW_S = 120.0
"""How long one transaction is retried through transient faults before it fails: a PostgreSQL
restart takes seconds, a managed database's failover up to a minute or two."""

# SQLSTATEs worth a rerun: class 08 (connection exception), the server shutting down or not
# yet accepting connections, too many connections, serialization failure and deadlock.
_TRANSIENT_STATES = frozenset({"57P01", "57P02", "57P03", "53300", "40001", "40P01"})


class StoreFault(StoreError):
    """The database failed a transaction: it stayed unreachable past the retry window
    (`transient`), or it refused the statement (a bug, or a schema changed under the store)."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


def is_transient(e: BaseException) -> bool:
    """True for a database error that a rerun of the same transaction may not meet again."""
    if not isinstance(e, DBAPIError):
        return False
    if e.connection_invalidated:
        return True
    orig = e.orig
    state = getattr(orig, "sqlstate", None)
    if state:
        return state.startswith("08") or state in _TRANSIENT_STATES
    if type(orig).__module__ == "sqlite3":
        message = str(orig).lower()
        return "database is locked" in message or "database table is locked" in message
    # PostgreSQL without a SQLSTATE: the client side of the connection failed (refused, reset).
    return isinstance(e, OperationalError)


def one_line(e: BaseException) -> str:
    """The first line of a database error's own message (never the SQL or its parameters)."""
    orig = getattr(e, "orig", None) or e
    text_ = str(orig).strip()
    return text_.splitlines()[0] if text_ else type(orig).__name__


def now() -> float:
    return time.time()


@dataclass(eq=False)
class _Write:
    """One write transaction waiting for, or in, a group commit."""

    fn: Callable[[Connection], Any]
    durable: bool
    wake: anyio.Event = field(default_factory=anyio.Event)
    lead: bool = False
    ran: bool = False
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class _InDoubt(Exception):
    """A write's COMMIT lost its connection: transaction `xid` tells whether it happened."""

    def __init__(self, xid: str, result: Any, cause: DBAPIError) -> None:
        super().__init__(xid)
        self.xid, self.result, self.cause = xid, result, cause


class StoreBase:
    retry_window_s: float = RETRY_WINDOW_S
    """Seconds a transaction is retried through transient faults (see the module docstring)."""

    def __init__(self, db: Engine, cfg: StoreConfig) -> None:
        self.db = db
        """The SQLAlchemy engine (agent-rl's "engine" is the SGLang server)."""
        self.cfg = cfg
        self.sqlite = is_sqlite(db)
        # At most as many transactions in flight as the pool has connections.
        self._limiter = anyio.CapacityLimiter(cfg.pool_size)
        self._queued: list[_Write] = []
        """Write transactions waiting for the batch in flight to commit (group commit)."""
        self._leading = False
        self._batches = ThreadPoolExecutor(1, thread_name_prefix="store-writes")
        """The thread the group commit's batches run on, one at a time."""
        self._writer: Connection | None = None
        """SQLite: the connection the batches run on, kept between them (`_write_connection`)."""
        self._index_due = 0.0
        """SQLite: when the batches' thread next catches the text index up (`_index_messages`)."""

    @classmethod
    async def open(cls: type[S], cfg: StoreConfig, *, check: bool = True, create: bool = False) -> S:
        """Connect, verify the schema is at head (unless `check=False`), and return the store.
        `create=True` first creates the schema in a SQLite database that has none yet (the
        embedded default's new file); a database behind its migrations is still refused."""
        if create:
            from agent_rl.store.migrate import create_if_new

            await create_if_new(cfg)
        db = create_database(cfg)

        def probe() -> None:
            with db.connect() as conn:
                revision = _revision(conn) if check else SCHEMA_REVISION
            if revision != SCHEMA_REVISION:
                # Alembic (slow to import) only to say what is wrong and how to fix it.
                from agent_rl.store.migrate import check_schema

                check_schema(db)

        try:
            await anyio.to_thread.run_sync(probe)
        except StoreError:
            db.dispose()
            raise
        except (SQLAlchemyError, OSError) as e:
            db.dispose()
            password = [database_url(cfg.url).password]
            raise StoreError(
                f"cannot open the store at {redact_url(cfg.url)}: "
                f"{redact_text(one_line(e), password)}; check store.url"
            ) from e
        return cls(db, cfg)

    async def warm(self) -> None:
        """Compile the store's own statements for this database now (`driver.compile_all`):
        a serving process calls it as it starts, so its first episodes' writes do not each
        compile one (1-2 ms apiece, about a dozen of them on an episode's path)."""
        await anyio.to_thread.run_sync(compile_all, self.db.dialect)

    async def close(self) -> None:
        def close() -> None:
            self._batches.shutdown(wait=True)  # a batch in flight ends first, on its connection
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self.db.dispose()

        await anyio.to_thread.run_sync(close)

    async def __aenter__(self: S) -> S:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run_in_transaction(
        self, fn: Callable[[Connection], R], *, write: bool, durable: bool = True, name: str = ""
    ) -> R:
        """Run `fn(conn)` inside one transaction in a worker thread, rerun through transient
        faults (see the module docstring); `name` says which in logs and errors."""
        what = name or getattr(fn, "__name__", "transaction")
        attempt_once = functools.partial(self._attempt, fn, write, durable)

        async def once() -> R:
            try:
                if write:
                    return await self._group_commit(fn, durable)
                return await anyio.to_thread.run_sync(attempt_once, limiter=self._limiter)
            except _InDoubt as doubt:
                if await self._committed(doubt.xid):
                    return doubt.result  # type: ignore[no-any-return]
                raise doubt.cause from None

        try:
            # The first attempt outside tenacity, whose machinery (even its construction) cost
            # more CPU than a turn's SQL; the retries only after a transient fault.
            try:
                return await once()
            except DBAPIError as e:
                if not is_transient(e):
                    raise
                log.warning("store: %s hit a transient database fault (%s); retrying",
                            what, one_line(e))
                await anyio.sleep(0.05)
            # Imported here, after a fault: a command that never retries (`agent-rl episodes
            # list`) should not load it.
            from tenacity import (AsyncRetrying, retry_if_exception, stop_after_delay,
                                  wait_exponential_jitter)

            retrying = AsyncRetrying(
                retry=retry_if_exception(is_transient),
                stop=stop_after_delay(self.retry_window_s),
                wait=wait_exponential_jitter(initial=0.05, max=2.0),
                before_sleep=lambda state: log.warning(
                    "store: %s hit a transient database fault (%s); retrying (attempt %d)",
                    what, one_line(state.outcome.exception()), state.attempt_number,
                ),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    return await once()
        except DBAPIError as e:
            if is_transient(e):
                raise StoreFault(
                    f"the store's database stayed unreachable for {self.retry_window_s:.0f} s "
                    f"({what}): {one_line(e)}", transient=True,
                ) from e
            raise StoreFault(f"the store's database refused {what}: {one_line(e)}",
                             transient=False) from e
        except SQLAlchemyError as e:
            raise StoreFault(f"the store failed {what}: {one_line(e)}", transient=False) from e
        raise AssertionError("unreachable: tenacity returns or raises")  # pragma: no cover

    async def _group_commit(self, fn: Callable[[Connection], R], durable: bool) -> R:
        """Run write `fn` in the next batch (see the module docstring); one batch at a time.

        The first writer to find no batch in flight leads: it runs every queued write as one
        transaction in a worker thread, wakes their callers, and hands the lead straight to the
        oldest write queued meanwhile (so there is never a second batch in flight)."""
        job = _Write(fn, durable)
        self._queued.append(job)
        if self._leading:
            try:
                await job.wake.wait()  # set when its batch ran, or when it is to lead the next
            except BaseException:
                if job in self._queued:  # its batch has not started: it never runs
                    self._queued.remove(job)
                if job.lead and not job.done:
                    self._hand_over()
                raise
        if not job.done:
            self._leading = True
            batch, self._queued = self._queued, []
            try:
                await self._in_batch_thread(batch)
            finally:
                if batch[0].ran:
                    for j in batch:
                        j.done = True
                        j.wake.set()
                else:  # cancelled before its thread started: the others go first next time
                    self._queued[:0] = [j for j in batch if j is not job]
                self._hand_over()
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[no-any-return]

    async def _in_batch_thread(self, batch: list[_Write]) -> None:
        """`_run_batch(batch)` on the batches' thread; waits for it even when cancelled (a batch
        that began is finished, and its writers are told), as anyio's `to_thread` does, without
        its checkpoint, capacity limiter and context copy: a third of a turn write's hop."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def run() -> None:
            error: BaseException | None = None
            try:
                self._run_batch(batch)
            except BaseException as e:  # not a write's own failure (those are kept on it): a bug
                error = e
            loop.call_soon_threadsafe(_resolve, done, error)
            self._index_messages()  # its writers are on their way meanwhile

        self._batches.submit(run)
        with anyio.CancelScope(shield=True):
            await done

    def _hand_over(self) -> None:
        if self._queued:
            nxt = self._queued[0]
            nxt.lead = True
            nxt.wake.set()
        else:
            self._leading = False

    def _run_batch(self, batch: list[_Write]) -> None:
        """Worker thread: the batch in one transaction; if a member raises, each on its own."""
        for j in batch:
            j.ran = True
        durable = any(j.durable for j in batch)
        if len(batch) > 1:
            try:
                results = self._attempt(lambda conn: [j.fn(conn) for j in batch], True, durable)
            except _InDoubt as doubt:
                for j, r in zip(batch, doubt.result or [None] * len(batch)):
                    j.error = _InDoubt(doubt.xid, r, doubt.cause)
                return
            except DBAPIError as e:
                if is_transient(e):
                    for j in batch:
                        j.error = e
                    return
            except Exception:
                pass  # rolled back; found out below, one by one
            else:
                for j, r in zip(batch, results):
                    j.result = r
                return
        for j in batch:
            try:
                j.result = self._attempt(j.fn, True, j.durable)
            except Exception as e:
                j.error = e

    def _index_messages(self) -> None:
        """Batches' thread, SQLite: the text index takes the messages written since it last
        did, at most every `search.INDEX_EVERY_S` (`search.catch_up`; a search catches it up
        itself, so a failure here only leaves it to the next)."""
        now = time.monotonic()
        if not self.sqlite or now < self._index_due:
            return
        self._index_due = now + search.INDEX_EVERY_S
        try:
            self._attempt(search.catch_up, True, False)
        except Exception as e:
            log.warning("the text index's catch-up failed (the next one or a search retries): %s",
                        one_line(e))

    def _write_connection(self, durable: bool) -> Connection:
        """SQLite: the batches' connection, opened once (again if it was invalidated), its
        durability set only when it changes (the pragma follows in `_on_begin`)."""
        conn = self._writer
        if conn is None or conn.closed or conn.invalidated:
            if conn is not None:
                conn.close()
            conn = self._writer = self.db.connect()
            conn.execution_options(**{BEGIN_OPTION: "IMMEDIATE"})
        level = "FULL" if durable else "NORMAL"
        if conn.get_execution_options().get(SYNC_OPTION) != level:
            conn.execution_options(**{SYNC_OPTION: level})
        return conn

    def _attempt(self, fn: Callable[[Connection], R], write: bool, durable: bool) -> R:
        if write and self.sqlite:  # a batch (`_run_batch`): the writes are one at a time
            conn = self._write_connection(durable)
            try:
                with conn.begin():
                    return fn(conn)
            except BaseException:
                if conn.invalidated:
                    self._writer = None
                    conn.close()
                raise
        xid: str | None = None
        committing = False
        result: Any = None
        try:
            with self.db.connect() as conn:
                if self.sqlite:
                    conn.execution_options(
                        **{
                            BEGIN_OPTION: "IMMEDIATE" if write else "DEFERRED",
                            SYNC_OPTION: "FULL" if durable else "NORMAL",
                        }
                    )
                with conn.begin():
                    result = fn(conn)
                    if write and not self.sqlite:
                        xid = conn.scalar(text("SELECT pg_current_xact_id()::text"))
                    committing = True
                return result
        except DBAPIError as e:
            if committing and xid is not None and is_transient(e):
                raise _InDoubt(xid, result, e) from e
            raise

    async def _committed(self, xid: str) -> bool:
        """Whether PostgreSQL transaction `xid` committed (asked again while it is still in
        progress, e.g. a backend that has not yet noticed its client is gone)."""

        def status(conn: Connection) -> str | None:
            return conn.scalar(text("SELECT pg_xact_status(CAST(:x AS xid8))"), {"x": xid})

        deadline = time.monotonic() + self.retry_window_s
        while True:
            state = await self.run_in_transaction(status, write=False, name="pg_xact_status")
            if state != "in progress" or time.monotonic() > deadline:
                return state == "committed"
            await anyio.sleep(0.1)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # cancelled natively meanwhile: nobody waits for it any more
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)


def _revision(conn: Connection) -> str | None:
    """The database's schema revision; None without one (or without agent-rl's schema)."""
    try:
        return conn.scalar(text("SELECT version_num FROM alembic_version"))
    except DBAPIError as e:
        if is_transient(e):
            raise
        return None


def write(
    durable: bool = True,
) -> Callable[[Callable[Concatenate[Any, Connection, P], R]], Callable[Concatenate[Any, P], Any]]:
    """Make `def m(self, conn, ...)` an async method running in one write transaction.

    `durable=False` is for bookkeeping that a later durable commit covers (see
    `agent_rl.store.db`); a caller may pass `durable=` to the method to decide for one call."""

    default = durable

    def decorate(fn: Callable[Concatenate[Any, Connection, P], R]) -> Callable[Concatenate[Any, P], Any]:
        @functools.wraps(fn)
        async def method(self: StoreBase, *args: Any, durable: bool = default, **kwargs: Any) -> R:
            return await self.run_in_transaction(
                lambda conn: fn(self, conn, *args, **kwargs), write=True, durable=durable,
                name=fn.__name__,
            )

        return method

    return decorate


def read(fn: Callable[Concatenate[Any, Connection, P], R]) -> Callable[Concatenate[Any, P], Any]:
    """Make `def m(self, conn, ...)` an async method running in one read transaction."""

    @functools.wraps(fn)
    async def method(self: StoreBase, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self.run_in_transaction(
            lambda conn: fn(self, conn, *args, **kwargs), write=False, name=fn.__name__
        )

    return method

"""Store faults: transient ones are ridden through by one retry policy, every transaction
lands exactly once, and what cannot be retried is a one-line `StoreFault`.

The PostgreSQL faults are real: a server of the test's own (tests/_own_postgres.py) restarted
under load, stopped for good, and a TCP proxy in front of it that loses the connection right
after forwarding a COMMIT (the server committed; the client cannot know) or instead of
forwarding it (the server aborts). SQLite's is a second connection holding the write lock past
the busy timeout. Before, each surfaced as a raw SQLAlchemy `OperationalError`, and a commit
whose connection was lost could only be rerun blindly (a second group, a second task)."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from sqlalchemy import Connection, text

from agent_rl.config import StoreConfig
from agent_rl.store import Store
from agent_rl.store.base import StoreFault
from agent_rl.store.migrate import upgrade
from tests._own_postgres import CommitCutter, OwnPostgres, own_postgres
from tests.store.helpers import make_turn, migrated_store

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture(scope="module")
def server() -> Iterator[OwnPostgres]:
    with own_postgres() as pg:
        anyio.run(upgrade, StoreConfig(url=pg.url))
        yield pg


async def rows(store: Store, sql: str, **params: object) -> list[tuple]:
    def q() -> list[tuple]:
        with store.db.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]

    return await anyio.to_thread.run_sync(q)


async def test_a_restart_under_load_is_ridden_through(server: OwnPostgres) -> None:
    async with await Store.open(StoreConfig(url=server.url)) as store:
        run = await store.ensure_run("restart")
        admitted: list[int] = []

        async def producer(k: int) -> None:
            for i in range(25):
                task = await store.add_task(run, "calculator", f"{k}-{i}", {})
                group, eps = await store.admit_group(run, task, "calculator", 2)
                admitted.append(group)
                for e in eps:
                    await store.start_episode(e, "test")
                    await store.append_turn(e, make_turn(e), final_reward=1.0)
                await store.complete_group(group)
                await store.list_episodes(run_id=run, limit=5)

        restarts = threading.Thread(target=lambda: [server.restart("fast", down_s=1.0)
                                                    for _ in range(2)])
        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(producer, k)
            await anyio.sleep(0.5)
            restarts.start()
        restarts.join()
        assert len(admitted) == 75
        audit = await store.audit(run)
        assert audit.problems(finished=False) == []
        assert audit.ledger.admitted == 150 == audit.ledger.completed
        # Exactly once: one task and one group per call, two turns' worth of rows per group.
        assert (await rows(store, "SELECT count(*) FROM tasks WHERE run_id = :r", r=run)) == [(75,)]
        assert (await rows(store, "SELECT count(*) FROM turns JOIN episodes e ON e.id = "
                                  "turns.episode_id WHERE e.run_id = :r", r=run)) == [(150,)]


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "aborted"])
async def test_a_commit_whose_answer_was_lost_lands_once(
    server: OwnPostgres, committed: bool
) -> None:
    cutter = CommitCutter(server.port)
    cutter.forward = committed
    try:
        async with await Store.open(StoreConfig(url=cutter.url())) as store:
            run = await store.ensure_run(f"cut-{committed}")
            cutter.armed = True
            task = await store.add_task(run, "calculator", "once", {"n": 1})
            assert cutter.cut == 1
            keys = await rows(store, "SELECT id FROM tasks WHERE run_id = :r", r=run)
            assert keys == [(task,)]
    finally:
        cutter.close()


async def test_a_database_gone_for_good_is_a_store_fault(server: OwnPostgres) -> None:
    async with await Store.open(StoreConfig(url=server.url)) as store:
        store.retry_window_s = 2.0
        await store.ensure_run("gone")
        server.stop("fast")
        try:
            with anyio.fail_after(30), pytest.raises(StoreFault) as caught:
                await store.list_runs()
        finally:
            server.start()
        assert caught.value.transient and "unreachable" in str(caught.value)
        assert "\n" not in str(caught.value)
        assert len(await store.list_runs()) >= 1  # and back once the server is


async def test_a_refused_statement_is_a_one_line_store_fault(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        await store.ensure_run("refused")

        def rename(conn: Connection) -> None:
            conn.execute(text("ALTER TABLE runs RENAME COLUMN name TO name_moved"))

        await store.run_in_transaction(rename, write=True)
        with pytest.raises(StoreFault) as caught:
            await store.run_id("refused")
        message = str(caught.value)
        assert not caught.value.transient and "\n" not in message and "SELECT" not in message
        assert message.startswith("the store's database refused run_id: ") and "name" in message


async def test_sqlite_locked_past_its_busy_timeout_is_retried(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    async with await migrated_store(url, busy_timeout_s=0.2) as store:
        run = await store.ensure_run("locked")
        holder = sqlite3.connect(tmp_path / "store.db", isolation_level=None,
                                 check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")  # another writer, holding the lock for a second

        def release() -> None:
            time.sleep(1.0)
            holder.execute("COMMIT")
            holder.close()

        threading.Thread(target=release).start()
        task = await store.add_task(run, "calculator", "after-the-lock", {})
        assert (await rows(store, "SELECT id FROM tasks")) == [(task,)]

"""Group commit: concurrent writes share a transaction, yet each is durable when its await
returns, and a failing write stays its caller's."""

from __future__ import annotations

import anyio
import pytest
from sqlalchemy import event

from agent_rl.config import StoreConfig
from agent_rl.kernel.errors import StoreError
from agent_rl.store import Store
from tests.store.helpers import make_turn, migrated_store

pytestmark = pytest.mark.anyio


def count_commits(store: Store) -> list[int]:
    commits = [0]

    @event.listens_for(store.db, "commit")
    def _commit(conn) -> None:  # type: ignore[no-untyped-def]
        commits[0] += 1

    return commits


async def test_concurrent_turns_share_commits_and_each_is_durable(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        task = await store.add_task(run, "calculator", "k", {})
        _, episodes = await store.admit_group(run, task, "calculator", 32)
        for e in episodes:
            await store.start_episode(e, "serve-1")
        commits = count_commits(store)
        seen_by_other_connection: dict[int, int] = {}

        async with await Store.open(StoreConfig(url=db_url)) as reader:

            async def write(e: int) -> None:
                for i in range(4):
                    await store.append_turn(e, make_turn(e * 10 + i))
                    # Returned: committed, so another connection (another process) reads it.
                    seen_by_other_connection[e] = (await reader.get_episode(e)).episode.num_turns
                    assert seen_by_other_connection[e] == i + 1

            async with anyio.create_task_group() as tg:
                for e in episodes:
                    tg.start_soon(write, e)

        assert commits[0] < 32 * 4 / 2, f"{commits[0]} commits for {32 * 4} turns"
        for e in episodes:
            detail = await store.get_episode(e)
            assert [t.index for t in detail.turns] == [0, 1, 2, 3]
            tokens = await store.episode_tokens(e)
            expected = [make_turn(e * 10 + i).tokens.token_ids for i in range(4)]
            assert tokens.token_ids.tolist() == [t for ids in expected for t in ids.tolist()]


async def test_a_failing_write_fails_alone(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        task = await store.add_task(run, "calculator", "k", {})
        _, episodes = await store.admit_group(run, task, "calculator", 16)
        refused = episodes[5]  # still waiting: its turn is refused (not the first: that one leads)
        for e in episodes:
            if e != refused:
                await store.start_episode(e, "serve-1")
        outcomes: dict[int, object] = {}

        async def write(e: int) -> None:
            try:
                outcomes[e] = await store.append_turn(e, make_turn(e))
            except StoreError as err:
                outcomes[e] = err

        async with anyio.create_task_group() as tg:
            for e in episodes:
                tg.start_soon(write, e)

        assert isinstance(outcomes[refused], StoreError)
        assert "waiting, not running" in str(outcomes[refused])
        assert all(outcomes[e] == 0 for e in episodes if e != refused)
        for e in episodes:
            assert (await store.get_episode(e)).episode.num_turns == (0 if e == refused else 1)


async def test_a_cancelled_writer_leaves_the_others_running(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        task = await store.add_task(run, "calculator", "k", {})
        _, episodes = await store.admit_group(run, task, "calculator", 24)
        for e in episodes:
            await store.start_episode(e, "serve-1")
        done: list[int] = []

        async def write(e: int) -> None:
            await store.append_turn(e, make_turn(e))
            done.append(e)

        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as doomed:
                async with anyio.create_task_group() as inner:
                    for e in episodes[:8]:
                        inner.start_soon(write, e)
                    for e in episodes[8:]:
                        tg.start_soon(write, e)
                    await anyio.sleep(0)
                    doomed.cancel()
        # Every write not cancelled landed; a cancelled one either landed or left nothing.
        assert set(episodes[8:]) <= set(done)
        for e in episodes:
            turns = (await store.get_episode(e)).episode.num_turns
            assert turns == (1 if e in done else turns) and turns in (0, 1)
        # The store still writes after the cancellations.
        await store.append_turn(episodes[-1], make_turn(99))
        assert (await store.get_episode(episodes[-1])).episode.num_turns == 2


async def test_each_transaction_commits_at_its_own_synchronous_level(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SQLite keeps `PRAGMA synchronous` on the connection, and the store sends the pragma only
    when a transaction's level differs from the connection's: on one pooled connection, a
    durable write after bookkeeping ones still runs at FULL (2), and bookkeeping after it at
    NORMAL (1)."""
    async with await migrated_store(f"sqlite:///{tmp_path}/s.db", pool_size=1) as store:

        def level(conn) -> int:  # type: ignore[no-untyped-def]
            return int(conn.exec_driver_sql("PRAGMA synchronous").scalar())

        seen = [await store.run_in_transaction(level, write=True, durable=durable)
                for durable in (False, False, True, True, False)]  # fmt: skip
        seen.append(await store.run_in_transaction(level, write=False))
    assert seen == [1, 1, 2, 2, 1, 2]

"""`DriverStatement`: the hot path's statements on the driver's cursor behave as SQLAlchemy's
`execute` does, on SQLite and PostgreSQL: the same rows (type processing: JSON, None, floats,
blobs, booleans), the same exception classes, a lost connection seen as transient (so the
store's retries still cover the hot path), and statements it cannot run faithfully refused."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from sqlalchemy import Connection, bindparam, insert, select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError

from agent_rl.store import EpisodeEnd, Store
from agent_rl.store.base import is_transient
from agent_rl.store.driver import DriverStatement
from agent_rl.store.models import EpisodeRow, MessageRow
from tests._databases import fresh_database
from tests.store.helpers import make_turn, migrated_store

pytestmark = pytest.mark.anyio

KEYS = ["episode_id", "turn_index", "position", "role", "content", "tool_calls", "name"]
INSERT = insert(MessageRow)
ROWS = [
    dict(role="assistant", content="<tool_call>{}</tool_call>",
         tool_calls=[{"name": "calc", "arguments": '{"x":1}'}], name=None),
    dict(role="tool", content="4 \u00e9 \U0001f600", tool_calls=None, name="calc"),
    dict(role="user", content="", tool_calls={"nested": {"a": [1, 2.5, None]}}, name=""),
]


async def one_episode(store: Store) -> int:
    run = await store.ensure_run("driver")
    task = await store.add_task(run, "calculator", "t", {})
    _, (episode,) = await store.admit_group(run, task, "calculator", 1)
    return episode


async def in_transaction(store: Store, fn):  # type: ignore[no-untyped-def]
    def body() -> object:
        with store.db.connect() as conn, conn.begin():
            return fn(conn)

    return await anyio.to_thread.run_sync(body)


async def test_rows_equal_those_written_by_execute(db_url: str) -> None:
    store = await migrated_store(db_url)
    try:
        episode = await one_episode(store)

        def write(conn: Connection) -> None:
            rows = [dict(episode_id=episode, turn_index=0, position=i, **r) for i, r in enumerate(ROWS)]
            conn.execute(INSERT, rows)
            DriverStatement(INSERT, KEYS).many(
                conn, [{**r, "turn_index": 1, "position": 10 + r["position"]} for r in rows])

        await in_transaction(store, write)

        def read(conn: Connection) -> list[tuple]:
            cols = [MessageRow.role, MessageRow.content, MessageRow.tool_calls, MessageRow.name,
                    MessageRow.position]
            found = conn.execute(select(MessageRow.turn_index, *cols).where(MessageRow.episode_id == episode)
                                 .order_by(MessageRow.position)).all()
            raw = conn.execute(text("SELECT CAST(tool_calls AS TEXT) FROM messages "
                                    "WHERE episode_id = :e ORDER BY position"), {"e": episode}).all()
            return [tuple(r) for r in found] + [tuple(r) for r in raw]

        rows = await in_transaction(store, read)
        by_execute, by_driver, raw = rows[:3], rows[3:6], rows[6:]
        assert [r[0] for r in by_execute] == [0, 0, 0] and [r[0] for r in by_driver] == [1, 1, 1]
        assert [r[1:5] for r in by_execute] == [r[1:5] for r in by_driver]
        assert [r[3] for r in by_driver] == [ROWS[i]["tool_calls"] for i in range(3)]
        # Stored as the same text (None is JSON null, as SQLAlchemy's JSON type writes it).
        assert raw[:3] == raw[3:]

        # A RETURNING update with literals of its own and a float/None processed.
        bump = DriverStatement(
            update(EpisodeRow).where(EpisodeRow.id == bindparam("eid"), EpisodeRow.status == "waiting")
            .values(num_turns=EpisodeRow.num_turns + 1, heartbeat_at=bindparam("t"))
            .returning(EpisodeRow.num_turns, EpisodeRow.heartbeat_at)
        )
        assert await in_transaction(store, lambda c: bump.one_or_none(c, {"eid": episode, "t": 1.5})) \
            == (1, 1.5)  # fmt: skip
        assert await in_transaction(store, lambda c: bump.one_or_none(c, {"eid": -1, "t": None})) is None
        assert await in_transaction(store, lambda c: bump.rowcount(c, {"eid": episode, "t": None})) == 1
    finally:
        await store.close()


async def test_driver_errors_are_sqlalchemys_and_roll_back(db_url: str) -> None:
    store = await migrated_store(db_url)
    try:
        episode = await one_episode(store)
        stmt = DriverStatement(INSERT, KEYS)
        row = dict(episode_id=episode, turn_index=0, position=0, role="user", content="kept?",
                   tool_calls=None, name=None)

        def write(conn: Connection) -> None:
            stmt.many(conn, [row])
            stmt.many(conn, [{**row, "episode_id": 999_999}])  # no such episode: FOREIGN KEY

        with pytest.raises(IntegrityError) as caught:
            await in_transaction(store, write)
        assert not is_transient(caught.value)
        count = await in_transaction(
            store, lambda c: c.scalar(select(MessageRow.id).where(MessageRow.episode_id == episode)))
        assert count is None  # the first insert went with the transaction
    finally:
        await store.close()


@pytest.mark.postgres
async def test_a_lost_connection_is_transient_and_invalidates(tmp_path: Path) -> None:
    with fresh_database("postgres", tmp_path) as url:
        await _lost_connection(url)


async def _lost_connection(url: str) -> None:
    store = await migrated_store(url)
    try:
        episode = await one_episode(store)
        start = DriverStatement(
            update(EpisodeRow).where(EpisodeRow.id == bindparam("eid")).values(owner=bindparam("owner")))

        def killed_midway(conn: Connection) -> None:
            pid = conn.scalar(text("SELECT pg_backend_pid()"))
            with store.db.connect() as other:
                other.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
                other.commit()
            start.rowcount(conn, {"eid": episode, "owner": "x"})

        with pytest.raises(DBAPIError) as caught:
            await in_transaction(store, killed_midway)
        assert caught.value.connection_invalidated and is_transient(caught.value)
        # The pool hands out a working connection afterwards: the store carries on.
        await store.start_episode(episode, "after")
    finally:
        await store.close()


def test_statements_it_cannot_run_faithfully_are_refused() -> None:
    from sqlalchemy import create_engine

    expanding = DriverStatement(
        update(EpisodeRow).where(EpisodeRow.status.in_(("waiting", "running"))).values(owner="x"))
    with pytest.raises(TypeError, match="Connection.execute"):
        expanding._for(create_engine("sqlite://").dialect)


async def test_a_warmed_store_compiles_nothing_on_an_episodes_path(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`Store.warm` (serve's start) compiles every statement of the store for its database, so
    an episode's writes and reads (admission, turns, its end and its group's, the version
    check) compile none: before, each of a dozen compiled at its first use (1-2 ms apiece)
    during serve's first episodes."""
    store = await migrated_store(db_url)
    try:
        # A statement that cannot compile for the database is left to raise at its use.
        refused = DriverStatement(
            update(EpisodeRow).where(EpisodeRow.status.in_(("waiting", "running"))).values(owner="x"))
        await store.warm()
        dialect = store.db.dialect
        assert not refused.compiled_for(dialect)
        import agent_rl.store.lifecycle as lifecycle
        import agent_rl.store.queries as queries

        hot = [v for m in (lifecycle, queries) for v in vars(m).values() if isinstance(v, DriverStatement)]
        hot += [v for m in (lifecycle,) for d in vars(m).values() if isinstance(d, dict)
                for v in d.values() if isinstance(v, DriverStatement)]  # fmt: skip
        assert len(hot) >= 10 and all(s.compiled_for(dialect) for s in hot)

        compiled: list[str] = []
        original = DriverStatement._compile

        def record(self: DriverStatement, d: object) -> object:
            compiled.append(str(self.statement))
            return original(self, d)  # type: ignore[arg-type]

        monkeypatch.setattr(DriverStatement, "_compile", record)
        run = await store.ensure_run("warm")
        await store.latest_version(run)
        group, (episode,) = await store.admit_task(run, "calculator", "t", {}, 1, [7], start="serve-1")
        await store.append_turn(episode, make_turn(1))
        end = EpisodeEnd("completed", reward=1.0, turn=make_turn(2))
        assert await store.end_episode_and_group(episode, end, group) == (2, "ready")
        assert compiled == []
    finally:
        await store.close()

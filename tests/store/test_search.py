"""Text search over messages (`list_episodes(text=...)`, the API's `q`) through each database's
own index (revision 0003): SQLite's FTS5 trigram table, PostgreSQL's pg_trgm GIN index. The
matches are the ILIKE substring matches they replace, the index is what the query plan uses,
and the FTS5 table follows inserts (in batches, revision 0006: a search still finds every
message written before it) and deletes. PostgreSQL's pattern is written into the SQL
(a bound one got a generic plan that scanned), so quotes and backslashes are in the cases."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
from alembic import command
from sqlalchemy import text as sql

from agent_rl.config import StoreConfig
from agent_rl.store import MessageRecord, Store, search
from agent_rl.store.migrate import alembic_config, upgrade
from tests.store.helpers import make_turn, migrated_store

pytestmark = pytest.mark.anyio

TEXTS = [
    "The answer is 42.",
    'She said "FTS5 AND NEAR(x y)" * ^ -- not syntax',
    "Zürich ÄRGER straße",
    "100% of x_3 \\ backslash",
    "tiny",
    "it's O'Brien's \\' turn",
]


async def episodes_with(store: Store, run: int, texts: list[str]) -> list[int]:
    task = await store.add_task(run, "calculator", "s", {})
    _, eps = await store.admit_group(run, task, "calculator", len(texts))
    for e, content in zip(eps, texts, strict=True):
        await store.start_episode(e, "test")
        turn = make_turn(e)
        turn.messages = [MessageRecord("user", "question"), MessageRecord("assistant", content)]
        await store.append_turn(e, turn, final_reward=1.0)
    return eps


@pytest.mark.parametrize("way", ["index", "walk", "default"])
async def test_search_matches_substrings_case_insensitively(
    db_url: str, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every way a search runs answers the same: through the index's matches (a rare text),
    walking the episodes in the page's order (a common text: SQLite's EXISTS, PostgreSQL's
    chunks, of one episode here so that every case crosses several), and the
    default choice between them; paged one episode at a time, both ways."""
    if way == "index":
        monkeypatch.setattr(search, "WALK_CHUNKS", 0)
        monkeypatch.setattr(search, "SQLITE_FEW", 10_000)
    elif way == "walk":  # every text counts as common: the walk goes to the end
        monkeypatch.setattr(search, "WALK_CHUNKS", 10_000)
        monkeypatch.setattr(search, "SQLITE_FEW", -1)
        monkeypatch.setattr(search, "CHUNK", 1)
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("search")
        eps = await episodes_with(store, run, TEXTS)
        found = lambda rows: sorted(r.id for r in rows)  # noqa: E731
        cases = {
            "answer is 4": [eps[0]], "ANSWER": [eps[0]], '"FTS5 AND NEAR(x y)"': [eps[1]],
            "* ^ --": [eps[1]], "100% of X_3": [eps[3]], "x_3 \\ b": [eps[3]], "1000%": [],
            "zürich": [eps[2]], "STRASSE": [], "question": eps, "ny": [eps[4]], "e": eps,
            "%": [eps[3]], "_": [eps[3]], '"': [eps[1]], "nothing like it": [],
            "o'brien's \\'": [eps[5]], "'": [eps[5]], "\\": [eps[3], eps[5]],
        }
        for q, expected in cases.items():
            assert found(await store.list_episodes(text=q)) == expected, q
            if len(q) >= 3:
                for sort in ("id", "-id"):
                    paged, after = [], None
                    while page := await store.list_episodes(text=q, sort=sort, limit=1,
                                                            after_id=after):
                        paged += [e.id for e in page]
                        after = page[-1].id
                    assert paged == sorted(expected, reverse=sort == "-id"), (q, sort)


async def test_search_uses_the_database_index(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("plan")
        await episodes_with(store, run, TEXTS)
        query = search.messages_with("answer", store.sqlite)
        with store.db.connect() as conn:
            if store.sqlite:
                compiled = query.compile(conn, compile_kwargs={"literal_binds": True})
                explained = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}")
                plan = " ".join(str(r) for r in explained)
                assert "VIRTUAL TABLE INDEX" in plan and "messages_fts" in plan, plan
            else:
                conn.execute(sql("SET enable_seqscan = off"))  # a tiny table is scanned anyway
                compiled = query.compile(conn, compile_kwargs={"literal_binds": True})
                plan = " ".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {compiled}"))
                assert "messages_fts_trgm" in plan, plan


def indexed(store: Store, text: str) -> int:
    """SQLite: messages the FTS5 table itself matches (no catch-up first)."""
    with store.db.connect() as conn:
        phrase = '"' + text + '"'
        return int(conn.scalar(sql("SELECT count(*) FROM messages_fts WHERE messages_fts MATCH :q"),
                               {"q": phrase}) or 0)


def integrity_check(store: Store) -> None:
    """FTS5's own check that its index is exactly the messages' (it raises otherwise)."""
    with store.db.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO messages_fts(messages_fts, rank) VALUES ('integrity-check', 1)").close()


async def test_the_sqlite_index_follows_inserts_and_deletes(tmp_path: Path) -> None:
    # SQLite only: PostgreSQL's index is an ordinary one, SQLite's FTS5 table has triggers.
    async with await migrated_store(f"sqlite:///{tmp_path / 'store.db'}") as store:
        run = await store.ensure_run("sync")
        first = await episodes_with(store, run, ["alpha bravo"])
        other = await store.ensure_run("other")
        await episodes_with(store, other, ["alpha charlie"])
        assert len(await store.list_episodes(text="alpha")) == 2
        with store.db.begin() as conn:  # runs cascade to their episodes and messages
            conn.execute(sql("DELETE FROM runs WHERE id = :r"), {"r": other})
            conn.execute(sql("UPDATE messages SET content = 'delta' WHERE content = 'alpha bravo'"))
        integrity_check(store)
        assert await store.list_episodes(text="alpha") == []
        assert [e.id for e in await store.list_episodes(text="DELTA")] == first


async def test_a_write_leaves_the_index_to_a_batch_and_a_search_finds_it_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: a turn's messages are not indexed in its own transaction (a trigger per message
    cost each turn's write a trip through FTS5), yet a search right after it finds them."""
    monkeypatch.setattr(search, "INDEX_EVERY_S", 3600.0)  # the writer's catch-up: its first batch only
    async with await migrated_store(f"sqlite:///{tmp_path / 'store.db'}") as store:
        run = await store.ensure_run("batched")
        await episodes_with(store, run, ["alpha one"])
        later = await episodes_with(store, run, ["bravo two"])
        assert indexed(store, "bravo") == 0
        assert [e.id for e in await store.list_episodes(text="BRAVO")] == later
        assert indexed(store, "bravo") == 1
        integrity_check(store)


async def test_the_writer_catches_the_index_up_after_its_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search, "INDEX_EVERY_S", 0.0)
    async with await migrated_store(f"sqlite:///{tmp_path / 'store.db'}") as store:
        run = await store.ensure_run("writer")
        await episodes_with(store, run, ["charlie three"])
        deadline = time.monotonic() + 10
        while indexed(store, "charlie") == 0:  # the catch-up runs once the writers are woken
            assert time.monotonic() < deadline, "the writer never indexed the new messages"
            await anyio.sleep(0.01)
        integrity_check(store)


async def test_deletes_and_updates_keep_the_batched_index_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages deleted or rewritten before and after they were indexed, and new messages
    given the ids of deleted ones (SQLite reuses the largest ids): the index stays exactly the
    messages, and every search finds what is there."""
    monkeypatch.setattr(search, "INDEX_EVERY_S", 3600.0)
    async with await migrated_store(f"sqlite:///{tmp_path / 'store.db'}") as store:
        run = await store.ensure_run("keep")
        other = await store.ensure_run("other")
        kept = await episodes_with(store, run, ["alpha kept"])
        await episodes_with(store, other, ["alpha gone"])
        assert len(await store.list_episodes(text="alpha")) == 2  # indexed now
        rewritten = await episodes_with(store, run, ["foxtrot unindexed"])
        await episodes_with(store, other, ["echo unindexed"])
        with store.db.begin() as conn:
            conn.execute(sql("DELETE FROM runs WHERE id = :r"), {"r": other})  # indexed and not
            conn.execute(sql("UPDATE messages SET content = 'golf' WHERE content LIKE 'foxtrot%'"))
            conn.execute(sql("UPDATE messages SET content = 'hotel' WHERE content = 'alpha kept'"))
        assert await store.list_episodes(text="echo") == []
        assert await store.list_episodes(text="alpha") == []
        assert [e.id for e in await store.list_episodes(text="golf")] == rewritten
        assert [e.id for e in await store.list_episodes(text="hotel")] == kept
        integrity_check(store)

        last = await store.ensure_run("last")
        await episodes_with(store, last, ["juliet largest"])
        assert len(await store.list_episodes(text="juliet")) == 1  # indexed: the largest ids
        with store.db.begin() as conn:
            largest = conn.scalar(sql("SELECT max(id) FROM messages"))
            conn.execute(sql("DELETE FROM runs WHERE id = :r"), {"r": last})
        reused = await episodes_with(store, run, ["india reused"])
        with store.db.connect() as conn:
            assert conn.scalar(sql("SELECT max(id) FROM messages")) == largest  # ids reused
        assert [e.id for e in await store.list_episodes(text="india")] == reused
        assert await store.list_episodes(text="juliet") == []
        integrity_check(store)


async def test_the_batched_index_migrates_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up from 0005 (a trigger per message), every message stays found; back down, the
    messages not yet indexed are indexed, and each new one is again as it is written."""
    monkeypatch.setattr(search, "INDEX_EVERY_S", 3600.0)
    cfg = StoreConfig(url=f"sqlite:///{tmp_path / 'store.db'}")
    alembic = alembic_config(cfg)
    await anyio.to_thread.run_sync(lambda: command.upgrade(alembic, "0005"))
    async with await Store.open(cfg, check=False) as store:  # 0006 changes no model
        before = await episodes_with(store, await store.ensure_run("old"), ["juliet before"])
    await upgrade(cfg)
    async with await Store.open(cfg) as store:
        run = await store.ensure_run("new")
        assert [e.id for e in await store.list_episodes(text="juliet")] == before
        await episodes_with(store, run, ["kilo after"])
        assert indexed(store, "kilo") == 0
    await anyio.to_thread.run_sync(lambda: command.downgrade(alembic, "0005"))
    async with await Store.open(cfg, check=False) as store:  # (its writer's catch-up: refused)
        assert indexed(store, "kilo") == 1
        await episodes_with(store, run, ["lima down"])
        assert indexed(store, "lima") == 1  # 0003's trigger, as the row is inserted
        integrity_check(store)

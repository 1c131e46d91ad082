"""Text search over messages: the episode list's `q`, a case-insensitive substring of any
message, at a cost bounded by the page rather than by how common the text is.

Each backend has a text index (revision 0003): SQLite's FTS5 trigram table, PostgreSQL's
pg_trgm GIN index. The index gives *every* message containing the text: a handful for a rare
text, most messages for a common word, and collecting all of them (PostgreSQL then rechecks
each candidate's text) took 55 ms on SQLite and 284-477 ms on PostgreSQL at 10k episodes. So:

- SQLite counts the FTS5 matches up to `SQLITE_FEW` + 1 (a few ms). Few: the page is sorted
  from the index's matches. Many: `EXISTS` with LIKE over each episode's messages, in the
  page's order, which stops once the page is full (a common word fills it at once).
- PostgreSQL, where even reading a common word's trigram lists costs tens of ms, checks the
  page's first `CHUNK` x limit episodes first, their messages read by the episode index in
  one statement (`WALK_CHUNKS` chunks): a common word fills the page there without touching
  the trigram index. A page not full then comes from every match through the trigram index,
  which is cheap when the text is not common. These are statements of our own, with bitmap
  or sequential scans off where needed: the planner's estimate of a long pattern's matches is
  far too low (4 for 3,600) and its plans follow it.

SQLite's index takes new messages in batches (revision 0006): `catch_up` indexes every
message after `messages_fts_state.indexed_to` in one statement, which the store's writer runs
at most every `INDEX_EVERY_S`, after a batch, and a text search runs first. A trigger per
inserted message cost each message its own trip through FTS5 and each write transaction a new
index segment, ~1.5 ms of CPU per 4-turn episode; the same messages in one catch-up, 0.06 ms.

A message's own check: SQLite's LIKE (it folds ASCII case; a text with other letters always
takes the FTS5 index, whose folding is Unicode's); PostgreSQL's case-insensitive regular
expression of the escaped text (`~*`), which the trigram index serves as it does ILIKE and
which costs a third of ILIKE's check (ILIKE lowercases the whole message first). Every path
answers the same rows (tests/store/test_search.py runs every case each way). Left slow: a
text under three characters (no trigrams: episodes are checked in the page's order until the
page is full), and a text in thousands of messages none of which are near the page's start.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ARRAY,
    ColumnElement,
    Connection,
    Integer,
    Row,
    Select,
    bindparam,
    exists,
    func,
    literal_column,
    select,
    table,
)

from agent_rl.store.driver import run_sql
from agent_rl.store.models import MESSAGE_SEARCH, EpisodeRow, MessageRow

SQLITE_FEW = 5000
"""SQLite: at most this many FTS5 matches (counted, a few ms) sorts the page from the index's
matches; more is a common text, found walking the episodes in the page's order."""

INDEX_EVERY_S = 1.0
"""SQLite: the writer's catch-up of the text index runs at most this often (a search always
catches it up first)."""

CHUNK = 4
"""PostgreSQL: episodes checked per statement, as a multiple of the page."""

WALK_CHUNKS = 1
"""PostgreSQL: chunks walked before a page not yet full is taken from the index's matches (a
word in a quarter of the episodes fills a page in one)."""


_STATE = f"{MESSAGE_SEARCH}_state"
_CATCH_UP = (
    f"INSERT INTO {MESSAGE_SEARCH}(rowid, content) SELECT id, content FROM messages "
    f"WHERE id > (SELECT indexed_to FROM {_STATE}) ORDER BY id",
    f"UPDATE {_STATE} SET indexed_to = (SELECT MAX(id) FROM messages) "
    f"WHERE indexed_to < (SELECT MAX(id) FROM messages)",
)


def catch_up(conn: Connection) -> None:
    """SQLite, in a write transaction: index the messages written since the index last did
    (none: two lookups, nothing written). PostgreSQL's index needs none."""
    for sql in _CATCH_UP:
        run_sql(conn, sql)


def page(
    conn: Connection, sqlite: bool, text: str, query: Select[Any], limit: int
) -> list[Row[Any]]:
    """The first `limit` rows of `query` (episodes, filtered and ordered) whose transcript
    contains `text`."""
    if len(text) < 3:  # no trigrams: each episode's messages are checked in the page's order
        return list(conn.execute(query.where(_walk(text, sqlite)).limit(limit)))
    if sqlite:
        rare = not text.isascii() or _fts_hits(conn, text, SQLITE_FEW) <= SQLITE_FEW
        return list(
            conn.execute(
                query.where(_indexed(text, sqlite) if rare else _walk(text, sqlite)).limit(limit)
            )
        )
    rows, walked_all = _walk_in_chunks(conn, text, query, limit, WALK_CHUNKS)
    if len(rows) == limit or walked_all:
        return rows
    # Not common near the page's start: every match, through the index, then the page.
    conn.exec_driver_sql("SET LOCAL enable_seqscan = off")  # this read's transaction
    ids = conn.scalars(messages_with(text, sqlite=False).distinct()).all()
    conn.exec_driver_sql("SET LOCAL enable_seqscan = on")
    return list(conn.execute(query.where(_any_of(ids)).limit(limit)))


def _indexed(text: str, sqlite: bool) -> ColumnElement[bool]:
    return EpisodeRow.id.in_(messages_with(text, sqlite))


def _fts_hits(conn: Connection, text: str, cap: int) -> int:
    """SQLite: messages the FTS5 index matches, counted up to `cap` + 1."""
    capped = _fts_rowids(text).limit(cap + 1).subquery()
    return int(conn.scalar(select(func.count()).select_from(capped)) or 0)


def _walk(text: str, sqlite: bool) -> ColumnElement[bool]:
    """Each episode, in the page's order, checked for a message containing `text`."""
    return exists(
        select(MessageRow.id).where(MessageRow.episode_id == EpisodeRow.id, _matches(text, sqlite))
    )


def _any_of(ids: Sequence[int]) -> ColumnElement[bool]:
    return EpisodeRow.id == func.any(bindparam("hits", list(ids), type_=ARRAY(Integer)))


def _walk_in_chunks(
    conn: Connection, text: str, query: Select[Any], limit: int, chunks: int
) -> tuple[list[Row[Any]], bool]:
    """PostgreSQL: the page's episodes in its order, `CHUNK` x limit at a time, each chunk's
    messages checked in one statement (by the messages' episode index), for at most `chunks`
    chunks; the rows found, and whether every episode was checked. Statements of our own, not
    one join: the planner's estimate of a long pattern's matches is far too low (4 for 3,600),
    and its plan then collected every match through the index."""
    rows: list[Row[Any]] = []
    size = CHUNK * limit
    for n in range(chunks):
        chunk = conn.execute(query.offset(n * size).limit(size)).all()
        hits = _hits_among(conn, text, [r.id for r in chunk])
        rows += [r for r in chunk if r.id in hits][: limit - len(rows)]
        if len(rows) == limit or len(chunk) < size:
            return rows, len(chunk) < size
    return rows, False


def _hits_among(conn: Connection, text: str, ids: list[int]) -> set[int]:
    """PostgreSQL: which of these episodes have a message containing `text`, their messages
    read by the episode index (bitmap scans off: the planner, misled by its estimate, would
    take the trigram index and recheck every match of the word instead)."""
    if not ids:
        return set()
    conn.exec_driver_sql("SET LOCAL enable_bitmapscan = off")  # this read's transaction
    conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
    among = MessageRow.episode_id == func.any(bindparam("ids", ids, type_=ARRAY(Integer)))
    found = select(MessageRow.episode_id).distinct().where(among, _matches(text, False))
    hits = set(conn.scalars(found))
    conn.exec_driver_sql("SET LOCAL enable_bitmapscan = on")
    conn.exec_driver_sql("SET LOCAL enable_seqscan = on")
    return hits


def messages_with(text: str, sqlite: bool) -> Select[tuple[int]]:
    """Episode ids of the messages containing `text`, case-insensitively, through the
    backend's text search index: SQLite's FTS5 trigram table, PostgreSQL's pg_trgm index
    under `~*`. Trigrams need three characters; a shorter text scans."""
    if sqlite and len(text) >= 3:
        return select(MessageRow.episode_id).where(MessageRow.id.in_(_fts_rowids(text)))
    return select(MessageRow.episode_id).where(_matches(text, sqlite))


def _matches(text: str, sqlite: bool) -> ColumnElement[bool]:
    """A message's own check: SQLite's LIKE (case-insensitive for ASCII), PostgreSQL's `~*`."""
    pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    if sqlite:
        if not text.isascii():  # LIKE would not fold its case: ask the index about this row
            return MessageRow.id.in_(_fts_rowids(text))
        return MessageRow.content.like(pattern, escape="\\")
    # A case-insensitive regular expression of the text, every ASCII character that is not a
    # letter or digit escaped (a literal then): it matches what ILIKE '%text%' matches, the
    # trigram index serves it the same way, and its check of a message costs a third of
    # ILIKE's, which lowercases the whole message first. Written into the SQL, not bound:
    # PostgreSQL plans a bound pattern once it is prepared (psycopg prepares a statement run
    # five times) with a generic plan that cannot see the trigrams.
    literal = re.sub(r"([\x00-\x2f\x3a-\x40\x5b-\x60\x7b-\x7f])", r"\\\1", text)
    inline = bindparam("pattern", literal, literal_execute=True)
    return MessageRow.content.op("~*")(inline)


def _fts_rowids(text: str) -> Select[tuple[int]]:
    phrase = '"' + text.replace('"', '""') + '"'  # one FTS5 phrase: no query syntax
    return (
        select(literal_column("rowid"))
        .select_from(table(MESSAGE_SEARCH))
        .where(literal_column(MESSAGE_SEARCH).op("MATCH")(phrase))
    )

"""Text search over messages: the episode list's `q`, a case-insensitive substring of any
message, at a cost bounded by the page rather than by how common the text is.

Each backend has a text index (revision 0003): SQLite's FTS5 trigram table, PostgreSQL's
pg_trgm GIN index under ILIKE. The index gives *every* message containing the text: a handful
for a rare text, most messages for a common word, and collecting all of them (PostgreSQL then
rechecks each with ILIKE, ~13 us a message) took 55 ms on SQLite and 284-477 ms on PostgreSQL
at 10k episodes. So how many messages match is found out cheaply first, and the query chosen:

- few (SQLite: the FTS5 index counts at most `SQLITE_FEW` hits, a few ms; PostgreSQL: the
  planner's estimate, from EXPLAIN, is at most `POSTGRES_FEW`): the episodes of the index's
  matches (`messages_with`; on PostgreSQL collected by a statement of their own, with
  sequential scans off: inside the page's statement the planner joins them along the
  episodes' order instead, rechecking every message on its way);
- many, SQLite: each episode in the page's order checked for a matching message with LIKE
  (`EXISTS` over its messages, by the messages' episode index), which stops once the page is
  full: a common word fills it within its first episodes;
- many, PostgreSQL, a page ordered by id: ranges of episode ids from the page's start, each
  four times the last; in a range the index's matches are intersected with the range's
  messages (a BitmapAnd), so only matching messages are rechecked, and a text whose matches
  lie far down the order (the tags `ep1` of episodes 1, 10-19, 100-199, ...) costs its
  matches, not a walk past every episode; ordered by another key: the `EXISTS` walk.

All answer the same rows (tests/store/test_search.py runs every case both ways). Left slow: a
text under three characters on PostgreSQL (no trigrams: the check scans), and, ordered by a
key other than id, a common text whose matches all lie far down that order. On SQLite a text
with non-ASCII letters always takes the index, whose case folding is Unicode's (LIKE folds
ASCII only).
"""

from __future__ import annotations

import json
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

from agent_rl.store.models import MESSAGE_SEARCH, EpisodeRow, MessageRow

SQLITE_FEW = 5000
"""Most FTS5 hits (messages) for which SQLite sorts the page from the index's matches."""

POSTGRES_FEW = 500
"""Most messages (the planner's estimate) for which PostgreSQL collects the index's matches
(each costs a recheck of its text, ~13 us); above it, ranges of ids (or the walk) are cheaper."""


def page(
    conn: Connection,
    sqlite: bool,
    text: str,
    query: Select[Any],
    limit: int,
    *,
    by_id: bool,
    desc: bool,
    after_id: int | None,
) -> list[Row[Any]]:
    """The first `limit` rows of `query` (episodes, filtered and ordered, `by_id`: by id
    alone) whose transcript contains `text`; `after_id` is where an id-ordered page starts."""
    if sqlite or len(text) < 3:
        return list(conn.execute(query.where(_text_filter(conn, sqlite, text)).limit(limit)))
    if _estimated_matches(conn, text) <= POSTGRES_FEW:
        return list(conn.execute(query.where(_collected(conn, text)).limit(limit)))
    if not by_id:
        return list(conn.execute(query.where(_walk(text, sqlite)).limit(limit)))
    return _by_id_windows(conn, text, query, limit, desc=desc, after_id=after_id)


def _text_filter(conn: Connection, sqlite: bool, text: str) -> ColumnElement[bool]:
    if len(text) >= 3 and sqlite and (not text.isascii() or _fts_hits(conn, text) <= SQLITE_FEW):
        return EpisodeRow.id.in_(messages_with(text, sqlite))
    return _walk(text, sqlite)


def _walk(text: str, sqlite: bool) -> ColumnElement[bool]:
    """Each episode, in the page's order, checked for a message containing `text`."""
    return exists(
        select(MessageRow.id).where(MessageRow.episode_id == EpisodeRow.id, _matches(text, sqlite))
    )


def _collected(conn: Connection, text: str) -> ColumnElement[bool]:
    """PostgreSQL: the episodes of every message the index finds, collected by a statement of
    their own first (inside the page's statement the planner would join them along the
    episodes' order, rechecking every message on its way)."""
    conn.exec_driver_sql("SET LOCAL enable_seqscan = off")  # this read's transaction
    ids = conn.scalars(messages_with(text, sqlite=False).distinct()).all()
    conn.exec_driver_sql("SET LOCAL enable_seqscan = on")
    return _any_of(ids)


def _any_of(ids: Sequence[int]) -> ColumnElement[bool]:
    return EpisodeRow.id == func.any(bindparam("hits", list(ids), type_=ARRAY(Integer)))


def _by_id_windows(
    conn: Connection, text: str, query: Select[Any], limit: int, *, desc: bool, after_id: int | None
) -> list[Row[Any]]:
    """PostgreSQL, a common text, a page by id: ranges of episode ids from the page's start,
    each four times the last, until the page is full. Within a range the index's matches are
    intersected with the range's messages (a BitmapAnd), so only matching messages in it are
    rechecked: a text common near the start fills the page in the first range, and one whose
    matches lie far down still costs only its matches, not a walk past every episode."""
    low, high = conn.execute(select(func.min(EpisodeRow.id), func.max(EpisodeRow.id))).one()
    if low is None:
        return []
    if after_id is not None:
        low, high = (low, min(high, after_id - 1)) if desc else (max(low, after_id + 1), high)
    rows: list[Row[Any]] = []
    edge, width = (high if desc else low), 4 * limit
    while len(rows) < limit and low <= edge <= high:
        lo, hi = (edge - width + 1, edge) if desc else (edge, edge + width - 1)
        hits = (
            select(MessageRow.episode_id)
            .where(MessageRow.episode_id.between(lo, hi), _matches(text, sqlite=False))
            .distinct()
        )
        ids = conn.scalars(hits).all()  # on its own, or the planner walks the range instead
        if ids:
            window = query.where(EpisodeRow.id.between(lo, hi), _any_of(ids))
            rows += conn.execute(window.limit(limit - len(rows))).all()
        edge, width = (lo - 1 if desc else hi + 1), width * 4
    return rows


def messages_with(text: str, sqlite: bool) -> Select[tuple[int]]:
    """Episode ids of the messages containing `text`, case-insensitively, through the
    backend's text search index: SQLite's FTS5 trigram table, PostgreSQL's pg_trgm index
    under ILIKE. Trigrams need three characters; a shorter text scans."""
    if sqlite and len(text) >= 3:
        return select(MessageRow.episode_id).where(MessageRow.id.in_(_fts_rowids(text)))
    return select(MessageRow.episode_id).where(_matches(text, sqlite))


def _matches(text: str, sqlite: bool) -> ColumnElement[bool]:
    """A message's own check: SQLite's LIKE (case-insensitive for ASCII), PostgreSQL's ILIKE."""
    pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    if sqlite:
        if not text.isascii():  # LIKE would not fold its case: ask the index about this row
            return MessageRow.id.in_(_fts_rowids(text))
        return MessageRow.content.like(pattern, escape="\\")
    # Written into the SQL, not bound: PostgreSQL plans a bound pattern once it is prepared
    # (psycopg prepares a statement run five times) with a generic plan that cannot see the
    # trigrams, and walked every message for a rare text (0.3-1.5 s at 10k episodes).
    inline = bindparam("pattern", pattern, literal_execute=True)
    return MessageRow.content.ilike(inline, escape="\\")


def _fts_rowids(text: str) -> Select[tuple[int]]:
    phrase = '"' + text.replace('"', '""') + '"'  # one FTS5 phrase: no query syntax
    return (
        select(literal_column("rowid"))
        .select_from(table(MESSAGE_SEARCH))
        .where(literal_column(MESSAGE_SEARCH).op("MATCH")(phrase))
    )


def _fts_hits(conn: Connection, text: str) -> int:
    """Messages the FTS5 index matches, counted up to SQLITE_FEW + 1 (a few ms at most)."""
    capped = _fts_rowids(text).limit(SQLITE_FEW + 1).subquery()
    return int(conn.scalar(select(literal_column("count(*)")).select_from(capped)) or 0)


def _estimated_matches(conn: Connection, text: str) -> float:
    """The planner's estimate of the messages containing `text` (EXPLAIN: no execution)."""
    query = select(MessageRow.id).where(_matches(text, sqlite=False))
    compiled = query.compile(conn, compile_kwargs={"literal_binds": True})
    plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {compiled}").scalar()
    if isinstance(plan, str):
        plan = json.loads(plan)
    return float(plan[0]["Plan"]["Plan Rows"])

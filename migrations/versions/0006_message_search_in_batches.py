"""message search in batches: SQLite's text index takes new messages in bulk, not per row

Revision 0003 kept SQLite's FTS5 index in step with `messages` by a trigger on every insert.
Each message then cost its own trip through FTS5, and each write transaction a new index
segment: ~1.5 ms of CPU per 4-turn episode, a third of its writes', against 0.06 ms for the
same messages indexed in one `INSERT ... SELECT` (measured on SQLite 3.40).

From here the index covers the messages up to `messages_fts_state.indexed_to`, and
`agent_rl.store.search.catch_up` indexes the ones after it in one statement: the store's
writer does so at most once a second, after a batch, and a text search first (so a search
still finds every message written before it). Deletes and content updates of indexed messages
still go through triggers. A delete that leaves `indexed_to` above the largest id lowers it,
since SQLite may then give a new message an id already passed.

PostgreSQL is unchanged: its trigram index is an ordinary index.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07 02:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEXED = "(SELECT indexed_to FROM messages_fts_state)"
_LARGEST = "(SELECT COALESCE(MAX(id), 0) FROM messages)"
_UNINDEX_OLD = (
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);"
)
_INDEX_NEW = "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);"
_DROP = ["DROP TRIGGER messages_fts_update", "DROP TRIGGER messages_fts_delete"]

UPGRADE = [
    "CREATE TABLE messages_fts_state (id INTEGER PRIMARY KEY CHECK (id = 1), "
    "indexed_to INTEGER NOT NULL)",
    # Every message so far went through 0003's insert trigger.
    f"INSERT INTO messages_fts_state (id, indexed_to) VALUES (1, {_LARGEST})",
    "DROP TRIGGER messages_fts_insert",
    *_DROP,
    "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) SELECT 'delete', old.id, old.content "
    f"WHERE old.id <= {_INDEXED}; "
    f"UPDATE messages_fts_state SET indexed_to = {_LARGEST} WHERE indexed_to > {_LARGEST}; END",
    f"CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages WHEN old.id <= {_INDEXED} "
    f"BEGIN {_UNINDEX_OLD} {_INDEX_NEW} END",
]
DOWNGRADE = [
    # The messages not yet indexed, then 0003's triggers again.
    f"INSERT INTO messages_fts(rowid, content) SELECT id, content FROM messages WHERE id > {_INDEXED}",
    *_DROP,
    "DROP TABLE messages_fts_state",
    f"CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN {_INDEX_NEW} END",
    f"CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN {_UNINDEX_OLD} END",
    f"CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN {_UNINDEX_OLD} "
    f"{_INDEX_NEW} END",
]


def upgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        for statement in UPGRADE:
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        for statement in DOWNGRADE:
            op.execute(statement)

"""message search: the databases' own text search over messages.content

The episode list's `q` (text in any message) scanned every message with ILIKE: 450-600 ms at
10k episodes on PostgreSQL. Each backend gets its own index, which SQLAlchemy's models cannot
describe (so it is written by hand here, and schema comparisons leave out every object named
`messages_fts*`, see `agent_rl.store.models.MESSAGE_SEARCH`):

- SQLite: an FTS5 table `messages_fts` with the trigram tokenizer (SQLite >= 3.34), an
  external-content index over `messages` kept in sync by triggers; a phrase query on it is a
  case-insensitive substring match, like ILIKE, for queries of three characters or more.
- PostgreSQL: the `pg_trgm` extension and a GIN trigram index `messages_fts_trgm`, which serves
  `content ILIKE '%...%'` as written. pg_trgm ships with PostgreSQL and is a trusted extension
  (13+): the database's owner may create it. Downgrading leaves the extension installed.

A later revision that rebuilds `messages` in SQLite's batch mode (copy, drop, rename) drops
the triggers with the table and must create them again.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 12:40:05.417226
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UNINDEX_OLD = (
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);"
)
SQLITE_UPGRADE = [
    "CREATE VIRTUAL TABLE messages_fts USING fts5("
    "content, content='messages', content_rowid='id', tokenize='trigram')",
    "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    f"CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN {_UNINDEX_OLD} END",
    f"CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN {_UNINDEX_OLD} "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')",
]
SQLITE_DOWNGRADE = [
    "DROP TRIGGER messages_fts_update",
    "DROP TRIGGER messages_fts_delete",
    "DROP TRIGGER messages_fts_insert",
    "DROP TABLE messages_fts",
]
POSTGRES_UPGRADE = [
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    "CREATE INDEX messages_fts_trgm ON messages USING gin (content gin_trgm_ops)",
]
POSTGRES_DOWNGRADE = ["DROP INDEX messages_fts_trgm"]


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == 'sqlite'
    for statement in SQLITE_UPGRADE if sqlite else POSTGRES_UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == 'sqlite'
    for statement in SQLITE_DOWNGRADE if sqlite else POSTGRES_DOWNGRADE:
        op.execute(statement)

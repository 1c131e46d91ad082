"""Alembic, driven from Python: upgrade, current revision, the schema-behind check, and the
schema's creation on first use.

The revisions live in the top-level `migrations` folder (found by path, not imported: its
`env.py` imports the store's models). Every process that opens the store checks that the
database is at the head revision and refuses to run otherwise, naming the command that fixes
it. The one exception is a SQLite database with no agent-rl schema at all (a new file of the
embedded defaults), which `create_if_new` creates at the head schema.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import anyio
from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from agent_rl.config import StoreConfig
from agent_rl.kernel.errors import SchemaBehindError
from agent_rl.store.db import create_database, database_url


def migrations_dir() -> Path:
    """Where the `migrations` package is installed (found without importing it)."""
    spec = importlib.util.find_spec("migrations")
    assert spec is not None and spec.origin is not None, "agent-rl's migrations are not installed"
    return Path(spec.origin).parent


def alembic_config(store: StoreConfig) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["store_config"] = store
    cfg.attributes["url"] = database_url(store.url).render_as_string(hide_password=False)
    return cfg


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config(StoreConfig()))


def head_revision() -> str:
    head = _script().get_current_head()
    assert head is not None, "the migrations package has no revisions"
    return head


async def upgrade(store: StoreConfig, revision: str = "head") -> None:
    """Apply migrations up to `revision`."""
    cfg = alembic_config(store)
    await anyio.to_thread.run_sync(lambda: command.upgrade(cfg, revision))


def current_revision(db: Engine) -> str | None:
    with db.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def check_schema(db: Engine) -> None:
    """Raise SchemaBehindError unless the database is at the head revision."""
    current = current_revision(db)
    head = head_revision()
    if current == head:
        return
    if current is None:
        raise SchemaBehindError("the database has no agent-rl schema: run `agent-rl db upgrade`")
    if current not in {rev.revision for rev in _script().walk_revisions()}:
        raise SchemaBehindError(
            f"the database schema ({current}) is newer than this agent-rl ({head}): upgrade agent-rl"
        )
    raise SchemaBehindError(
        f"the database schema ({current}) is behind this agent-rl ({head}): run `agent-rl db upgrade`"
    )


async def create_if_new(store: StoreConfig) -> None:
    """Create the head schema in a SQLite database that has none yet (e.g. a new file); leave
    every other database as it is (one behind its migrations is refused when opened)."""
    db = create_database(store)
    try:
        fresh = db.dialect.name == "sqlite" and await anyio.to_thread.run_sync(
            current_revision, db
        ) is None
    finally:
        db.dispose()
    if fresh:
        await upgrade(store)

"""Alembic, driven from Python: upgrade, current revision, and the schema-behind check.

The revisions live in the top-level `migrations` package. Every process that opens the store
checks that the database is at the head revision and refuses to run otherwise, naming the
command that fixes it.
"""

from __future__ import annotations

from pathlib import Path

import anyio
from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

import migrations
from agent_rl.config import StoreConfig
from agent_rl.errors import SchemaBehindError
from agent_rl.store.db import engine_url


def alembic_config(store: StoreConfig) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.attributes["store_config"] = store
    cfg.attributes["url"] = engine_url(store.url).render_as_string(hide_password=False)
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


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def check_schema(engine: Engine) -> None:
    """Raise SchemaBehindError unless the database is at the head revision."""
    current = current_revision(engine)
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

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
from sqlalchemy.ext.asyncio import AsyncEngine

import migrations
from agent_rl.config import StoreConfig
from agent_rl.errors import SchemaBehindError
from agent_rl.store.db import async_url


def alembic_config(store: StoreConfig) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.attributes["store_config"] = store
    cfg.attributes["url"] = async_url(store.url).render_as_string(hide_password=False)
    return cfg


def head_revision() -> str:
    script = ScriptDirectory.from_config(alembic_config(StoreConfig()))
    head = script.get_current_head()
    assert head is not None, "the migrations package has no revisions"
    return head


async def upgrade(store: StoreConfig, revision: str = "head") -> None:
    """Apply migrations up to `revision` (Alembic runs its own event loop, so in a thread)."""
    cfg = alembic_config(store)
    await anyio.to_thread.run_sync(lambda: command.upgrade(cfg, revision))


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())


async def check_schema(engine: AsyncEngine) -> None:
    """Raise SchemaBehindError unless the database is at the head revision."""
    current = await current_revision(engine)
    head = head_revision()
    if current == head:
        return
    if current is None:
        raise SchemaBehindError("the database has no agent-rl schema: run `agent-rl db upgrade`")
    script = ScriptDirectory.from_config(alembic_config(StoreConfig()))
    known = {rev.revision for rev in script.walk_revisions()}
    if current not in known:
        raise SchemaBehindError(
            f"the database schema ({current}) is newer than this agent-rl ({head}): upgrade agent-rl"
        )
    raise SchemaBehindError(
        f"the database schema ({current}) is behind this agent-rl ({head}): run `agent-rl db upgrade`"
    )

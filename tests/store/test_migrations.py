"""The Alembic revisions and the models agree, and a store behind its schema is refused."""

from __future__ import annotations

import anyio
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from agent_rl.config import StoreConfig
from agent_rl.kernel.errors import SchemaBehindError
from agent_rl.store import Store
from agent_rl.store.db import create_database
from agent_rl.store.migrate import alembic_config, head_revision, upgrade
from agent_rl.store.models import MESSAGE_SEARCH, SCHEMA_REVISION, Base

pytestmark = pytest.mark.anyio


async def test_models_match_migrations(db_url: str) -> None:
    cfg = StoreConfig(url=db_url)
    await upgrade(cfg)
    engine = create_database(cfg)
    try:
        with engine.connect() as conn:
            # The text search objects (FTS5 tables, a trigram index) are no models' (0003).
            opts = {"compare_type": True, "include_name": lambda name, kind, parents: not (
                name or "").startswith(MESSAGE_SEARCH)}
            diff = compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ; autogenerate a revision: {diff}"


def test_the_models_name_the_head_revision() -> None:
    # Store.open compares the database's revision with this constant (importing Alembic only
    # when they differ), so it must move with every new revision.
    assert SCHEMA_REVISION == head_revision()


async def test_schema_behind_or_ahead_is_refused(db_url: str) -> None:
    cfg = StoreConfig(url=db_url)
    with pytest.raises(SchemaBehindError, match="run `agent-rl db upgrade`"):
        await Store.open(cfg)
    await upgrade(cfg)
    store = await Store.open(cfg)
    await store.close()

    await anyio.to_thread.run_sync(lambda: command.downgrade(alembic_config(cfg), "base"))
    with pytest.raises(SchemaBehindError, match="agent-rl db upgrade"):
        await Store.open(cfg)
    await upgrade(cfg)

    engine = create_database(cfg)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffff'"))
    engine.dispose()
    with pytest.raises(SchemaBehindError, match="newer than this agent-rl"):
        await Store.open(cfg)
    assert head_revision() != "ffff"

"""Alembic environment for the trajectory store (async engines, batch mode on SQLite).

The URL comes from the caller (`agent_rl.store.migrate.alembic_config`), never from an ini file,
so `agent-rl db upgrade` migrates exactly the database the config names.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from agent_rl.store.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def _run_sync(connection) -> None:  # type: ignore[no-untyped-def]
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run_sync)
            await conn.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_sync(connection)
        return
    asyncio.run(_run_async(config.attributes["url"]))


if context.is_offline_mode():
    context.configure(url=config.attributes["url"], target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()

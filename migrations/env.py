"""Alembic environment for the trajectory store (batch mode on SQLite).

The URL comes from the caller (`agent_rl.store.migrate.alembic_config`), never from an ini file,
so `agent-rl db upgrade` migrates exactly the database the config names.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from agent_rl.store.models import MESSAGE_SEARCH, Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    db = create_engine(config.attributes["url"])  # SQLAlchemy's; "engine" is SGLang's here
    try:
        with db.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=connection.dialect.name == "sqlite",
                compare_type=True,
                # The text search objects are revision 0003's, not the models' (autogenerate
                # would otherwise propose dropping them).
                include_name=lambda name, kind, parents: not (name or "").startswith(MESSAGE_SEARCH),
            )
            with context.begin_transaction():
                context.run_migrations()
            connection.commit()
    finally:
        db.dispose()


if context.is_offline_mode():
    context.configure(url=config.attributes["url"], target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()

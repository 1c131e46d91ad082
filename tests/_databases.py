"""Throwaway databases for tests: a fresh SQLite file or a fresh PostgreSQL database each time.

PostgreSQL comes from AGENT_RL_TEST_POSTGRES_URL (a server URL whose database we may connect to
for CREATE DATABASE). Without it the PostgreSQL variants skip locally and FAIL in CI (CI=true),
where the server is always there.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

POSTGRES_ENV = "AGENT_RL_TEST_POSTGRES_URL"


def postgres_server_url() -> str:
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{POSTGRES_ENV} is not set; PostgreSQL tests must run in CI")
        pytest.skip(f"set {POSTGRES_ENV} to run PostgreSQL tests")
    return url


@contextmanager
def fresh_postgres() -> Iterator[str]:
    """Create an empty database on the test server; yield its URL; drop it afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    server = make_url(postgres_server_url())
    name = f"agent_rl_test_{uuid.uuid4().hex[:12]}"
    admin = server.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server.set(drivername="postgresql", database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def fresh_database(backend: str, tmp_path: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / f'store-{uuid.uuid4().hex[:8]}.db'}"
    else:
        with fresh_postgres() as url:
            yield url

"""Fixtures shared across the test packages.

Integration tests use the real components: SQLite and PostgreSQL, real HTTP servers on loopback,
real SGLang on CPU, real megatron-core on CPU. PostgreSQL tests read AGENT_RL_TEST_POSTGRES_URL;
in CI (CI=true) they must run, so a missing URL is an error there rather than a skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._databases import fresh_database


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database URL, once on SQLite and once on PostgreSQL."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


# --- tiny models (agent_rl.models) -------------------------------------------------------------
# Session-scoped: every test package shares one directory per preset (about a second each).

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-dense model directory (Qwen2, ~3M parameters, seed 0)."""
    from agent_rl.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-dense", "tiny-dense", seed=0)


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-moe model directory (Qwen3-MoE, 8 experts, top-2, 2 layers, seed 0)."""
    from agent_rl.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-moe", "tiny-moe", seed=0)

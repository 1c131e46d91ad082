"""Fixtures shared across the test packages.

Integration tests use the real components: SQLite and PostgreSQL, real HTTP servers on loopback,
real SGLang on CPU, real megatron-core on CPU. PostgreSQL tests read AGENT_RL_TEST_POSTGRES_URL;
in CI (CI=true) they must run, so a missing URL is an error there rather than a skip.
"""

from __future__ import annotations

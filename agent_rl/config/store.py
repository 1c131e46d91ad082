"""Config of the trajectory store, the run, and telemetry (what every process shares)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from agent_rl.config.base import Section
from agent_rl.config.secrets import redact_url


class StoreConfig(Section):
    url: str = "sqlite:///agent_rl.db"
    """Database URL. `sqlite:///PATH` (relative to the working directory) or
    `postgresql://user@host/db` (driven by psycopg 3). Its password is masked wherever the
    config is stored or shown."""

    compress_tokens: bool = False
    """zlib-compress token arrays (smaller rows, more CPU per write)."""

    busy_timeout_s: float = 30.0
    """How long SQLite waits for a lock held by another process before failing."""

    pool_size: int = Field(default=5, ge=1)
    """Connections kept per process (PostgreSQL)."""

    @field_validator("url")
    @classmethod
    def _known_backend(cls, url: str) -> str:
        if not url.startswith(("sqlite", "postgresql", "postgres://")):
            raise ValueError(
                f"unsupported database URL {redact_url(url)!r}: use sqlite:///PATH or "
                "postgresql://USER@HOST/DB"
            )
        return url


class RunConfig(Section):
    name: str = "default"
    """Name of the run; serve and train with the same name share one run in the store."""


class TelemetryConfig(Section):
    exporter: Literal["none", "console"] = "none"
    """Where OpenTelemetry spans go: nowhere (the API is a no-op), or the console."""

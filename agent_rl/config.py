"""One configuration tree for every agent-rl process.

`serve`, `train`, `router` and the CLI all read the same nested pydantic model. Values come,
highest priority first, from: explicit overrides (CLI flags), `AGENT_RL_*` environment variables
(nested with `__`, e.g. `AGENT_RL_STORE__URL`), the TOML file given with `--config` (or
`AGENT_RL_CONFIG`, or `./agent-rl.toml` when present), then the defaults written here. Every
model forbids unknown keys, so a typo fails loudly with the key and the file named.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from agent_rl.errors import ConfigError

DEFAULT_CONFIG_FILE = Path("agent-rl.toml")


class Section(BaseModel):
    """Base for config sections: unknown keys are errors, docstrings document fields."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class StoreConfig(Section):
    url: str = "sqlite:///agent_rl.db"
    """Database URL. `sqlite:///PATH` (relative to the working directory) or
    `postgresql://user@host/db`; async drivers (aiosqlite, asyncpg) are chosen automatically."""

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
                f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql://USER@HOST/DB"
            )
        return url


class RunConfig(Section):
    name: str = "default"
    """Name of the run; serve and train with the same name share one run in the store."""


class Config(BaseSettings):
    """The whole agent-rl configuration."""

    model_config = SettingsConfigDict(
        env_prefix="AGENT_RL_",
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
    )

    run: RunConfig = RunConfig()
    """The run that episodes and policy versions belong to."""

    store: StoreConfig = StoreConfig()
    """The trajectory store."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _ACTIVE_FILE.get("path")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


# The TOML path for the Config being built; pydantic-settings builds sources from a classmethod,
# so the path travels here for the duration of one `load_config` call.
_ACTIVE_FILE: dict[str, Path | None] = {"path": None}


def resolve_config_path(path: Path | None) -> Path | None:
    """The config file to read: the given one, `AGENT_RL_CONFIG`, or `./agent-rl.toml` if present."""
    if path is not None:
        return path
    env = os.environ.get("AGENT_RL_CONFIG")
    if env:
        return Path(env)
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def load_config(path: Path | None = None, **overrides: Any) -> Config:
    """Build the effective config; raise ConfigError with a one-line, actionable message."""
    path = resolve_config_path(path)
    if path is not None and not path.is_file():
        raise ConfigError(f"config file {path} does not exist: pass an existing file to --config")
    _ACTIVE_FILE["path"] = path
    try:
        return Config(**overrides)
    except ValidationError as e:
        raise ConfigError(_describe(e, path)) from e
    except Exception as e:  # a TOML syntax error surfaces as tomllib.TOMLDecodeError
        if type(e).__name__ == "TOMLDecodeError":
            raise ConfigError(f"{path}: invalid TOML: {e}") from e
        raise
    finally:
        _ACTIVE_FILE["path"] = None


def _describe(e: ValidationError, path: Path | None) -> str:
    where = f"in {path}" if path is not None else "in the environment (AGENT_RL_*)"
    problems = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown key '{key}' {where}")
        else:
            problems.append(f"invalid value for '{key}' {where}: {err['msg']}")
    return "; ".join(problems)

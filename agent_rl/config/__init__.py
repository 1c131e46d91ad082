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

from pydantic import ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from agent_rl.config.base import Section
from agent_rl.config.cluster import ClusterConfig, RoleResources
from agent_rl.config.engine import EngineConfig
from agent_rl.config.moved import moved_in_environment
from agent_rl.config.router import RouterConfig
from agent_rl.config.sandbox import SandboxConfig, SandboxLimits
from agent_rl.config.serving import ApiConfig, RolloutConfig
from agent_rl.config.store import RunConfig, StoreConfig, TelemetryConfig
from agent_rl.config.trainer import TrainerConfig
from agent_rl.kernel.errors import ConfigError

__all__ = [
    "ApiConfig", "ClusterConfig", "Config", "EngineConfig", "RoleResources", "RolloutConfig",
    "RouterConfig", "RunConfig", "SandboxConfig", "SandboxLimits", "Section", "StoreConfig",
    "TelemetryConfig", "TrainerConfig", "load_config", "resolve_config_path",
]  # fmt: skip

DEFAULT_CONFIG_FILE = Path("agent-rl.toml")


class Config(BaseSettings):
    """The whole agent-rl configuration."""

    model_config = SettingsConfigDict(
        env_prefix="AGENT_RL_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    run: RunConfig = RunConfig()
    """The run that episodes and policy versions belong to."""

    store: StoreConfig = StoreConfig()
    """The trajectory store."""

    router: RouterConfig = RouterConfig()
    """The metadata-preserving router in front of the SGLang workers."""

    engine: EngineConfig = EngineConfig()
    """The SGLang engine launched by `serve` (embedded) or `agent-rl engine start`."""

    trainer: TrainerConfig = TrainerConfig()
    """The Megatron-core trainer (`agent-rl train`)."""

    sandbox: SandboxConfig = SandboxConfig()
    """Sandboxes that run the agents' tool calls."""

    telemetry: TelemetryConfig = TelemetryConfig()
    """OpenTelemetry tracing of episodes, generations and tool calls (off by default)."""

    rollout: RolloutConfig = RolloutConfig()
    """The scheduler and episode runners of `agent-rl serve` (admission uses
    `trainer.max_staleness` as the staleness bound)."""

    api: ApiConfig = ApiConfig()
    """The web API and episode viewer (`agent-rl api`, or mounted by `serve`)."""

    cluster: ClusterConfig = ClusterConfig()
    """Roles placed and kept alive on a Ray cluster by `agent-rl launch`."""

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
    except SettingsError as e:  # a variable that is not the JSON its section needs
        moved = moved_in_environment(dict(os.environ))
        if moved is not None:
            raise ConfigError(f"{moved} (in the environment (AGENT_RL_*))") from e
        raise ConfigError(f"{e}: {e.__cause__}") from e
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
        elif err["type"] == "moved_key":  # agent_rl/config/moved.py: the message names both keys
            problems.append(f"{err['msg']} ({where})")
        else:
            problems.append(f"invalid value for '{key}' {where}: {err['msg']}")
    return "; ".join(problems)

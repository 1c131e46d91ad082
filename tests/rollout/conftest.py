"""Rollout tests run the real episode runner against the session's real SGLang server (tiny-moe
with routing replay), a real store, and real sandboxes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig, TrainerConfig


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def serve_config(db: str, server_url: str, model: Path, **rollout: Any) -> Config:
    """A config that serves through `server_url` with short episodes."""
    staleness = rollout.pop("max_staleness", 4)
    values: dict[str, Any] = dict(router_url=server_url, group_size=2, max_new_tokens=48,
                                  max_tokens=1024, max_turns=3, heartbeat_s=1.0)
    values.update(rollout)
    return Config(
        store=StoreConfig(url=db),
        engine=EngineConfig(model=model, moe_routing_replay=True),
        rollout=RolloutConfig(**values),
        trainer=TrainerConfig(max_staleness=staleness),
    )

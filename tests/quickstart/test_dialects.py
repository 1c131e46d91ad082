"""`agent-rl quickstart --agent --dialect`: each dialect runs a registered example agent on the
calculator's tasks, with the same env kwargs (fast: the recipe only; the whole quickstart with
the chat agent is test_quickstart_agent.py)."""

from __future__ import annotations

import pytest

from agent_rl.app.quickstart.recipe import AGENT_ENV_KWARGS, Options, recipe
from agent_rl.sdk.agent import AgentEnv
from agent_rl.sdk.registry import make


@pytest.mark.parametrize(("dialect", "env"), [("chat", "calculator-agent"), ("responses", "calculator-agent-responses"),
                                             ("messages", "calculator-agent-anthropic")])  # fmt: skip
def test_each_dialect_runs_its_example_agent(dialect: str, env: str) -> None:
    rollout = recipe(Options(agent=True, dialect=dialect))["rollout"]  # type: ignore[arg-type]
    assert (rollout["env"], rollout["env_kwargs"]) == (env, AGENT_ENV_KWARGS)
    assert isinstance(make(env, **AGENT_ENV_KWARGS), AgentEnv)  # registered, and builds with them
    with pytest.raises(ValueError):
        Options(agent=True, dialect="grpc")  # type: ignore[arg-type]

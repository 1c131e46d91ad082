"""`agent-rl quickstart --agent --dialect`: each dialect runs a registered example agent on the
calculator's tasks, with the same env kwargs (fast: the recipe only; the whole quickstart with
the chat agent is test_quickstart_agent.py)."""

from __future__ import annotations

import functools
import io
import sys
from pathlib import Path

import anyio
import pytest
from rich.console import Console

from agent_rl.app.quickstart import run_quickstart
from agent_rl.app.quickstart.recipe import (
    AGENT_CLIENTS,
    AGENT_ENV_IDS,
    AGENT_ENV_KWARGS,
    ENV_ID,
    ENV_KWARGS,
    Options,
    check_agent_client,
    recipe,
    sft_demonstrations,
    write_or_load,
)
from agent_rl.config import load_config
from agent_rl.kernel.errors import ConfigError
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


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_an_agent_runs_sft_is_the_sdk_runs(dialect: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SFT stage of `--agent` trains on the SDK run's demonstrations with the SDK run's
    settings (what lets tests/quickstart share one SFT between the two whole-run tests)."""
    sdk_opts, agent_opts = Options(), Options(agent=True, dialect=dialect)  # type: ignore[arg-type]
    sdk = write_or_load(tmp_path / "sdk", sdk_opts)
    assert sft_demonstrations(sdk_opts, sdk) == (ENV_ID, {})
    env_id, settings = sft_demonstrations(agent_opts, write_or_load(tmp_path / "agent", agent_opts))
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    agent = load_config(tmp_path / "agent" / "agent-rl.toml")  # as the SFT process reads it
    assert env_id == ENV_ID and agent.rollout.env == AGENT_ENV_IDS[dialect]
    assert agent.rollout.model_copy(update={"env": env_id}) == sdk.rollout
    assert agent.rollout.env_kwargs == ENV_KWARGS and agent.trainer == sdk.trainer


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_a_missing_agent_client_is_a_clear_error_before_anything_starts(
    dialect: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the `[agents]` extra every episode would fail on the agent's import: the run
    refuses to start, naming the client and the install command, and makes nothing."""
    monkeypatch.setitem(sys.modules, AGENT_CLIENTS[dialect], None)  # as if not installed
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"{AGENT_CLIENTS[dialect]} client.*pip install -e '\.\[agents\]'"):
        anyio.run(functools.partial(run_quickstart, Options(agent=True, dialect=dialect), workdir,  # type: ignore[arg-type]
                                    console=Console(file=io.StringIO())))  # fmt: skip
    assert not workdir.exists()
    check_agent_client(Options())  # the SDK quickstart needs no client

"""Every way an episode ends, forced by config against the real engine, ends in exactly one
recorded state: the runner's budgets are completed truncations (reward 0, the limit named in
the reward details), failures carry their cause, groups are decided and the ledger balances.
Before, episodes that hit the runner's own max_turns/max_tokens stayed `running` forever."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent_rl.app.serve import serve
from agent_rl.store import Store
from tests.rollout.conftest import serve_config
from tests.rollout.fault_envs import register_fault_envs

pytestmark = pytest.mark.anyio


async def _serve(tmp_path: Path, server: Any, model: Path, env: str, n: int = 4, **rollout: Any):  # type: ignore[no-untyped-def]
    register_fault_envs()
    rollout.setdefault("stop", ["e"])  # a random model ends its turn by stop, not by length
    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", server.url, model, env=env,
                       filter_zero_variance=False, **rollout)
    await serve(cfg, max_episodes=n)
    store = await Store.open(cfg.store)
    return store, await store.run_id(cfg.run.name)


async def _check_run(store: Store, run: int, n: int) -> list[Any]:
    episodes = await store.list_episodes(run_id=run)
    assert len(episodes) == n
    audit = await store.audit(run)
    assert audit.problems() == [], audit.problems()  # all terminal, nothing lost, causes kept
    assert await store.groups_to_complete(run) == []  # every group decided
    return episodes


async def _truncated_by(tmp_path: Path, server: Any, model: Path, why: str, env: str, **rollout: Any) -> list[Any]:
    store, run = await _serve(tmp_path, server, model, env, **rollout)
    async with store:
        episodes = await _check_run(store, run, 4)
        for e in episodes:
            assert e.status == "completed" and e.reward == 0.0, (e.status, e.error_cause)
            assert e.reward_details["truncated"] == why, e.reward_details
        return episodes


async def test_runner_max_turns(tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path) -> None:
    # The reproduction: an env that always answers, [rollout] max_turns = 2.
    episodes = await _truncated_by(tmp_path, sglang_moe_server, tiny_moe_model, "max_turns",
                                   "test-never-ends", max_turns=2)
    assert all(e.num_turns == 2 for e in episodes)


async def test_runner_max_tokens(tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path) -> None:
    # max_new_tokens above the budget: every completion is cut by the episode's budget, never by
    # its own cap (with 24, a random model's 24 tokens without a stop ended an episode by
    # max_new_tokens first, a CI flake).
    episodes = await _truncated_by(tmp_path, sglang_moe_server, tiny_moe_model, "max_tokens",
                                   "test-never-ends", max_turns=50, max_tokens=160,
                                   max_new_tokens=200)
    assert all(1 <= e.num_turns < 50 and e.num_tokens <= 160 for e in episodes)


async def test_completion_cut_at_max_new_tokens(tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path) -> None:
    episodes = await _truncated_by(tmp_path, sglang_moe_server, tiny_moe_model, "max_new_tokens",
                                   "test-never-ends", stop=[], max_new_tokens=3, max_turns=50)
    assert all(e.num_turns >= 1 for e in episodes)


async def test_deadline(tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path) -> None:
    await _truncated_by(tmp_path, sglang_moe_server, tiny_moe_model, "deadline",
                        "test-hanging-tool", episode_timeout_s=3.0)


@pytest.mark.parametrize("env,kind,words", [
    ("test-step-raises", "EnvError", "a bug in the environment's step"),
    ("test-sandbox-dies", "SandboxError", "killed by the host"),
    ("test-prompt-too-long", "EngineError", "/generate"),
])
async def test_failures_carry_their_cause(
    tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path, env: str, kind: str, words: str
) -> None:
    store, run = await _serve(tmp_path, sglang_moe_server, tiny_moe_model, env, max_tokens=65536)
    async with store:
        for e in await _check_run(store, run, 4):
            assert (e.status, e.error_type) == ("failed", kind) and e.reward is None
            assert words in e.error_cause, e.error_cause

"""Failures stay local: each ends in a recorded turn or episode state with its cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_rl.app.serve import serve
from agent_rl.store import Store
from tests.rollout.conftest import serve_config
from tests.rollout.fault_envs import register_fault_envs

pytestmark = pytest.mark.anyio


async def _served(tmp_path: Path, server, model: Path, env: str, n: int = 2):  # type: ignore[no-untyped-def]
    register_fault_envs()
    # A random model rarely ends its turn within a few tokens; a stop string makes it.
    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", server.url, model, env=env, stop=["e"])
    await serve(cfg, max_episodes=n)
    store = await Store.open(cfg.store, create=True)
    run = await store.run_id(cfg.run.name)
    return store, run


async def test_env_step_raises_is_an_env_error(tmp_path: Path, sglang_moe_server, tiny_moe_model: Path) -> None:
    store, run = await _served(tmp_path, sglang_moe_server, tiny_moe_model, "test-step-raises")
    async with store:
        episodes = await store.list_episodes(run_id=run)
        assert [e.status for e in episodes] == ["failed", "failed"]
        for e in episodes:
            assert e.error_type == "EnvError"
            assert "ValueError: a bug in the environment's step" in e.error_cause
            assert "Traceback" in e.error_cause
            assert e.reward is None  # a failure is never scored
        ledger = await store.ledger(run)
        assert ledger.failed == 2 and ledger.balances()


async def test_tool_that_raises_costs_a_turn(tmp_path: Path, sglang_moe_server, tiny_moe_model: Path) -> None:
    store, run = await _served(tmp_path, sglang_moe_server, tiny_moe_model, "test-tool-raises")
    async with store:
        for e in await store.list_episodes(run_id=run):
            assert e.status in ("completed", "filtered")
            detail = await store.get_episode(e.id)
            calls = detail.tool_calls
            assert calls and all(c["name"] == "boom" and c["status"] == "error" for c in calls)
            assert "RuntimeError" in calls[0]["sandbox_error"]
            assert e.tool_error_count == len(calls)
            # The model saw the error as an observation.
            assert any(m["role"] == "tool" and "error" in m["content"] for m in detail.messages)


async def test_malformed_tool_call_is_an_observation(tmp_path: Path, sglang_moe_server, tiny_moe_model: Path) -> None:
    store, run = await _served(tmp_path, sglang_moe_server, tiny_moe_model, "test-raw-json-call")
    async with store:
        for e in await store.list_episodes(run_id=run):
            assert e.status in ("completed", "filtered")
            detail = await store.get_episode(e.id)
            malformed = [c for c in detail.tool_calls if c["status"] == "malformed"]
            assert malformed, detail.tool_calls
            assert any("malformed tool call" in m["content"] for m in detail.messages if m["role"] == "tool")

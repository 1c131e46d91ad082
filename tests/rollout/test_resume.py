"""A serve SIGKILLed in the middle of its episodes: the next serve resumes them from the turns
they persisted (re-running them through a fresh env, every observation checked against the
stored one) and finishes them, instead of failing them as interrupted; the tokens stored before
the kill are kept bit for bit. Envs that opt out, or whose re-run differs, fail with the cause."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from agent_rl.config import Config
from agent_rl.app.serve import serve
from agent_rl.store import Store
from tests.rollout.conftest import serve_config
from tests.rollout.fault_envs import register_fault_envs

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]
EPISODES = 4


def _config(tmp_path: Path, server: Any, model: Path, env: str) -> Config:
    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", server.url, model, env=env,
                       max_turns=8, stop=["e"], filter_zero_variance=False, heartbeat_s=0.2,
                       stale_after_s=1.0, env_kwargs={"delay": 0.3})
    return cfg


async def _kill_mid_episode(cfg: Config) -> dict[int, Any]:
    """Start serve in its own process, SIGKILL it once every episode has persisted two turns,
    and return each episode's stored tokens at that moment."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.rollout._serve_process",
                             cfg.model_dump_json(), str(EPISODES)], cwd=ROOT)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "serve ended before it could be killed"
            assert time.monotonic() < deadline, "episodes did not get going"
            await anyio.sleep(0.1)
            try:
                store = await Store.open(cfg.store)
            except Exception:
                continue  # not created yet
            async with store:
                try:
                    run = await store.run_id(cfg.run.name)
                except Exception:
                    continue
                episodes = await store.list_episodes(run_id=run)
                if len(episodes) == EPISODES and all(
                    e.status == "running" and e.num_turns >= 2 for e in episodes
                ):
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    # What a dead serve leaves: running episodes and their persisted turns.
                    return {e.id: await store.episode_tokens(e.id) for e in
                            await store.list_episodes(run_id=run)}
    finally:
        if proc.poll() is None:
            proc.kill()


async def _serve_again(cfg: Config) -> tuple[Store, int]:
    await anyio.sleep(cfg.rollout.stale_after_s + 0.5)  # the dead serve's heartbeats age out
    register_fault_envs()
    summary = await serve(cfg, max_episodes=EPISODES)
    store = await Store.open(cfg.store)
    return store, summary.run_id


async def test_a_killed_serve_is_resumed(tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path) -> None:
    cfg = _config(tmp_path, sglang_moe_server, tiny_moe_model, "test-never-ends")
    before = await _kill_mid_episode(cfg)
    store, run = await _serve_again(cfg)
    async with store:
        episodes = await store.list_episodes(run_id=run)
        assert len(episodes) == EPISODES  # nothing new was admitted: the old ones were resumed
        for e in episodes:
            assert e.status == "completed" and e.resumes == 1, (e.status, e.error_cause)
            assert e.reward_details["truncated"] == "max_turns" and e.num_turns == 8
            after = await store.episode_tokens(e.id)
            old = before[e.id]
            # The tokens persisted before the kill are kept exactly, with their logprobs,
            # versions and routed experts; the resumed turns follow them.
            n = len(old)
            assert np.array_equal(after.token_ids[:n], old.token_ids)
            assert np.array_equal(after.logprobs[:n], old.logprobs)
            assert np.array_equal(after.versions[:n], old.versions)
            assert np.array_equal(after.routed_experts[:n], old.routed_experts)
            assert len(after) > n
            detail = await store.get_episode(e.id)
            assert [t.index for t in detail.turns] == list(range(8))
            assert e.drift_count == 0
        audit = await store.audit(run)
        assert audit.problems() == [], audit.problems()


@pytest.mark.parametrize("env,why", [
    ("test-opts-out", "interrupted: the process running it stopped"),
    ("test-forgetful", "Interrupted: not resumable (turn 0 differs"),
])
async def test_unresumable_episodes_fail_with_the_reason(
    tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path, env: str, why: str
) -> None:
    cfg = _config(tmp_path, sglang_moe_server, tiny_moe_model, env)
    await _kill_mid_episode(cfg)
    store, run = await _serve_again(cfg)
    async with store:
        episodes = await store.list_episodes(run_id=run)
        failed = [e for e in episodes if e.status == "failed"]
        assert len(failed) == EPISODES, [(e.status, e.error_cause) for e in episodes]
        assert all(e.error_type == "Interrupted" and why in e.error_cause for e in failed)
        assert (await store.audit(run)).problems() == []

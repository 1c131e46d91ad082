"""`serve` end to end against real SGLang: every built-in environment, every episode recorded
with tokens that agree with its transcript."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_rl.rollout.render import ChatRenderer
from agent_rl.app.serve import serve
from agent_rl.store import Store
from tests.rollout.conftest import serve_config
from tests.rollout.invariants import check_episode

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("env_id", ["calculator", "search-qa", "python-math", "code-tests"])
async def test_serve_each_builtin_env(env_id: str, tmp_path: Path, sglang_moe_server, tiny_moe_model: Path) -> None:
    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", sglang_moe_server.url, tiny_moe_model,
                       env=env_id)
    stats = await serve(cfg, max_episodes=4)
    assert stats.admitted == 4 and stats.completed + stats.failed == 4
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store, create=True) as store:
        run = await store.run_id(cfg.run.name)
        ledger = await store.ledger(run)
        assert ledger.admitted == 4 and ledger.balances()
        assert ledger.running == ledger.waiting == 0
        episodes = await store.list_episodes(run_id=run)
        assert {e.status for e in episodes} <= {"completed", "filtered"}, [e.error_cause for e in episodes]
        for e in episodes:
            await check_episode(store, renderer, e.id, experts=True)
        groups = {e.group_id for e in episodes}
        assert len(groups) == 2


async def test_serve_samples_engine_loads_for_the_audit(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    """serve records what SGLang's /v1/loads says of its engine while it runs; the audit of the
    run reads those samples and the episodes' times."""
    from agent_rl.store.audit import compute_audit

    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", sglang_moe_server.url, tiny_moe_model,
                       env="calculator", engine_sample_s=0.1)
    await serve(cfg, max_episodes=8)
    async with await Store.open(cfg.store) as store:
        timeline = await store.run_timeline(await store.run_id(cfg.run.name))
    assert timeline.samples and {s.engine for s in timeline.samples} == {sglang_moe_server.url}
    assert any(s.running > 0 for s in timeline.samples)
    assert all(s.token_usage is not None and 0 <= s.token_usage <= 1 for s in timeline.samples)
    audit = compute_audit(timeline)
    assert sum(audit.shares.cells.values()) == pytest.approx(1.0)
    assert audit.shares.rollout_busy > 0.5 and audit.episode_time.episodes == 8
    (engine,) = audit.throughput.engines
    assert 0 < engine.decode_busy <= 1 and audit.throughput.generated_tokens > 0
    assert audit.verdict.startswith("rollout only: no trainer step recorded")

"""Staleness: admission waits while the served policy is more than eta versions behind the
store; admitted episodes are never discarded, and their tokens carry the versions that
sampled them."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agent_rl.sglang.client import EngineClient
from agent_rl.rollout.scheduler import Scheduler
from agent_rl.app.serve import serve
from agent_rl.store import Claim, Store
from agent_rl.store.migrate import upgrade
from tests.rollout.conftest import serve_config

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("max_queued_groups", [None, 0])
async def test_admission_bounded_none_discarded(tmp_path: Path, sglang_moe_server, tiny_moe_model: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                max_queued_groups: int | None) -> None:  # fmt: skip
    """With a queue bound (the default) admission reads the newest version before it admits;
    without one (0) the admission's own transaction checks it (`Store.admit_task`)."""
    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", sglang_moe_server.url, tiny_moe_model,
                       max_staleness=1, max_concurrent_episodes=2, max_new_tokens=32,
                       max_queued_groups=max_queued_groups)
    await upgrade(cfg.store)
    schedulers: list[Scheduler] = []
    original_init = Scheduler.__init__

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original_init(self, *args, **kwargs)
        schedulers.append(self)

    monkeypatch.setattr(Scheduler, "__init__", spy)
    bumped_after = 0

    async def trainer_publishes_version_2() -> None:
        nonlocal bumped_after
        while not schedulers or schedulers[0].stats.admitted < 2:
            await anyio.sleep(0.05)
        async with await Store.open(cfg.store, create=True) as store:
            run = await store.run_id(cfg.run.name)
            bumped_after = schedulers[0].stats.admitted
            await store.commit(Claim("none", "trainer", 0.0, []), run, step=1, version=2)
        # The engine still serves version 0: admission must wait until it serves version 2.
        await anyio.sleep(3)
        assert schedulers[0].stats.admitted == bumped_after
        assert schedulers[0].stats.waits_for_staleness > 0
        async with EngineClient(sglang_moe_server.url) as client:
            await client.update_weights_from_disk(tiny_moe_model, weight_version="2")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer_publishes_version_2)
            stats = await serve(cfg, max_episodes=8)
    finally:
        async with EngineClient(sglang_moe_server.url) as client:
            await client.update_weights_from_disk(tiny_moe_model, weight_version="default")

    assert stats.admitted == 8
    async with await Store.open(cfg.store, create=True) as store:
        run = await store.run_id(cfg.run.name)
        episodes = await store.list_episodes(run_id=run)
        # None discarded after admission: every episode ran to a terminal state of its own.
        assert all(e.status in ("completed", "filtered") for e in episodes)
        before, after = episodes[:bumped_after], episodes[bumped_after:]
        # Admitted after version 2 was published: sampled by version >= 2 - eta, all of them.
        assert after and all(e.min_version is not None and e.min_version >= 1 for e in after)
        assert all(e.max_version == 2 for e in after)
        assert all(e.min_version == 0 for e in before)
        ledger = await store.ledger(run)
        assert ledger.balances() and ledger.admitted == 8

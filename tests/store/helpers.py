"""Helpers for store tests: open a migrated store, make deterministic episodes."""

from __future__ import annotations

import time

import numpy as np

from agent_rl.config import StoreConfig
from agent_rl.store import MessageRecord, Store, TokenArrays, ToolCallRecord, TurnRecord
from agent_rl.store.migrate import upgrade


async def migrated_store(url: str, **cfg: object) -> Store:
    store_cfg = StoreConfig(url=url, **cfg)
    await upgrade(store_cfg)
    return await Store.open(store_cfg)


def make_turn(seed: int, n_prompt: int = 5, n_completion: int = 7, version: int = 0,
              layers: int | None = None, topk: int = 2) -> TurnRecord:
    """A deterministic turn whose content depends only on `seed`."""
    rng = np.random.default_rng(seed)
    n = n_prompt + n_completion
    mask = np.r_[np.zeros(n_prompt), np.ones(n_completion)]
    experts = None if layers is None else rng.integers(0, 8, size=(n, layers, topk))
    tokens = TokenArrays.build(
        token_ids=rng.integers(0, 50_000, size=n),
        logprobs=np.where(mask == 1, -rng.random(n), 0.0),
        loss_mask=mask,
        versions=np.where(mask == 1, version, -1),
        routed_experts=experts,
    )
    t = time.time()
    return TurnRecord(
        tokens=tokens, num_prompt_tokens=n_prompt, started_at=t, finished_at=t,
        messages=[MessageRecord("user", f"obs {seed}"), MessageRecord("assistant", f"act {seed}")],
        tool_calls=[ToolCallRecord("calc", '{"expression": "1+1"}', output="2", exit_status=0)],
        finish_reason="stop",
    )


async def completed_group(store: Store, run_id: int, size: int = 2, reward: float = 1.0,
                          version: int = 0) -> tuple[int, list[int]]:
    """Admit, run and finish a group of one-turn episodes, then mark it ready."""
    task = await store.add_task(run_id, "calculator", "k", {})
    group, episodes = await store.admit_group(run_id, task, "calculator", size)
    for i, e in enumerate(episodes):
        await store.start_episode(e, "test")
        await store.append_turn(e, make_turn(e, version=version))
        await store.finish_episode(e, reward * (i % 2))
    assert await store.complete_group(group) == "ready"
    return group, episodes

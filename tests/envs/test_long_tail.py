"""`long-tail`: lognormal turn counts and completion lengths, asked of the real engine through
`Env.sampling_params`; a completion that ends at the length the env asked for is stepped, one
that ends at the rollout's cap is a truncation."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from agent_rl import make
from agent_rl.app.serve import serve
from agent_rl.store import Store
from tests.rollout.conftest import serve_config

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_draws_are_lognormal_and_deterministic() -> None:
    env = make("long-tail", turns_median=2.0, length_median=16.0, sigma=1.0)
    tasks = env.task_source().take(2000, seed=0)
    assert tasks == env.task_source().take(2000, seed=0)
    turns = [t["turns"] for t in tasks]
    lengths = [n for t in tasks for n in t["lengths"]]
    assert all(len(t["lengths"]) == t["turns"] for t in tasks)
    assert statistics.median(turns) == 2 and statistics.median(lengths) == 16
    logs = [math.log(n) for n in lengths if 1 < n < 1024]
    assert 0.8 < statistics.pstdev(logs) < 1.2  # sigma 1
    assert max(lengths) > 10 * statistics.median(lengths)  # a long tail


async def test_the_engine_writes_exactly_the_lengths_asked(
    tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path
) -> None:
    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", sglang_moe_server.url, tiny_moe_model,
                       env="long-tail", env_kwargs={"turns_median": 2.0, "length_median": 12.0},
                       max_turns=4, max_new_tokens=40, max_tokens=8192, filter_zero_variance=False)
    await serve(cfg, max_episodes=6)
    async with await Store.open(cfg.store) as store:
        run = await store.run_id(cfg.run.name)
        for e in await store.list_episodes(run_id=run):
            assert e.status == "completed", e.error_cause
            task = await store.get_task(e.task_id)
            asked = task["payload"]["lengths"]
            detail = await store.get_episode(e.id)
            written = [t.num_tokens - t.num_prompt_tokens for t in detail.turns]
            capped = [min(n, 40) for n in asked[: len(written)]]
            assert written == capped, (written, asked)
            why = (e.reward_details or {}).get("truncated")
            if any(n > 40 for n in asked[: len(written)]):
                assert why == "max_new_tokens"  # cut at the rollout's cap: never stepped
            elif task["payload"]["turns"] > 4:
                assert why == "max_turns" and len(written) == 4
            else:
                assert why is False and len(written) == task["payload"]["turns"]


async def test_siblings_differ_a_pool_cycles_and_the_env_truncates_at_its_max_turns() -> None:
    """`sibling_sigma`: each episode's turns drawn around its task's from its seed, so siblings
    differ; `task_pool` (of `pool_seed`'s stream): the same tasks come back; `max_turns`: an
    episode longer than the env's limit ends truncated there with reward 0."""
    from agent_rl.sdk.demonstrations import run_demonstration

    kwargs = {"turns_median": 16.0, "sigma": 1.4, "sibling_sigma": 0.5, "length_median": 3.0,
              "task_pool": 6, "pool_seed": 32, "max_turns": 30, "max_drawn_turns": 90}
    env = make("long-tail", **kwargs)
    tasks = env.task_source().take(12)
    assert [t.id for t in tasks[:6]] != [t.id for t in tasks[6:]]  # each epoch reshuffled
    assert sorted(t.id for t in tasks[:6]) == sorted(t.id for t in tasks[6:])
    assert sorted(t["turns"] for t in tasks[:6]) == [3, 9, 14, 21, 89, 90]
    task = next(t for t in tasks if t["turns"] == 21)
    runs = [await run_demonstration(make("long-tail", **kwargs), task, seed=s) for s in range(8)]
    turns = [len(r.completions()) for r in runs]
    assert len(set(turns)) > 3 and max(turns) == 30  # siblings differ; some reach the limit
    for r, n in zip(runs, turns):
        assert (n == 30 and r.reward == 0.0) if r.cut else r.terminated
    hopeless = next(t for t in tasks if t["turns"] == 90)
    cut = [await run_demonstration(make("long-tail", **kwargs), hopeless, seed=s) for s in range(4)]
    assert all(r.cut and r.reward == 0.0 and len(r.completions()) == 30 for r in cut)

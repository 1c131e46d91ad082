"""Task selection (`rollout.task_selection = "skip_all_equal"`, agent_rl/rollout/task_selection.py):
a task whose last group was all equal is skipped the next `task_pause` times it comes back,
recorded as drawn, and a restarted serve keeps skipping it (the record rebuilt from the store).

The engine is the stand-in (`agent_rl.testing.stand_in_engine`, the fault-free stand-in for a GPU
engine: every turn answers "413" at once); everything else is real: `serve`, the scheduler, the
runner, the tokenizer, a SQLite store.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from agent_rl import Env, StepResult
from agent_rl.app.serve import serve
from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig
from agent_rl.rollout.render import ChatRenderer
from agent_rl.rollout.task_selection import TaskSelection
from agent_rl.sdk.messages import AssistantTurn, Message, user
from agent_rl.sdk.registry import register, unregister
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from agent_rl.store import Store
from agent_rl.testing.stand_in_engine import StandInEngine

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class HardAndMixed(Env):
    """Tasks t0..t3 in this order, again and again: t0 and t2 no episode solves (reward 0 in
    every sibling), t1 and t3 every other episode solves (a group of two has both rewards)."""

    solved: Counter[str] = Counter()

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=f"t{i}", data={"q": f"question {i}"}) for i in range(4)],
                         shuffle=False)

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(task["q"])]

    async def step(self, turn: AssistantTurn) -> StepResult:
        assert self.task is not None
        reward = 0.0
        if self.task.id in ("t1", "t3"):
            HardAndMixed.solved[self.task.id] += 1
            reward = float(HardAndMixed.solved[self.task.id] % 2)
        return StepResult(reward=reward, terminated=True)

    async def score(self, answer: str) -> float:
        return 0.0


def test_a_pause_doubles_with_each_all_equal_group_and_one_signal_clears_it() -> None:
    s = TaskSelection(pause=2)
    s.observe("a", [0.0, 0.0])
    assert [s.admit("a") for _ in range(3)] == [False, False, True]
    s.observe("a", [1.0, 1.0])  # all equal again: paused twice as long
    assert [s.admit("a") for _ in range(5)] == [False] * 4 + [True]
    s.observe("a", [0.0, 1.0])  # a group with signal clears the record
    assert s.admit("a") and s.admit("b") and s.skipped == 6


def test_a_task_with_a_record_of_signal_is_paused_for_its_share_of_all_equal_groups() -> None:
    """The pause is scaled by the task's record: a hopeless task (every group all equal) is
    paused the whole `task_pause`; one whose groups mostly had a signal and that went all-equal
    once (by chance) is paused a quarter of it after four groups."""
    s = TaskSelection(pause=8)
    s.observe("hopeless", [0.0] * 4)
    assert [s.admit("hopeless") for _ in range(9)] == [False] * 8 + [True]
    for _ in range(3):
        s.observe("coin", [0.0, 1.0, 1.0, 0.0])
    s.observe("coin", [1.0] * 4)  # 1 of its 4 groups all equal
    assert s.pause_after("coin") == 2
    assert [s.admit("coin") for _ in range(3)] == [False, False, True]
    s.observe("coin", [0.0] * 4)  # a second in a row: 2 of 5, doubled: ceil(8 x 2 x 0.4)
    assert s.pause_after("coin") == 7


async def test_serve_skips_tasks_whose_groups_were_all_equal(
    tmp_path: Path, tiny_dense_model: Path
) -> None:
    register("test-hard-and-mixed", HardAndMixed)
    HardAndMixed.solved.clear()
    renderer = ChatRenderer(tiny_dense_model)
    try:
        async with StandInEngine([renderer.encode("413")], renderer.eos_id) as engine:
            cfg = Config(
                store=StoreConfig(url=f"sqlite:///{tmp_path / 'store.db'}"),
                engine=EngineConfig(model=tiny_dense_model),
                rollout=RolloutConfig(env="test-hard-and-mixed", router_url=engine.url,
                                      group_size=2, max_concurrent_episodes=2,
                                      max_queued_groups=0, max_turns=2,
                                      task_selection="skip_all_equal", task_pause=2),
            )  # fmt: skip
            first = await serve(cfg, max_episodes=16)
            # Draws: t0 t1 t2 t3 admitted; t0 and t2 (all 0) skipped twice each, t1 t3 not.
            assert first.scheduler.skipped_tasks == 4
            second = await serve(cfg, max_episodes=4)  # a restart: the record from the store
            assert second.scheduler.skipped_tasks == 2
        async with await Store.open(cfg.store) as store:
            run = first.run_id
            assert (await store.audit(run)).problems() == []
            assert await store.count_tasks(run, "test-hard-and-mixed") == 12 + 4  # skips too
            groups = Counter()
            for e in await store.list_episodes(run_id=run, limit=100):
                groups[(await store.get_task(e.task_id))["key"]] += 1
            assert groups == {"t0": 2, "t2": 2, "t1": 8, "t3": 8}  # episodes, 2 per group
            assert (await store.endings(run)).filtered == {"zero_variance": 4}
    finally:
        unregister("test-hard-and-mixed")

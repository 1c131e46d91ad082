"""Admission fills slots as they free up: a group's long-tail episode does not hold the next
group back (the scheduler used to admit a group only once all its n slots were free, so the
slots its finished episodes left sat idle until the slowest one ended).

The engine is the stand-in (`agent_rl.testing.stand_in_engine`, the fault-free stand-in for a GPU
engine: every turn answers "413" at once), so the only thing that takes time is the env's
long-tail episode. Everything else is real: `serve`, the scheduler, the episode runner, the
chat template and tokenizer, a SQLite store, HTTP on loopback.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agent_rl import Env, StepResult
from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig
from agent_rl.testing.stand_in_engine import StandInEngine
from agent_rl.sdk.messages import AssistantTurn, Message, user
from agent_rl.sdk.registry import register
from agent_rl.rollout.render import ChatRenderer
from agent_rl.app.serve import serve
from agent_rl.store import Store
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource

pytestmark = pytest.mark.anyio

WAIT_S = 10.0


class LongTailEnv(Env):
    """The first episode to step is the long tail: it waits (up to WAIT_S) until an episode of
    another task, i.e. of a later group, has stepped, and records whether one did."""

    stepped: set[str] = set()
    tail_overlapped: bool | None = None

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=f"t{i}", data={"q": f"question {i}"}) for i in range(4)])

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(task["q"])]

    async def step(self, turn: AssistantTurn) -> StepResult:
        assert self.task is not None
        tail = not LongTailEnv.stepped
        LongTailEnv.stepped.add(self.task.id)
        if tail:
            with anyio.move_on_after(WAIT_S):
                while len(LongTailEnv.stepped) < 2:
                    await anyio.sleep(0.02)
            LongTailEnv.tail_overlapped = len(LongTailEnv.stepped) >= 2
        return StepResult(reward=float(tail), terminated=True)

    async def score(self, answer: str) -> float:
        return 0.0


async def test_next_group_starts_while_a_long_tail_episode_runs(tmp_path: Path, tiny_dense_model: Path) -> None:
    register("test-long-tail", LongTailEnv)
    LongTailEnv.stepped, LongTailEnv.tail_overlapped = set(), None
    renderer = ChatRenderer(tiny_dense_model)
    async with StandInEngine([renderer.encode("413")], renderer.eos_id) as engine:
        cfg = Config(
            store=StoreConfig(url=f"sqlite:///{tmp_path / 'store.db'}"),
            engine=EngineConfig(model=tiny_dense_model),
            rollout=RolloutConfig(env="test-long-tail", router_url=engine.url, group_size=2,
                                  max_concurrent_episodes=2, max_queued_groups=0, max_turns=2,
                                  filter_zero_variance=False),
        )  # fmt: skip
        summary = await serve(cfg, max_episodes=6)
    # The tail's group held one of the two slots; the other went to the next group at once.
    assert LongTailEnv.tail_overlapped is True
    assert summary.admitted == 6
    async with await Store.open(cfg.store) as store:
        run = summary.run_id
        assert (await store.audit(run)).problems() == []
        ledger = await store.ledger(run)
        assert ledger.balances() and ledger.admitted == 6 and ledger.failed == 0
        assert await store.groups_to_complete(run) == []
        # Groups still land whole: each decided once all of its episodes ended.
        episodes = await store.list_episodes(run_id=run)
        by_group: dict[int, list[str]] = {}
        for e in episodes:
            by_group.setdefault(e.group_id, []).append(e.status)
        assert sorted(len(v) for v in by_group.values()) == [2, 2, 2]
        assert all(s == "completed" for v in by_group.values() for s in v)


class Alternating(Env):
    """One-turn episodes whose rewards alternate 0, 1, 0, ...: every group of two has a signal
    (none is filtered), so every finished group is ready for a trainer."""

    count = 0

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=f"t{i}", data={"q": f"question {i}"}) for i in range(4)])

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(task["q"])]

    async def step(self, turn: AssistantTurn) -> StepResult:
        Alternating.count += 1
        return StepResult(reward=float(Alternating.count % 2), terminated=True)

    async def score(self, answer: str) -> float:
        return 0.0


@pytest.mark.parametrize("max_ready_groups", [None, 0])
async def test_admission_waits_on_finished_groups_under_a_wide_queue(
    tmp_path: Path, tiny_dense_model: Path, max_ready_groups: int | None
) -> None:
    """A queue 4x the default (8 groups) and no trainer: by default admission stops once the
    trainer's next step's worth of groups (2) has finished and waits, so groups do not line up
    ready and age past the bound (a group still running when the last one was admitted may
    finish after: 3 at most here, one group running at a time); `max_ready_groups = 0` admits
    up to the queue (8 ready)."""
    register("test-alternating", Alternating)
    renderer = ChatRenderer(tiny_dense_model)
    async with StandInEngine([renderer.encode("413")], renderer.eos_id) as engine:
        cfg = Config(
            store=StoreConfig(url=f"sqlite:///{tmp_path / 'store.db'}"),
            engine=EngineConfig(model=tiny_dense_model),
            rollout=RolloutConfig(env="test-alternating", router_url=engine.url, group_size=2,
                                  max_concurrent_episodes=2, max_queued_groups=8,
                                  max_ready_groups=max_ready_groups, max_turns=2),
            trainer={"max_staleness": 1, "groups_per_step": 2},
        )  # fmt: skip
        with anyio.move_on_after(6.0):  # bounded: it waits for a trainer that never comes
            await serve(cfg, max_episodes=20)
    async with await Store.open(cfg.store) as store:
        run = await store.run_id(cfg.run.name)
        queued, ready = await store.queued_groups(run)
        assert (await store.audit(run)).problems(finished=False) == []
    assert queued == ready  # nothing left running
    assert ready in ((2, 3) if max_ready_groups is None else (8,))



class Overtaken(Env):
    """One-turn episodes of tasks t0, t1, ... in order. t0 is the long one: its turn waits until
    four later tasks have stepped (or TAIL_S), recording those that stepped while it ran."""

    TAIL_S = 1.5
    during_tail: set[str] = set()
    tail_done = False

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=f"t{i}", data={"q": f"question {i}"}) for i in range(8)],
                         shuffle=False)

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(task["q"])]

    async def step(self, turn: AssistantTurn) -> StepResult:
        assert self.task is not None
        if self.task.id == "t0":
            with anyio.move_on_after(self.TAIL_S):
                while len(Overtaken.during_tail) < 4:
                    await anyio.sleep(0.02)
            Overtaken.tail_done = True
        elif not Overtaken.tail_done:
            Overtaken.during_tail.add(self.task.id)
        return StepResult(reward=float(self.task.id in ("t1", "t3", "t5", "t7")), terminated=True)

    async def score(self, answer: str) -> float:
        return 0.0


@pytest.mark.parametrize("protect", [True, False])
async def test_admission_keeps_the_oldest_running_group_trainable(
    tmp_path: Path, tiny_dense_model: Path, protect: bool
) -> None:
    """`protect_oldest_group` at max_staleness 1, 2 groups a step, version 0: the groups that
    could be trained before the long-running t0 (the ones beside it and the new one) may make
    one step (3 groups: t1-t3), not two, so t4 waits for t0 though slots are free, and then
    all 8 run. Without it the free slots take t4 at once."""
    register("test-overtaken", Overtaken)
    Overtaken.during_tail, Overtaken.tail_done = set(), False
    renderer = ChatRenderer(tiny_dense_model)
    async with StandInEngine([renderer.encode("413")], renderer.eos_id) as engine:
        cfg = Config(
            store=StoreConfig(url=f"sqlite:///{tmp_path / 'store.db'}"),
            engine=EngineConfig(model=tiny_dense_model),
            rollout=RolloutConfig(env="test-overtaken", router_url=engine.url, group_size=1,
                                  max_concurrent_episodes=4, max_queued_groups=0,
                                  protect_oldest_group=protect, max_turns=2,
                                  filter_zero_variance=False),
            trainer={"max_staleness": 1, "groups_per_step": 2},
        )  # fmt: skip
        summary = await serve(cfg, max_episodes=8)
    assert summary.admitted == 8
    if protect:
        assert Overtaken.during_tail == {"t1", "t2", "t3"}
    else:
        assert len(Overtaken.during_tail) >= 4
    async with await Store.open(cfg.store) as store:
        assert (await store.audit(summary.run_id)).problems() == []
        ledger = await store.ledger(summary.run_id)
        assert ledger.balances() and ledger.admitted == 8 and ledger.failed == 0

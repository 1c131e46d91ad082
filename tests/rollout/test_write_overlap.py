"""The store's commits are off the engine's path: an episode's start and each turn's write
commit while the next generation runs, and still land in order, before the episode's end.

The engine is the stand-in (`agent_rl.testing.stand_in_engine`, the fault-free stand-in for a GPU
engine), answering at once: 3 calculator tool calls, then the answer. Everything else is real
(the episode runner, the calculator env and its tool, the chat template and tokenizer, a
SQLite store, HTTP on loopback); each commit is made slow (0.2 s, in the store's worker
thread) so that a runner waiting for it before its next request shows.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from sqlalchemy import event

from agent_rl.config import RolloutConfig, StoreConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.testing.stand_in_engine import StandInEngine
from agent_rl.kernel.errors import StoreError
from agent_rl.rollout.render import ChatRenderer
from agent_rl.rollout.runner import EpisodeRunner, RunnerContext
from agent_rl.store import Store
from agent_rl.sdk.tasks import Task
from agent_rl.sdk.tool_calls import format_tool_call

pytestmark = pytest.mark.anyio

TURNS = 4
SLOW_COMMIT_S = 0.2
TASK = Task(id="t", data={"expression": "12*34+5", "question": "What is 12*34+5?", "answer": "413"})


class TimedEngine(StandInEngine):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arrivals: list[float] = []

    async def generate(self, request: web.Request) -> web.Response:
        self.arrivals.append(time.monotonic())
        return await super().generate(request)


async def _episode(tmp_path: Path, model: Path):  # type: ignore[no-untyped-def]
    renderer = ChatRenderer(model)
    call = renderer.encode(format_tool_call("calc", {"expression": "12*34+5"}))
    engine = TimedEngine([call] * (TURNS - 1) + [renderer.encode("413")], renderer.eos_id)
    store = await Store.open(StoreConfig(url=f"sqlite:///{tmp_path}/s.db"), create=True)
    run = await store.ensure_run("overlap")
    task_id = await store.add_task(run, "calculator", "t", {})
    _, (episode,) = await store.admit_group(run, task_id, "calculator", 1)
    return renderer, engine, store, episode


def _runner(store: Store, client: EngineClient, renderer: ChatRenderer, episode: int) -> EpisodeRunner:
    cfg = RolloutConfig(max_turns=TURNS, max_new_tokens=64)
    ctx = RunnerContext(store=store, client=client, renderer=renderer, cfg=cfg, owner="test",
                        run_name="overlap")
    return EpisodeRunner(ctx, episode, "calculator", TASK, seed=0, env_kwargs={"max_turns": TURNS})


async def test_each_write_commits_during_the_next_generation(tmp_path: Path, tiny_dense_model: Path) -> None:
    renderer, engine, store, episode = await _episode(tmp_path, tiny_dense_model)
    committed: list[float] = []

    @event.listens_for(store.db, "commit")
    def _slow_commit(conn) -> None:  # type: ignore[no-untyped-def]
        time.sleep(SLOW_COMMIT_S)
        committed.append(time.monotonic())  # the DBAPI commit follows: durable only after this

    async with store, engine, EngineClient(engine.url) as client:
        result = await _runner(store, client, renderer, episode).run()
        writes = list(committed)
        assert result.status == "completed" and result.reward == 1.0, result
        detail = await store.get_episode(episode)
    # Commits: the start, turns 0..2, then the end with the last turn.
    assert len(writes) == TURNS + 1 and len(engine.arrivals) == TURNS
    # Request i went out while the write before it (the start, then turn i-1) was committing.
    for i, arrived in enumerate(engine.arrivals):
        assert arrived < writes[i], f"request {i} waited for commit {i}"
    # And the writes landed in order: every turn, then the end.
    assert detail.episode.status == "completed" and detail.episode.num_turns == TURNS
    assert [t.index for t in detail.turns] == list(range(TURNS))


async def test_an_episode_started_elsewhere_is_not_run_on_nor_ended_here(tmp_path: Path, tiny_dense_model: Path) -> None:
    renderer, engine, store, episode = await _episode(tmp_path, tiny_dense_model)
    async with store, engine, EngineClient(engine.url) as client:
        await store.start_episode(episode, "another-serve")
        with pytest.raises(StoreError):
            await _runner(store, client, renderer, episode).run()
        detail = await store.get_episode(episode)
    # Its start failed during the first generation: nothing of this runner's was written.
    assert engine.requests <= 1
    assert detail.episode.status == "running" and detail.episode.num_turns == 0

"""A turn costs serve the same at turn 50 as at turn 2: no per-turn work grows with the
conversation (the drift check used to re-render and re-tokenize the whole conversation every
turn, so a 50-turn episode cost ~25x per turn what a short one did).

The work is counted, not timed, so the test cannot flake: the characters the chat template
renders, the characters tokenized and the tokens decoded, the SQL statements and the bytes
they carry, and the request body sent to the engine, each between the runner's request for
turn t and its request for turn t+1 (everything turn t does: decode, parse, tool call, the
drift check, the store write). A turn's write commits while the next turn generates, so the
engine takes its snapshot for turn t+1 once turn t's write has committed (one commit per turn,
after the episode's start). The request's input ids are left out of the body count: SGLang's
protocol sends the whole context with every turn.

The engine is the stand-in (`agent_rl.testing.stand_in_engine`), the fault-free stand-in for a GPU
engine: it answers 59 scripted tool calls, then the answer, so every turn's text is the same and
only the conversation's length changes. Everything else is real: the episode runner, the
calculator env and its tool, the chat template and tokenizer, a SQLite store, HTTP on loopback.
"""

from __future__ import annotations

import asyncio
import collections
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from sqlalchemy import event

from agent_rl.config import RolloutConfig, StoreConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.testing.stand_in_engine import StandInEngine
from agent_rl.sdk.messages import Message
from agent_rl.rollout.render import ChatRenderer
from agent_rl.rollout.runner import EpisodeRunner, RunnerContext
from agent_rl.store import Store
from agent_rl.sdk.tasks import Task
from agent_rl.sdk.tool_calls import format_tool_call

pytestmark = pytest.mark.anyio

TURNS = 60


class CountingRenderer(ChatRenderer):
    def __init__(self, model: Path, work: collections.Counter[str]) -> None:
        super().__init__(model)
        self.work = work

    def render(self, messages: list[Message], tools: list[dict[str, Any]], *,
               generation_prompt: bool = True) -> str:  # fmt: skip
        text = super().render(messages, tools, generation_prompt=generation_prompt)
        self.work["template chars"] += len(text)
        return text

    def encode(self, text: str) -> list[int]:
        self.work["chars tokenized"] += len(text)
        return super().encode(text)

    def decode(self, ids: list[int]) -> str:
        self.work["tokens decoded"] += len(ids)
        return super().decode(ids)


class CountingEngine(StandInEngine):
    """Snapshots the work counters when each turn's request arrives."""

    def __init__(self, work: collections.Counter[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.work, self.snapshots = work, []  # type: ignore[var-annotated]
        self.input_ids: list[list[int]] = []

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.read()
        payload = json.loads(body)
        self.input_ids.append(payload["input_ids"])
        # Turn t's request comes with turn t-1's write in flight: counted once committed.
        while self.work["commits"] < len(self.input_ids):
            await asyncio.sleep(0.001)
        del payload["input_ids"]
        self.work["request bytes, without input ids"] += len(json.dumps(payload))
        self.snapshots.append(collections.Counter(self.work))
        return await super().generate(request)


def _count_sql(store: Store, work: collections.Counter[str]) -> None:
    @event.listens_for(store.db, "commit")
    def _commit(conn) -> None:  # type: ignore[no-untyped-def]
        work["commits"] += 1

    def _statement(sql: str) -> None:
        work["SQL statements"] += 1
        work["SQL bytes"] += len(sql)  # with its parameters: sqlite3 traces the expanded SQL

    # Counted by the driver (the hot path's statements run on its cursor, around SQLAlchemy's
    # events): every statement SQLite runs, on whichever pooled connection runs it.
    @event.listens_for(store.db, "begin")
    def _trace(conn) -> None:  # type: ignore[no-untyped-def]
        conn.connection.dbapi_connection.set_trace_callback(_statement)


async def test_turn_50_costs_what_turn_2_does(tmp_path: Path, tiny_dense_model: Path) -> None:
    work: collections.Counter[str] = collections.Counter()
    renderer = CountingRenderer(tiny_dense_model, work)
    call = renderer.encode(format_tool_call("calc", {"expression": "12*34+5"}))
    engine = CountingEngine(work, [call] * (TURNS - 1) + [renderer.encode("413")], renderer.eos_id)
    cfg = RolloutConfig(max_turns=TURNS, max_tokens=100_000, max_new_tokens=64)
    async with engine, await Store.open(StoreConfig(url=f"sqlite:///{tmp_path}/s.db"), create=True) as store:
        run = await store.ensure_run("cost")
        task_id = await store.add_task(run, "calculator", "t", {})
        _, (episode,) = await store.admit_group(run, task_id, "calculator", 1)
        _count_sql(store, work)
        async with EngineClient(engine.url) as client:
            ctx = RunnerContext(store=store, client=client, renderer=renderer, cfg=cfg,
                                owner="test", run_name="cost")
            task = Task(id="t", data={"expression": "12*34+5", "question": "What is 12*34+5?",
                                      "answer": "413"})
            result = await EpisodeRunner(ctx, episode, "calculator", task, seed=0,
                                         env_kwargs={"max_turns": TURNS}).run()
        assert result.status == "completed" and result.reward == 1.0, result
        detail = await store.get_episode(episode)
        assert detail.episode.num_turns == TURNS and detail.episode.drift_count == 0

    # What was sent is the carried stream: each request's ids extend the previous one's.
    sent = engine.input_ids
    assert all(later[: len(earlier)] == earlier for earlier, later in zip(sent, sent[1:]))
    snaps = engine.snapshots
    assert len(snaps) == TURNS
    cost = {t: {k: snaps[t + 1][k] - snaps[t][k] for k in work if k != "commits"} for t in (2, 50)}
    assert cost[2]["template chars"] > 0 and cost[2]["SQL statements"] > 0
    for what, early in cost[2].items():
        late = cost[50][what]
        assert abs(late - early) <= 0.2 * early, f"{what}: turn 50 {late} vs turn 2 {early}"

"""Tool-call arguments reach the store as the model wrote them (`_tool_records`, the runner's
one place that turns a step's tool results into records): `{"expression":"2+3"}` used to be
stored re-serialized as `{"expression": "2+3"}`, and spacing, key order and number spelling
were lost with it. Real parser, real calculator env, real SQLite store."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_rl import make, parse_completion
from agent_rl.rollout.runner import _tool_records
from agent_rl.store import MessageRecord
from tests.store.helpers import make_turn, migrated_store

pytestmark = pytest.mark.anyio

WRITTEN = [
    '{"expression":"2+3"}',
    '{ "expression" : "7*6" }',
    '"{\\"expression\\": \\"1+1\\"}"',
]


async def test_the_store_records_arguments_as_written(tmp_path: Path) -> None:
    env = make("calculator")
    task = env.task_source().take(1)[0]
    await env.reset(task)
    completion = "".join(f'<tool_call>{{"name":"calc","arguments":{a}}}</tool_call>' for a in WRITTEN)
    turn = parse_completion(completion)
    result = await env.step(turn)
    records = _tool_records(turn, result)
    assert [r.arguments for r in records] == WRITTEN
    assert [r.output for r in records] == ["5", "42", "2"]

    async with await migrated_store(f"sqlite:///{tmp_path / 'store.db'}") as store:
        run = await store.ensure_run("raw")
        task_id = await store.add_task(run, "calculator", task.id, task.data)
        _, (episode,) = await store.admit_group(run, task_id, "calculator", 1)
        await store.start_episode(episode, "test")
        record = make_turn(episode)
        record.messages = [MessageRecord("assistant", completion)]
        record.tool_calls = records
        await store.append_turn(episode, record, final_reward=0.0)
        stored = (await store.get_episode(episode)).tool_calls
        assert [c["arguments"] for c in stored] == WRITTEN

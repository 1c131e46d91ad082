"""Task sources: deterministic per seed, JSONL parsing with useful errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_rl import EnvError, GeneratedTasks, JsonlTasks, ListTasks, Task


def test_generated_tasks_depend_only_on_name_split_seed_and_index() -> None:
    src = GeneratedTasks("g", lambda rng: {"x": rng.randint(0, 10**9)})
    a = src.take(5, seed=3)
    assert a == GeneratedTasks("g", lambda rng: {"x": rng.randint(0, 10**9)}).take(5, seed=3)
    assert [t.id for t in a] == [f"g-train-3-{i}" for i in range(5)]
    assert src.task(3, 4) == a[4]
    assert a != src.take(5, seed=4)
    assert a != GeneratedTasks("g", lambda rng: {"x": rng.randint(0, 10**9)}, split="eval").take(
        5, seed=3
    )
    assert src.size is None


def test_list_tasks_cycle_with_a_fresh_shuffle_per_epoch() -> None:
    tasks = [Task(id=str(i), data={"i": i}) for i in range(10)]
    src = ListTasks(tasks)
    first, second = src.take(10, seed=1), src.take(20, seed=1)[10:]
    assert (
        sorted(t.id for t in first) == sorted(t.id for t in second) == sorted(t.id for t in tasks)
    )
    assert first != second and src.take(20, seed=1) == src.take(20, seed=1)
    assert ListTasks(tasks, shuffle=False).take(3) == tasks[:3]
    with pytest.raises(EnvError, match="empty"):
        ListTasks([])
    with pytest.raises(EnvError, match="task id '1' appears more than once"):
        ListTasks([tasks[1], tasks[1]])


def test_jsonl_tasks(tmp_path: Path) -> None:
    path = tmp_path / "qs.jsonl"
    path.write_text(json.dumps({"id": "a", "q": 1}) + "\n\n" + json.dumps({"q": 2}) + "\n")
    src = JsonlTasks(path, shuffle=False)
    assert [(t.id, t["q"]) for t in src.take(2)] == [("a", 1), ("qs-3", 2)]
    path.write_text('{"q": 1}\n{"q": \n')
    with pytest.raises(EnvError, match=r"qs.jsonl:2: invalid JSON"):
        JsonlTasks(path)
    path.write_text("[1]\n")
    with pytest.raises(EnvError, match="must be a JSON object"):
        JsonlTasks(path)
    with pytest.raises(EnvError, match="cannot read task file"):
        JsonlTasks(tmp_path / "missing.jsonl")


def test_env_tasks_option_replaces_the_builtin_set(tmp_path: Path) -> None:
    from agent_rl import make

    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"id": "m1", "question": "What is 1+1?", "expression": "1+1", "answer": "2"})
        + "\n"
    )
    assert [t.id for t in make("calculator", tasks=str(path)).task_source().take(2)] == ["m1", "m1"]

"""Tasks and task sources: what episodes are about, in a deterministic order for a seed.

A `Task` is an id plus JSON data the environment understands (a question and its answer, a
function signature and hidden tests). A `TaskSource` yields tasks: `stream(seed)` is the same
sequence for the same seed, in every process and after every restart, so a scheduler that
resumes at position k can simply skip k tasks. Sources:

- `JsonlTasks(path)`: one JSON object per line (`id` optional); finite, so `stream` cycles
  through it, reshuffled per epoch from the seed;
- `ListTasks(items)`: the same over an in-memory list (bundled task sets);
- `GeneratedTasks(name, fn)`: task i of seed s is `fn(random.Random("name:split:s:i"))`, so
  any task can be rebuilt from its id alone and the stream never ends.
"""

from __future__ import annotations

import itertools
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agent_rl.kernel.errors import EnvError


class Task(BaseModel):
    """One problem an episode is run on."""

    model_config = ConfigDict(frozen=True)

    id: str
    """Stable id: the same task always has the same id (the store groups episodes by it)."""
    data: dict[str, Any] = Field(default_factory=dict)
    """Environment-specific JSON (prompt, answer, tests...)."""

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


class TaskSource(ABC):
    """A deterministic supply of tasks."""

    size: int | None = None
    """Number of distinct tasks, or None for a generator."""

    @abstractmethod
    def stream(self, seed: int = 0) -> Iterator[Task]:
        """Tasks in a fixed order for `seed`; endless (finite sources cycle)."""

    def take(self, n: int, seed: int = 0) -> list[Task]:
        return list(itertools.islice(self.stream(seed), n))


class ListTasks(TaskSource):
    """A finite task set; each epoch is shuffled with a seed derived from `seed` and the epoch."""

    def __init__(self, tasks: Iterable[Task], *, shuffle: bool = True) -> None:
        self.tasks = list(tasks)
        if not self.tasks:
            raise EnvError("the task set is empty: give at least one task")
        ids = [t.id for t in self.tasks]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise EnvError(f"task id {dup!r} appears more than once: task ids must be unique")
        self.size = len(self.tasks)
        self.shuffle = shuffle

    def stream(self, seed: int = 0) -> Iterator[Task]:
        for epoch in itertools.count():
            order = list(self.tasks)
            if self.shuffle:
                random.Random(f"{seed}:{epoch}").shuffle(order)
            yield from order


class JsonlTasks(ListTasks):
    """Tasks read from a JSONL file: one object per line; `id` defaults to `<stem>-<line>`."""

    def __init__(self, path: str | Path, *, shuffle: bool = True) -> None:
        self.path = Path(path)
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise EnvError(f"cannot read task file {self.path}: {e.strerror}") from e
        tasks = []
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise EnvError(
                    f"{self.path}:{n}: invalid JSON ({e.msg}): fix or remove the line"
                ) from e
            if not isinstance(obj, dict):
                raise EnvError(f"{self.path}:{n}: each line must be a JSON object")
            tasks.append(Task(id=str(obj.get("id", f"{self.path.stem}-{n}")), data=obj))
        super().__init__(tasks, shuffle=shuffle)


class GeneratedTasks(TaskSource):
    """An endless task generator; task i of seed s depends only on (name, split, s, i)."""

    def __init__(
        self, name: str, fn: Callable[[random.Random], Mapping[str, Any]], *, split: str = "train"
    ) -> None:
        self.name, self.fn, self.split = name, fn, split

    def task(self, seed: int, index: int) -> Task:
        # str seeds hash with SHA-512 inside random.Random, so they are stable across processes.
        rng = random.Random(f"{self.name}:{self.split}:{seed}:{index}")
        return Task(id=f"{self.name}-{self.split}-{seed}-{index}", data=dict(self.fn(rng)))

    def stream(self, seed: int = 0) -> Iterator[Task]:
        return (self.task(seed, i) for i in itertools.count())

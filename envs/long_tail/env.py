"""`long-tail`: episodes whose lengths are heavy-tailed, to test the pipeline, not the policy.

Each task draws how many turns its episodes last and how many tokens each completion has, both
lognormal (`turns_median`, `length_median`, `sigma`; sigma 1 puts the 99th percentile ~10x
above the median): the env asks the engine for exactly that many tokens each turn
(`sampling_params`: `min_new_tokens = max_new_tokens`), answers every turn but the last with a
short observation, and scores the last one. So the token length and the wall time of episodes
have the long tail agentic episodes have, whatever the model, and a few percent of them run
into `rollout.max_turns` or `rollout.max_tokens` when those are set near the tail. The reward is
a coin the completion flips (the parity of its length in characters), so groups have reward
variance and train: what is measured is where episodes go, not what is learned. This is what
`bench/long_tail.py` runs to measure length bias and staleness.

Options for the long tail of a group (issue 49's shape, a searcher whose episodes run a few to
30 turns): `sibling_sigma > 0` draws each episode's turns around its task's (lognormal, from the
episode's seed), so a group's short siblings finish long before its long ones; `max_turns` (the
env's own limit) truncates an episode at that many turns with reward 0, so a task whose turns
lie past it fails in every sibling (an all-equal group); `task_pool = N` cycles over N tasks
instead of drawing new ones, so a task comes back (task selection can learn which are all-equal).
`demonstrate` writes each turn as the env asks, for SFT: a demonstration is as long as its
episode, and one past `max_turns` is cut.
"""

from __future__ import annotations

import math
import random
from typing import Any

from agent_rl.sdk.env import Env, StepResult
from agent_rl.sdk.messages import AssistantTurn, Message, user
from agent_rl.sdk.rewards import Reward
from agent_rl.sdk.tasks import GeneratedTasks, ListTasks, TaskSource


def lognormal(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    """An integer in [1, cap] drawn lognormal around `median`."""
    return max(1, min(cap, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


class LongTailEnv(Env):
    """Episodes of lognormal turn counts and completion lengths (a pipeline stress env)."""

    def __init__(self, *, turns_median: float = 2.0, length_median: float = 16.0,
                 sigma: float = 1.0, max_drawn_turns: int = 64, max_length: int = 1024,
                 sibling_sigma: float = 0.0, task_pool: int = 0, pool_seed: int = 0,
                 **kwargs: Any) -> None:  # fmt: skip
        """`turns_median`/`length_median`: medians of the turns an episode lasts and of the tokens
        a completion has; `sigma`: the lognormal's shape (both); `max_drawn_turns`,
        `max_length`: caps of the draws; `sibling_sigma`: the shape of each episode's turns
        around its task's (0: every sibling lasts the task's turns); `task_pool`: cycle over
        this many tasks (0: a new task each time), the first of the stream of `pool_seed`.
        `max_turns` (Env's): the env's own limit."""
        super().__init__(**kwargs)
        self.shape = dict(turns_median=turns_median, length_median=length_median, sigma=sigma,
                          max_drawn_turns=max_drawn_turns, max_length=max_length)
        self.sibling_sigma = sibling_sigma
        self.task_pool = task_pool
        self.pool_seed = pool_seed
        self.episode_turns = 0

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        s = self.shape

        def draw(rng: random.Random) -> dict[str, Any]:
            turns = lognormal(rng, s["turns_median"], s["sigma"], s["max_drawn_turns"])
            lengths = [lognormal(rng, s["length_median"], s["sigma"], s["max_length"])
                       for _ in range(turns)]
            return {"question": f"Talk for {turns} turns.", "turns": turns, "lengths": lengths}

        tasks = GeneratedTasks("long-tail", draw, split=split)
        return ListTasks(tasks.take(self.task_pool, self.pool_seed)) if self.task_pool else tasks

    async def initial_messages(self, task: Any) -> list[Message]:
        """The task's question; also draws this episode's turns (see `sibling_sigma`)."""
        turns = task["turns"]
        if self.sibling_sigma > 0:
            rng = random.Random(f"{task.id}:{self.seed}:turns")
            turns = lognormal(rng, turns, self.sibling_sigma, self.shape["max_drawn_turns"])
        self.episode_turns = turns
        return [user(task["question"])]

    async def demonstrate(self, messages: list[Message]) -> str:
        """The completion a turn asks for: as many characters as the env's length (a
        demonstration of the episode's shape; the coin's side is its parity)."""
        assert self.task is not None
        lengths = self.task["lengths"]
        return "x" * lengths[min(self.turns, len(lengths) - 1)]

    def sampling_params(self) -> dict[str, Any]:
        assert self.task is not None
        lengths = self.task["lengths"]
        n = lengths[min(self.turns, len(lengths) - 1)]
        return {"min_new_tokens": n, "max_new_tokens": n}

    async def step(self, turn: AssistantTurn) -> StepResult:
        assert self.task is not None
        self.turns += 1
        turns = self.episode_turns or self.task["turns"]
        if self.turns < turns:
            if self.max_turns is not None and self.turns >= self.max_turns:
                self.done = True  # the env's own limit: cut before its end, reward 0
                return StepResult(truncated=True)
            return StepResult(observations=[user(f"go on ({self.turns}/{turns})")])
        self.done = True
        reward = await self.score(turn.text)
        return StepResult(reward=reward.value, terminated=True)

    async def score(self, answer: str) -> Reward:
        return Reward(value=float(len(answer) % 2), detail="a coin: the parity of the length")

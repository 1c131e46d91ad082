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
"""

from __future__ import annotations

import math
import random
from typing import Any

from agent_rl.sdk.env import Env, StepResult
from agent_rl.sdk.messages import AssistantTurn, user
from agent_rl.sdk.rewards import Reward
from agent_rl.sdk.tasks import GeneratedTasks, TaskSource


def lognormal(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    """An integer in [1, cap] drawn lognormal around `median`."""
    return max(1, min(cap, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


class LongTailEnv(Env):
    """Episodes of lognormal turn counts and completion lengths (a pipeline stress env)."""

    def __init__(self, *, turns_median: float = 2.0, length_median: float = 16.0,
                 sigma: float = 1.0, max_drawn_turns: int = 64, max_length: int = 1024,
                 **kwargs: Any) -> None:  # fmt: skip
        """`turns_median`/`length_median`: medians of the turns an episode lasts and of the tokens
        a completion has; `sigma`: the lognormal's shape (both); `max_drawn_turns`,
        `max_length`: caps of the draws."""
        super().__init__(**kwargs)
        self.shape = dict(turns_median=turns_median, length_median=length_median, sigma=sigma,
                          max_drawn_turns=max_drawn_turns, max_length=max_length)

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        s = self.shape

        def draw(rng: random.Random) -> dict[str, Any]:
            turns = lognormal(rng, s["turns_median"], s["sigma"], s["max_drawn_turns"])
            lengths = [lognormal(rng, s["length_median"], s["sigma"], s["max_length"])
                       for _ in range(turns)]
            return {"question": f"Talk for {turns} turns.", "turns": turns, "lengths": lengths}

        return GeneratedTasks("long-tail", draw, split=split)

    def sampling_params(self) -> dict[str, Any]:
        assert self.task is not None
        lengths = self.task["lengths"]
        n = lengths[min(self.turns, len(lengths) - 1)]
        return {"min_new_tokens": n, "max_new_tokens": n}

    async def step(self, turn: AssistantTurn) -> StepResult:
        assert self.task is not None
        self.turns += 1
        if self.turns < self.task["turns"]:
            return StepResult(observations=[user(f"go on ({self.turns}/{self.task['turns']})")])
        self.done = True
        reward = await self.score(turn.text)
        return StepResult(reward=reward.value, terminated=True)

    async def score(self, answer: str) -> Reward:
        return Reward(value=float(len(answer) % 2), detail="a coin: the parity of the length")

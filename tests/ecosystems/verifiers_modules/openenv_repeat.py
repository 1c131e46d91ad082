"""An OpenEnv environment written against OpenEnv's public API (openenv 0.4.1) and served
locally, for the tests of verifiers' OpenEnv taskset: no container, no registry.

`python openenv_repeat.py PORT [letters]` serves it on 127.0.0.1:PORT (OpenEnv's HTTP and
WebSocket server, uvicorn). Each episode asks for `ROUNDS` words, one at a time, chosen by the
reset's seed; a reply that contains the word asked earns 1 (OpenEnv's per-step reward:
verifiers sums them into `openenv_reward`). With `letters`, a reply earns the share of the
word's letters it contains instead (partial credit, so a random policy's rewards vary:
bench/wrapped_train.py trains on it).
"""

from __future__ import annotations

import random
import sys
from typing import Any
from uuid import uuid4

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ("apple", "river", "stone", "cloud", "green", "house", "light", "sugar")
ROUNDS = 2
LETTERS = False
"""Partial credit: the share of the asked word's distinct letters in the reply."""


class RepeatAction(Action):
    message: str


class RepeatObservation(Observation):
    prompt: str = ""


class RepeatEnv(Environment[RepeatAction, RepeatObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()))
        self.words: list[str] = []

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_: Any) -> RepeatObservation:
        self._state = State(episode_id=episode_id or str(uuid4()))
        self.words = random.Random(seed).sample(WORDS, ROUNDS)
        return RepeatObservation(prompt=f"Say the word {self.words[0]}.")

    def step(self, action: RepeatAction, timeout_s: float | None = None, **_: Any) -> RepeatObservation:
        asked = self.words[self._state.step_count]
        self._state.step_count += 1
        reply = action.message.lower()
        reward = len(set(asked) & set(reply)) / len(set(asked)) if LETTERS else float(asked in reply)
        if self._state.step_count >= ROUNDS:
            return RepeatObservation(done=True, reward=reward)
        return RepeatObservation(reward=reward, prompt=f"Say the word {self.words[self._state.step_count]}.")

    @property
    def state(self) -> State:
        return self._state


if __name__ == "__main__":
    LETTERS = sys.argv[2:] == ["letters"]
    app = create_app(RepeatEnv, RepeatAction, RepeatObservation, env_name="repeat",
                     max_concurrent_envs=16)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")

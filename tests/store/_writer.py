"""An episode writer run as a separate OS process, to be SIGKILLed mid-write by a test.

Each episode gets three turns whose content derives from (episode id, turn index), so the test
can rebuild what a committed episode must contain."""

from __future__ import annotations

import sys

import anyio

from agent_rl.config import StoreConfig
from agent_rl.store import Store
from tests.store.helpers import make_turn

TURNS = 3


def turn_seed(episode_id: int, turn: int) -> int:
    return episode_id * 100 + turn


async def main(url: str) -> None:
    async with await Store.open(StoreConfig(url=url)) as store:
        run = await store.ensure_run("crash")
        while True:
            task = await store.add_task(run, "calculator", "k", {})
            group, (episode,) = await store.admit_group(run, task, "calculator", 1)
            await store.start_episode(episode, "writer")
            for k in range(TURNS):
                await store.append_turn(episode, make_turn(turn_seed(episode, k), n_completion=400))
            await store.finish_episode(episode, 1.0)
            await store.complete_group(group)
            print(episode, flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])

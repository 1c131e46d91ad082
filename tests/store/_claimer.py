"""A trainer stand-in run as a separate OS process: claims groups until none are left, commits
each claim as one step, and prints the group ids it trained as JSON."""

from __future__ import annotations

import json
import sys

import anyio

from agent_rl.config import StoreConfig
from agent_rl.kernel.errors import StoreError
from agent_rl.store import Store


async def main(url: str, name: str) -> None:
    trained: list[int] = []
    async with await Store.open(StoreConfig(url=url)) as store:
        run = await store.run_id("claims")
        empty = 0
        while empty < 3:
            claim = await store.claim(run, name, 3, lease_s=60)
            if not claim.groups:
                empty += 1
                await anyio.sleep(0.05)
                continue
            empty = 0
            # Versions are shared by both trainers; retry on a collision with the other one.
            while True:
                version = await store.latest_version(run) + 1
                try:
                    await store.commit(claim, run, step=version, version=version)
                    break
                except StoreError as e:
                    if "not newer" not in str(e) and "unique" not in str(e).lower():
                        raise
            trained.extend(claim.group_ids)
    print(json.dumps(trained))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])

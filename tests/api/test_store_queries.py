"""The store reads the API adds: transcript search, tool-error and drift filters, keyset sorts,
groups, runs and recent activity, on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses

import pytest

from agent_rl.kernel.errors import NotFoundError
from agent_rl.store import MessageRecord
from tests.store.helpers import make_turn, migrated_store

pytestmark = pytest.mark.anyio


async def test_filters_sorts_and_keyset_pages(db_url: str) -> None:
    store = await migrated_store(db_url)
    async with store:
        run = await store.ensure_run("r", {"engine": {"model": "m"}})
        task = await store.add_task(run, "calculator", "k", {"question": "q"})
        group, eps = await store.admit_group(run, task, "calculator", 6)
        rewards = [0.5, None, 1.0, 0.5, 0.0, 0.25]
        for i, e in enumerate(eps):
            await store.start_episode(e, "t")
            turn = make_turn(e)
            turn = dataclasses.replace(
                turn,
                drift=i == 1,
                messages=[MessageRecord("user", f"100% of x_{i}"), MessageRecord("assistant", "A")],
                tool_calls=[
                    dataclasses.replace(turn.tool_calls[0], status="error" if i == 2 else "ok")
                ],
            )
            if rewards[i] is None:
                await store.append_turn(e, turn)
            else:
                await store.append_turn(e, turn, final_reward=rewards[i])
        ids = lambda rows: [r.id for r in rows]
        assert ids(await store.list_episodes(text="100% OF X_3")) == [eps[3]]
        assert ids(await store.list_episodes(text="x_")) == eps  # `_` is literal, not a wildcard
        assert await store.list_episodes(text="1000%") == []
        assert ids(await store.list_episodes(has_tool_error=True)) == [eps[2]]
        assert len(await store.list_episodes(has_tool_error=False)) == 5
        assert ids(await store.list_episodes(drift=True)) == [eps[1]]
        assert ids(await store.list_episodes(group_id=group, limit=2)) == eps[:2]
        assert ids(await store.list_episodes(sort="-id", after_id=eps[3])) == eps[:3][::-1]
        # Highest reward first, ties by id descending, the running one (no reward) last.
        order = [eps[2], eps[3], eps[0], eps[5], eps[4], eps[1]]
        assert ids(await store.list_episodes(sort="-reward")) == order
        seen, after = [], None
        while True:
            page = await store.list_episodes(
                sort="-reward", limit=2, after_id=after and after[1], after_key=after and after[0]
            )
            if not page:
                break
            seen += ids(page)
            last = page[-1]
            after = (last.reward if last.reward is not None else -1e300, last.id)
        assert seen == order
        assert ids(await store.list_episodes(sort="reward"))[0] == eps[1]
        with pytest.raises(ValueError, match="unknown sort"):
            await store.list_episodes(sort="bogus")

        assert (await store.get_group(group))["size"] == 6
        with pytest.raises(NotFoundError):
            await store.get_group(group + 100)
        (summary,) = await store.list_runs()
        assert summary["name"] == "r" and summary["num_episodes"] == 6
        assert summary["latest_version"] == 0
        assert (await store.get_run(run))["config"] == {"engine": {"model": "m"}}
        activity = await store.recent_activity(run)
        assert len(activity["episodes"]) == 5 and len(activity["tool_calls"]) == 6
        assert activity["versions"][0]["version"] == 0

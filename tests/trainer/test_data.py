"""A training step's batch comes from one store read, whatever the number of groups and turns,
with the stored tokens exactly (routed experts included, -1 kept as "unknown")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agent_rl.store import Store
from tests.store.helpers import make_turn, migrated_store
from trainer.data import load_batch

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _fill(store: Store, run: int, groups: int, turns: int) -> None:
    for g in range(groups):
        task = await store.add_task(run, "calculator", f"k{g}", {})
        group, episodes = await store.admit_group(run, task, "calculator", 2)
        for i, e in enumerate(episodes):
            await store.start_episode(e, "test")
            for t in range(turns):
                await store.append_turn(e, make_turn(100 * e + t, layers=2))
            await store.finish_episode(e, float(i))
        assert await store.complete_group(group) == "ready"


def _counting(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every store transaction goes through `run_in_transaction`: note each one."""
    seen: list[bool] = []
    original = Store.run_in_transaction

    async def counted(self: Store, fn, *, write: bool, **options):  # type: ignore[no-untyped-def]
        seen.append(write)
        return await original(self, fn, write=write, **options)

    monkeypatch.setattr(Store, "run_in_transaction", counted)
    return seen


@pytest.mark.parametrize("groups,turns", [(1, 1), (6, 4)])
async def test_a_step_reads_its_batch_in_one_transaction(
    db_url: str, monkeypatch: pytest.MonkeyPatch, groups: int, turns: int
) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("data")
        await _fill(store, run, groups, turns)
        claim = await store.claim(run, "trainer", groups)
        assert len(claim.groups) == groups
        transactions = _counting(store, monkeypatch)
        data = await load_batch(store, claim, version=1)
        assert transactions == [False], "one read transaction per step, not per group or episode"
        monkeypatch.undo()
        assert data.episode_ids == claim.episode_ids and data.batch.size == 2 * groups
        for row, eid in enumerate(data.episode_ids):
            stored = await store.episode_tokens(eid)
            n = len(stored)
            assert data.batch.tokens[row, :n].tolist() == stored.token_ids.tolist()
            assert data.batch.loss_mask[row, :n].tolist() == stored.loss_mask.tolist()
            experts = data.batch.routed_experts
            assert experts is not None
            assert torch.equal(experts[row, :n], torch.from_numpy(stored.routed_experts.astype(np.int64)))
            assert bool((experts[row, n:] == -1).all())  # padding is "unknown" too
        # GRPO within each group of two rewards {0, 1}: one positive, one negative advantage.
        assert sorted(np.sign(list(data.advantages.values()))) == [-1.0] * groups + [1.0] * groups


@pytest.mark.parametrize("advantage,magnitude", [
    ("grpo", 0.5 / (0.5**0.5 + 1e-6)), ("dr_grpo", 0.5), ("rloo", 1.0),
    # batch of rewards {0, 1} x 3: mean 0.5, unbiased std sqrt(6 / 4 / 5)
    ("reinforce_pp", 0.5 / ((1.5 / 5) ** 0.5 + 1e-6)),
])  # fmt: skip
async def test_the_configured_estimator_gives_the_batch_its_advantages(
    db_url: str, advantage: str, magnitude: float
) -> None:
    """`trainer.loss.advantage` reaches the batch: each episode's advantage, and its rows', are
    the estimator's over the claim's rewards (groups of two, rewards 0 and 1)."""
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("data")
        await _fill(store, run, 3, 1)
        claim = await store.claim(run, "trainer", 3)
        data = await load_batch(store, claim, version=1, advantage=advantage)
        for row, eid in enumerate(data.episode_ids):
            reward = data.rewards[row]
            assert data.advantages[eid] == pytest.approx(magnitude * (1 if reward else -1))
            assert float(data.batch.advantages[row]) == pytest.approx(data.advantages[eid])


async def test_a_rewritten_conversation_trains_as_sequences_of_its_own(db_url: str) -> None:
    """An episode of two segments (an agent rewrote its history: `TurnRecord.segment`) is two
    batch rows with the episode's advantage, each holding exactly its segment's tokens; the
    stored stream, the segment numbers and the trainer-logprob round trip stay the episode's."""
    from dataclasses import replace

    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("segments")
        task = await store.add_task(run, "calculator-agent", "k", {})
        group, episodes = await store.admit_group(run, task, "calculator-agent", 2)
        turns = {}
        for i, e in enumerate(episodes):
            await store.start_episode(e, "test")
            segments = [0, 0, 1, 1] if i == 0 else [0, 0, 0, 0]
            turns[e] = [replace(make_turn(10 * e + t), segment=s) for t, s in enumerate(segments)]
            for turn in turns[e]:
                await store.append_turn(e, turn)
            await store.finish_episode(e, float(i))
        assert await store.complete_group(group) == "ready"
        detail = await store.get_episode(episodes[0])
        assert [t.segment for t in detail.turns] == [0, 0, 1, 1]
        claim = await store.claim(run, "trainer", 1)
        data = await load_batch(store, claim, version=1)

        assert data.episode_ids == episodes
        assert data.row_episodes == [episodes[0], episodes[0], episodes[1]]
        assert data.batch.size == 3
        rewritten = turns[episodes[0]]
        for row, spans in enumerate([rewritten[:2], rewritten[2:], turns[episodes[1]]]):
            ids = [int(x) for t in spans for x in t.tokens.token_ids]
            assert data.lengths[row] == len(ids)
            assert data.batch.tokens[row, : len(ids)].tolist() == ids
            assert float(data.batch.advantages[row]) == data.advantages[data.rows_of_episodes()[row]]
        # The segment's own prompt opens its row: loss mask 0 there, as at an episode's start.
        assert data.batch.loss_mask[1, : rewritten[2].num_prompt_tokens].sum() == 0
        stream = await store.episode_tokens(episodes[0])
        assert len(stream) == data.lengths[0] + data.lengths[1]


async def test_a_stale_sibling_counts_in_the_baseline_and_trains_no_token(db_url: str) -> None:
    """A group whose short sibling finished long ago (every token sampled at version 1) and
    whose three long siblings ran on (a turn at version 1, then one at version 4), at version 5
    with max_staleness 2 (floor 3): the group is claimed, not dropped; the three fresh siblings
    train their recent tokens (the old turn masked, per token), with advantages computed over
    all four rewards; the stale sibling is no batch row, and the commit records it filtered as
    a stale sibling. Under `drop_group` (the rule before) the
    same group can only be filtered as stale."""
    from agent_rl.store.staleness import Siblings
    from trainer.advantages import grpo

    async def fill(store: Store, run: int) -> list[int]:
        task = await store.add_task(run, "calculator", "k", {})
        group, episodes = await store.admit_group(run, task, "calculator", 4)
        for i, e in enumerate(episodes):
            await store.start_episode(e, "test")
            await store.append_turn(e, make_turn(10 * e, version=1))
            if i:  # the long siblings: a later turn, by a newer policy
                await store.append_turn(e, make_turn(10 * e + 1, version=4))
            await store.finish_episode(e, [1.0, 0.0, 1.0, 0.0][i])
        assert await store.complete_group(group) == "ready"
        return episodes

    async with await migrated_store(db_url) as store:
        rules: dict[Siblings, int] = {}
        for rule in ("baseline", "drop_group"):
            rules[rule] = await store.ensure_run(rule)
        episodes = await fill(store, rules["baseline"])
        stale, fresh = episodes[0], episodes[1:]
        claim = await store.claim(rules["baseline"], "trainer", 1, min_version=3)
        assert claim.episode_ids == episodes
        data = await load_batch(store, claim, version=5, floor=3)

        assert data.episode_ids == fresh and data.batch.size == 3
        expected = grpo(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long))
        assert [data.advantages[e] for e in episodes] == pytest.approx(expected.tolist())
        assert data.advantages[stale] > 0 and data.advantages[fresh[1]] > 0
        for row, eid in enumerate(fresh):  # the old turn masked, the new one trained
            assert data.batch.advantages[row] == pytest.approx(data.advantages[eid])
            mask = data.batch.loss_mask[row, : data.lengths[row]].tolist()
            assert mask == [0.0] * 12 + [0.0] * 5 + [1.0] * 7
        assert data.stale_tokens == 3 * 7 and data.model_tokens == 3 * 7  # the siblings' own
        assert list(data.stale_siblings) == [stale]
        assert "stale sibling" in data.stale_siblings[stale]

        await store.commit(claim, rules["baseline"], step=1, version=6,
                           metrics={"episodes": len(data.episode_ids)},
                           advantages=data.advantages, stale_siblings=data.stale_siblings)
        rows = {e: (await store.get_episode(e)).episode for e in episodes}
        assert rows[stale].status == "filtered" and rows[stale].advantage == pytest.approx(
            data.advantages[stale])
        assert all(rows[e].status == "trained" for e in fresh)
        assert (await store.endings(rules["baseline"])).filtered == {"stale_sibling": 1}
        assert (await store.audit(rules["baseline"])).problems() == []

        await fill(store, rules["drop_group"])
        run = rules["drop_group"]
        assert (await store.claim(run, "t", 1, min_version=3, siblings="drop_group")).groups == []
        assert await store.filter_stale(run, 3, siblings="drop_group") == 1
        assert (await store.endings(run)).filtered == {"stale": 4}

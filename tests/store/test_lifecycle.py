"""Episode and group lifecycle: every episode ends in exactly one recorded state."""

from __future__ import annotations

import pytest

from agent_rl.kernel.errors import NotFoundError, StoreError
from agent_rl.store import Claim, EpisodeEnd, MessageRecord
from tests.store.helpers import completed_group, make_turn, migrated_store

pytestmark = pytest.mark.anyio


async def test_lifecycle_and_ledger(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r", {"lr": 1e-5})
        assert await store.ensure_run("r") == run
        assert await store.latest_version(run) == 0
        task = await store.add_task(run, "calculator", "7", {"question": "2+2"})
        group, eps = await store.admit_group(run, task, "calculator", 4, seeds=[1, 2, 3, 4])
        ledger = await store.ledger(run)
        assert (ledger.waiting, ledger.admitted) == (4, 4) and ledger.balances()

        for e in eps[:3]:
            await store.start_episode(e, "serve-1")
        with pytest.raises(StoreError, match="running, expected waiting"):
            await store.start_episode(eps[0], "serve-1")
        await store.append_turn(eps[0], make_turn(1, version=3))
        await store.append_turn(eps[0], make_turn(2, version=4))
        await store.add_messages(eps[0], [MessageRecord("tool", "final observation")])
        await store.finish_episode(eps[0], 1.0, {"exact": 1.0})
        await store.fail_episode(eps[1], "EnvError", "Traceback ...\nValueError: boom")
        await store.fail_episode(eps[3], "EngineError", "engine crashed")
        ledger = await store.ledger(run)
        assert (ledger.running, ledger.completed, ledger.failed) == (1, 1, 2) and ledger.balances()

        with pytest.raises(StoreError, match="still has 1 episodes in flight"):
            await store.complete_group(group)
        assert await store.groups_to_complete(run) == []
        await store.finish_episode(eps[2], 0.0)
        assert await store.groups_to_complete(run) == [group]
        assert await store.complete_group(group) == "ready"
        assert await store.complete_group(group) == "ready"  # idempotent

        detail = await store.get_episode(eps[0])
        e = detail.episode
        assert (e.status, e.reward, e.reward_details) == ("completed", 1.0, {"exact": 1.0})
        assert (e.num_turns, e.num_tokens, e.num_model_tokens) == (2, 24, 14)
        assert (e.min_version, e.max_version) == (3, 4)
        assert [t.span_start for t in detail.turns] == [0, 12]
        assert detail.messages[-1]["content"] == "final observation"
        assert len(detail.tool_calls) == 2
        failed = (await store.get_episode(eps[1])).episode
        assert failed.error_type == "EnvError" and "ValueError: boom" in failed.error_cause

        with pytest.raises(StoreError, match="not running"):
            await store.append_turn(eps[0], make_turn(3))
        with pytest.raises(NotFoundError):
            await store.get_episode(10_000)


async def test_final_turn_completes_the_episode_in_one_commit(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        task = await store.add_task(run, "calculator", "1", {})
        group, (episode,) = await store.admit_group(run, task, "calculator", 1)
        await store.start_episode(episode, "s")
        await store.append_turn(episode, make_turn(1, version=2))
        await store.append_turn(episode, make_turn(2, version=3), final_reward=0.75,
                                reward_details={"f1": 0.75})
        e = (await store.get_episode(episode)).episode
        assert (e.status, e.reward, e.reward_details, e.num_turns) == ("completed", 0.75, {"f1": 0.75}, 2)
        assert (e.min_version, e.max_version, e.num_model_tokens) == (2, 3, 14)
        assert e.finished_at is not None
        assert await store.complete_group(group) == "ready"


async def test_the_last_episodes_end_decides_its_group_in_the_same_transaction(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        task = await store.add_task(run, "calculator", "1", {})
        group, eps = await store.admit_group(run, task, "calculator", 3)
        for e in eps[:2]:
            await store.start_episode(e, "s")
        # Episodes still in flight (one running, one waiting): the group stays open.
        end = EpisodeEnd("completed", reward=0.5, turn=make_turn(1, version=2))
        assert await store.end_episode_and_group(eps[0], end, group) == (1, None)
        assert await store.groups_to_complete(run) == []
        await store.fail_episode(eps[2], "EnvError", "boom")
        assert await store.end_episode_and_group(
            eps[1], EpisodeEnd("completed", reward=1.0, turn=make_turn(2, version=5)), group) == (1, "ready")
        assert await store.complete_group(group) == "ready"  # decided once: as it is
        assert await store.groups_to_complete(run) == []
        e = (await store.get_episode(eps[0])).episode
        assert (e.status, e.reward, e.num_turns) == ("completed", 0.5, 1)
        ledger = await store.ledger(run)
        assert (ledger.completed, ledger.failed) == (2, 1) and ledger.balances()
        # The same as `complete_group` with the episodes' own rewards: the oldest of the
        # completed episodes' versions and the oldest of their newest ones.
        ready = await store.get_group(group)
        assert (ready["min_version"], ready["newest_version"]) == (2, 2)

        # A group whose episodes all failed is decided `failed`; an end the store refuses
        # (not running) decides nothing.
        group2, (only,) = await store.admit_group(run, task, "calculator", 1)
        assert await store.end_episode_and_group(only, EpisodeEnd("failed", error_type="EnvError",
                                                                  error_cause="boom"), group2) == (0, "failed")
        group3, (waiting,) = await store.admit_group(run, task, "calculator", 1)
        with pytest.raises(StoreError, match="expected running"):
            await store.end_episode_and_group(waiting, EpisodeEnd("completed", reward=1.0), group3)
        assert (await store.get_episode(waiting)).episode.status == "waiting"
        assert await store.groups_to_complete(run) == []


async def test_admission_can_start_the_groups_first_episode(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        group, eps = await store.admit_task(run, "calculator", "1", {}, 2, [1, 2], start="serve-1")
        first, second = [(await store.get_episode(e)).episode for e in eps]
        assert (first.status, first.owner, second.status) == ("running", "serve-1", "waiting")
        with pytest.raises(StoreError, match="running, expected waiting"):
            await store.start_episode(eps[0], "serve-2")
        ledger = await store.ledger(run)
        assert (ledger.running, ledger.waiting, ledger.admitted) == (1, 1, 2) and ledger.balances()


async def test_admission_refuses_a_served_version_past_the_bound_in_its_transaction(db_url: str) -> None:
    """`admit_task(served_version=...)` admits nothing, and returns None, while the served
    version is more than `max_staleness` behind the run's newest; within it, it admits."""
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        await store.commit(Claim("none", "trainer", 0.0, []), run, step=1, version=3)
        assert await store.admit_task(run, "calculator", "1", {}, 2, [1, 2], start="s",
                                      served_version=1, max_staleness=1) is None  # fmt: skip
        ledger = await store.ledger(run)
        assert ledger.admitted == 0 and await store.count_tasks(run, "calculator") == 0
        admitted = await store.admit_task(run, "calculator", "1", {}, 2, [1, 2], start="s",
                                          served_version=2, max_staleness=1)  # fmt: skip
        assert admitted is not None and len(admitted[1]) == 2
        assert (await store.ledger(run)).admitted == 2


async def test_filter_and_failed_groups(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        task = await store.add_task(run, "calculator", "1", {})
        group, eps = await store.admit_group(run, task, "calculator", 2)
        for e in eps:
            await store.start_episode(e, "s")
            await store.finish_episode(e, 1.0)
        assert await store.complete_group(group, filter_reason="zero variance") == "filtered"
        statuses = {(await store.get_episode(e)).episode.filter_reason for e in eps}
        assert statuses == {"zero variance"}

        group2, eps2 = await store.admit_group(run, task, "calculator", 2)
        for e in eps2:
            await store.fail_episode(e, "SandboxError", "sandbox died")
        assert await store.complete_group(group2) == "failed"
        ledger = await store.ledger(run)
        assert (ledger.filtered, ledger.failed) == (2, 2) and ledger.balances()


async def test_resolve_interrupted(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        task = await store.add_task(run, "calculator", "1", {})
        _, eps = await store.admit_group(run, task, "calculator", 3)
        await store.start_episode(eps[0], "dead")
        await store.start_episode(eps[1], "alive")
        await store.append_turn(eps[0], make_turn(5))
        assert await store.resolve_interrupted(owner="dead") == [eps[0]]
        e = (await store.get_episode(eps[0])).episode
        assert e.status == "failed" and e.error_cause.startswith("interrupted")
        assert e.num_turns == 1  # what was persisted stays for inspection
        assert await store.resolve_interrupted(stale_after_s=3600) == []
        assert await store.resolve_interrupted(stale_after_s=-1) == [eps[1]]


async def test_list_filters(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        _, eps = await completed_group(store, run, size=4, version=2)
        assert [e.id for e in await store.list_episodes(run_id=run)] == eps
        assert len(await store.list_episodes(min_reward=0.5)) == 2
        assert len(await store.list_episodes(max_reward=0.5)) == 2
        assert len(await store.list_episodes(status="completed", env_id="calculator")) == 4
        assert await store.list_episodes(env_id="other") == []
        assert len(await store.list_episodes(min_version=2, max_version=2)) == 4
        assert await store.list_episodes(min_version=3) == []
        page = await store.list_episodes(limit=2)
        rest = await store.list_episodes(after_id=page[-1].id)
        assert [e.id for e in page + rest] == eps


async def test_trainer_logprobs(db_url: str) -> None:
    import numpy as np

    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        _, eps = await completed_group(store, run, size=1)
        assert await store.trainer_logprobs(eps[0]) is None
        values = np.linspace(-3, 0, 12, dtype=np.float32)
        await store.record_trainer_logprobs(eps[0], values)
        assert np.array_equal(await store.trainer_logprobs(eps[0]), values)
        with pytest.raises(StoreError, match="12 tokens"):
            await store.record_trainer_logprobs(eps[0], values[:3])


async def test_nul_in_generated_text_is_stored(db_url: str) -> None:
    """A model can generate NUL; PostgreSQL text cannot hold it. The turn is stored all the
    same (NUL as U+FFFD in text; the token ids stay exact)."""
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        task = await store.add_task(run, "calculator", "1", {})
        _, (episode,) = await store.admit_group(run, task, "calculator", 1)
        await store.start_episode(episode, "s")
        turn = make_turn(1)
        turn.messages[1].content = "a\x00b"
        turn.tool_calls[0].output = "\x00"
        await store.append_turn(episode, turn, final_reward=1.0)
        detail = await store.get_episode(episode)
        assert detail.messages[1]["content"] == "a\ufffdb"
        assert detail.tool_calls[0]["output"] == "\ufffd"
        assert await store.episode_tokens(episode) == turn.tokens


async def test_an_evaluation_runs_ended_episodes_are_scored_not_in_flight(db_url: str) -> None:
    """No trainer consumes an evaluation run: its completed episodes are `scored` in the ledger
    (its own and all runs'), never in flight or awaiting training, and the ledger balances."""
    async with await migrated_store(db_url) as store:
        train = await store.ensure_run("t")
        run = await store.ensure_run("t-eval-v0", kind="eval", evaluates_run_id=train,
                                     evaluates_version=0)  # fmt: skip
        task = await store.add_task(run, "calculator", "7", {"question": "2+2"})
        _, eps = await store.admit_group(run, task, "calculator", 4, seeds=[1, 2, 3, 4])
        for e in eps[:3]:
            await store.start_episode(e, "eval-1")
        await store.finish_episode(eps[0], 1.0)
        await store.finish_episode(eps[1], 0.0)
        await store.fail_episode(eps[2], "EngineError", "engine crashed")
        ledger = await store.ledger(run)
        assert (ledger.scored, ledger.completed, ledger.failed, ledger.waiting) == (2, 0, 1, 1)
        assert ledger.in_flight == 0 and ledger.balances() and ledger.mean_reward == 0.5
        shown = ledger.as_dict()
        assert (shown["scored"], shown["in_flight"], shown["awaiting_training"]) == (2, 0, 0)
        await completed_group(store, train, size=2)  # a training run's ended episodes await
        everything = await store.ledger()
        assert (everything.scored, everything.completed) == (2, 2) and everything.balances()
        assert (await store.audit(run)).problems(finished=False) == []


async def test_held_turns_land_in_order_in_one_write_and_with_the_end(db_url: str) -> None:
    """`append_turns` (an agent's held turns) writes several turns in order, in one
    transaction; an end's `unwritten` turns land before its `turn`, in the end's transaction.
    The stored episode is the same as one written a turn at a time."""
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        task = await store.add_task(run, "calculator", "1", {})
        _, (held, one_by_one) = await store.admit_group(run, task, "calculator", 2)
        for e in (held, one_by_one):
            await store.start_episode(e, "s")
        turns = [make_turn(i, version=i) for i in range(1, 6)]
        with pytest.raises(ValueError, match="at least one turn"):
            await store.append_turns(held, [])
        assert await store.append_turns(held, turns[:2], durable=False) == 1
        assert await store.end_episode(held, EpisodeEnd("completed", reward=1.0, turn=turns[4],
                                                        unwritten=turns[2:4])) == 5  # fmt: skip
        for t in turns[:4]:
            await store.append_turn(one_by_one, t)
        await store.end_episode(one_by_one, EpisodeEnd("completed", reward=1.0, turn=turns[4]))
        a, b = await store.get_episode(held), await store.get_episode(one_by_one)
        assert [t.index for t in a.turns] == list(range(5))
        assert [(t.span_start, t.num_tokens) for t in a.turns] == [(t.span_start, t.num_tokens) for t in b.turns]
        ta, tb = await store.episode_tokens(held), await store.episode_tokens(one_by_one)
        assert (ta.token_ids == tb.token_ids).all() and (ta.versions == tb.versions).all()
        assert (a.episode.min_version, a.episode.max_version) == (1, 5)
        # An ended episode refuses held turns as it refuses one.
        with pytest.raises(StoreError, match="not running"):
            await store.append_turns(held, [make_turn(9)])
        assert (await store.get_episode(held)).episode.num_turns == 5

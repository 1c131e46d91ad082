"""The episode lifecycle as a state machine (hypothesis): random interleavings of everything the
scheduler, the runners, the reaper and the trainers do to the store, on SQLite and PostgreSQL,
with the store's own bookkeeping checked after every step: the ledger balances (admitted is
counted from the groups, not the rows), no episode is trained twice, and no open group is left
with only terminal episodes once the process that ended its last one has moved on."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sqlalchemy import update

from agent_rl.kernel.errors import LeaseLostError, StoreError
from agent_rl.store import Claim, EpisodeEnd, Store
from agent_rl.store.models import GroupRow
from tests.store.helpers import make_turn, migrated_store

ENDINGS = ["completed", "completed", "truncated", "failed"]  # mostly trainable


class Lifecycle(RuleBasedStateMachine):
    """One run in a fresh store; the machine plays scheduler, runners, reaper and trainers."""

    url: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.Runner()
        self.store: Store = self.loop.run(migrated_store(self.url))
        self.run_id = self.call(self.store.ensure_run(f"sm-{uuid.uuid4().hex[:8]}"))
        self.waiting: list[int] = []
        self.running: dict[int, str] = {}  # episode -> owner
        self.group_of: dict[int, int] = {}
        self.open_groups: set[int] = set()
        self.claims: list[Claim] = []
        self.version = 0
        self.trained: set[int] = set()

    def call(self, coro: Any) -> Any:
        return self.loop.run(coro)

    def teardown(self) -> None:
        self.call(self.store.close())
        self.loop.close()

    def _decide_if_done(self, group: int) -> None:
        """What the scheduler does once the last episode of a group it runs has ended."""
        if group in self.open_groups and not any(
            self.group_of[e] == group for e in [*self.waiting, *self.running]
        ):
            self.call(self.store.complete_group(group))
            self.open_groups.discard(group)

    @rule(size=st.integers(1, 2))
    def admit(self, size: int) -> None:
        task = self.call(self.store.add_task(self.run_id, "env", uuid.uuid4().hex, {}))
        group, episodes = self.call(self.store.admit_group(self.run_id, task, "env", size))
        self.open_groups.add(group)
        self.waiting += episodes
        self.group_of.update({e: group for e in episodes})

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), owner=st.sampled_from(["serve-a", "serve-b"]))
    def start(self, data: st.DataObject, owner: str) -> None:
        episode = data.draw(st.sampled_from(self.waiting))
        self.call(self.store.start_episode(episode, owner))
        self.waiting.remove(episode)
        self.running[episode] = owner

    @precondition(lambda self: self.running)
    @rule(data=st.data(), behind=st.integers(0, 3))
    def append_turn(self, data: st.DataObject, behind: int) -> None:
        episode = data.draw(st.sampled_from(sorted(self.running)))
        version = max(self.version - behind, 0)
        self.call(self.store.append_turn(episode, make_turn(episode, version=version)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), how=st.sampled_from(ENDINGS), with_turn=st.booleans(),
          reward=st.sampled_from([0.0, 1.0]))  # fmt: skip
    def end(self, data: st.DataObject, how: str, with_turn: bool, reward: float) -> None:
        episode = data.draw(st.sampled_from(sorted(self.running)))
        turn = make_turn(episode, version=self.version) if with_turn else None
        if how == "failed":
            end = EpisodeEnd("failed", error_type="EngineError", error_cause="engine died")
        elif how == "truncated":
            end = EpisodeEnd("completed", 0.0, {"truncated": "max_turns"}, turn=turn)
        else:
            end = EpisodeEnd("completed", reward, {"terminated": True}, turn=turn)
        self.call(self.store.end_episode(episode, end))
        del self.running[episode]
        self._decide_if_done(self.group_of[episode])

    @precondition(lambda self: self.running)
    @rule(owner=st.sampled_from(["serve-a", "serve-b"]), resume=st.booleans())
    def process_dies(self, owner: str, resume: bool) -> None:
        """A serve dies; another's reaper resumes (back to waiting) or fails its episodes."""
        dead = [e for e, o in self.running.items() if o == owner]
        if resume:
            back = self.call(self.store.resume_interrupted(
                owner=owner, run_id=self.run_id, env_ids=["env"], max_resumes=5))
            assert set(back) <= set(dead)
            self.waiting += back
            for e in back:
                del self.running[e]
            dead = [e for e in dead if e not in back]
        failed = self.call(self.store.resolve_interrupted(owner=owner, run_id=self.run_id))
        assert sorted(failed) == sorted(dead)
        for e in failed:
            del self.running[e]
        for group in {self.group_of[e] for e in failed}:
            self._decide_if_done(group)

    @rule(groups=st.integers(1, 3), eta=st.sampled_from([None, 0, 2]))
    def claim(self, groups: int, eta: int | None) -> None:
        floor = None if eta is None else self.version - eta
        claim = self.call(self.store.claim(self.run_id, f"trainer-{len(self.claims)}", groups,
                                           min_version=floor, lease_s=300.0))
        if claim.groups:
            self.claims.append(claim)

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def trainer_stalls_past_its_lease(self, data: st.DataObject) -> None:
        """Its lease runs out (another trainer may now claim its groups); it may still commit."""
        claim = data.draw(st.sampled_from(self.claims))
        self.call(self.store.run_in_transaction(
            lambda conn: conn.execute(
                update(GroupRow).where(GroupRow.claim_id == claim.claim_id)
                .values(lease_expires_at=0.0)
            ), write=True,
        ))

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        claim = data.draw(st.sampled_from(self.claims))
        self.claims.remove(claim)
        self.call(self.store.release(claim))

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        claim = data.draw(st.sampled_from(self.claims))
        self.claims.remove(claim)
        try:
            # As the trainer does: the step says how many episodes it trained on.
            self.call(self.store.commit(claim, self.run_id, step=self.version + 1,
                                        version=self.version + 1,
                                        metrics={"episodes": len(claim.episode_ids)}))
        except LeaseLostError:
            return  # another trainer took a group after the lease expired: nothing written
        self.version += 1
        assert not self.trained & set(claim.episode_ids), "an episode was trained twice"
        self.trained |= set(claim.episode_ids)

    @rule(eta=st.integers(0, 3))
    def filter_stale(self, eta: int) -> None:
        self.call(self.store.filter_stale(self.run_id, self.version - eta))

    @invariant()
    def the_store_accounts_for_every_episode(self) -> None:
        audit = self.call(self.store.audit(self.run_id))
        ledger = audit.ledger
        assert ledger.balances(), ledger
        assert audit.lost == 0 and audit.failed_without_cause == 0
        assert audit.trained_by_steps == ledger.trained == len(self.trained)
        assert ledger.waiting == len(self.waiting) and ledger.running == len(self.running)
        assert self.call(self.store.groups_to_complete(self.run_id)) == []


@pytest.mark.slow
def test_lifecycle_state_machine(db_url: str) -> None:
    class Machine(Lifecycle):
        url = db_url

    Machine.TestCase.settings = settings(
        max_examples=80, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    Machine.TestCase().runTest()


def test_ending_twice_is_refused(db_url: str) -> None:
    async def go() -> None:
        async with await migrated_store(db_url) as store:
            run = await store.ensure_run("twice")
            task = await store.add_task(run, "env", "k", {})
            _, (episode,) = await store.admit_group(run, task, "env", 1)
            await store.start_episode(episode, "serve")
            end = EpisodeEnd("completed", 1.0, turn=make_turn(1))
            assert await store.end_episode(episode, end) == 1
            with pytest.raises(StoreError, match="is completed"):
                await store.end_episode(episode, end)
            detail = await store.get_episode(episode)
            assert len(detail.turns) == 1  # the refused end wrote nothing, its turn included

    asyncio.run(go())

"""Trainers consuming the store: exclusive claims across processes, leases, atomic commits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent_rl.kernel.errors import LeaseLostError, StoreError
from tests.store.helpers import completed_group, migrated_store

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


async def test_two_processes_never_claim_the_same_group(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("claims")
        groups = [(await completed_group(store, run, size=2))[0] for _ in range(40)]
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.store._claimer", db_url, f"trainer-{i}"],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    results = [json.loads(p.communicate(timeout=240)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    a, b = (set(r) for r in results)
    assert not a & b, f"groups trained twice: {sorted(a & b)}"
    assert a | b == set(groups)
    async with await migrated_store(db_url) as store:
        ledger = await store.ledger(run)
        assert ledger.trained == 80 and ledger.balances()
        versions = [v["version"] for v in await store.policy_versions(run)]
        assert versions == list(range(len(versions)))


async def test_expired_lease_returns_and_old_claim_cannot_commit(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        g1, _ = await completed_group(store, run)
        g2, _ = await completed_group(store, run)
        old = await store.claim(run, "t1", 10, lease_s=-1)  # already expired
        assert old.group_ids == [g1, g2]
        new = await store.claim(run, "t2", 1, lease_s=60)
        assert new.group_ids == [g1]
        with pytest.raises(LeaseLostError):
            await store.commit(old, run, step=1, version=1)
        # All or nothing: the failed commit recorded neither the version nor any trained episode.
        assert await store.latest_version(run) == 0
        assert (await store.ledger(run)).trained == 0
        with pytest.raises(LeaseLostError):
            await store.renew(old)
        await store.commit(new, run, step=1, version=1, advantages={new.episode_ids[0]: 0.5})
        ledger = await store.ledger(run)
        assert ledger.trained == 2 and ledger.completed == 2
        e = (await store.get_episode(new.episode_ids[0])).episode
        assert (e.status, e.trained_step, e.advantage) == ("trained", 1, 0.5)
        # The other group is still held by the expired claim: a new claim takes it back.
        again = await store.claim(run, "t2", 10)
        assert again.group_ids == [g2]


async def test_release_min_version_and_monotonic_versions(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        old_group, _ = await completed_group(store, run, version=0)
        new_group, _ = await completed_group(store, run, version=5)
        claim = await store.claim(run, "t", 10, min_version=3)
        assert claim.group_ids == [new_group]
        await store.release(claim)
        claim = await store.claim(run, "t", 10)
        assert claim.group_ids == [old_group, new_group]
        await store.commit(claim, run, step=7, version=7, metrics={"loss": 0.25})
        with pytest.raises(StoreError, match="not newer"):
            await store.commit(await store.claim(run, "t", 1), run, step=8, version=7)
        assert (await store.policy_versions(run))[-1]["metrics"] == {"loss": 0.25}
        assert (await store.claim(run, "t", 10)).groups == []


async def test_the_group_nearest_to_going_stale_is_claimed_first(db_url: str) -> None:
    """Earliest deadline first: with more groups ready than a step takes, the one sampled by the
    older version (the first to fall below a rising floor) is claimed before a fresher one that
    became ready earlier; groups of one version stay in ready order."""
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("r")
        fresh, _ = await completed_group(store, run, version=5)
        older, _ = await completed_group(store, run, version=4)
        fresh_later, _ = await completed_group(store, run, version=5)
        claim = await store.claim(run, "t", 1, min_version=4)
        assert claim.group_ids == [older]
        await store.release(claim)
        claim = await store.claim(run, "t", 3, min_version=4)
        assert sorted(claim.group_ids) == sorted([older, fresh, fresh_later])
        await store.release(claim)
        claim = await store.claim(run, "t", 2, min_version=4)
        assert set(claim.group_ids) == {older, fresh}

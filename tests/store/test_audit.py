"""The audit (the quickstart's and the chaos run's end-of-run check) and the stale-group filter."""

from __future__ import annotations

import pytest
from tests.store.helpers import completed_group, make_turn, migrated_store

pytestmark = pytest.mark.anyio


async def test_audit_of_a_clean_run_has_no_problems(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("audit")
        await completed_group(store, run)
        await completed_group(store, run)
        claim = await store.claim(run, "t", 1)
        await store.commit(claim, run, step=1, version=1, metrics={"episodes": 2})
        task = await store.add_task(run, "calculator", "f", {})
        group, (a, b) = await store.admit_group(run, task, "calculator", 2)
        for e in (a, b):
            await store.start_episode(e, "serve-x")
        await store.fail_episode(a, "EngineError", "engine died")
        await store.append_turn(b, make_turn(b))
        await store.finish_episode(b, 1.0)
        await store.complete_group(group)
        audit = await store.audit(run)
        assert audit.problems() == []
        assert (audit.ledger.trained, audit.ledger.failed, audit.ledger.completed) == (2, 1, 3)
        assert audit.trained_twice == 0


async def test_audit_names_what_is_wrong(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("audit-bad")
        await completed_group(store, run)
        claim = await store.claim(run, "t", 1)
        # A step that claims to have trained more episodes than are marked trained: the
        # signature of an episode trained twice.
        await store.commit(claim, run, step=1, version=1, metrics={"episodes": 4})
        task = await store.add_task(run, "calculator", "g", {})
        _, (e, _) = await store.admit_group(run, task, "calculator", 2)
        await store.start_episode(e, "serve-x")
        audit = await store.audit(run)
        assert audit.trained_twice == 2
        problems = " | ".join(audit.problems())
        assert "2 episodes not in a terminal state" in problems  # one running, one waiting
        assert "steps trained on 4 episodes but 2 are marked trained" in problems
        assert audit.problems(finished=False) == [p for p in audit.problems() if "terminal" not in p]


async def test_stale_ready_groups_are_filtered_with_the_reason(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        run = await store.ensure_run("stale")
        old, old_eps = await completed_group(store, run, version=1)
        fresh, _ = await completed_group(store, run, version=5)
        assert await store.filter_stale(run, 4) == 1
        group = await store.get_group(old)
        assert group["status"] == "filtered" and "stale" in group["filter_reason"]
        e = (await store.get_episode(old_eps[0])).episode
        assert e.status == "filtered" and "policy version 1" in (e.filter_reason or "")
        assert (await store.get_group(fresh))["status"] == "ready"
        assert await store.filter_stale(run, 4) == 0
        assert (await store.audit(run)).problems() == []


async def test_audit_ignores_other_runs(db_url: str) -> None:
    async with await migrated_store(db_url) as store:
        a = await store.ensure_run("a")
        b = await store.ensure_run("b")
        await completed_group(store, a)
        claim = await store.claim(a, "t", 1)
        await store.commit(claim, a, step=1, version=1, metrics={"episodes": 2})
        assert (await store.audit(b)).ledger.admitted == 0
        assert (await store.audit(a)).problems() == []


async def test_concurrent_ensure_run_creates_one_run(db_url: str) -> None:
    # Two serves, a trainer and the quickstart all ensure the run at start (a race that failed
    # on PostgreSQL with a unique violation in the chaos run).
    import anyio

    stores = [await migrated_store(db_url) for _ in range(6)]
    ids: list[int] = []
    try:
        async with anyio.create_task_group() as tg:
            for s in stores:
                tg.start_soon(lambda s=s: _append(ids, s.ensure_run("raced")))
    finally:
        for s in stores:
            await s.close()
    assert len(set(ids)) == 1 and len(ids) == 6
    async with await migrated_store(db_url) as store:
        assert [v["version"] for v in await store.policy_versions(ids[0])] == [0]


async def _append(out: list[int], coro) -> None:  # type: ignore[no-untyped-def]
    out.append(await coro)

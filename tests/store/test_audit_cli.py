"""`agent-rl db audit` as a user runs it, on SQLite and PostgreSQL: zero on a clean store,
non-zero with the problem named on one with a lost episode and one trained twice (both
planted the way they would happen: a row gone from a decided group, a step that reports
training episodes no group gave it)."""

from __future__ import annotations

import json

import anyio
import pytest
from sqlalchemy import text

from tests.store.helpers import completed_group, migrated_store
from tests.store.test_cli import cli


def fill(url: str) -> dict[str, int]:
    async def go() -> dict[str, int]:
        async with await migrated_store(url) as store:
            clean = await store.ensure_run("clean")
            await completed_group(store, clean)
            claim = await store.claim(clean, "t", 1)
            await store.commit(claim, clean, step=1, version=1, metrics={"episodes": 2})
            lost = await store.ensure_run("lost")
            _, eps = await completed_group(store, lost)
            twice = await store.ensure_run("twice")
            await completed_group(store, twice)
            claim = await store.claim(twice, "t", 1)
            await store.commit(claim, twice, step=1, version=1, metrics={"episodes": 2})
            empty = await store.claim(twice, "t", 1)  # nothing left, yet the step says 2
            await store.commit(empty, twice, step=2, version=2, metrics={"episodes": 2})
            with store.db.begin() as conn:
                conn.execute(text("DELETE FROM episodes WHERE id = :e"), {"e": eps[1]})
            return {"clean": clean, "lost": lost, "twice": twice}

    return anyio.run(go)


@pytest.mark.slow  # five CLI processes per database
def test_db_audit_exit_status_names_the_problem(db_url: str) -> None:
    fill(db_url)
    clean = cli("db", "audit", "--run", "clean", url=db_url)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "  ok" in clean.stdout and "problem:" not in clean.stdout

    lost = cli("db", "audit", "--run", "lost", url=db_url)
    assert lost.returncode == 1 and "1 admitted episodes lost" in lost.stdout, lost.stdout

    twice = cli("db", "audit", "--run", "twice", url=db_url)
    assert twice.returncode == 1, twice.stdout
    assert "steps trained on 4 episodes but 2 are marked trained" in twice.stdout

    every = cli("db", "audit", "--json", url=db_url)
    assert every.returncode == 1
    rows = {r["run"]: r for r in map(json.loads, every.stdout.splitlines())}
    assert rows["clean"]["problems"] == [] and rows["twice"]["trained_twice"] == 2
    assert rows["lost"]["lost"] == 1

    missing = cli("db", "audit", "--run", "no-such-run", url=db_url)
    assert missing.returncode == 1 and "no run named 'no-such-run'" in missing.stderr
    assert "Traceback" not in missing.stderr

"""Crash safety: SIGKILL a process writing episodes; nothing committed is lost or half-visible."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent_rl.store import TokenArrays
from tests.store._writer import TURNS, turn_seed
from tests.store.helpers import make_turn, migrated_store

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


async def test_sigkill_while_writing(db_url: str) -> None:
    await (await migrated_store(db_url)).close()
    writer = subprocess.Popen([sys.executable, "-m", "tests.store._writer", db_url], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    finished = []
    assert writer.stdout is not None
    while len(finished) < 8:
        line = writer.stdout.readline()
        assert line, "the writer exited early"
        finished.append(int(line))
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)

    async with await migrated_store(db_url) as store:
        run = await store.run_id("crash")
        episodes = await store.list_episodes(run_id=run, limit=10_000)
        assert {e.id for e in episodes if e.status == "completed"} >= set(finished)
        for e in episodes:
            detail = await store.get_episode(e.id)
            # A turn is visible whole (tokens, messages, tool call, counters) or not at all.
            assert len(detail.turns) == e.num_turns
            assert len(detail.messages) == 2 * e.num_turns
            assert len(detail.tool_calls) == e.num_turns
            tokens = await store.episode_tokens(e.id)
            assert len(tokens) == e.num_tokens
            expected = TokenArrays.concat(
                [make_turn(turn_seed(e.id, k), n_completion=400).tokens for k in range(e.num_turns)]
            )
            assert tokens == expected
            if e.status == "completed":
                assert e.num_turns == TURNS and e.reward == 1.0
            elif e.status == "waiting":
                # Killed between its admission and its start: admitted, never run.
                assert e.num_turns == 0
            else:
                assert e.status == "running"
        interrupted = await store.resolve_interrupted(owner="writer")
        assert interrupted == [e.id for e in episodes if e.status == "running"]
        ledger = await store.ledger(run)
        assert ledger.running == 0 and ledger.balances()
        assert ledger.failed == len(interrupted)

"""The compute audit's arithmetic on a store filled with known timings (SQLite and PostgreSQL).

Episodes, turns and tool calls are written through the store's lifecycle calls; their times are
then set to a schedule worked out by hand (the store stamps the real clock), and the trainer's
spans and the engine samples are recorded as the trainer and serve record them. Every number
the audit reports is checked against the schedule, and the shares against each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import update

from agent_rl.store import EngineLoad, EpisodeEnd, Span, Store, ToolCallRecord
from agent_rl.store.audit import DecodeTable, compute_audit
from agent_rl.store.models import EpisodeRow, PolicyVersionRow, TurnRow
from tests.store.helpers import make_turn, migrated_store

pytestmark = pytest.mark.anyio
T0 = 1_000_000.0

# episode: (created, started, finished, turn start, turn end, tool seconds, completion tokens)
SCHEDULE = {
    "e1": (0, 0, 40, 0, 30, 10.0, 7),
    "e2": (0, 10, 60, 10, 50, 0.0, 20),
    "e3": (50, 70, 80, 70, 78, 3.0, 3),
    "e4": (5, 5, 15, 5, 12, 0.0, 4),
}
TRAINER = [("wait", 0, 20), ("step", 20, 30), ("export", 30, 32), ("sync", 32, 35),
           ("wait", 35, 65), ("step", 65, 75), ("wait", 75, 90), ("step", 95, 100),
           ("eval", -50, -10)]  # an evaluation before: its own runs, not this run's time


async def _fill(store: Store) -> int:
    run = await store.ensure_run("timed")
    ids = {}
    for name, group in (("e1", 0), ("e3", 1)):
        task = await store.add_task(run, "calculator", name, {})
        _, episodes = await store.admit_group(run, task, "calculator", 2)
        pair = ("e1", "e2") if group == 0 else ("e3", "e4")
        ids.update(dict(zip(pair, episodes)))
    for name, eid in ids.items():
        *_, tool_s, completion = SCHEDULE[name]
        await store.start_episode(eid, "test")
        turn = make_turn(eid, n_prompt=5, n_completion=completion)
        turn.tool_calls = [ToolCallRecord("calc", "{}", duration_s=tool_s)]
        if name == "e4":
            await store.append_turn(eid, turn)
            await store.end_episode(eid, EpisodeEnd("failed", error_type="EngineError",
                                                    error_cause="EngineError: engine died"))
        else:
            await store.end_episode(eid, EpisodeEnd("completed", reward=1.0, turn=turn))

    def schedule(conn) -> None:  # type: ignore[no-untyped-def]
        for name, eid in ids.items():
            c, s, f, ts, tf, _, _ = SCHEDULE[name]
            conn.execute(update(EpisodeRow).where(EpisodeRow.id == eid).values(
                created_at=T0 + c, started_at=T0 + s, finished_at=T0 + f))
            conn.execute(update(TurnRow).where(TurnRow.episode_id == eid).values(
                started_at=T0 + ts, finished_at=T0 + tf))
        for name in ("e1", "e2"):
            conn.execute(update(EpisodeRow).where(EpisodeRow.id == ids[name])
                         .values(status="trained", trained_step=1))
        conn.execute(update(EpisodeRow).where(EpisodeRow.id == ids["e3"]).values(
            status="filtered", filter_reason="zero reward variance in the group"))
        conn.execute(PolicyVersionRow.__table__.insert().values(
            run_id=run, version=1, trainer_step=1, created_at=T0 + 30,
            metrics={"stale_tokens": 2, "episodes": 2}))

    await store.run_in_transaction(schedule, write=True)
    await store.record_timings(run, [Span(k, T0 + a, T0 + b, "trainer-1") for k, a, b in TRAINER])
    await store.record_engine_samples(run, [
        EngineLoad("http://e0", T0 + t, 2 if (t < 60 or 70 <= t < 80) else 0, 0, 0.1 * (t < 60),
                   prefill_tokens_total=float(t if t < 50 else t - 50))  # restarted at 50
        for t in range(0, 101, 10)
    ])  # fmt: skip
    return run


async def test_shares_add_up_to_the_schedule(db_url: str, tmp_path: Path) -> None:
    async with await migrated_store(db_url) as store:
        run = await _fill(store)
        timeline = await store.run_timeline(run)
    audit = compute_audit(timeline)
    s = audit.shares
    assert s.wall_s == pytest.approx(100.0)
    # Worked out by hand from SCHEDULE and TRAINER (rollout busy: [0, 60] and [70, 80]).
    expected = {"waiting/busy": 0.50, "stepping/busy": 0.15, "syncing/busy": 0.05,
                "waiting/idle": 0.15, "stepping/idle": 0.10, "other/idle": 0.05}
    for cell, share in s.cells.items():
        assert share == pytest.approx(expected.get(cell, 0.0), abs=1e-9), cell
    assert sum(s.cells.values()) == pytest.approx(1.0, abs=1e-12)
    assert s.rollout_busy == pytest.approx(0.70)
    assert (s.trainer_stepping, s.trainer_syncing, s.trainer_waiting, s.trainer_other) == (
        pytest.approx(0.25), pytest.approx(0.05), pytest.approx(0.65), pytest.approx(0.05))
    assert s.trainer_stepping + s.trainer_syncing + s.trainer_waiting + s.trainer_other == (
        pytest.approx(1.0))
    assert s.stepping_while_rollout == pytest.approx(0.15)

    et = audit.episode_time
    assert (et.episodes, et.wall_s, et.generation_s, et.tool_s, et.queued_s, et.other_s) == (
        4, pytest.approx(140), pytest.approx(72), pytest.approx(13), pytest.approx(30),
        pytest.approx(25))
    assert et.generation_s + et.tool_s + et.queued_s + et.other_s == pytest.approx(et.wall_s)

    tail = audit.tail
    assert tail.duration_s["max"] == pytest.approx(50) and tail.duration_s["p50"] == pytest.approx(25)
    assert tail.turns["max"] == 1 and tail.tokens["max"] == 25  # e2: 5 prompt + 20 completion
    assert tail.slowest_10pct_token_share == pytest.approx(20 / 34)  # e2 is the slowest

    w = audit.waste
    assert (w.generated_tokens, w.trained_tokens, w.never_trained, w.stale_masked) == (34, 27, 0, 2)
    assert w.filtered == {"zero_variance": 3} and w.failed == {"EngineError": 4}
    assert w.trained_tokens + w.wasted == w.generated_tokens

    tp = audit.throughput
    assert tp.generated_tokens == 34 and tp.generated_per_s == pytest.approx(34 / 70)
    (engine,) = tp.engines
    assert engine.decode_busy == pytest.approx(0.70) and engine.mean_running == pytest.approx(2)
    assert tp.decode_tok_s_per_engine == pytest.approx(34 / 70)
    # prefill counter 0..40, restart, 0..50: 40 + 0 + 50 = 90 tokens (the drop counts from 0)
    assert engine.prefilled_tokens == pytest.approx(90) and tp.prefilled_per_s == pytest.approx(90 / 70)
    assert audit.verdict.startswith("rollout-bound: the trainer waited 65% of the run")
    assert tp.reference is None

    table = tmp_path / "decode.json"
    table.write_text(json.dumps({"tok_s": {"engine": {
        "256": {"1": 0.5, "8": 4.0}, "1024": {"1": 0.1, "8": 1.0}}}}))
    with_table = compute_audit(timeline, DecodeTable.load(table))
    ref = with_table.throughput.reference
    assert ref is not None and (ref["length"], ref["concurrency"]) == (256, 1)
    assert ref["ratio"] == pytest.approx((34 / 70) / 0.5)
    assert "engines decoded at 97% of the throughput measured for 256 tokens at concurrency 1" in (
        with_table.verdict)
    assert json.loads(json.dumps(with_table.as_dict()))["shares"]["cells"] == pytest.approx(s.cells)



@pytest.mark.slow  # two CLI processes
def test_cli_prints_the_audit_read_from_the_store(tmp_path: Path) -> None:
    import anyio

    from tests.store.test_cli import cli

    url = f"sqlite:///{tmp_path / 'timed.db'}"

    async def go() -> None:
        async with await migrated_store(url) as store:
            await _fill(store)

    anyio.run(go)
    text = cli("audit", "--run", "timed", url=url)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "run timed (train): 100 s of wall clock" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[:9] if "%" in line}
    assert rows["waiting"] == ["50.0%", "15.0%", "65.0%"]
    assert rows["total"] == ["70.0%", "30.0%", "100.0%"]
    assert "decode busy 70% of 11 samples" in out
    engine_line = next(line for line in out.splitlines() if "decode busy" in line)
    assert "SGLang" not in engine_line  # the engine reported no throughput of its own: no "-"
    assert "generation 51.4% · tools 9.3% · queued 21.4% · other 17.9%" in out
    assert "the slowest 10% of episodes produced 58.8% of the generated tokens" in out
    assert "filtered 3 (zero_variance 3); failed 4 (EngineError 4)" in out
    assert "verdict: rollout-bound: the trainer waited 65% of the run" in out
    as_json = cli("audit", "--run", "timed", "--json", url=url)
    data = json.loads(as_json.stdout)
    assert sum(data["shares"]["cells"].values()) == pytest.approx(1.0)
    assert data["waste"]["wasted"] == 7
    missing = cli("audit", "--run", "nope", url=url)
    assert missing.returncode == 1 and "no run named 'nope'" in missing.stderr


async def test_a_run_dominated_by_zero_variance_waste_gets_a_verdict_that_names_it(
    db_url: str,
) -> None:
    """The schedule above, but the trained group's rewards were all equal too (filtered as
    zero variance, as serve filters them): 30 of the 34 generated tokens were never trained for
    that, the largest waste, so the verdict names it with its share and the advice that fits,
    and still says what bounded the time. (Above, at 3 of 34 tokens, it does not.)"""
    async with await migrated_store(db_url) as store:
        run = await _fill(store)
        await store.run_in_transaction(lambda conn: conn.execute(
            update(EpisodeRow).where(EpisodeRow.run_id == run, EpisodeRow.status == "trained")
            .values(status="filtered", filter_reason="zero reward variance (all 1)")), write=True)
        audit = compute_audit(await store.run_timeline(run))
    assert audit.waste.filtered == {"zero_variance": 30}
    assert audit.verdict.startswith(
        "waste-bound: 88% of the generated tokens were in groups whose rewards were all equal")
    assert "besides, rollout-bound: the trainer waited 65% of the run" in audit.verdict
    assert "rollout.task_selection" in audit.advice and "rollout.group_size" in audit.advice

"""Where a run's time went, as the store records it: trainer timings, engine load samples, and
everything the audit reads of the episodes, turns and tool calls.

Writes: the trainer records each step's spans (`wait` for data, `step`, `export`, `sync`) with
`record_timings`; serve records what SGLang's `/v1/loads` said of each engine with
`record_engine_samples`. Both are bookkeeping (not durable at commit: a power failure loses the
last samples, never an episode). Read: `run_timeline` gathers one run's facts in one
transaction, and `agent_rl.store.audit` turns them into the audit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, case, func, insert, select

from agent_rl.kernel.errors import NotFoundError
from agent_rl.store.base import StoreBase, read, write
from agent_rl.store.models import (
    EngineSampleRow,
    EpisodeRow,
    PolicyVersionRow,
    RunRow,
    TimingRow,
    ToolCallRow,
    TurnRow,
)
from agent_rl.store.queries import FILTER_KIND

TIMING_KINDS = ("wait", "step", "export", "sync", "eval")
"""What a timing span says its process was doing: the trainer waiting for data (idle), taking
an optimizer step, exporting weights, having the engines load them; an evaluation."""


@dataclass
class Span:
    kind: str
    started_at: float
    finished_at: float
    source: str = ""


@dataclass
class EngineLoad:
    """One sample of one engine (`/v1/loads`, `include=core`)."""

    engine: str
    sampled_at: float
    running: int
    waiting: int
    token_usage: float | None = None
    gen_tokens_per_s: float | None = None
    prefill_tokens_total: float | None = None
    """The engine's cumulative count of prompt tokens it prefilled (cache misses)."""


@dataclass
class EpisodeTiming:
    """An episode's times and sizes, with its turns' and tool calls' time summed."""

    id: int
    status: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    num_turns: int
    num_tokens: int
    num_model_tokens: int
    ended_why: str | None
    """filtered: the reason's kind (stale, zero_variance, ...); failed: the error type."""
    turn_s: float = 0.0
    """Seconds inside turns: generation, then the env's step (its tool calls)."""
    tool_s: float = 0.0


@dataclass
class TurnTiming:
    finished_at: float
    duration_s: float
    completion_tokens: int
    context_tokens: int
    """Tokens sent to the engine for the turn (the whole context so far)."""


@dataclass
class RunTimeline:
    run: dict[str, Any]
    episodes: list[EpisodeTiming] = field(default_factory=list)
    turns: list[TurnTiming] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    samples: list[EngineLoad] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    """The published versions' metrics (version, created_at and the step's metrics)."""


class TimelineStore(StoreBase):
    @write(durable=False)
    def record_timings(self, conn: Connection, run_id: int, spans: list[Span]) -> None:
        """Record spans of a process's time (kinds: TIMING_KINDS)."""
        if spans:
            conn.execute(insert(TimingRow), [
                {"run_id": run_id, "source": s.source, "kind": s.kind,
                 "started_at": s.started_at, "finished_at": s.finished_at} for s in spans
            ])  # fmt: skip

    @write(durable=False)
    def record_engine_samples(self, conn: Connection, run_id: int, samples: list[EngineLoad]) -> None:
        if samples:
            conn.execute(insert(EngineSampleRow), [
                {"run_id": run_id, "engine": s.engine, "sampled_at": s.sampled_at,
                 "running": s.running, "waiting": s.waiting, "token_usage": s.token_usage,
                 "gen_tokens_per_s": s.gen_tokens_per_s,
                 "prefill_tokens_total": s.prefill_tokens_total} for s in samples
            ])  # fmt: skip

    @read
    def run_timeline(self, conn: Connection, run_id: int) -> RunTimeline:
        """Everything the audit of run `run_id` reads, in one read transaction."""
        run = conn.execute(select(RunRow.id, RunRow.name, RunRow.kind, RunRow.evaluates_run_id,
                                  RunRow.evaluates_version, RunRow.created_at)
                           .where(RunRow.id == run_id)).mappings().one_or_none()
        if run is None:
            raise NotFoundError(f"run {run_id} does not exist")
        out = RunTimeline(run=dict(run))
        turn_s = (
            select(TurnRow.episode_id.label("eid"),
                   func.sum(TurnRow.finished_at - TurnRow.started_at).label("s"))
            .join(EpisodeRow, EpisodeRow.id == TurnRow.episode_id).where(EpisodeRow.run_id == run_id)
            .group_by(TurnRow.episode_id).subquery()
        )
        tool_s = (
            select(ToolCallRow.episode_id.label("eid"), func.sum(ToolCallRow.duration_s).label("s"))
            .join(EpisodeRow, EpisodeRow.id == ToolCallRow.episode_id).where(EpisodeRow.run_id == run_id)
            .group_by(ToolCallRow.episode_id).subquery()
        )
        rows = conn.execute(
            select(EpisodeRow.id, EpisodeRow.status, EpisodeRow.created_at, EpisodeRow.started_at,
                   EpisodeRow.finished_at, EpisodeRow.num_turns, EpisodeRow.num_tokens,
                   EpisodeRow.num_model_tokens,
                   case((EpisodeRow.status == "filtered", FILTER_KIND),
                        (EpisodeRow.status == "failed", EpisodeRow.error_type), else_=None),
                   func.coalesce(turn_s.c.s, 0.0), func.coalesce(tool_s.c.s, 0.0))
            .outerjoin(turn_s, turn_s.c.eid == EpisodeRow.id)
            .outerjoin(tool_s, tool_s.c.eid == EpisodeRow.id)
            .where(EpisodeRow.run_id == run_id).order_by(EpisodeRow.id)
        ).all()
        out.episodes = [EpisodeTiming(*r[:8], r[8], float(r[9]), float(r[10])) for r in rows]
        turns = conn.execute(
            select(TurnRow.finished_at, TurnRow.finished_at - TurnRow.started_at,
                   TurnRow.num_tokens - TurnRow.num_prompt_tokens, TurnRow.span_start + TurnRow.num_prompt_tokens)
            .join(EpisodeRow, EpisodeRow.id == TurnRow.episode_id).where(EpisodeRow.run_id == run_id)
            .order_by(TurnRow.finished_at)
        ).all()
        out.turns = [TurnTiming(float(a), float(b), int(c), int(d)) for a, b, c, d in turns]
        out.spans = [Span(k, float(a), float(b), s) for k, a, b, s in conn.execute(
            select(TimingRow.kind, TimingRow.started_at, TimingRow.finished_at, TimingRow.source)
            .where(TimingRow.run_id == run_id).order_by(TimingRow.started_at)
        )]
        out.samples = [EngineLoad(*r) for r in conn.execute(
            select(EngineSampleRow.engine, EngineSampleRow.sampled_at, EngineSampleRow.running,
                   EngineSampleRow.waiting, EngineSampleRow.token_usage, EngineSampleRow.gen_tokens_per_s,
                   EngineSampleRow.prefill_tokens_total)
            .where(EngineSampleRow.run_id == run_id).order_by(EngineSampleRow.sampled_at)
        )]
        out.steps = [
            {"version": v, "created_at": t, **(m or {})} for v, t, m in conn.execute(
                select(PolicyVersionRow.version, PolicyVersionRow.created_at, PolicyVersionRow.metrics)
                .where(PolicyVersionRow.run_id == run_id, PolicyVersionRow.version > 0)
                .order_by(PolicyVersionRow.version)
            )
        ]
        return out

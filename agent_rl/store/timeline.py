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
from agent_rl.store.models import EngineSample, Episode, PolicyVersion, Run, Timing, ToolCall, Turn
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
            conn.execute(insert(Timing), [
                {"run_id": run_id, "source": s.source, "kind": s.kind,
                 "started_at": s.started_at, "finished_at": s.finished_at} for s in spans
            ])  # fmt: skip

    @write(durable=False)
    def record_engine_samples(self, conn: Connection, run_id: int, samples: list[EngineLoad]) -> None:
        if samples:
            conn.execute(insert(EngineSample), [
                {"run_id": run_id, "engine": s.engine, "sampled_at": s.sampled_at,
                 "running": s.running, "waiting": s.waiting, "token_usage": s.token_usage,
                 "gen_tokens_per_s": s.gen_tokens_per_s,
                 "prefill_tokens_total": s.prefill_tokens_total} for s in samples
            ])  # fmt: skip

    @read
    def run_timeline(self, conn: Connection, run_id: int) -> RunTimeline:
        """Everything the audit of run `run_id` reads, in one read transaction."""
        run = conn.execute(select(Run.id, Run.name, Run.kind, Run.evaluates_run_id,
                                  Run.evaluates_version, Run.created_at)
                           .where(Run.id == run_id)).mappings().one_or_none()
        if run is None:
            raise NotFoundError(f"run {run_id} does not exist")
        out = RunTimeline(run=dict(run))
        turn_s = (
            select(Turn.episode_id.label("eid"),
                   func.sum(Turn.finished_at - Turn.started_at).label("s"))
            .join(Episode, Episode.id == Turn.episode_id).where(Episode.run_id == run_id)
            .group_by(Turn.episode_id).subquery()
        )
        tool_s = (
            select(ToolCall.episode_id.label("eid"), func.sum(ToolCall.duration_s).label("s"))
            .join(Episode, Episode.id == ToolCall.episode_id).where(Episode.run_id == run_id)
            .group_by(ToolCall.episode_id).subquery()
        )
        rows = conn.execute(
            select(Episode.id, Episode.status, Episode.created_at, Episode.started_at,
                   Episode.finished_at, Episode.num_turns, Episode.num_tokens,
                   Episode.num_model_tokens,
                   case((Episode.status == "filtered", FILTER_KIND),
                        (Episode.status == "failed", Episode.error_type), else_=None),
                   func.coalesce(turn_s.c.s, 0.0), func.coalesce(tool_s.c.s, 0.0))
            .outerjoin(turn_s, turn_s.c.eid == Episode.id)
            .outerjoin(tool_s, tool_s.c.eid == Episode.id)
            .where(Episode.run_id == run_id).order_by(Episode.id)
        ).all()
        out.episodes = [EpisodeTiming(*r[:8], r[8], float(r[9]), float(r[10])) for r in rows]
        turns = conn.execute(
            select(Turn.finished_at, Turn.finished_at - Turn.started_at,
                   Turn.num_tokens - Turn.num_prompt_tokens, Turn.span_start + Turn.num_prompt_tokens)
            .join(Episode, Episode.id == Turn.episode_id).where(Episode.run_id == run_id)
            .order_by(Turn.finished_at)
        ).all()
        out.turns = [TurnTiming(float(a), float(b), int(c), int(d)) for a, b, c, d in turns]
        out.spans = [Span(k, float(a), float(b), s) for k, a, b, s in conn.execute(
            select(Timing.kind, Timing.started_at, Timing.finished_at, Timing.source)
            .where(Timing.run_id == run_id).order_by(Timing.started_at)
        )]
        out.samples = [EngineLoad(*r) for r in conn.execute(
            select(EngineSample.engine, EngineSample.sampled_at, EngineSample.running,
                   EngineSample.waiting, EngineSample.token_usage, EngineSample.gen_tokens_per_s,
                   EngineSample.prefill_tokens_total)
            .where(EngineSample.run_id == run_id).order_by(EngineSample.sampled_at)
        )]
        out.steps = [
            {"version": v, "created_at": t, **(m or {})} for v, t, m in conn.execute(
                select(PolicyVersion.version, PolicyVersion.created_at, PolicyVersion.metrics)
                .where(PolicyVersion.run_id == run_id, PolicyVersion.version > 0)
                .order_by(PolicyVersion.version)
            )
        ]
        return out

"""Pydantic response models of the web API, separate from the store's records.

The store hands out dataclasses shaped for its own callers; these models are the public,
versioned contract under `/api/v1` and what `/openapi.json` documents. An episode's row and a
turn are the store's records field for field, so their schemas are made from the records
(`from_record`) rather than written twice. Floats that can be
non-finite in the store (logprobs of -inf, NaN) are sent as null, since JSON has no such
numbers. Every error is an `ErrorOut`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from agent_rl.store import EpisodeSummary, TurnView


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorOut(Schema):
    """Every error response: one readable message."""

    detail: str


def from_record(record: type, doc: str, descriptions: dict[str, str]) -> type[Schema]:
    """A response schema with exactly the fields and types of a store record (so the two can
    never drift apart), documented for `/openapi.json` with `descriptions` per field."""
    hints = get_type_hints(record)
    fields: dict[str, Any] = {
        f.name: (hints[f.name], Field(description=descriptions.get(f.name)))
        for f in dataclasses.fields(record)
    }
    name = record.__name__.removesuffix("Summary").removesuffix("View") + "Out"
    return create_model(name, __base__=Schema, __doc__=doc, __module__=__name__, **fields)


EpisodeOut = from_record(
    EpisodeSummary,
    "An episode's row: where it is in its lifecycle, its reward and counters.",
    {
        "index": "Position within its group.",
        "status": "waiting | running | completed | trained | filtered | failed",
        "advantage": "Set when the trainer committed its group.",
        "staleness": "Set when trained: the trainer's version before the step minus the "
        "episode's token-weighted sampling version.",
        "resumes": "Times a serve resumed it after the serve running it died.",
    },
)


class EpisodePage(Schema):
    """One page of episodes; pass `next_cursor` as `cursor` for the next one."""

    items: list[EpisodeOut]
    next_cursor: str | None


class MessageOut(Schema):
    turn_index: int
    position: int
    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None
    name: str | None


class ToolCallOut(Schema):
    """One tool call with its outcome, exit status and timing."""

    turn_index: int
    call_index: int
    name: str
    arguments: str = Field(description="The arguments as the model wrote them (raw text).")
    status: str = Field(description="ok | error | malformed | timeout")
    output: str
    exit_status: int | None
    duration_s: float
    sandbox_error: str | None


TurnOut = from_record(
    TurnView,
    "One turn: where its tokens start in the episode's stream, how many, and how it ended.",
    {"num_prompt_tokens": "Leading tokens of the span that are prompt or observation (mask 0).",
     "segment": "The episode's segment: 0, then one more at each turn whose conversation was "
     "rewritten instead of extended (a gateway agent's edited history; that turn's prompt is "
     "the whole new conversation). Each segment trains as a sequence of its own."},
)


class TokenView(Schema):
    """The episode's token stream as parallel arrays (one entry per token)."""

    token_ids: list[int]
    pieces: list[str] | None = Field(description="Each token's text; null without a tokenizer.")
    logprobs: list[float | None] = Field(description="Rollout logprobs (null: not finite).")
    trainer_logprobs: list[float | None] | None = Field(
        description="The trainer's logprobs, when it recorded them."
    )
    loss_mask: list[int]
    versions: list[int] = Field(description="Policy version per model token, -1 elsewhere.")
    routed_experts: list[list[list[int]]] | None = Field(
        description="[token][layer][k] expert ids, with ?experts=true on MoE episodes."
    )
    tokenizer: str | None = Field(description="Where the pieces were decoded from.")


class EpisodeDetailOut(Schema):
    episode: EpisodeOut
    task: dict[str, Any] | None = Field(description="The task row (key and payload).")
    turns: list[TurnOut]
    messages: list[MessageOut]
    tool_calls: list[ToolCallOut]
    tokens: TokenView | None


class GroupOut(Schema):
    """A group with its episodes side by side."""

    id: int
    run_id: int
    task_id: int
    env_id: str
    size: int
    status: str
    filter_reason: str | None
    min_version: int | None
    trained_step: int | None
    created_at: float
    ready_at: float | None
    episodes: list[EpisodeOut]


class RunSummaryOut(Schema):
    id: int
    name: str
    created_at: float
    latest_version: int | None
    num_episodes: int
    kind: str = Field(description="train, or eval: an evaluation that no trainer consumes.")
    evaluates_run_id: int | None = Field(description="eval: the run whose policy it scored.")
    evaluates_version: int | None = Field(
        description="eval: the policy version its engines served for every token.")


class PolicyVersionOut(Schema):
    version: int
    trainer_step: int | None
    checkpoint: str | None
    metrics: dict[str, Any] | None
    created_at: float


class EvaluationOut(Schema):
    """One evaluation of a training run's policy (`agent-rl eval`)."""

    run_id: int
    name: str
    version: int | None = Field(description="The policy version evaluated (None: other weights).")
    created_at: float
    tasks: int
    episodes: int
    failed: int
    task_rewards: list[float] = Field(description="Mean reward per task, in task order.")
    mean: float
    stderr: float | None = Field(description="Standard error of the mean over tasks.")


class DraftAcceptanceOut(Schema):
    """An MTP draft's (`trainer.mtp.layers`) expected acceptance at one policy version, as the
    learner measured it without a speculative engine: on the policy tokens of the step that
    made the version, at the weights that step started from."""

    version: int
    acceptance: list[float] = Field(
        description="Per draft depth (1, 2, ...): the chance speculative sampling accepts its "
        "token, the sum over the vocabulary of min(p_policy, q_draft) (`mtp_acceptance_{j}`).")
    accept_length: float | None = Field(
        description="Expected drafts accepted per anchor when all are proposed "
        "(`mtp_accept_length`).")


class RunOut(Schema):
    id: int
    name: str
    created_at: float
    kind: str = Field(description="train, or eval: an evaluation that no trainer consumes.")
    evaluates_run_id: int | None
    evaluates_version: int | None
    evaluations: list[EvaluationOut] = Field(
        description="A training run's evaluations, by policy version (empty for an eval run).")
    config: dict[str, Any]
    policy_versions: list[PolicyVersionOut]
    metrics: dict[str, list[list[float]]] = Field(
        description="Per metric, [trainer step, value] points over the policy versions."
    )
    draft_acceptance: list[DraftAcceptanceOut] = Field(
        description="Per policy version whose step measured an MTP draft, its expected "
        "acceptance (empty without `trainer.mtp.layers`).")
    ledger: dict[str, int]


class Percentiles(Schema):
    count: int
    p50: float | None
    p90: float | None
    p99: float | None


class ToolLatency(Percentiles):
    errors: int


class EndingsOut(Schema):
    """How episodes ended, counted by reason over the run."""

    truncated: dict[str, int] = Field(
        description="Completed by a budget: max_turns, max_tokens, max_new_tokens, deadline, env."
    )
    filtered: dict[str, int] = Field(
        description="Filtered, by kind: stale, stale_sibling, zero_variance, group_reward_failed, "
                    "fork, other."
    )
    failed: dict[str, int] = Field(description="Failed, by error type (Interrupted, EngineError, ...).")


class StatsOut(Schema):
    """Where episodes are, how fast they come, how stale they were, how long things take."""

    run_id: int | None
    ledger: dict[str, int]
    endings: EndingsOut
    throughput: dict[str, float | None] = Field(
        description="Over the sampled window: episodes_per_s and model_tokens_per_s."
    )
    staleness: dict[str, int] = Field(
        description="Trained episodes by staleness, as the trainer counted it against its bound: "
        "its version before the step minus the episode's sampling version, rounded."
    )
    episode_latency_s: dict[str, Percentiles] = Field(description="Per env: episode wall time.")
    tool_latency_s: dict[str, ToolLatency] = Field(description="Per tool: call wall time.")


class ObservationDiff(Schema):
    """The observations after one assistant turn, as recorded and as replayed."""

    turn: int = Field(description="Assistant turn index; -1 for the reset's initial messages.")
    recorded: list[dict[str, Any]] = Field(description="Messages as stored: role, content, name.")
    replayed: list[dict[str, Any]] = Field(description="Messages the fresh environment produced.")
    equal: bool
    diff: str = Field(description="Unified diff of the two, empty when equal.")


class ReplayOut(Schema):
    episode_id: int
    env_id: str
    reproduced: bool = Field(description="Every observation and the reward are identical.")
    recorded_reward: float | None
    replayed_reward: float | None
    reward_equal: bool
    terminated: bool
    truncated: bool
    turns: list[ObservationDiff]
    notes: list[str] = Field(description="Turns that could not be compared, and why.")


class ForkOut(Schema):
    episode_id: int = Field(description="The new episode.")
    parent_episode_id: int
    from_turn: int
    status: str
    reward: float | None


class HealthOut(Schema):
    status: Literal["ok"]
    version: str

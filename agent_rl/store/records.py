"""Plain records that cross the store's API: what the runner writes and what readers get back.

They are dataclasses, not ORM objects, so that callers never hold a session and token arrays
stay numpy. The web API defines its own pydantic schemas on top of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent_rl.store.arrays import TokenArrays


@dataclass
class MessageRecord:
    """One chat message as the environment and the model exchanged it."""

    role: str
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    name: str | None = None


@dataclass
class ToolCallRecord:
    """One tool call made in a turn, with its outcome. `arguments` is the model's raw text."""

    name: str
    arguments: str
    status: str = "ok"
    """ok | error | malformed | timeout."""
    output: str = ""
    exit_status: int | None = None
    duration_s: float = 0.0
    sandbox_error: str | None = None


@dataclass
class TurnRecord:
    """A turn as the runner persists it: the tokens it appended, and the messages and tool
    calls it produced. The span's first `num_prompt_tokens` tokens are the rendered prompt
    (initial prompt or observations, loss mask 0); the rest is the completion."""

    tokens: TokenArrays
    num_prompt_tokens: int
    started_at: float
    finished_at: float
    messages: list[MessageRecord] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    finish_reason: str | None = None
    drift: bool = False
    segment: int = 0
    """The episode's segment (`Turn.segment`): one more than the previous turn's when this turn
    starts a rewritten conversation, whose whole prompt its span then holds."""


@dataclass
class EpisodeEnd:
    """How an episode ended, with what of it is still unwritten (`Store.end_episode`)."""

    status: str
    """completed | failed."""
    reward: float | None = None
    reward_details: dict[str, Any] | None = None
    """For a truncation: `{"truncated": "max_turns" | "max_tokens" | "max_new_tokens" |
    "deadline" | "env"}` (the env cut it at its own limit), plus the env's reward breakdown."""
    error_type: str | None = None
    """failed: the boundary the failure crossed (EnvError, SandboxError, EngineError,
    Interrupted, or the exception's type for a bug of ours)."""
    error_cause: str | None = None
    turn: TurnRecord | None = None
    """The last turn, when it is written together with the end."""
    unwritten: list[TurnRecord] = field(default_factory=list)
    """Turns before `turn` not written yet (an agent's held turns), written first, in order."""
    messages: list[MessageRecord] = field(default_factory=list)
    """Observations after the last turn (not part of any generation)."""


@dataclass
class EpisodeSummary:
    """An episode's row: status, reward, counters, versions, timings, cause."""

    id: int
    run_id: int
    group_id: int
    task_id: int
    env_id: str
    index: int
    seed: int | None
    status: str
    reward: float | None
    reward_details: dict[str, Any] | None
    advantage: float | None
    num_turns: int
    num_tokens: int
    num_model_tokens: int
    min_version: int | None
    max_version: int | None
    drift_count: int
    tool_error_count: int
    owner: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    filter_reason: str | None
    error_type: str | None
    error_cause: str | None
    trained_step: int | None
    parent_episode_id: int | None
    staleness: float | None
    resumes: int


@dataclass
class TurnView:
    index: int
    span_start: int
    num_tokens: int
    num_prompt_tokens: int
    finish_reason: str | None
    drift: bool
    started_at: float
    finished_at: float
    segment: int = 0


@dataclass
class EpisodeDetail:
    """An episode with its transcript; token arrays are loaded separately (they can be large)."""

    episode: EpisodeSummary
    turns: list[TurnView]
    messages: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]


@dataclass
class Ledger:
    """Where every admitted episode is. `admitted` is counted independently of the rows (from
    the groups as admitted, `size` episodes each), so the ledger balances only if no episode
    was lost: admitted = trained + filtered + failed + scored + in_flight + waiting, at every
    moment. `in_flight` counts episodes being generated or generated and awaiting training; an
    evaluation run's ended episodes (`agent-rl eval`: no trainer consumes them) are `scored`
    instead."""

    admitted: int = 0
    waiting: int = 0
    running: int = 0
    completed: int = 0
    trained: int = 0
    filtered: int = 0
    failed: int = 0
    scored: int = 0
    """Ended episodes of evaluation runs (their status is completed, and stays so)."""
    mean_reward: float | None = None
    """Mean reward of the episodes that ended with one (completed, trained or filtered)."""

    @property
    def in_flight(self) -> int:
        return self.running + self.completed

    @property
    def accounted(self) -> int:
        """Episodes found in some state."""
        return (self.trained + self.filtered + self.failed + self.scored + self.in_flight
                + self.waiting)

    def balances(self) -> bool:
        return self.admitted == self.accounted

    def as_dict(self) -> dict[str, int]:
        return {
            "admitted": self.admitted,
            "trained": self.trained,
            "filtered": self.filtered,
            "failed": self.failed,
            "scored": self.scored,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "running": self.running,
            "awaiting_training": self.completed,
        }


@dataclass
class Endings:
    """How episodes ended, by reason: truncations (completed by a budget: `max_turns`,
    `max_tokens`, `max_new_tokens`, `deadline`, `env`), filters by kind (`stale`, `stale_sibling`,
    `zero_variance`, `group_reward_failed`, `fork`, `other`) and failures by error type."""

    truncated: dict[str, int] = field(default_factory=dict)
    filtered: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)


@dataclass
class Audit:
    """A run's bookkeeping checked from the rows: every admitted episode exists (none lost), is
    in exactly one state (a row has one status), and a terminal one carries its cause; trained
    episodes add up to what the trainer's steps say they consumed (none trained twice)."""

    ledger: Ledger
    lost: int
    """Episodes a decided group was admitted with but has no row for."""
    not_terminal: int
    """Episodes still waiting or running."""
    failed_without_cause: int
    filtered_without_reason: int
    trained_without_step: int
    trained_by_steps: int
    """Sum of the episodes each published policy version says its step trained on."""

    @property
    def trained_twice(self) -> int:
        """Episodes consumed by steps beyond those marked trained (0 unless one trained twice)."""
        return max(self.trained_by_steps - self.ledger.trained, 0)

    def problems(self, *, finished: bool = True) -> list[str]:
        """What is wrong, as sentences (empty: the run balances). `finished`: no episode may
        still be waiting or running."""
        out = []
        if not self.ledger.balances():
            out.append(f"ledger does not balance: {self.ledger.as_dict()}")
        if self.lost:
            out.append(f"{self.lost} admitted episodes lost")
        if finished and self.not_terminal:
            out.append(f"{self.not_terminal} episodes not in a terminal state")
        if self.failed_without_cause:
            out.append(f"{self.failed_without_cause} failed episodes without a cause")
        if self.filtered_without_reason:
            out.append(f"{self.filtered_without_reason} filtered episodes without a reason")
        if self.trained_without_step:
            out.append(f"{self.trained_without_step} trained episodes without their step")
        if self.trained_by_steps != self.ledger.trained:
            out.append(f"steps trained on {self.trained_by_steps} episodes but "
                       f"{self.ledger.trained} are marked trained")
        return out


@dataclass
class ClaimedGroup:
    id: int
    task_id: int
    env_id: str
    min_version: int | None
    episode_ids: list[int]
    """The group's completed episodes, the ones a training step consumes."""


@dataclass
class ClaimedEpisode:
    """One completed episode of a claim, as a training step consumes it."""

    id: int
    group_id: int
    reward: float
    tokens: TokenArrays
    segment_starts: list[int] = field(default_factory=lambda: [0])
    """Where each segment of the stream starts (`Turn.segment`): a rewritten conversation's
    tokens are trained as a sequence of their own."""

    def segments(self) -> list[TokenArrays]:
        """The stream cut into its segments, in order."""
        ends = [*self.segment_starts[1:], len(self.tokens)]
        return [self.tokens.slice(a, b) for a, b in zip(self.segment_starts, ends)]


@dataclass
class Claim:
    """Groups held by one trainer under a lease until it commits or the lease expires."""

    claim_id: str
    trainer_id: str
    lease_expires_at: float
    groups: list[ClaimedGroup]

    @property
    def group_ids(self) -> list[int]:
        return [g.id for g in self.groups]

    @property
    def episode_ids(self) -> list[int]:
        return [e for g in self.groups for e in g.episode_ids]

"""The one definition of staleness, shared by claims, the trainer's batch and metrics, and the
stats.

A step trains from policy version v under the bound eta (`trainer.max_staleness`); its floor is
v - eta. Staleness bounds tokens, not whole episodes: a token sampled by a policy older than the
floor is not trained (loss mask 0; it stays in the context the later tokens were sampled from),
every token at or above it is (TIS corrects their ratio). So an episode that ran across many
weight updates (the router retracts in-flight generations and continues them on the new
weights) still trains on what its recent policies wrote instead of being thrown away whole for
its first turn, and staleness control stops favouring short episodes.

Which groups a step may take (`Siblings`): with "baseline" (the default) a group is claimable
while ANY of its completed episodes has a token at or above the floor. A sibling entirely below
it (a short episode that finished early and aged while a long sibling still ran) still counts in
its group's advantage baseline (its reward is a sample of the same task) but trains no token,
and is recorded as filtered with the reason `stale sibling: ...`; only a group with no such
token left at all is filtered as stale. With "drop_group" (the rule before) a group is claimable
only while EVERY completed episode has a token at or above the floor (`Group.newest_version`),
so one stale sibling threw its whole group away, its fresh long episodes with it. An episode's
staleness, recorded when it is trained and shown by the stats, is v minus the mean version of
its trained tokens: never more than eta.

`measure="oldest"` is the rule before (a group is claimable only while its oldest token is within
the bound, and then every token trains), kept for comparison: bench/long_tail.py measures both.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from sqlalchemy import ColumnElement, func, select

from agent_rl.store.models import EpisodeRow, GroupRow

if TYPE_CHECKING:
    import numpy as np

Measure = Literal["tokens", "oldest"]
Siblings = Literal["baseline", "drop_group"]


def group_version(measure: Measure, siblings: Siblings = "baseline") -> ColumnElement[int]:
    """What of a group the staleness floor is compared with: its freshest completed episode's
    newest token ("baseline"), its stalest episode's newest token ("drop_group"), or its oldest
    token (`measure="oldest"`)."""
    if measure == "oldest":
        return GroupRow.min_version  # type: ignore[return-value]
    if siblings == "drop_group":
        return GroupRow.newest_version  # type: ignore[return-value]
    return (
        select(func.max(EpisodeRow.max_version))
        .where(EpisodeRow.group_id == GroupRow.id, EpisodeRow.status == "completed")
        .scalar_subquery()
    )


def trained_tokens(versions: np.ndarray, floor: int | None, measure: Measure) -> np.ndarray:
    """Which of an episode's model tokens (versions >= 0) a step with this floor trains (all
    of them without a floor)."""
    sampled = versions >= 0
    return sampled & (versions >= floor) if measure == "tokens" and floor is not None else sampled


def staleness(trainer_version: int, versions: np.ndarray) -> float:
    """How many versions behind the trainer (before its step) the trained tokens were sampled,
    on average (`versions`: the policy versions of the tokens trained)."""
    if versions.size == 0:
        return 0.0
    return max(0.0, trainer_version - float(versions.mean()))


def bucket(value: float) -> int:
    """A staleness for a histogram: rounded half up, so a value within the bound stays in it."""
    return math.floor(value + 0.5)

"""The one definition of staleness, shared by admission, claims, the trainer's metrics and the
stats.

An episode's sampling version is the token-weighted mean of the policy versions that sampled
its model tokens (`Episode.version_sum / Episode.num_model_tokens`): an episode that ran across
weight updates (the router retracts and continues in-flight generations on the new weights) is
judged by where its tokens came from, not by its first token, so long episodes are not the
ones the bound throws away. Its staleness when trained is the trainer's policy version before
the step minus that sampling version; the trainer claims a group only while
`trainer version - max_staleness <= group version`, where a group's version is its stalest
completed episode's (`Group.token_version`), so no trained episode is staler than the bound.

`measure="oldest"` counts the oldest token instead (`min_version`, the rule before this one),
kept for comparison (bench/long_tail.py measures both in one run).
"""

from __future__ import annotations

import math
from typing import Literal

from sqlalchemy import ColumnElement, func

from agent_rl.store.models import Episode, Group

Measure = Literal["tokens", "oldest"]

TOKEN_VERSION: ColumnElement[float] = (
    Episode.version_sum * 1.0 / func.nullif(Episode.num_model_tokens, 0)
)
"""An episode's token-weighted sampling version (NULL before its first model token)."""


def group_version(measure: Measure) -> ColumnElement[float]:
    """The column a group's staleness is counted from."""
    return Group.token_version if measure == "tokens" else Group.min_version  # type: ignore[return-value]


def episode_version(measure: Measure) -> ColumnElement[float]:
    """The expression an episode's staleness is counted from."""
    return TOKEN_VERSION if measure == "tokens" else Episode.min_version  # type: ignore[return-value]


def staleness(trainer_version: int, sampled: float) -> float:
    """How many versions behind the trainer (before its step) the data was sampled."""
    return max(0.0, trainer_version - sampled)


def bucket(value: float) -> int:
    """A staleness for a histogram: rounded half up, so a value within the bound stays in it."""
    return math.floor(value + 0.5)

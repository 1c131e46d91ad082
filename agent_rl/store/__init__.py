"""The persisted trajectory store: every episode, turn, tool call and token, durably.

`Store` is the one async API the runner, the trainer, the web API and the CLI use:

    async with await Store.open(config.store) as store:
        run = await store.ensure_run("default")
        ...

Its parts: `lifecycle` (admission and episode writes), `queries` (reads and the ledger),
`consume` (trainer claims and commits), `timeline` (where the run's time went: trainer timings
and engine samples, read by `compute`'s audit), over `models` (the schema, owned by `migrations/`).
"""

from __future__ import annotations

from agent_rl.store.arrays import TokenArrays
from agent_rl.store.consume import Consumption
from agent_rl.store.lifecycle import LifecycleWrites
from agent_rl.store.queries import Queries
from agent_rl.store.records import (
    Audit,
    Claim,
    ClaimedEpisode,
    ClaimedGroup,
    Endings,
    EpisodeDetail,
    EpisodeEnd,
    EpisodeSummary,
    Ledger,
    MessageRecord,
    ToolCallRecord,
    TurnRecord,
    TurnView,
)
from agent_rl.store.timeline import EngineLoad, Span, TimelineStore


class Store(LifecycleWrites, Queries, Consumption, TimelineStore):
    """The trajectory store (open it with `await Store.open(cfg)`)."""


__all__ = [
    "Audit",
    "Claim",
    "ClaimedEpisode",
    "ClaimedGroup",
    "Endings",
    "EpisodeDetail",
    "EpisodeEnd",
    "EpisodeSummary",
    "EngineLoad",
    "Ledger",
    "MessageRecord",
    "Span",
    "Store",
    "TokenArrays",
    "ToolCallRecord",
    "TurnRecord",
    "TurnView",
]

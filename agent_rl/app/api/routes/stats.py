"""GET /stats: ledger, throughput, staleness distribution, latency percentiles."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from agent_rl.app.api.deps import StoreDep
from agent_rl.app.api.filters import NO_NUL
from agent_rl.app.api.schemas import StatsOut
from agent_rl.app.api.stats import run_stats

router = APIRouter(tags=["stats"])


@router.get("/stats", response_model=StatsOut)
async def get_stats(
    store: StoreDep,
    run: Annotated[
        str | None,
        Query(max_length=200, pattern=NO_NUL, description="Run name (default: all runs)."),
    ] = None,
) -> StatsOut:
    """Where every admitted episode is, and how fast, stale and slow the recent ones were."""
    run_id = await store.run_id(run) if run else None
    return await run_stats(store, run_id)

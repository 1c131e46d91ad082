"""GET /audit: where a run's compute went (`agent_rl.store.audit`), as JSON."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from agent_rl.app.api.deps import ConfigDep, StoreDep
from agent_rl.app.api.filters import NO_NUL
from agent_rl.store.audit import ComputeAudit, audit_run

router = APIRouter(tags=["audit"])


@router.get("/audit", response_model=ComputeAudit)
async def get_audit(
    store: StoreDep,
    cfg: ConfigDep,
    run: Annotated[
        str | None,
        Query(max_length=200, pattern=NO_NUL, description="Run name (default: run.name)."),
    ] = None,
) -> ComputeAudit:
    """Shares of the run's wall clock (trainer state x rollout state, adding up to 1), engine
    use and throughput (against bench/decode.py's table when `rollout.decode_table` is set),
    episode time, the long tail, waste, and the verdict with its advice."""
    run_id = await store.run_id(run or cfg.run.name)
    return await audit_run(store, run_id, cfg.rollout.decode_table)

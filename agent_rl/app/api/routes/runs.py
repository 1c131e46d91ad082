"""GET /runs and GET /runs/{id}: config, policy versions, per-step training metrics (and an MTP
draft's acceptance per version), ledger."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from agent_rl.app.api.convert import draft_acceptance, json_safe, metric_series, policy_version_out
from agent_rl.app.api.deps import StoreDep
from agent_rl.app.api.schemas import EvaluationOut, RunOut, RunSummaryOut
from agent_rl.config.secrets import redact
from agent_rl.store.models import ID_MAX

router = APIRouter(tags=["runs"])


@router.get("/runs", response_model=list[RunSummaryOut])
async def list_runs(store: StoreDep) -> list[RunSummaryOut]:
    """Every run with its latest policy version and number of episodes."""
    return [RunSummaryOut(**r) for r in await store.list_runs()]


@router.get("/runs/{run_id}", response_model=RunOut)
async def get_run(run_id: Annotated[int, Path(ge=0, le=ID_MAX)], store: StoreDep) -> RunOut:
    """One run: its kind (an evaluation names the run and version it scored), recorded config,
    policy versions with their metrics, evaluations, and its ledger."""
    run = await store.get_run(run_id)
    versions = await store.policy_versions(run_id)
    ledger = await store.ledger(run_id)
    return RunOut(
        id=run["id"],
        name=run["name"],
        created_at=run["created_at"],
        kind=run["kind"],
        evaluates_run_id=run["evaluates_run_id"],
        evaluates_version=run["evaluates_version"],
        evaluations=[EvaluationOut(**e) for e in await store.evaluations(run_id)]
        if run["kind"] == "train" else [],
        config=redact(json_safe(run["config"] or {})),
        policy_versions=[policy_version_out(v) for v in versions],
        metrics=metric_series(versions),
        draft_acceptance=draft_acceptance(versions),
        ledger=ledger.as_dict(),
    )

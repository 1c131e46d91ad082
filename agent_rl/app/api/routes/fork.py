"""POST /episodes/{id}/fork?turn=k: regenerate from turn k with the current policy, stored as a
new episode linked to the original (needs the bearer token and an engine)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, FastAPI, Query, Request

from agent_rl.app.api.deps import ConfigDep, StoreDep, TokenDep, sandbox_pool
from agent_rl.app.api.routes.episodes import EpisodeId
from agent_rl.app.api.schemas import ForkOut
from agent_rl.sdk.registry import make

if TYPE_CHECKING:
    from agent_rl.rollout.runner import RunnerContext

router = APIRouter(tags=["fork"])


@router.post("/episodes/{episode_id}/fork", response_model=ForkOut)
async def fork(
    episode_id: EpisodeId,
    request: Request,
    store: StoreDep,
    cfg: ConfigDep,
    _: TokenDep,
    turn: Annotated[int, Query(ge=0, le=100_000, description="First turn to regenerate.")],
) -> ForkOut:
    """Run the fork to its end and return the new episode."""
    # Imported here: the runner brings transformers, which read-only API processes never need.
    from agent_rl.app.api.fork import fork_episode

    parent = (await store.get_episode(episode_id)).episode
    ctx = await runner_context(request.app, parent.run_id)
    if make(parent.env_id).needs_sandbox and ctx.sandboxes is None:
        ctx = dataclasses.replace(ctx, sandboxes=await sandbox_pool(request.app))
    return await fork_episode(store, cfg, ctx, episode_id, turn)


async def runner_context(app: FastAPI, run_id: int) -> RunnerContext:
    """The runner context `serve` lent the app, else one per run made on first use."""
    if app.state.runner is not None:
        return app.state.runner
    contexts: dict[int, RunnerContext] = app.state.fork_contexts
    if run_id not in contexts:
        from agent_rl.app.api.fork import api_runner_context

        store, cfg = app.state.store, app.state.config
        run = await store.get_run(run_id)
        contexts[run_id] = await api_runner_context(store, cfg, run.get("config"), run["name"])
    return contexts[run_id]

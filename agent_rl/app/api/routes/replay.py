"""POST /episodes/{id}/replay: re-execute the recorded turns in a fresh environment and return
the per-turn differences and the replayed reward (needs the bearer token)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from agent_rl.app.api.deps import ConfigDep, StoreDep, TokenDep, sandbox_pool
from agent_rl.app.api.replay import replay_episode
from agent_rl.app.api.routes.episodes import EpisodeId
from agent_rl.app.api.schemas import ReplayOut

router = APIRouter(tags=["replay"])


@router.post("/episodes/{episode_id}/replay", response_model=ReplayOut)
async def replay(
    episode_id: EpisodeId, request: Request, store: StoreDep, cfg: ConfigDep, _: TokenDep
) -> ReplayOut:
    """Replay a finished episode; nothing is written to the store."""
    return await replay_episode(
        store, cfg, episode_id, sandboxes=lambda: sandbox_pool(request.app)
    )

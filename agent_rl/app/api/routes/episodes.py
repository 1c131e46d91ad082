"""GET /episodes (filtered, sorted, cursor-paged) and GET /episodes/{id} (transcript, task,
reward and the token view)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query

from agent_rl.app.api.convert import episode_out, json_safe, transcript
from agent_rl.app.api.deps import ConfigDep, StoreDep
from agent_rl.app.api.filters import page_for_request
from agent_rl.app.api.schemas import EpisodeDetailOut, EpisodePage
from agent_rl.app.api.tokens import token_view
from agent_rl.store import EpisodeSummary
from agent_rl.store.models import ID_MAX

router = APIRouter(tags=["episodes"])

EpisodeId = Annotated[int, Path(ge=0, le=ID_MAX, description="Episode id.")]


@router.get("/episodes", response_model=EpisodePage)
async def list_episodes(
    page: Annotated[tuple[list[EpisodeSummary], str | None], Depends(page_for_request)],
) -> EpisodePage:
    """Episodes matching every filter, one page at a time."""
    episodes, next_cursor = page
    return EpisodePage(items=[episode_out(e) for e in episodes], next_cursor=next_cursor)


@router.get("/episodes/{episode_id}", response_model=EpisodeDetailOut)
async def get_episode(
    episode_id: EpisodeId,
    store: StoreDep,
    cfg: ConfigDep,
    tokens: Annotated[bool, Query(description="Include the token view.")] = True,
    experts: Annotated[bool, Query(description="Include routed experts (MoE).")] = False,
) -> EpisodeDetailOut:
    """One episode in full: transcript, tool calls, turns, task, and the token view."""
    detail = await store.get_episode(episode_id)
    turns, messages, calls = transcript(detail)
    task = await store.get_task(detail.episode.task_id)
    view = None
    if tokens:
        run = await store.get_run(detail.episode.run_id)
        view = await token_view(store, cfg, episode_id, run.get("config"), experts=experts)
    return EpisodeDetailOut(
        episode=episode_out(detail.episode),
        task=json_safe({k: task[k] for k in ("id", "key", "env_id", "payload")}),
        turns=turns,
        messages=messages,
        tool_calls=calls,
        tokens=view,
    )

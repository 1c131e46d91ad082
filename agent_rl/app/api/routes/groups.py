"""GET /groups/{id}: a group's episodes side by side, with rewards and advantages."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from agent_rl.app.api.convert import episode_out
from agent_rl.app.api.deps import StoreDep
from agent_rl.app.api.schemas import GroupOut
from agent_rl.store.models import ID_MAX

router = APIRouter(tags=["groups"])


@router.get("/groups/{group_id}", response_model=GroupOut)
async def get_group(
    group_id: Annotated[int, Path(ge=0, le=ID_MAX)], store: StoreDep
) -> GroupOut:
    """The group's row and its episodes in group order."""
    row = await store.get_group(group_id)
    episodes = await store.group_episodes(group_id)
    fields = set(GroupOut.model_fields) - {"episodes"}
    return GroupOut(**{k: row[k] for k in fields}, episodes=[episode_out(e) for e in episodes])

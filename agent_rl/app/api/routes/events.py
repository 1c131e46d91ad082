"""GET /episodes/{id}/events: server-sent events for an episode, turn by turn, while it runs.

The stream polls the store (every `api.events_poll_s`), so it works for episodes run by any
serve process on any machine sharing the store. Events:

- `episode`: the episode's row, first, and again whenever its status changes;
- `turn`: one persisted turn with the messages and tool calls it added (`id:` is the turn index,
  so a reconnecting client sends `Last-Event-ID` and gets only later turns);
- `messages`: messages recorded after the last turn (e.g. a final observation);
- `end`: the episode reached a terminal state; the stream closes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Header
from fastapi.responses import StreamingResponse

from agent_rl.app.api.convert import episode_out, transcript
from agent_rl.app.api.deps import ConfigDep, StoreDep
from agent_rl.app.api.routes.episodes import EpisodeId
from agent_rl.store import Store
from agent_rl.store.models import ID_MAX, TERMINAL_EPISODE_STATUSES

router = APIRouter(tags=["episodes"])


def sse(event: str, data: Any, event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def episode_events(
    store: Store, episode_id: int, poll_s: float, after_turn: int = -1
) -> AsyncIterator[str]:
    sent_turn, sent_position, status = after_turn, -1, None
    while True:
        detail = await store.get_episode(episode_id)
        turns, messages, calls = transcript(detail)
        if sent_position < 0 and sent_turn >= 0:
            # Resuming: the messages of turns already sent count as sent.
            sent_position = max(
                (m.position for m in messages if m.turn_index <= sent_turn), default=-1
            )
        if detail.episode.status != status:
            status = detail.episode.status
            yield sse("episode", episode_out(detail.episode).model_dump(mode="json"))
        for t in turns:
            if t.index <= sent_turn:
                continue
            new = [m for m in messages if m.position > sent_position and m.turn_index <= t.index]
            yield sse(
                "turn",
                {
                    "turn": t.model_dump(mode="json"),
                    "messages": [m.model_dump(mode="json") for m in new],
                    "tool_calls": [
                        c.model_dump(mode="json") for c in calls if c.turn_index == t.index
                    ],
                },
                event_id=t.index,
            )
            sent_turn = t.index
            sent_position = max([sent_position, *(m.position for m in new)])
        terminal = status in TERMINAL_EPISODE_STATUSES
        if terminal:
            # Read once more: the terminal write may carry messages after the last turn.
            trailing = [m for m in messages if m.position > sent_position]
            if trailing:
                yield sse("messages", [m.model_dump(mode="json") for m in trailing])
            yield sse("end", episode_out(detail.episode).model_dump(mode="json"))
            return
        await anyio.sleep(poll_s)


@router.get(
    "/episodes/{episode_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "A stream of server-sent events.",
        }
    },
)
async def stream_events(
    episode_id: EpisodeId,
    store: StoreDep,
    cfg: ConfigDep,
    last_event_id: Annotated[int | None, Header(ge=-1, le=ID_MAX)] = None,
) -> StreamingResponse:
    """Server-sent events for the episode, until it is terminal."""
    await store.get_episode(episode_id)  # 404 before the stream starts, not inside it
    return StreamingResponse(
        episode_events(
            store, episode_id, cfg.api.events_poll_s, -1 if last_event_id is None else last_event_id
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )

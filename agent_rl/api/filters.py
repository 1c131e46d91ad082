"""The episode list's query: filters, sort and an opaque cursor, shared by the JSON API and
the viewer so that both select exactly the same episodes.

Pagination is keyset, not offset: the cursor carries the sort key and id of the last episode
of a page, so pages stay consistent while the runner keeps inserting episodes.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, HTTPException, Query

from agent_rl.api.deps import ConfigDep, StoreDep
from agent_rl.store import EpisodeSummary, Store
from agent_rl.store.models import EPISODE_STATUSES

Status = Literal["waiting", "running", "completed", "trained", "filtered", "failed"]
assert set(Status.__args__) == set(EPISODE_STATUSES)  # type: ignore[attr-defined]
Sort = Literal[
    "id",
    "-id",
    "reward",
    "-reward",
    "num_turns",
    "-num_turns",
    "num_tokens",
    "-num_tokens",
    "created_at",
    "-created_at",
    "finished_at",
    "-finished_at",
]
NO_NUL = r"^[^\x00]*$"
"""Text parameters never hold NUL, which PostgreSQL text cannot store."""
PAGE_SIZE_CAP = 10_000
"""The schema's bound on `limit`; the configured api.max_page_size clamps below it."""


@dataclass
class EpisodeQuery:
    run: str | None = None
    env: str | None = None
    status: Status | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    min_version: int | None = None
    max_version: int | None = None
    q: str | None = None
    has_tool_error: bool | None = None
    drift: bool | None = None
    group: int | None = None
    sort: Sort = "-id"
    cursor: str | None = None
    limit: int = 50

    def params(self, **changes: object) -> dict[str, str]:
        """The query as URL parameters (unset ones left out), e.g. for the next page's link."""
        values = {**self.__dict__, **changes}
        return {
            k: str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in values.items()
            if v is not None and v != ""
        }


def episode_query(
    run: Annotated[
        str | None, Query(max_length=200, pattern=NO_NUL, description="Run name.")
    ] = None,
    env: Annotated[
        str | None, Query(max_length=200, pattern=NO_NUL, description="Environment id.")
    ] = None,
    status: Annotated[Status | None, Query()] = None,
    min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    min_version: Annotated[int | None, Query(ge=-(2**31), lt=2**31)] = None,
    max_version: Annotated[int | None, Query(ge=-(2**31), lt=2**31)] = None,
    q: Annotated[
        str | None, Query(max_length=500, pattern=NO_NUL, description="Text in any message.")
    ] = None,
    has_tool_error: Annotated[bool | None, Query()] = None,
    drift: Annotated[bool | None, Query(description="Has a re-tokenization drift.")] = None,
    group: Annotated[int | None, Query(ge=0, lt=2**63, description="Group id.")] = None,
    sort: Annotated[Sort, Query(description="Sort key; `-` for descending.")] = "-id",
    cursor: Annotated[
        str | None, Query(max_length=200, pattern=NO_NUL, description="next_cursor of a page.")
    ] = None,
    limit: Annotated[
        int, Query(ge=1, le=PAGE_SIZE_CAP, description="Page size (clamped to api.max_page_size).")
    ] = 50,
) -> EpisodeQuery:
    return EpisodeQuery(
        run,
        env,
        status,
        min_reward,
        max_reward,
        min_version,
        max_version,
        q,
        has_tool_error,
        drift,
        group,
        sort,
        cursor,
        limit,
    )


EpisodeQueryDep = Annotated[EpisodeQuery, Depends(episode_query)]


def encode_cursor(sort: str, last: EpisodeSummary) -> str:
    key_name = sort.lstrip("-")
    key = None if key_name == "id" else getattr(last, key_name)
    if key_name in ("reward", "finished_at") and key is None:
        from agent_rl.store.queries import NULL_KEY

        key = NULL_KEY
    raw = json.dumps({"s": sort, "k": key, "i": last.id}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, sort: str) -> tuple[float | None, int]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
        key, last_id, cursor_sort = data["k"], data["i"], data["s"]
        if not isinstance(last_id, int) or (key is not None and not isinstance(key, (int, float))):
            raise ValueError("bad cursor fields")
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise HTTPException(400, "invalid cursor: pass a next_cursor from a previous page") from e
    if cursor_sort != sort:
        raise HTTPException(400, f"the cursor belongs to sort={cursor_sort}, not sort={sort}")
    return (None if key is None else float(key)), last_id


async def fetch_page(
    store: Store, query: EpisodeQuery, max_page_size: int
) -> tuple[list[EpisodeSummary], str | None]:
    """One page of episodes for the query, and the cursor of the next page (None at the end)."""
    limit = min(query.limit, max_page_size)
    after_key, after_id = (
        (None, None) if query.cursor is None else decode_cursor(query.cursor, query.sort)
    )
    run_id = await store.run_id(query.run) if query.run else None
    episodes = await store.list_episodes(
        run_id=run_id,
        status=query.status,
        env_id=query.env,
        min_reward=query.min_reward,
        max_reward=query.max_reward,
        min_version=query.min_version,
        max_version=query.max_version,
        after_id=after_id,
        after_key=after_key,
        limit=limit + 1,
        group_id=query.group,
        text=query.q or None,
        has_tool_error=query.has_tool_error,
        drift=query.drift,
        sort=query.sort,
    )
    more = len(episodes) > limit
    episodes = episodes[:limit]
    return episodes, (encode_cursor(query.sort, episodes[-1]) if more else None)


async def page_for_request(
    store: StoreDep, cfg: ConfigDep, query: EpisodeQueryDep
) -> tuple[list[EpisodeSummary], str | None]:
    return await fetch_page(store, query, cfg.api.max_page_size)

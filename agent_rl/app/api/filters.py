"""The episode list's query: filters, sort and an opaque cursor, shared by the JSON API and
the viewer so that both select exactly the same episodes.

Pagination is keyset, not offset: the cursor carries the sort key and id of the last episode
of a page, so pages stay consistent while the runner keeps inserting episodes.

Every number a query accepts is bounded by what both databases hold (ids and versions are
INTEGER, 32-bit on PostgreSQL), and a cursor is checked field by field, so a value out of
range is a 422 or a 400, never a database error.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, HTTPException, Query

from agent_rl.app.api.deps import ConfigDep, StoreDep
from agent_rl.store import EpisodeSummary, Store
from agent_rl.store.models import EPISODE_STATUSES, ID_MAX, INT_MIN

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
    min_version: Annotated[int | None, Query(ge=INT_MIN, le=ID_MAX)] = None,
    max_version: Annotated[int | None, Query(ge=INT_MIN, le=ID_MAX)] = None,
    q: Annotated[
        str | None, Query(max_length=500, pattern=NO_NUL, description="Text in any message.")
    ] = None,
    has_tool_error: Annotated[bool | None, Query()] = None,
    drift: Annotated[bool | None, Query(description="Has a re-tokenization drift.")] = None,
    group: Annotated[int | None, Query(ge=0, le=ID_MAX, description="Group id.")] = None,
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
    """The sort key and episode id a cursor carries; 400 unless it is one `encode_cursor`
    could have made for this sort (so nothing the database cannot hold reaches a query)."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _bad_cursor() from e
    if not isinstance(data, dict) or set(data) != {"s", "k", "i"}:
        raise _bad_cursor()
    cursor_sort, key, last_id = data["s"], data["k"], data["i"]
    if cursor_sort not in Sort.__args__:  # type: ignore[attr-defined]
        raise _bad_cursor()
    if cursor_sort != sort:
        raise HTTPException(400, f"the cursor belongs to sort={cursor_sort}, not sort={sort}")
    if not _is_int(last_id) or not 0 <= last_id <= ID_MAX:
        raise _bad_cursor()
    if sort.lstrip("-") == "id":
        if key is not None:
            raise _bad_cursor()
        return None, last_id
    if not _is_number(key) or not -MAX_KEY <= key <= MAX_KEY:
        raise _bad_cursor()
    return float(key), last_id


MAX_KEY = 1e300
"""Sort keys a cursor may carry: finite, and the store's sentinel for a missing value
(`NULL_KEY`, -1e300) is the lowest."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    # NaN fails the range check that follows; JSON's bool is no number.
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bad_cursor() -> HTTPException:
    return HTTPException(400, "invalid cursor: pass a next_cursor from a previous page")


async def fetch_page(
    store: Store, query: EpisodeQuery, max_page_size: int
) -> tuple[list[EpisodeSummary], str | None]:
    """One page of episodes for the query, and the cursor of the next page (None at the end)."""
    limit = min(query.limit, max_page_size)
    after_key, after_id = (
        # An empty cursor (`?cursor=`, which the schema allows) is the first page.
        (None, None) if not query.cursor else decode_cursor(query.cursor, query.sort)
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

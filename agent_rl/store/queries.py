"""Reads of the store: episodes (filtered, paged), one episode in full, its tokens, the ledger,
runs and policy versions. Reads never block writers."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    case,
    func,
    or_,
    select,
)

from agent_rl.kernel.errors import NotFoundError
from agent_rl.store import arrays as codec
from agent_rl.store.arrays import TokenArrays
from agent_rl.store.base import StoreBase, read
from agent_rl.store.driver import DriverStatement
from agent_rl.store.models import (
    TERMINAL_EPISODE_STATUSES,
    EpisodeRow,
    GroupRow,
    MessageRow,
    PolicyVersionRow,
    RunRow,
    TaskRow,
    ToolCallRow,
    TurnRow,
)
from agent_rl.store.records import Audit, Endings, EpisodeDetail, EpisodeSummary, Ledger, TurnView
from agent_rl.store import search
from agent_rl.store.staleness import Measure, Siblings, group_version

if TYPE_CHECKING:
    import numpy as np

_SUMMARY_COLUMNS = [getattr(EpisodeRow, f.name) for f in fields(EpisodeSummary)]
# The reads every episode makes, built once: a statement built per call cost ~10x its execution
# (SQLAlchemy derives a new statement's cache key on each run; ~1.3 ms for a summary's columns).
LATEST_VERSION = DriverStatement(
    select(func.max(PolicyVersionRow.version)).where(PolicyVersionRow.run_id == bindparam("run")))
_GROUP_EPISODES = (select(*_SUMMARY_COLUMNS).where(EpisodeRow.group_id == bindparam("gid"))
                   .order_by(EpisodeRow.index))
# Sort keys of `list_episodes` (None: the id itself). Missing values sort as the lowest, through
# a sentinel rather than NULLS FIRST/LAST, so that keyset pagination compares plain numbers.
NULL_KEY = -1e300
SORT_KEYS = {
    "id": None,
    "reward": func.coalesce(EpisodeRow.reward, NULL_KEY),
    "num_turns": EpisodeRow.num_turns,
    "num_tokens": EpisodeRow.num_tokens,
    "created_at": EpisodeRow.created_at,
    "finished_at": func.coalesce(EpisodeRow.finished_at, NULL_KEY),
}


# Filter reasons by kind. The texts come from the scheduler (zero variance, a failed group
# hook), the trainer's stale filter (`consume.filter_stale`), its stale siblings
# (`consume.commit`) and forks (`api/fork.py`).
FILTER_KIND = case(
    (EpisodeRow.filter_reason.like("stale sibling%"), "stale_sibling"),
    (EpisodeRow.filter_reason.like("stale%"), "stale"),
    (EpisodeRow.filter_reason.like("zero reward variance%"), "zero_variance"),
    (EpisodeRow.filter_reason.like("group reward hook failed%"), "group_reward_failed"),
    (EpisodeRow.filter_reason.like("fork of episode%"), "fork"),
    else_="other",
)


class Queries(StoreBase):
    @read
    def run_id(self, conn: Connection, name: str) -> int:
        run_id = conn.scalar(select(RunRow.id).where(RunRow.name == name))
        if run_id is None:
            raise NotFoundError(f"no run named {name!r} in the store")
        return run_id

    @read
    def latest_version(self, conn: Connection, run_id: int) -> int:
        """The newest published policy version of the run (0 before any training)."""
        v = LATEST_VERSION.scalar(conn, {"run": run_id})
        return int(v) if v is not None else 0

    @read
    def policy_versions(self, conn: Connection, run_id: int) -> list[dict[str, Any]]:
        rows = conn.execute(
            select(PolicyVersionRow).where(PolicyVersionRow.run_id == run_id).order_by(PolicyVersionRow.version)
        ).mappings().all()
        return [dict(r) for r in rows]

    async def list_episodes(self, **filters: Any) -> list[EpisodeSummary]:
        """`_list_episodes(**filters)`. A text search on SQLite first brings the text index up
        to date (`search.catch_up`: new messages are indexed in batches), so it finds every
        message written before it."""
        if filters.get("text") and self.sqlite:
            await self.run_in_transaction(search.catch_up, write=True, durable=False,
                                          name="catch_up")
        return await self._list_episodes(**filters)  # type: ignore[no-any-return]

    @read
    def _list_episodes(
        self,
        conn: Connection,
        *,
        run_id: int | None = None,
        status: str | None = None,
        env_id: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
        after_id: int | None = None,
        limit: int = 100,
        group_id: int | None = None,
        text: str | None = None,
        has_tool_error: bool | None = None,
        drift: bool | None = None,
        sort: str = "id",
        after_key: float | None = None,
    ) -> list[EpisodeSummary]:
        """Episodes matching every given filter, by id, at most `limit`, after `after_id`.

        The version filters select episodes whose tokens all come from policies in the range.
        `text` matches any message of the transcript (case-insensitive substring, through the
        backend's text search, `agent_rl.store.search`);
        `has_tool_error` and `drift` select episodes with (True) or without (False) a failed
        tool call or a re-tokenization drift. `sort` is one of SORT_KEYS, `-` first for
        descending; for keyed sorts the page starts after (`after_key`, `after_id`), the sort
        key and id of the previous page's last episode (keyset pagination, ties broken by id)."""
        if sort.lstrip("-") not in SORT_KEYS:
            raise ValueError(f"unknown sort {sort!r}: use one of {', '.join(SORT_KEYS)}, or -KEY")
        cond = []
        if group_id is not None:
            cond.append(EpisodeRow.group_id == group_id)
        if has_tool_error is not None:
            cond.append(EpisodeRow.tool_error_count > 0 if has_tool_error else EpisodeRow.tool_error_count == 0)
        if drift is not None:
            cond.append(EpisodeRow.drift_count > 0 if drift else EpisodeRow.drift_count == 0)
        if run_id is not None:
            cond.append(EpisodeRow.run_id == run_id)
        if status is not None:
            cond.append(EpisodeRow.status == status)
        if env_id is not None:
            cond.append(EpisodeRow.env_id == env_id)
        if min_reward is not None:
            cond.append(EpisodeRow.reward >= min_reward)
        if max_reward is not None:
            cond.append(EpisodeRow.reward <= max_reward)
        if min_version is not None:
            cond.append(EpisodeRow.min_version >= min_version)
        if max_version is not None:
            cond.append(EpisodeRow.max_version <= max_version)
        desc = sort.startswith("-")
        key = SORT_KEYS[sort.lstrip("-")]
        if after_id is not None:
            later = EpisodeRow.id < after_id if desc else EpisodeRow.id > after_id
            if key is not None and after_key is not None:
                past = key < after_key if desc else key > after_key
                later = or_(past, and_(key == after_key, later))
            cond.append(later)
        order = [] if key is None else [key.desc() if desc else key.asc()]
        order.append(EpisodeRow.id.desc() if desc else EpisodeRow.id.asc())
        query = select(*_SUMMARY_COLUMNS).where(*cond).order_by(*order)
        if text:
            rows = search.page(conn, self.sqlite, text, query, limit)
        else:
            rows = conn.execute(query.limit(limit)).all()
        return [EpisodeSummary(*r) for r in rows]

    @read
    def get_episode(self, conn: Connection, episode_id: int) -> EpisodeDetail:
        row = conn.execute(select(*_SUMMARY_COLUMNS).where(EpisodeRow.id == episode_id)).one_or_none()
        if row is None:
            raise NotFoundError(f"episode {episode_id} does not exist: list ids with `agent-rl episodes list`")
        turns = conn.execute(
            select(TurnRow.index, TurnRow.span_start, TurnRow.num_tokens, TurnRow.num_prompt_tokens,
                   TurnRow.finish_reason, TurnRow.drift, TurnRow.started_at, TurnRow.finished_at, TurnRow.segment)
            .where(TurnRow.episode_id == episode_id).order_by(TurnRow.index)
        ).all()
        messages = conn.execute(
            select(MessageRow.turn_index, MessageRow.position, MessageRow.role, MessageRow.content,
                   MessageRow.tool_calls, MessageRow.name)
            .where(MessageRow.episode_id == episode_id).order_by(MessageRow.position)
        ).mappings().all()
        calls = conn.execute(
            select(ToolCallRow.turn_index, ToolCallRow.call_index, ToolCallRow.name, ToolCallRow.arguments,
                   ToolCallRow.status, ToolCallRow.output, ToolCallRow.exit_status, ToolCallRow.duration_s,
                   ToolCallRow.sandbox_error)
            .where(ToolCallRow.episode_id == episode_id)
            .order_by(ToolCallRow.turn_index, ToolCallRow.call_index)
        ).mappings().all()
        return EpisodeDetail(
            episode=EpisodeSummary(*row),
            turns=[TurnView(*t) for t in turns],
            messages=[dict(m) for m in messages],
            tool_calls=[dict(c) for c in calls],
        )

    async def episode_tokens(self, episode_id: int) -> TokenArrays:
        """The episode's whole token stream, its turns' spans joined in order."""
        tokens, _ = await self._tokens(episode_id)
        return tokens

    async def trainer_logprobs(self, episode_id: int) -> np.ndarray | None:
        """The trainer's logprobs for the token stream, or None if not recorded for every turn."""
        _, trainer = await self._tokens(episode_id)
        return trainer

    @read
    def _tokens(self, conn: Connection, episode_id: int) -> tuple[TokenArrays, np.ndarray | None]:
        if conn.scalar(select(EpisodeRow.id).where(EpisodeRow.id == episode_id)) is None:
            raise NotFoundError(f"episode {episode_id} does not exist")
        tokens, trainer, _ = episode_streams(conn, [episode_id])[episode_id]
        return tokens, trainer

    @read
    def get_task(self, conn: Connection, task_id: int) -> dict[str, Any]:
        """A task row: id, run_id, env_id, key (the task's id in its source) and payload."""
        return _row_by_id(conn, TaskRow, task_id, "task")

    @read
    def count_tasks(self, conn: Connection, run_id: int, env_id: str) -> int:
        """Tasks of the run drawn for `env_id` so far (a restarted scheduler skips them)."""
        return int(
            conn.scalar(
                select(func.count()).select_from(TaskRow)
                .where(TaskRow.run_id == run_id, TaskRow.env_id == env_id)
            ) or 0
        )

    @read
    def task_outcomes(self, conn: Connection, run_id: int, env_id: str,
                      limit: int = 5000) -> list[tuple[str, list[float]]]:
        """The run's newest `limit` decided groups of `env_id`, oldest first: each one's task key
        and the rewards of its finished episodes (for task selection at a restart)."""
        groups = (
            select(GroupRow.id, TaskRow.key).join(TaskRow, TaskRow.id == GroupRow.task_id)
            .where(GroupRow.run_id == run_id, GroupRow.env_id == env_id,
                   GroupRow.status != "open", GroupRow.status != "failed")
            .order_by(GroupRow.id.desc()).limit(limit)
        ).subquery()
        rows = conn.execute(
            select(groups.c.id, groups.c.key, EpisodeRow.reward)
            .join(EpisodeRow, EpisodeRow.group_id == groups.c.id)
            .where(EpisodeRow.status.in_(("completed", "trained", "filtered")),
                   EpisodeRow.reward.is_not(None))
            .order_by(groups.c.id, EpisodeRow.id)
        ).all()
        out: dict[int, tuple[str, list[float]]] = {}
        for gid, key, reward in rows:
            out.setdefault(gid, (key, []))[1].append(float(reward))
        return list(out.values())

    @read
    def unfinished_groups(self, conn: Connection, run_id: int, env_id: str | None = None) -> list[dict[str, Any]]:
        """Open groups of the run with their task and the ids of their still-waiting episodes
        (admitted but never started, e.g. before a restart), oldest first."""
        cond = [GroupRow.run_id == run_id, GroupRow.status == "open"]
        if env_id is not None:
            cond.append(GroupRow.env_id == env_id)
        groups = conn.execute(
            select(GroupRow.id, GroupRow.task_id, GroupRow.env_id).where(*cond).order_by(GroupRow.id)
        ).all()
        out = []
        for g in groups:
            waiting = conn.scalars(
                select(EpisodeRow.id).where(EpisodeRow.group_id == g.id, EpisodeRow.status == "waiting")
                .order_by(EpisodeRow.id)
            ).all()
            out.append({"group_id": g.id, "task_id": g.task_id, "env_id": g.env_id,
                        "waiting": list(waiting)})
        return out

    @read
    def queued_groups(
        self, conn: Connection, run_id: int, *, floor: int | None = None,
        measure: Measure = "tokens", siblings: Siblings = "baseline",
    ) -> tuple[int, int]:
        """The run's groups admitted and not yet taken by a trainer (running or ready), and of
        those the ready ones (finished, waiting for it) a claim with this staleness `floor` could
        still take (`agent_rl.store.staleness`; the stale ones are the trainer's to filter)."""
        queued = conn.scalar(
            select(func.count()).select_from(GroupRow)
            .where(GroupRow.run_id == run_id, GroupRow.status.in_(("open", "ready")))
        )
        ready = select(func.count()).select_from(GroupRow).where(
            GroupRow.run_id == run_id, GroupRow.status == "ready")
        if floor is not None:
            ready = ready.where(group_version(measure, siblings) >= floor)
        return int(queued or 0), int(conn.scalar(ready) or 0)

    @read
    def claimed_groups(self, conn: Connection, run_id: int) -> int:
        """The run's groups a trainer holds (claimed for its step now)."""
        return int(conn.scalar(select(func.count()).select_from(GroupRow).where(
            GroupRow.run_id == run_id, GroupRow.status == "claimed")) or 0)

    @read
    def episodes_by_id(self, conn: Connection, ids: list[int]) -> list[EpisodeSummary]:
        """These episodes' rows, by id (missing ids are left out)."""
        rows = conn.execute(
            select(*_SUMMARY_COLUMNS).where(EpisodeRow.id.in_(ids)).order_by(EpisodeRow.id)
        ).all()
        return [EpisodeSummary(*r) for r in rows]

    @read
    def group_episodes(self, conn: Connection, group_id: int) -> list[EpisodeSummary]:
        """The episodes of one group, by index."""
        rows = conn.execute(_GROUP_EPISODES, {"gid": group_id}).all()
        return [EpisodeSummary(*r) for r in rows]

    @read
    def ledger(self, conn: Connection, run_id: int | None = None, *, owner: str | None = None) -> Ledger:
        """Where the run's episodes are (all runs' without `run_id`; with `owner`, only the
        episodes that process ran, e.g. one serve's for its summary)."""
        return _ledger(conn, run_id, owner)

    @read
    def audit(self, conn: Connection, run_id: int) -> Audit:
        """Check the run's bookkeeping from the rows themselves (see `Audit`)."""
        ledger = _ledger(conn, run_id)
        sizes = conn.execute(_AUDIT_SIZES, {"run": run_id}).all()
        published = 0
        for (metrics,) in conn.execute(_AUDIT_PUBLISHED, {"run": run_id}):
            published += int((metrics or {}).get("episodes", 0))
        failed, filtered, trained = conn.execute(_AUDIT_FLAWS, {"run": run_id}).one()
        return Audit(
            ledger=ledger,
            lost=sum(max(size - n, 0) for size, n in sizes),
            not_terminal=ledger.waiting + ledger.running,
            failed_without_cause=int(failed or 0),
            filtered_without_reason=int(filtered or 0),
            trained_without_step=int(trained or 0),
            trained_by_steps=published,
        )

    @read
    def get_group(self, conn: Connection, group_id: int) -> dict[str, Any]:
        """A group row: task, env, size, status, filter reason, claim, trained step, times."""
        return _row_by_id(conn, GroupRow, group_id, "group")

    @read
    def list_runs(self, conn: Connection) -> list[dict[str, Any]]:
        """Every run (id, name, created_at, kind and, for an evaluation, the run and version it
        evaluated) with its latest policy version and episode count."""
        latest = (
            select(func.max(PolicyVersionRow.version)).where(PolicyVersionRow.run_id == RunRow.id)
            .scalar_subquery()
        )
        episodes = select(func.count(EpisodeRow.id)).where(EpisodeRow.run_id == RunRow.id).scalar_subquery()
        rows = conn.execute(
            select(RunRow.id, RunRow.name, RunRow.created_at, latest.label("latest_version"),
                   episodes.label("num_episodes"), RunRow.kind, RunRow.evaluates_run_id,
                   RunRow.evaluates_version).order_by(RunRow.id)
        ).mappings().all()
        return [dict(r) for r in rows]

    @read
    def get_run(self, conn: Connection, run_id: int) -> dict[str, Any]:
        """A run row with its config."""
        return _row_by_id(conn, RunRow, run_id, "run")

    @read
    def evaluations(self, conn: Connection, run_id: int) -> list[dict[str, Any]]:
        """The evaluation runs of training run `run_id` (`agent-rl eval`), by policy version:
        name, version, tasks, episodes, failed, the per-task mean rewards in task order (a
        failed episode scores 0: the policy earned nothing), their mean and its standard error
        over tasks."""
        rows = conn.execute(
            select(RunRow.id, RunRow.name, RunRow.evaluates_version, RunRow.created_at, EpisodeRow.task_id,
                   func.avg(func.coalesce(EpisodeRow.reward, 0.0)), func.count(),
                   func.sum(case((EpisodeRow.status == "failed", 1), else_=0)))
            .join(EpisodeRow, EpisodeRow.run_id == RunRow.id)
            .where(RunRow.kind == "eval", RunRow.evaluates_run_id == run_id,
                   EpisodeRow.status.in_(TERMINAL_EPISODE_STATUSES))
            .group_by(RunRow.id, RunRow.name, RunRow.evaluates_version, RunRow.created_at, EpisodeRow.task_id)
            .order_by(RunRow.id, EpisodeRow.task_id)
        ).all()
        out: dict[int, dict[str, Any]] = {}
        for rid, name, version, created, _, mean, n, failed in rows:
            e = out.setdefault(rid, {"run_id": rid, "name": name, "version": version,
                                     "created_at": created, "task_rewards": [], "episodes": 0,
                                     "failed": 0})
            e["task_rewards"].append(float(mean))
            e["episodes"] += int(n)
            e["failed"] += int(failed or 0)
        for e in out.values():
            r = e["task_rewards"]
            e["tasks"], e["mean"] = len(r), sum(r) / len(r)
            e["stderr"] = (math.sqrt(sum((x - e["mean"]) ** 2 for x in r) / (len(r) - 1) / len(r))
                           if len(r) > 1 else None)
        return sorted(out.values(), key=lambda e: (e["version"] is not None, e["version"] or 0,
                                                    e["run_id"]))

    @read
    def endings(self, conn: Connection, run_id: int | None = None, *, owner: str | None = None) -> Endings:
        """How the run's episodes ended, counted by reason (see `Endings`); with `owner`, only
        those that process ran."""
        cond = [] if run_id is None else [EpisodeRow.run_id == run_id]
        if owner is not None:
            cond.append(EpisodeRow.owner == owner)
        truncated = EpisodeRow.reward_details["truncated"].as_string()
        out = Endings()
        for reason, n in conn.execute(
            select(truncated, func.count()).where(
                *cond, EpisodeRow.status.in_(("completed", "trained", "filtered")),
                truncated.is_not(None), truncated.not_in(("false", "0")),  # SQLite: false is 0
            ).group_by(truncated)
        ):
            out.truncated[str(reason)] = int(n)
        for kind, n in conn.execute(
            select(FILTER_KIND, func.count()).where(*cond, EpisodeRow.status == "filtered")
            .group_by(FILTER_KIND)
        ):
            out.filtered[str(kind)] = int(n)
        for error_type, n in conn.execute(
            select(EpisodeRow.error_type, func.count()).where(*cond, EpisodeRow.status == "failed")
            .group_by(EpisodeRow.error_type)
        ):
            out.failed[str(error_type)] = int(n)
        return out

    @read
    def recent_activity(self, conn: Connection, run_id: int | None = None,
                        limit: int = 5000) -> dict[str, list[dict[str, Any]]]:
        """The newest `limit` finished episodes and tool calls (for throughput, staleness and
        latency statistics), and the run's policy versions with the step that made each."""
        ep_cond = [EpisodeRow.finished_at.is_not(None)]
        if run_id is not None:
            ep_cond.append(EpisodeRow.run_id == run_id)
        episodes = conn.execute(
            select(EpisodeRow.run_id, EpisodeRow.env_id, EpisodeRow.status, EpisodeRow.started_at,
                   EpisodeRow.finished_at, EpisodeRow.num_tokens, EpisodeRow.num_model_tokens,
                   EpisodeRow.min_version, EpisodeRow.trained_step, EpisodeRow.staleness)
            .where(*ep_cond).order_by(EpisodeRow.finished_at.desc()).limit(limit)
        ).mappings().all()
        calls = select(ToolCallRow.name, ToolCallRow.status, ToolCallRow.duration_s)
        if run_id is not None:
            calls = calls.join(EpisodeRow, EpisodeRow.id == ToolCallRow.episode_id).where(EpisodeRow.run_id == run_id)
        tool_calls = conn.execute(calls.order_by(ToolCallRow.id.desc()).limit(limit)).mappings().all()
        ver_cond = [] if run_id is None else [PolicyVersionRow.run_id == run_id]
        versions = conn.execute(
            select(PolicyVersionRow.run_id, PolicyVersionRow.version, PolicyVersionRow.trainer_step)
            .where(*ver_cond).order_by(PolicyVersionRow.version)
        ).mappings().all()
        return {
            "episodes": [dict(r) for r in episodes],
            "tool_calls": [dict(r) for r in tool_calls],
            "versions": [dict(r) for r in versions],
        }


def _row_by_id(conn: Connection, table: type[TaskRow | GroupRow | RunRow], row_id: int,
               noun: str) -> dict[str, Any]:
    """The row `row_id` of `table` as a dict; NotFoundError naming the `noun` if there is none."""
    row = conn.execute(select(table).where(table.id == row_id)).mappings().one_or_none()
    if row is None:
        raise NotFoundError(f"{noun} {row_id} does not exist")
    return dict(row)


# The ledger's and the audit's statements, built once (a statement built per call costs its cache
# key each time, more than these queries' execution: the lifecycle's state machine test audits
# after each of its thousands of steps, and serve's summary and the API read the ledger).
_LEDGER_ROWS = {
    (by_run, by_owner): select(EpisodeRow.status, RunRow.kind, func.count(), func.avg(EpisodeRow.reward))
    .join(RunRow, RunRow.id == EpisodeRow.run_id)
    .where(*([EpisodeRow.run_id == bindparam("run")] if by_run else []),
           *([EpisodeRow.owner == bindparam("owner")] if by_owner else []))
    .group_by(EpisodeRow.status, RunRow.kind)
    for by_run in (False, True) for by_owner in (False, True)
}  # fmt: skip
_ADMITTED = {
    by_run: select(func.coalesce(func.sum(GroupRow.size), 0))
    .where(*([GroupRow.run_id == bindparam("run")] if by_run else []))
    for by_run in (False, True)
}  # fmt: skip
_AUDIT_SIZES = (
    select(GroupRow.size, func.count(EpisodeRow.id)).select_from(GroupRow)
    .outerjoin(EpisodeRow, EpisodeRow.group_id == GroupRow.id)
    .where(GroupRow.run_id == bindparam("run"), GroupRow.status != "open").group_by(GroupRow.id, GroupRow.size)
)  # fmt: skip
_AUDIT_PUBLISHED = select(PolicyVersionRow.metrics).where(PolicyVersionRow.run_id == bindparam("run"))


def _count_where(*cond: Any) -> Any:
    return func.sum(case((and_(*cond), 1), else_=0))


_AUDIT_FLAWS = select(
    _count_where(EpisodeRow.status == "failed",
                 or_(EpisodeRow.error_type.is_(None), EpisodeRow.error_cause.is_(None))),
    _count_where(EpisodeRow.status == "filtered", EpisodeRow.filter_reason.is_(None)),
    _count_where(EpisodeRow.status == "trained", EpisodeRow.trained_step.is_(None)),
).where(EpisodeRow.run_id == bindparam("run"))  # fmt: skip


def _ledger(conn: Connection, run_id: int | None, owner: str | None = None) -> Ledger:
    params = {"run": run_id, "owner": owner}
    rows = conn.execute(_LEDGER_ROWS[run_id is not None, owner is not None], params).all()
    counts: dict[str, int] = {}
    for status, kind, n, _ in rows:
        # No trainer consumes an evaluation run: its ended episodes are scored, not in flight.
        key = "scored" if kind == "eval" and status == "completed" else status
        counts[key] = counts.get(key, 0) + int(n)
    rewarded = [(int(n), float(r)) for status, _, n, r in rows if r is not None and status != "failed"]
    total = sum(n for n, _ in rewarded)
    mean = sum(n * r for n, r in rewarded) / total if total else None
    if owner is None:
        # Counted from the groups as admitted, not from the episode rows: a lost row shows.
        admitted = int(conn.scalar(_ADMITTED[run_id is not None], params))
    else:
        admitted = sum(counts.values())  # the episodes it ran: its share of admission
    return Ledger(admitted=admitted, mean_reward=mean, **counts)


def episode_streams(
    conn: Connection, episode_ids: list[int]
) -> dict[int, tuple[TokenArrays, np.ndarray | None, list[int]]]:
    """Each episode's whole token stream (its turns' spans joined in order), the trainer's
    logprobs for it (None unless recorded for every turn) and where each of its segments starts
    in the stream (`Turn.segment`; `[0]` for an episode of one), from one query over all of them."""
    import numpy as np

    rows = conn.execute(
        select(TurnRow.episode_id, TurnRow.codec, TurnRow.token_ids, TurnRow.logprobs, TurnRow.loss_mask,
               TurnRow.versions, TurnRow.routed_experts, TurnRow.experts_shape, TurnRow.trainer_logprobs,
               TurnRow.span_start, TurnRow.segment)
        .where(TurnRow.episode_id.in_(episode_ids)).order_by(TurnRow.episode_id, TurnRow.index)
    ).all()
    turns: dict[int, list[Any]] = {eid: [] for eid in episode_ids}
    for t in rows:
        turns[t.episode_id].append(t)
    out = {}
    for eid, rows_of in turns.items():
        spans = [_span(t) for t in rows_of]
        trainer = [codec.decode(t.trainer_logprobs, codec.LOGPROB_DTYPE, t.codec)
                   for t in rows_of if t.trainer_logprobs is not None]
        full = np.concatenate(trainer) if trainer and len(trainer) == len(rows_of) else None
        starts = [0] + [t.span_start for prev, t in zip(rows_of, rows_of[1:])
                        if t.segment != prev.segment]
        out[eid] = (TokenArrays.concat(spans), full, starts)
    return out


def _span(t: Any) -> TokenArrays:
    experts = None
    if t.routed_experts is not None:
        layers, topk = (int(x) for x in t.experts_shape.split(","))
        experts = codec.decode(t.routed_experts, codec.EXPERT_DTYPE, t.codec, (-1, layers, topk))
    return TokenArrays(
        token_ids=codec.decode(t.token_ids, codec.TOKEN_DTYPE, t.codec),
        logprobs=codec.decode(t.logprobs, codec.LOGPROB_DTYPE, t.codec),
        loss_mask=codec.decode(t.loss_mask, codec.MASK_DTYPE, t.codec),
        versions=codec.decode(t.versions, codec.VERSION_DTYPE, t.codec),
        routed_experts=experts,
    )

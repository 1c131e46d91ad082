"""Writes that move runs, groups and episodes through their lifecycle.

Admission creates a group and its n episodes as `waiting` in one transaction (the scheduler's
starts the first one in it too: it runs at once). The runner then starts each other episode,
appends its turns one transaction each as they complete (a crash loses at most the turn in
flight), and ends it in exactly one terminal state. Once every episode of a group is terminal,
the scheduler decides the group (with its last episode's end when nothing else is needed):
`ready` for the trainer, or `filtered` / `failed`. A restarted server resolves episodes left running by a process that died.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Integer, bindparam, case, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from agent_rl.kernel.errors import NotFoundError, StoreError
from agent_rl.store import arrays as codec
from agent_rl.store.base import StoreBase, now, read, write
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
from agent_rl.store.records import EpisodeEnd, MessageRecord, TurnRecord
from agent_rl.store.queries import LATEST_VERSION

if TYPE_CHECKING:
    import numpy as np


class LifecycleWrites(StoreBase):
    @write()
    def ensure_run(
        self, conn: Connection, name: str, config: dict[str, Any] | None = None, *,
        kind: str = "train", evaluates_run_id: int | None = None,
        evaluates_version: int | None = None,
    ) -> int:
        """The id of the run called `name`, created if new: a training run with policy version
        0, or (`kind="eval"`) an evaluation of run `evaluates_run_id` at `evaluates_version`,
        which has no policy versions of its own (no trainer consumes it)."""
        run_id = conn.scalar(select(RunRow.id).where(RunRow.name == name))
        if run_id is not None:
            return run_id
        t = now()
        try:
            with conn.begin_nested():
                run_id = conn.scalar(
                    insert(RunRow).values(name=name, config=config or {}, created_at=t, kind=kind,
                                       evaluates_run_id=evaluates_run_id,
                                       evaluates_version=evaluates_version).returning(RunRow.id)
                )
                if kind == "train":
                    conn.execute(insert(PolicyVersionRow).values(run_id=run_id, version=0, created_at=t))
        except IntegrityError:
            # Another process (a second serve, the trainer) created it since our select.
            run_id = conn.scalar(select(RunRow.id).where(RunRow.name == name))
            if run_id is None:
                raise
        return run_id

    @write()
    def add_task(self, conn: Connection, run_id: int, env_id: str, key: str, payload: dict[str, Any]) -> int:
        return _add_task(conn, run_id, env_id, key, payload)

    @write(durable=False)
    def admit_task(
        self, conn: Connection, run_id: int, env_id: str, key: str, payload: dict[str, Any],
        size: int, seeds: list[int] | None = None, *, start: str | None = None,
        served_version: int | None = None, max_staleness: int = 0,
    ) -> tuple[int, list[int]] | None:
        """`add_task` then `admit_group` of that task, in one transaction (the scheduler's
        admission of a drawn task: one commit per group, not two); returns (group id, episode
        ids). With `start` (a serve process), the group's first episode is also started,
        owned by it (`start_episode`), in the same transaction: the scheduler runs it at once.
        With `served_version` (the policy version the engines serve), nothing is admitted and
        None returned if it is more than `max_staleness` versions behind the run's newest: the
        staleness check and the admission are one transaction, without a read of their own.
        Bookkeeping, as `admit_group` and `start_episode` are (`agent_rl.store.db`): lost in
        a crash of the machine only with everything written after it, the episode's own turns
        included, so a restart draws the task again."""
        if served_version is not None:
            latest = LATEST_VERSION.scalar(conn, {"run": run_id})
            if served_version < (latest or 0) - max_staleness:
                return None
        task_id = _add_task(conn, run_id, env_id, key, payload)
        group_id, episodes = self._admit_group(conn, run_id, task_id, env_id, size, seeds)
        if start is not None:
            _START.rowcount(conn, {"eid": episodes[0], "owner": start, "t": now()})
        return group_id, episodes

    @write(durable=False)
    def admit_group(
        self, conn: Connection, run_id: int, task_id: int, env_id: str, size: int,
        seeds: list[int] | None = None, *, parent_episode_id: int | None = None,
    ) -> tuple[int, list[int]]:
        """Create a group of `size` waiting episodes; returns (group id, episode ids).
        `parent_episode_id` links each episode to the one it was forked from (in the same
        transaction, so no fork exists without its link)."""
        return self._admit_group(conn, run_id, task_id, env_id, size, seeds, parent_episode_id)

    def _admit_group(
        self, conn: Connection, run_id: int, task_id: int, env_id: str, size: int,
        seeds: list[int] | None, parent_episode_id: int | None = None,
    ) -> tuple[int, list[int]]:
        if size < 1:
            raise ValueError("a group needs at least one episode")
        seeds = seeds if seeds is not None else [None] * size  # type: ignore[list-item]
        t = now()
        group_id = _INSERT_GROUP.scalar(conn, dict(run_id=run_id, task_id=task_id, env_id=env_id,
                                                   size=size, status="open", created_at=t))  # fmt: skip
        # One row at a time on the driver's cursor: SQLAlchemy's executemany with RETURNING
        # cost ~0.3 ms of CPU per admission, more than the rows themselves for a small group.
        episodes = [
            _INSERT_EPISODE.scalar(conn, dict(run_id=run_id, group_id=group_id, task_id=task_id,
                                              env_id=env_id, index=i, seed=seeds[i], created_at=t,
                                              parent_episode_id=parent_episode_id))
            for i in range(size)
        ]  # fmt: skip
        return group_id, episodes

    @write(durable=False)
    def start_episode(self, conn: Connection, episode_id: int, owner: str) -> None:
        """waiting -> running, owned by `owner` (a serve process)."""
        t = now()
        if _START.rowcount(conn, {"eid": episode_id, "owner": owner, "t": t}) != 1:
            _raise_state(conn, episode_id, "waiting")

    @write()
    def append_turn(
        self, conn: Connection, episode_id: int, turn: TurnRecord, *,
        final_reward: float | None = None, reward_details: dict[str, Any] | None = None,
    ) -> int:
        """Persist one completed turn atomically; returns its index. With `final_reward`, the
        episode is completed in the same transaction (one durable commit for its last turn)."""
        if final_reward is None:
            return self._append(conn, episode_id, turn)
        end = EpisodeEnd("completed", reward=final_reward, reward_details=reward_details, turn=turn)
        return self._end(conn, episode_id, end) - 1

    @write()
    def append_turns(self, conn: Connection, episode_id: int, turns: list[TurnRecord]) -> int:
        """Persist turns in order, atomically (an agent's held turns, `AgentSession`); returns
        the last one's index."""
        if not turns:
            raise ValueError("append_turns needs at least one turn")
        for turn in turns:
            index = self._append(conn, episode_id, turn)
        return index

    @write()
    def add_messages(self, conn: Connection, episode_id: int, messages: list[MessageRecord]) -> None:
        """Record messages outside a turn (e.g. the environment's final observation)."""
        self._add_messages(conn, episode_id, messages)

    @write()
    def end_episode(self, conn: Connection, episode_id: int, end: EpisodeEnd) -> int:
        """The one way an episode ends: its last turn and trailing messages (if any) and its
        terminal state, in one transaction; returns its number of turns. `completed` needs a
        running episode, `failed` a waiting or running one; otherwise StoreError."""
        return self._end(conn, episode_id, end)

    @write()
    def end_episode_and_group(self, conn: Connection, episode_id: int, end: EpisodeEnd,
                              group_id: int) -> tuple[int, str | None]:  # fmt: skip
        """`end_episode`, then, in the same transaction, `complete_group(group_id)` (the
        episode's group, with no filter and the episodes' own rewards) if none of the group's
        episodes is waiting or running any more: one commit for the last episode of a group,
        and no read of the group's episodes, when nothing needs them before the decision (no
        group reward hook, task selection or zero-variance filter). Returns the episode's number
        of turns and the group's status, or None when it is still open (episodes in flight)."""
        turns = self._end(conn, episode_id, end)
        return turns, self._complete_group(conn, group_id, None, None, unless_in_flight=True)

    @write()
    def finish_episode(
        self, conn: Connection, episode_id: int, reward: float,
        reward_details: dict[str, Any] | None = None,
    ) -> None:
        """running -> completed with its reward (`end_episode` without a last turn)."""
        self._end(conn, episode_id, EpisodeEnd("completed", reward, reward_details))

    @write()
    def fail_episode(self, conn: Connection, episode_id: int, error_type: str, cause: str) -> None:
        """waiting|running -> failed, with the error's type and a readable cause."""
        self._end(conn, episode_id, EpisodeEnd("failed", error_type=error_type, error_cause=cause))

    def _end(self, conn: Connection, episode_id: int, end: EpisodeEnd) -> int:
        for turn in end.unwritten:
            self._append(conn, episode_id, turn)
        if end.turn is not None:
            self._append(conn, episode_id, end.turn)
        if end.messages:
            self._add_messages(conn, episode_id, end.messages)
        if end.status == "completed":
            statement, allowed = _COMPLETE, "running"
            values: dict[str, Any] = dict(reward=float(end.reward or 0.0),
                                          details=end.reward_details)
        elif end.status == "failed":
            statement, allowed = _FAIL, "waiting or running"
            values = dict(error_type=end.error_type, cause=_text(end.error_cause))
        else:
            raise ValueError(f"an episode ends completed or failed, not {end.status!r}")
        row = statement.one_or_none(conn, dict(eid=episode_id, t=now(), **values))
        if row is None:
            _raise_state(conn, episode_id, allowed)
        return int(row[0])

    def _append(self, conn: Connection, episode_id: int, turn: TurnRecord) -> int:
        tokens = turn.tokens
        model = tokens.loss_mask.astype(bool)
        model_versions = tokens.versions[model]
        enc = codec.CODEC_ZLIB if self.cfg.compress_tokens else codec.CODEC_RAW
        # The episode's counters move first, in one statement that also checks it is running
        # and returns where the turn goes: one round trip fewer than reading them first.
        row = _UPDATE_FOR_TURN.one_or_none(
            conn,
            dict(
                eid=episode_id, messages=len(turn.messages), tokens=len(tokens),
                model_tokens=int(model.sum()), lo=_min(model_versions), hi=_max(model_versions),
                drift=int(turn.drift),
                tool_errors=sum(c.status != "ok" for c in turn.tool_calls),
                heartbeat_at=turn.finished_at,
            ),
        )
        if row is None:
            status = conn.scalar(select(EpisodeRow.status).where(EpisodeRow.id == episode_id))
            if status is None:
                raise NotFoundError(f"episode {episode_id} does not exist")
            raise StoreError(f"episode {episode_id} is {status}, not running: cannot add a turn")
        num_turns, num_tokens, num_messages = row
        index = num_turns - 1
        experts = tokens.routed_experts
        _INSERT_TURN.rowcount(
            conn,
            dict(
                episode_id=episode_id, index=index, span_start=num_tokens - len(tokens),
                num_tokens=len(tokens), num_prompt_tokens=turn.num_prompt_tokens,
                finish_reason=turn.finish_reason, drift=turn.drift, segment=turn.segment,
                started_at=turn.started_at, finished_at=turn.finished_at, codec=enc,
                token_ids=codec.encode(tokens.token_ids, enc),
                logprobs=codec.encode(tokens.logprobs, enc),
                loss_mask=codec.encode(tokens.loss_mask, enc),
                versions=codec.encode(tokens.versions, enc),
                routed_experts=None if experts is None else codec.encode(experts, enc),
                experts_shape=None if experts is None else f"{experts.shape[1]},{experts.shape[2]}",
                trainer_logprobs=None,
            ),
        )
        _insert_messages(conn, episode_id, index, num_messages - len(turn.messages), turn.messages)
        if turn.tool_calls:
            _INSERT_TOOL_CALL.many(
                conn,
                [
                    dict(episode_id=episode_id, turn_index=index, call_index=i, name=_text(c.name),
                         arguments=_text(c.arguments), status=c.status, output=_text(c.output),
                         exit_status=c.exit_status, duration_s=c.duration_s,
                         sandbox_error=_text(c.sandbox_error))
                    for i, c in enumerate(turn.tool_calls)
                ],
            )
        return index

    def _add_messages(self, conn: Connection, episode_id: int, messages: list[MessageRecord]) -> None:
        row = conn.execute(
            select(EpisodeRow.num_turns, EpisodeRow.num_messages).where(EpisodeRow.id == episode_id)
        ).one_or_none()
        if row is None:
            raise NotFoundError(f"episode {episode_id} does not exist")
        _insert_messages(conn, episode_id, max(row.num_turns - 1, 0), row.num_messages, messages)
        conn.execute(
            update(EpisodeRow).where(EpisodeRow.id == episode_id)
            .values(num_messages=row.num_messages + len(messages))
        )

    @write(durable=False)
    def heartbeat(self, conn: Connection, owner: str) -> None:
        """Mark `owner`'s running episodes as alive."""
        conn.execute(
            update(EpisodeRow)
            .where(EpisodeRow.owner == owner, EpisodeRow.status == "running")
            .values(heartbeat_at=now())
        )

    @write()
    def resume_interrupted(
        self, conn: Connection, *, run_id: int, env_ids: Collection[str], max_resumes: int,
        owner: str | None = None, stale_after_s: float | None = None,
    ) -> list[int]:
        """Give running episodes of these envs whose process is gone (by owner, or silent for
        `stale_after_s`) back to `waiting`, each at most `max_resumes` times, to be resumed by
        a live serve from the turns they persisted; returns their ids. `resolve_interrupted`
        then fails what is left."""
        cond = _gone(owner, stale_after_s) + [
            EpisodeRow.run_id == run_id, EpisodeRow.env_id.in_(list(env_ids)),
            EpisodeRow.resumes < max_resumes,
        ]
        ids = list(conn.scalars(select(EpisodeRow.id).where(*cond).order_by(EpisodeRow.id)).all())
        if ids:
            conn.execute(
                update(EpisodeRow).where(EpisodeRow.id.in_(ids), EpisodeRow.status == "running")
                .values(status="waiting", owner=None, resumes=EpisodeRow.resumes + 1)
            )
        return ids

    @write()
    def resolve_interrupted(
        self, conn: Connection, *, owner: str | None = None, stale_after_s: float | None = None,
        run_id: int | None = None,
    ) -> list[int]:
        """Fail running episodes whose process is gone (by owner, or silent for `stale_after_s`)
        with cause "interrupted"; returns their ids. Their turns so far stay for inspection."""
        cond = _gone(owner, stale_after_s)
        if run_id is not None:
            cond.append(EpisodeRow.run_id == run_id)
        ids = list(conn.scalars(select(EpisodeRow.id).where(*cond).order_by(EpisodeRow.id)).all())
        if ids:
            conn.execute(
                update(EpisodeRow)
                .where(EpisodeRow.id.in_(ids), EpisodeRow.status == "running")
                .values(status="failed", error_type="Interrupted",
                        error_cause="interrupted: the process running it stopped", finished_at=now())
            )
        return ids

    @write()
    def complete_group(
        self, conn: Connection, group_id: int, *, filter_reason: str | None = None,
        rewards: dict[int, float] | None = None,
    ) -> str:
        """Decide a group whose episodes are all terminal: `filtered` (its completed episodes
        too, with the reason), `ready` if any episode completed, else `failed`. `rewards`
        replaces completed episodes' rewards (a group reward hook's result) in the same
        transaction. Returns the group's status; a group already decided is left as it is."""
        status = self._complete_group(conn, group_id, filter_reason, rewards)
        assert status is not None
        return status

    def _complete_group(self, conn: Connection, group_id: int, filter_reason: str | None,
                        rewards: dict[int, float] | None, *,
                        unless_in_flight: bool = False) -> str | None:  # fmt: skip
        """`complete_group`; with `unless_in_flight`, a group with episodes still in flight is
        left open (None) rather than refused."""
        status = _GROUP_STATUS.scalar(conn, {"gid": group_id})
        if status is None:
            raise NotFoundError(f"group {group_id} does not exist")
        if status != "open":
            return status
        if rewards:
            _SET_REWARD.many(conn, [dict(eid=e, gid=group_id, reward=float(r))
                                    for e, r in rewards.items()])
        rows = [_Versions(*r) for r in _GROUP_VERSIONS.all(conn, {"gid": group_id})]
        pending = [r for r in rows if r.status not in TERMINAL_EPISODE_STATUSES]
        if pending and unless_in_flight:
            return None
        if pending:
            raise StoreError(f"group {group_id} still has {len(pending)} episodes in flight")
        completed = [r for r in rows if r.status == "completed"]
        if filter_reason is not None:
            _FILTER_GROUP_EPISODES.rowcount(conn, {"gid": group_id, "reason": filter_reason})
            new, values = "filtered", {"reason": filter_reason}
        elif completed:
            oldest = [r.min_version for r in completed if r.min_version is not None]
            newest = [r.max_version for r in completed if r.max_version is not None]
            new = "ready"
            values = {"t": now(), "lo": min(oldest) if oldest else None,
                      "hi": min(newest) if newest else None}
        else:
            new, values = "failed", {}
        _DECIDE_GROUP[new].rowcount(conn, {"gid": group_id, **values})
        return new

    @read
    def groups_to_complete(self, conn: Connection, run_id: int) -> list[int]:
        """Open groups none of whose episodes is waiting or running (e.g. after a restart)."""
        busy = select(EpisodeRow.group_id).where(EpisodeRow.status.in_(("waiting", "running")))
        return list(
            conn.scalars(
                select(GroupRow.id)
                .where(GroupRow.run_id == run_id, GroupRow.status == "open", GroupRow.id.not_in(busy))
                .order_by(GroupRow.id)
            ).all()
        )

    @write()
    def record_trainer_logprobs(self, conn: Connection, episode_id: int, logprobs: np.ndarray) -> None:
        """Store the trainer's logprobs for an episode's whole token stream, split by turn."""
        import numpy as np

        logprobs = np.ascontiguousarray(logprobs, dtype=codec.LOGPROB_DTYPE)
        turns = conn.execute(
            select(TurnRow.id, TurnRow.span_start, TurnRow.num_tokens, TurnRow.codec)
            .where(TurnRow.episode_id == episode_id)
        ).all()
        total = sum(t.num_tokens for t in turns)
        if total != logprobs.shape[0]:
            raise StoreError(f"episode {episode_id} has {total} tokens, got {logprobs.shape[0]} logprobs")
        for t in turns:
            span = logprobs[t.span_start : t.span_start + t.num_tokens]
            conn.execute(
                update(TurnRow).where(TurnRow.id == t.id).values(trainer_logprobs=codec.encode(span, t.codec))
            )


# The hot path's statements are built once: constructing SQLAlchemy statements per call cost
# more CPU than the database work for a turn. Those each turn or episode runs go to the driver's
# cursor (`DriverStatement`): SQLAlchemy's per-execute work cost about as much again.
_START = DriverStatement(
    update(EpisodeRow)
    .where(EpisodeRow.id == bindparam("eid"), EpisodeRow.status == "waiting")
    # A resumed episode keeps the start of its first run.
    .values(status="running", owner=bindparam("owner"),
            started_at=func.coalesce(EpisodeRow.started_at, bindparam("t")), heartbeat_at=bindparam("t"))
)
_INSERT_TASK = DriverStatement(insert(TaskRow).returning(TaskRow.id),
                               ["run_id", "env_id", "key", "payload", "created_at"])
_INSERT_GROUP = DriverStatement(insert(GroupRow).returning(GroupRow.id),
                                ["run_id", "task_id", "env_id", "size", "status", "created_at"])
_INSERT_EPISODE = DriverStatement(
    # The columns' Python-side defaults are given as the statement's own values.
    insert(EpisodeRow).values(status="waiting", num_turns=0, num_messages=0, num_tokens=0,
                              num_model_tokens=0, resumes=0, drift_count=0, tool_error_count=0)
    .returning(EpisodeRow.id),
    ["run_id", "group_id", "task_id", "env_id", "index", "seed", "created_at", "parent_episode_id"])
_INSERT_TURN = DriverStatement(insert(TurnRow), [
    "episode_id", "index", "span_start", "num_tokens", "num_prompt_tokens", "finish_reason", "drift",
    "segment", "started_at", "finished_at", "codec", "token_ids", "logprobs", "loss_mask", "versions",
    "routed_experts", "experts_shape", "trainer_logprobs",
])
_INSERT_MESSAGE = DriverStatement(insert(MessageRow), [
    "episode_id", "turn_index", "position", "role", "content", "tool_calls", "name",
])
_INSERT_TOOL_CALL = DriverStatement(insert(ToolCallRow), [
    "episode_id", "turn_index", "call_index", "name", "arguments", "status", "output", "exit_status",
    "duration_s", "sandbox_error",
])
_LO, _HI = bindparam("lo", type_=Integer), bindparam("hi", type_=Integer)
_UPDATE_FOR_TURN = DriverStatement(
    update(EpisodeRow)
    .where(EpisodeRow.id == bindparam("eid"), EpisodeRow.status == "running")
    .values(
        num_turns=EpisodeRow.num_turns + 1,
        num_messages=EpisodeRow.num_messages + bindparam("messages", type_=Integer),
        num_tokens=EpisodeRow.num_tokens + bindparam("tokens", type_=Integer),
        num_model_tokens=EpisodeRow.num_model_tokens + bindparam("model_tokens", type_=Integer),
        # The turn's model tokens widen the episode's version range (NULL: none yet).
        min_version=case((_LO.is_(None), EpisodeRow.min_version),
                         (EpisodeRow.min_version.is_(None) | (_LO < EpisodeRow.min_version), _LO),
                         else_=EpisodeRow.min_version),
        max_version=case((_HI.is_(None), EpisodeRow.max_version),
                         (EpisodeRow.max_version.is_(None) | (_HI > EpisodeRow.max_version), _HI),
                         else_=EpisodeRow.max_version),
        drift_count=EpisodeRow.drift_count + bindparam("drift", type_=Integer),
        tool_error_count=EpisodeRow.tool_error_count + bindparam("tool_errors", type_=Integer),
        heartbeat_at=bindparam("heartbeat_at"),
    )
    .returning(EpisodeRow.num_turns, EpisodeRow.num_tokens, EpisodeRow.num_messages)
)
_COMPLETE = DriverStatement(
    update(EpisodeRow)
    .where(EpisodeRow.id == bindparam("eid"), EpisodeRow.status == "running")
    .values(status="completed", finished_at=bindparam("t"), reward=bindparam("reward"),
            reward_details=bindparam("details", type_=EpisodeRow.reward_details.type))
    .returning(EpisodeRow.num_turns)
)
_FAIL = DriverStatement(
    update(EpisodeRow)
    # Not `in_`: its expanding parameter needs SQLAlchemy's execution.
    .where(EpisodeRow.id == bindparam("eid"), or_(EpisodeRow.status == "waiting", EpisodeRow.status == "running"))
    .values(status="failed", finished_at=bindparam("t"), error_type=bindparam("error_type"),
            error_cause=bindparam("cause"))
    .returning(EpisodeRow.num_turns)
)
# A group's decision, once per group (per episode with groups of one).
_GROUP_STATUS = DriverStatement(select(GroupRow.status).where(GroupRow.id == bindparam("gid")))
_GROUP_VERSIONS = DriverStatement(select(EpisodeRow.status, EpisodeRow.min_version, EpisodeRow.max_version)
                                  .where(EpisodeRow.group_id == bindparam("gid")))
_Versions = namedtuple("_Versions", ["status", "min_version", "max_version"])
_FILTER_GROUP_EPISODES = DriverStatement(
    update(EpisodeRow)
    .where(EpisodeRow.group_id == bindparam("gid"), EpisodeRow.status == "completed")
    .values(status="filtered", filter_reason=bindparam("reason"))
)
_GROUP_ID = GroupRow.id == bindparam("gid")
_DECIDE_GROUP = {
    "filtered": DriverStatement(update(GroupRow).where(_GROUP_ID).values(
        status="filtered", filter_reason=bindparam("reason"))),
    "ready": DriverStatement(update(GroupRow).where(_GROUP_ID).values(
        status="ready", ready_at=bindparam("t"), min_version=bindparam("lo", type_=Integer),
        newest_version=bindparam("hi", type_=Integer))),
    "failed": DriverStatement(update(GroupRow).where(_GROUP_ID).values(status="failed")),
}
_SET_REWARD = DriverStatement(
    update(EpisodeRow)
    .where(EpisodeRow.id == bindparam("eid"), EpisodeRow.group_id == bindparam("gid"),
           EpisodeRow.status == "completed")
    .values(reward=bindparam("reward"))
)


def _add_task(conn: Connection, run_id: int, env_id: str, key: str, payload: dict[str, Any]) -> int:
    return int(_INSERT_TASK.scalar(conn, dict(run_id=run_id, env_id=env_id, key=key, payload=payload,
                                              created_at=now())))  # fmt: skip


def _insert_messages(
    conn: Connection, episode_id: int, turn_index: int, start: int, messages: list[MessageRecord]
) -> None:
    if messages:
        _INSERT_MESSAGE.many(
            conn,
            [
                dict(episode_id=episode_id, turn_index=turn_index, position=start + i,
                     role=m.role, content=_text(m.content), tool_calls=m.tool_calls, name=_text(m.name))
                for i, m in enumerate(messages)
            ],
        )


def _text(value: str | None) -> str | None:
    """Text as stored: PostgreSQL text cannot hold NUL, which a model can generate, so NUL is
    stored as U+FFFD on every backend (the token arrays keep the exact ids)."""
    return value.replace("\x00", "\ufffd") if value else value


def _gone(owner: str | None, stale_after_s: float | None) -> list[Any]:
    """Running episodes whose process stopped: by its owner name, or silent for a while."""
    if owner is None and stale_after_s is None:
        raise ValueError("give the owner that stopped or a staleness threshold")
    cond: list[Any] = [EpisodeRow.status == "running"]
    if owner is not None:
        cond.append(EpisodeRow.owner == owner)
    if stale_after_s is not None:
        cond.append(EpisodeRow.heartbeat_at < now() - stale_after_s)
    return cond


def _raise_state(conn: Connection, episode_id: int, expected: str) -> None:
    status = conn.scalar(select(EpisodeRow.status).where(EpisodeRow.id == episode_id))
    if status is None:
        raise NotFoundError(f"episode {episode_id} does not exist")
    raise StoreError(f"episode {episode_id} is {status}, expected {expected}")


def _min(a: np.ndarray) -> int | None:
    return int(a.min()) if a.size else None


def _max(a: np.ndarray) -> int | None:
    return int(a.max()) if a.size else None

"""How trainers consume the store: claim ready groups under a lease, commit them as trained.

`claim` takes ready groups (and groups whose lease expired) whose policy version is at least the
staleness floor, nearest to going stale first (the lowest version, then the oldest ready), and
marks them claimed by a fresh claim id. `commit` then, in ONE
transaction, marks those groups and their completed episodes trained by the step and records
the new policy version; if any group's claim was taken over after its lease expired, nothing is
written and LeaseLostError is raised. So two trainers, or a restarted one, never train the same
episode twice. PostgreSQL uses `FOR UPDATE SKIP LOCKED`; SQLite an immediate transaction.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import Connection, bindparam, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from agent_rl.kernel.errors import LeaseLostError, StoreError
from agent_rl.store.base import StoreBase, now, read, write
from agent_rl.store.models import EpisodeRow, GroupRow, PolicyVersionRow
from agent_rl.store.queries import episode_streams
from agent_rl.store.records import Claim, ClaimedEpisode, ClaimedGroup
from agent_rl.store.staleness import Measure, Siblings, group_version


class Consumption(StoreBase):
    @write(durable=False)  # a claim lost to a power failure only makes its commit fail
    def claim(
        self,
        conn: Connection,
        run_id: int,
        trainer_id: str,
        max_groups: int,
        *,
        min_version: int | None = None,
        measure: Measure = "tokens",
        siblings: Siblings = "baseline",
        lease_s: float = 300.0,
    ) -> Claim:
        """Claim up to `max_groups` ready groups whose version (by `measure` and `siblings`,
        `agent_rl.store.staleness`) is at least `min_version`, the lowest version first, then
        the oldest ready: a group one step from going stale is trained before a fresher one that
        can wait a step (earliest deadline first), instead of being filtered as stale behind it
        when more groups are ready than a step takes. The claim may hold fewer (or none)."""
        t = now()
        claim_id = uuid.uuid4().hex
        version = group_version(measure, siblings)
        candidates = (
            select(GroupRow.id)
            .where(
                GroupRow.run_id == run_id,
                or_(GroupRow.status == "ready",
                    (GroupRow.status == "claimed") & (GroupRow.lease_expires_at < t)),
            )
            .order_by(version, GroupRow.ready_at, GroupRow.id)
            .limit(max_groups)
        )
        if min_version is not None:
            candidates = candidates.where(version >= min_version)
        if not self.sqlite:
            candidates = candidates.with_for_update(skip_locked=True)
        # One statement picks and marks the groups, so a claim costs two round trips in all.
        mark = (
            update(GroupRow)
            .where(GroupRow.id.in_(candidates.scalar_subquery()))
            .values(status="claimed", claim_id=claim_id, claimed_by=trainer_id,
                    lease_expires_at=t + lease_s)
            .returning(GroupRow.id, GroupRow.task_id, GroupRow.env_id, GroupRow.min_version, GroupRow.ready_at)
        )
        groups = sorted(conn.execute(mark).all(), key=lambda g: (g.ready_at, g.id))
        ids = [g.id for g in groups]
        episodes = conn.execute(
            select(EpisodeRow.group_id, EpisodeRow.id)
            .where(EpisodeRow.group_id.in_(ids), EpisodeRow.status == "completed")
            .order_by(EpisodeRow.id)
        ).all() if ids else []
        by_group: dict[int, list[int]] = {}
        for gid, eid in episodes:
            by_group.setdefault(gid, []).append(eid)
        return Claim(
            claim_id=claim_id,
            trainer_id=trainer_id,
            lease_expires_at=t + lease_s,
            groups=[ClaimedGroup(g.id, g.task_id, g.env_id, g.min_version, by_group.get(g.id, []))
                    for g in groups],
        )

    @read
    def claimed_episodes(self, conn: Connection, claim: Claim) -> list[ClaimedEpisode]:
        """The claim's completed episodes in claim order, each with its reward and whole token
        stream: everything one training step reads, in one transaction."""
        ids = claim.episode_ids
        if not ids:
            return []
        rows = {r.id: r for r in conn.execute(
            select(EpisodeRow.id, EpisodeRow.group_id, EpisodeRow.reward)
            .where(EpisodeRow.id.in_(ids), EpisodeRow.status == "completed")
        )}
        streams = episode_streams(conn, [i for i in ids if i in rows])
        return [ClaimedEpisode(i, rows[i].group_id, float(rows[i].reward or 0.0), streams[i][0],
                               streams[i][2])
                for i in ids if i in rows]

    @write()
    def filter_stale(
        self, conn: Connection, run_id: int, min_version: int, measure: Measure = "tokens",
        siblings: Siblings = "baseline",
    ) -> int:
        """Filter ready groups sampled below `min_version` (no claim can take them any more,
        since the floor only rises) with the reason; returns how many groups."""
        t = now()
        version = group_version(measure, siblings)
        stale = conn.execute(
            select(GroupRow.id, version).where(
                GroupRow.run_id == run_id, version < min_version,
                or_(GroupRow.status == "ready",
                    (GroupRow.status == "claimed") & (GroupRow.lease_expires_at < t)),
            )
        ).all()
        for gid, sampled in stale:
            what = ("its oldest token" if measure == "oldest" else "an episode's newest token"
                    if siblings == "drop_group" else "every episode's newest token")
            reason = (f"stale: {what} was sampled by policy version {sampled}, below the "
                      f"trainer's staleness floor {min_version}")
            conn.execute(update(GroupRow).where(GroupRow.id == gid)
                         .values(status="filtered", filter_reason=reason, claim_id=None,
                                 claimed_by=None, lease_expires_at=None))
            conn.execute(update(EpisodeRow).where(EpisodeRow.group_id == gid, EpisodeRow.status == "completed")
                         .values(status="filtered", filter_reason=reason))
        return len(stale)

    async def renew(self, claim: Claim, lease_s: float = 300.0) -> None:
        """Extend the lease of a claim still held; LeaseLostError if it was taken over."""
        claim.lease_expires_at = await self._renew(claim, lease_s)

    @write(durable=False)
    def _renew(self, conn: Connection, claim: Claim, lease_s: float) -> float:
        expires = now() + lease_s
        res = conn.execute(
            update(GroupRow)
            .where(GroupRow.id.in_(claim.group_ids), GroupRow.claim_id == claim.claim_id,
                   GroupRow.status == "claimed")
            .values(lease_expires_at=expires)
        )
        if res.rowcount != len(claim.group_ids):
            raise LeaseLostError(f"claim {claim.claim_id} lost {len(claim.group_ids) - res.rowcount} groups")
        return expires

    @write(durable=False)
    def release(self, conn: Connection, claim: Claim) -> None:
        """Give the claimed groups back without training them."""
        conn.execute(
            update(GroupRow)
            .where(GroupRow.id.in_(claim.group_ids), GroupRow.claim_id == claim.claim_id,
                   GroupRow.status == "claimed")
            .values(status="ready", claim_id=None, claimed_by=None, lease_expires_at=None)
        )

    @write()
    def commit(
        self,
        conn: Connection,
        claim: Claim,
        run_id: int,
        *,
        step: int,
        version: int,
        checkpoint: str | None = None,
        metrics: dict[str, Any] | None = None,
        advantages: dict[int, float] | None = None,
        staleness: dict[int, float] | None = None,
        stale_siblings: dict[int, str] | None = None,
    ) -> None:
        """Mark the claim's groups and episodes trained by `step` and publish `version`, all or
        nothing, with each episode's advantage and staleness (`agent_rl.store.staleness`).
        `stale_siblings` (episode -> reason): episodes of the claim that counted in their
        group's baseline but trained no token; they are marked filtered with the reason."""
        latest = conn.scalar(
            select(PolicyVersionRow.version).where(PolicyVersionRow.run_id == run_id)
            .order_by(PolicyVersionRow.version.desc()).limit(1)
        )
        if latest is not None and version <= latest:
            raise StoreError(f"policy version {version} is not newer than the latest ({latest})")
        if claim.group_ids:
            res = conn.execute(
                update(GroupRow)
                .where(GroupRow.id.in_(claim.group_ids), GroupRow.claim_id == claim.claim_id,
                       GroupRow.status == "claimed")
                .values(status="trained", trained_step=step, lease_expires_at=None)
            )
            if res.rowcount != len(claim.group_ids):
                # Raising rolls the whole transaction back: nothing of this step is recorded.
                raise LeaseLostError(
                    f"claim {claim.claim_id}: {len(claim.group_ids) - res.rowcount} groups were "
                    "taken over after the lease expired; the step is discarded"
                )
            if stale_siblings:
                conn.execute(_FILTER_SIBLING, [{"eid": e, "reason": r}
                                               for e, r in stale_siblings.items()])
            conn.execute(
                update(EpisodeRow)
                .where(EpisodeRow.group_id.in_(claim.group_ids), EpisodeRow.status == "completed")
                .values(status="trained", trained_step=step)
            )
            per_episode = {e: {"eid": e, "adv": None, "stale": None}
                           for e in {*(advantages or {}), *(staleness or {})}}
            for e, a in (advantages or {}).items():
                per_episode[e]["adv"] = float(a)
            for e, v in (staleness or {}).items():
                per_episode[e]["stale"] = float(v)
            if per_episode:
                # executemany of one prebuilt statement: building a 256-way CASE per step cost
                # more Python time than the database work.
                conn.execute(_SET_PER_EPISODE, list(per_episode.values()))
        try:
            with conn.begin_nested():
                conn.execute(
                    insert(PolicyVersionRow).values(
                        run_id=run_id, version=version, checkpoint=checkpoint, trainer_step=step,
                        metrics=metrics, created_at=now(),
                    )
                )
        except IntegrityError as e:
            # Another trainer published the same version between our check and insert.
            raise StoreError(
                f"policy version {version} is not newer than the latest (published concurrently)"
            ) from e


_FILTER_SIBLING = (
    update(EpisodeRow).where(EpisodeRow.id == bindparam("eid"), EpisodeRow.status == "completed")
    .values(status="filtered", filter_reason=bindparam("reason"))
)
_SET_PER_EPISODE = (
    update(EpisodeRow).where(EpisodeRow.id == bindparam("eid"))
    .values(advantage=bindparam("adv"), staleness=bindparam("stale"))
)

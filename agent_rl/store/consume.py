"""How trainers consume the store: claim ready groups under a lease, commit them as trained.

`claim` takes the oldest ready groups (and groups whose lease expired) whose policy version is
at least the staleness floor, and marks them claimed by a fresh claim id. `commit` then, in ONE
transaction, marks those groups and their completed episodes trained by the step and records
the new policy version; if any group's claim was taken over after its lease expired, nothing is
written and LeaseLostError is raised. So two trainers, or a restarted one, never train the same
episode twice. PostgreSQL uses `FOR UPDATE SKIP LOCKED`; SQLite an immediate transaction.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import bindparam, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from agent_rl.errors import LeaseLostError, StoreError
from agent_rl.store.base import StoreBase, now
from agent_rl.store.models import Episode, Group, PolicyVersion
from agent_rl.store.records import Claim, ClaimedGroup


class Consumption(StoreBase):
    async def claim(
        self,
        run_id: int,
        trainer_id: str,
        max_groups: int,
        *,
        min_version: int | None = None,
        lease_s: float = 300.0,
    ) -> Claim:
        """Claim up to `max_groups` ready groups; the claim may hold fewer (or none)."""
        t = now()
        claim_id = uuid.uuid4().hex
        query = (
            select(Group.id)
            .where(
                Group.run_id == run_id,
                or_(Group.status == "ready",
                    (Group.status == "claimed") & (Group.lease_expires_at < t)),
            )
            .order_by(Group.ready_at, Group.id)
            .limit(max_groups)
        )
        if min_version is not None:
            query = query.where(Group.min_version >= min_version)
        if not self.sqlite:
            query = query.with_for_update(skip_locked=True)
        async with self.write() as conn:
            ids = list((await conn.scalars(query)).all())
            if ids:
                await conn.execute(
                    update(Group).where(Group.id.in_(ids))
                    .values(status="claimed", claim_id=claim_id, claimed_by=trainer_id,
                            lease_expires_at=t + lease_s)
                )
            groups = (
                await conn.execute(
                    select(Group.id, Group.task_id, Group.env_id, Group.min_version)
                    .where(Group.id.in_(ids)).order_by(Group.ready_at, Group.id)
                )
            ).all()
            episodes = (
                await conn.execute(
                    select(Episode.group_id, Episode.id)
                    .where(Episode.group_id.in_(ids), Episode.status == "completed")
                    .order_by(Episode.id)
                )
            ).all()
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

    async def renew(self, claim: Claim, lease_s: float = 300.0) -> None:
        """Extend the lease of a claim still held; LeaseLostError if it was taken over."""
        expires = now() + lease_s
        async with self.write() as conn:
            res = await conn.execute(
                update(Group)
                .where(Group.id.in_(claim.group_ids), Group.claim_id == claim.claim_id,
                       Group.status == "claimed")
                .values(lease_expires_at=expires)
            )
            if res.rowcount != len(claim.group_ids):
                raise LeaseLostError(f"claim {claim.claim_id} lost {len(claim.group_ids) - res.rowcount} groups")
        claim.lease_expires_at = expires

    async def release(self, claim: Claim) -> None:
        """Give the claimed groups back without training them."""
        async with self.write() as conn:
            await conn.execute(
                update(Group)
                .where(Group.id.in_(claim.group_ids), Group.claim_id == claim.claim_id,
                       Group.status == "claimed")
                .values(status="ready", claim_id=None, claimed_by=None, lease_expires_at=None)
            )

    async def commit(
        self,
        claim: Claim,
        run_id: int,
        *,
        step: int,
        version: int,
        checkpoint: str | None = None,
        metrics: dict[str, Any] | None = None,
        advantages: dict[int, float] | None = None,
    ) -> None:
        """Mark the claim's groups and episodes trained by `step` and publish `version`, all or
        nothing."""
        async with self.write() as conn:
            latest = await conn.scalar(
                select(PolicyVersion.version).where(PolicyVersion.run_id == run_id)
                .order_by(PolicyVersion.version.desc()).limit(1)
            )
            if latest is not None and version <= latest:
                raise StoreError(f"policy version {version} is not newer than the latest ({latest})")
            if claim.group_ids:
                res = await conn.execute(
                    update(Group)
                    .where(Group.id.in_(claim.group_ids), Group.claim_id == claim.claim_id,
                           Group.status == "claimed")
                    .values(status="trained", trained_step=step, lease_expires_at=None)
                )
                if res.rowcount != len(claim.group_ids):
                    # Raising rolls the whole transaction back: nothing of this step is recorded.
                    raise LeaseLostError(
                        f"claim {claim.claim_id}: {len(claim.group_ids) - res.rowcount} groups were "
                        "taken over after the lease expired; the step is discarded"
                    )
                await conn.execute(
                    update(Episode)
                    .where(Episode.group_id.in_(claim.group_ids), Episode.status == "completed")
                    .values(status="trained", trained_step=step)
                )
                if advantages:
                    await conn.execute(
                        update(Episode).where(Episode.id == bindparam("eid"))
                        .values(advantage=bindparam("adv")),
                        [{"eid": e, "adv": float(a)} for e, a in advantages.items()],
                    )
            try:
                await conn.execute(
                    insert(PolicyVersion).values(
                        run_id=run_id, version=version, checkpoint=checkpoint, trainer_step=step,
                        metrics=metrics, created_at=now(),
                    )
                )
            except IntegrityError as e:
                # Another trainer published the same version between our check and insert.
                raise StoreError(
                    f"policy version {version} is not newer than the latest (published concurrently)"
                ) from e

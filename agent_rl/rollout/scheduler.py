"""The rollout scheduler: admits groups of episodes within the staleness bound and runs them.

Admission: a group of n episodes (one task) is admitted only while the policy the engine
serves is within eta versions of the newest version in the store, and only when n slots are
free, so waiting episodes never pile up. Once admitted, an episode is never discarded for
staleness: it runs across weight updates and its tokens carry the versions that sampled them.
When every episode of a group has ended, the env's group reward hook runs and the group is
handed to the trainer (`ready`), or filtered (zero reward variance) with the reason.

Restart: episodes a dead process left running are resolved as interrupted, groups whose
episodes all ended are decided, episodes admitted but never started are run, and the task
stream continues after the tasks already drawn.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from agent_rl.env import Env
from agent_rl.errors import EngineError, EnvError, StoreError
from agent_rl.registry import make
from agent_rl.rewards import EpisodeOutcome
from agent_rl.rollout.runner import EpisodeRunner, RunnerContext
from agent_rl.tasks import Task

log = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    admitted: int = 0
    completed: int = 0
    failed: int = 0
    groups_ready: int = 0
    groups_filtered: int = 0
    waits_for_staleness: int = 0
    rewards: list[float] = field(default_factory=list)


class Scheduler:
    def __init__(self, ctx: RunnerContext, *, env_id: str, max_staleness: int,
                 env_kwargs: dict[str, Any] | None = None, run_config: dict[str, Any] | None = None,
                 version_poll_s: float = 0.5) -> None:
        self.ctx = ctx
        self.env_id = env_id
        self.env_kwargs = env_kwargs or {}
        self.max_staleness = max_staleness
        self.run_config = run_config or {}
        self.version_poll_s = version_poll_s
        self.stats = SchedulerStats()
        self.run_id: int | None = None
        n = ctx.cfg.group_size
        # Admission takes n slots per group, so a group can always start all its episodes.
        self._slots = anyio.Semaphore(max(ctx.cfg.max_concurrent_episodes, n))
        self._pending: dict[int, int] = {}
        """Episodes of each group this process still runs."""
        self._stopping = False
        self._admission_wait: anyio.CancelScope | None = None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop_admitting(self) -> None:
        """Graceful stop: admit no new group; `run` returns once the running episodes end."""
        self._stopping = True
        if self._admission_wait is not None:
            self._admission_wait.cancel()

    async def run(self, max_episodes: int | None = None) -> SchedulerStats:
        """Admit and run episodes until `max_episodes` have been admitted (None: forever)."""
        store, cfg = self.ctx.store, self.ctx.cfg
        self.run_id = run_id = await store.ensure_run(self.ctx.run_name, self.run_config)
        resolved = await store.resolve_interrupted(stale_after_s=cfg.stale_after_s, run_id=run_id)
        if resolved:
            log.warning("resolved %d episodes left running by a stopped process", len(resolved))
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat)
            resumed = await self._resume(tg)
            budget = None if max_episodes is None else max(max_episodes - resumed, 0)
            await self._admit_loop(tg, budget)
            # Everything admitted is running; wait for it, then stop the heartbeat.
            await self._drain()
            tg.cancel_scope.cancel()
        return self.stats

    async def _resume(self, tg: anyio.abc.TaskGroup) -> int:
        store, run_id = self.ctx.store, self.run_id
        assert run_id is not None
        resumed = 0
        decidable = set(await store.groups_to_complete(run_id))
        for g in await store.unfinished_groups(run_id, self.env_id):
            if g["group_id"] in decidable:
                await self._complete_group(g["group_id"])
                continue
            if not g["waiting"]:
                continue  # still running in another serve process
            task_row = await store.get_task(g["task_id"])
            task = Task(id=task_row["key"], data=task_row["payload"])
            for _ in g["waiting"]:
                await self._slots.acquire()
            summaries = {e.id: e for e in await store.group_episodes(g["group_id"])}
            # Only the episodes this process runs: one still "running" belongs to a process that
            # stopped, and is resolved by the heartbeat's reaper, which then decides the group.
            self._pending[g["group_id"]] = len(g["waiting"])
            for eid in g["waiting"]:
                tg.start_soon(self._run_episode, g["group_id"], eid, task, summaries[eid].seed)
            resumed += len(g["waiting"])
        return resumed

    async def _admit_loop(self, tg: anyio.abc.TaskGroup, budget: int | None) -> None:
        store, cfg, run_id = self.ctx.store, self.ctx.cfg, self.run_id
        assert run_id is not None
        n = cfg.group_size
        tasks = self._tasks(await store.count_tasks(run_id, self.env_id))
        while (budget is None or budget > 0) and not self._stopping:
            size = n if budget is None else min(n, budget)
            held = 0
            # Only the waits are cancelled by a graceful stop, never a store write in progress.
            with anyio.CancelScope() as self._admission_wait:
                for _ in range(size):
                    await self._slots.acquire()
                    held += 1
                # Checked after the slots are ours, right before admitting: a check made before
                # waiting for slots could be stale by the time the group starts.
                await self._wait_within_staleness()
            self._admission_wait = None
            if self._stopping:
                for _ in range(held):
                    self._slots.release()
                return
            index, task = next(tasks)
            task_id = await store.add_task(run_id, self.env_id, task.id, task.data)
            seeds = [_seed(cfg.seed, index, i) for i in range(size)]
            group_id, episodes = await store.admit_group(run_id, task_id, self.env_id, size, seeds)
            self._pending[group_id] = size
            self.stats.admitted += size
            for eid, seed in zip(episodes, seeds):
                tg.start_soon(self._run_episode, group_id, eid, task, seed)
            if budget is not None:
                budget -= size

    def _tasks(self, skip: int) -> Iterator[tuple[int, Task]]:
        source = make(self.env_id, **self.env_kwargs).task_source(self.ctx.cfg.split)
        for index, task in enumerate(source.stream(self.ctx.cfg.seed)):
            if index >= skip:
                yield index, task

    async def _wait_within_staleness(self) -> None:
        """Block while the served policy is more than eta versions behind the newest one, or
        while no engine answers (a crashed engine being restarted): new episodes wait for it
        instead of failing one after another."""
        unavailable = False
        while True:
            latest = await self.ctx.store.latest_version(self.run_id)  # type: ignore[arg-type]
            served = await self._served_version()
            if served is None:
                if not unavailable:
                    log.warning("no engine answers; admission waits for one")
                    unavailable = True
            elif served >= latest - self.max_staleness:
                if unavailable:
                    log.info("an engine answers again; admission resumes")
                return
            else:
                self.stats.waits_for_staleness += 1
            await anyio.sleep(self.version_poll_s)

    async def _served_version(self) -> int | None:
        """The policy version the engines serve, or None if none answers."""
        from agent_rl.rollout.runner import policy_version

        try:
            info = await self.ctx.client.model_info()
        except (EngineError, OSError) as e:
            log.debug("model_info failed: %s", e)
            return None
        return policy_version(info.get("weight_version"))

    async def _run_episode(self, group_id: int, episode_id: int, task: Task, seed: int | None) -> None:
        try:
            result = await EpisodeRunner(self.ctx, episode_id, self.env_id, task, seed,
                                         self.env_kwargs).run()
            if result.status == "completed":
                self.stats.completed += 1
                self.stats.rewards.append(result.reward or 0.0)
            else:
                self.stats.failed += 1
        except StoreError as e:
            # Another serve process started it first, or the store refused a write: the episode
            # is that process's, or is resolved as interrupted when its heartbeat goes stale.
            log.warning("episode %d: %s", episode_id, e)
        finally:
            self._slots.release()
        self._pending[group_id] -= 1
        if self._pending[group_id] == 0:
            # Decided before it leaves `_pending`, so `run` does not return with it undecided.
            await self._complete_group(group_id)
            del self._pending[group_id]

    async def _complete_group(self, group_id: int) -> None:
        store, cfg = self.ctx.store, self.ctx.cfg
        episodes = [e for e in await store.group_episodes(group_id) if e.status == "completed"]
        rewards: dict[int, float] = {}
        filter_reason = None
        try:
            outcomes = [
                EpisodeOutcome(episode_id=str(e.id), task_id=str(e.task_id), reward=e.reward or 0.0,
                               terminated=True, truncated=False, turns=e.num_turns,
                               completion_tokens=e.num_model_tokens)
                for e in episodes
            ]
            if outcomes:
                new = await apply_group_reward(make(self.env_id, **self.env_kwargs), outcomes)
                rewards = {e.id: r for e, r in zip(episodes, new)}
        except EnvError as e:
            filter_reason = f"group reward hook failed: {e}"
        values = list(rewards.values())
        if filter_reason is None and cfg.filter_zero_variance and len(values) > 1 and max(values) == min(values):
            filter_reason = f"zero reward variance (all {values[0]:g})"
        try:
            status = await store.complete_group(group_id, filter_reason=filter_reason, rewards=rewards)
        except StoreError as e:
            log.warning("group %d: %s", group_id, e)
            return
        if status == "ready":
            self.stats.groups_ready += 1
        elif status == "filtered":
            self.stats.groups_filtered += 1

    async def _drain(self) -> None:
        while self._pending:
            await anyio.sleep(0.05)

    async def _heartbeat(self) -> None:
        """Beat for this process's episodes, and reap other processes': episodes silent for
        `stale_after_s` (their serve died; another serve, or this one restarted, runs on) end as
        interrupted, and groups left with no running episode are decided."""
        store, run_id = self.ctx.store, self.run_id
        assert run_id is not None
        while True:
            await anyio.sleep(self.ctx.cfg.heartbeat_s)
            try:
                await store.heartbeat(self.ctx.owner)
                resolved = await store.resolve_interrupted(
                    stale_after_s=self.ctx.cfg.stale_after_s, run_id=run_id)
                if not resolved:
                    continue
                log.warning("resolved %d episodes left running by a stopped process", len(resolved))
                # Only after a death: a live serve decides its own groups.
                for group_id in await store.groups_to_complete(run_id):
                    if group_id not in self._pending:
                        await self._complete_group(group_id)
            except StoreError as e:
                log.warning("heartbeat failed: %s", e)


async def apply_group_reward(env: Env, outcomes: Sequence[EpisodeOutcome]) -> list[float]:
    """Rewards after the env's group hook: one float per outcome, in order.

    Raises `EnvError` (with the user's traceback, via the Env guard) if the hook raises or
    returns the wrong number of rewards.
    """
    new = await env.group_reward(list(outcomes))
    if new is None:
        return [o.reward for o in outcomes]
    rewards = [float(r) for r in new]
    if len(rewards) != len(outcomes):
        raise EnvError(
            f"{type(env).__name__}.group_reward returned {len(rewards)} rewards for "
            f"{len(outcomes)} episodes: return exactly one per episode, in order"
        )
    return rewards


def _seed(base: int, task_index: int, episode_index: int) -> int:
    return random.Random(f"{base}:{task_index}:{episode_index}").randrange(2**31)

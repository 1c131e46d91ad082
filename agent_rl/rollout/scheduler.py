"""The rollout scheduler: admits groups of episodes within the staleness bound and runs them.

Admission: a group of n episodes (one task) is admitted only while the policy the engine
serves is within eta versions of the newest version in the store (and fewer than
`max_queued_groups` groups are queued for the trainer, fewer than `max_ready_groups` of them
finished and waiting for it, and, with `protect_oldest_group`, while one more group could not
step the trainer past the oldest running group's tokens), and only once a slot is free. Its
episodes then start one by one as slots free up, in order, and the next group is admitted
only after all of them have started: slots never sit idle while a group's long-tail episode
finishes (the old rule, all n slots free before a group, left up to n-1 idle), and at most
n-1 admitted episodes wait for a slot. Once admitted, an episode is never discarded for
staleness: it runs across weight updates and its tokens carry the versions that sampled them.
When every episode of a group has ended, the env's group reward hook runs and the group is
handed to the trainer (`ready`) as one, or filtered (zero reward variance) with the reason.
With `rollout.task_selection = "skip_all_equal"`, a drawn task whose recent groups were all
equal is skipped for a while instead of admitted (agent_rl/rollout/task_selection.py).

Restart: episodes a dead process left running are resolved as interrupted, groups whose
episodes all ended are decided, episodes admitted but never started are run, and the task
stream continues after the tasks already drawn.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from agent_rl.sdk.env import Env
from agent_rl.kernel.encoding import policy_version
from agent_rl.kernel.errors import EngineError, EnvError, StoreError
from agent_rl.sdk.registry import make
from agent_rl.sdk.rewards import EpisodeOutcome
from agent_rl.rollout.agent_runner import AgentRunner
from agent_rl.rollout.gateway import Gateway
from agent_rl.rollout.oldest_group import OldestGroup
from agent_rl.rollout.recorded import recorded_turns
from agent_rl.rollout.runner import EpisodeRunner, RunnerContext
from agent_rl.rollout.task_selection import TaskSelection
from agent_rl.sdk.tasks import Task
from agent_rl.store.staleness import Measure, Siblings

log = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    """What this process did, for tests of admission; how its episodes ended is the store's
    to say (`Store.ledger(run, owner=...)`), never these counters."""

    admitted: int = 0
    waits_for_staleness: int = 0
    resumed: int = 0
    skipped_tasks: int = 0
    """Drawn tasks task selection did not admit."""
    waits_for_oldest: int = 0
    """Admission checks that waited for the oldest running group (`protect_oldest_group`)."""


class Scheduler:
    def __init__(self, ctx: RunnerContext, *, env_id: str, max_staleness: int,
                 max_queued_groups: int = 0, max_ready_groups: int = 0,
                 protect_oldest_group: bool = False, groups_per_step: int = 1,
                 staleness: tuple[Measure, Siblings] = ("tokens", "baseline"),
                 env_kwargs: dict[str, Any] | None = None,
                 run_config: dict[str, Any] | None = None, version_poll_s: float = 0.5,
                 gateway: Gateway | None = None) -> None:  # fmt: skip
        """`max_queued_groups`: admit only while fewer of the run's groups are queued for the
        trainer, running or ready (0: no bound); see `RolloutConfig.max_queued_groups`.
        `max_ready_groups`: nor while this many of them are ready and within the bound (0: no
        bound; `staleness`: the trainer's measure and sibling rule, which say what is within
        it); see `RolloutConfig.max_ready_groups`.
        `protect_oldest_group`: nor while one more group could let the trainer (`groups_per_step`
        groups a step) step past the oldest group this process runs before training it
        (agent_rl/rollout/oldest_group.py).
        `gateway`: where an agent env's episodes talk to the policy (`AgentRunner` runs them)."""
        self.ctx = ctx
        self.gateway = gateway
        self.env_id = env_id
        self.env_kwargs = env_kwargs or {}
        self.max_staleness = max_staleness
        self.max_queued_groups = max_queued_groups
        self.max_ready_groups = max_ready_groups
        self.oldest = OldestGroup(max_staleness, groups_per_step) if protect_oldest_group else None
        self.staleness = staleness
        self._told_capacity = False
        self.run_config = run_config or {}
        self.version_poll_s = version_poll_s
        self.stats = SchedulerStats()
        self.run_id: int | None = None
        # FIFO: a slot that frees goes to the episode that has waited longest.
        self._slots = anyio.Semaphore(ctx.cfg.max_concurrent_episodes)
        self._pending: dict[int, int] = {}
        """Episodes of each group this process still runs."""
        self._stopping = False
        self._admission_wait: anyio.CancelScope | None = None
        cfg = ctx.cfg
        self.selection = (TaskSelection(cfg.task_pause)
                          if cfg.task_selection == "skip_all_equal" else None)
        self._task_keys: dict[int, str] = {}
        """The task key of each group this process admitted (for task selection)."""
        self._group_ended = anyio.Event()
        """Set (and replaced) whenever a group of `_pending` has ended."""
        self._served: tuple[int, float] | None = None
        """The served version and when the engine said so (`_served_version`)."""
        self._decide_with_end = False
        """Whether a group is decided with its last episode's end, in one transaction: when
        nothing needs its episodes first (`_decided_plainly`)."""

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
        store = self.ctx.store
        self.run_id = await store.ensure_run(self.ctx.run_name, self.run_config)
        self._decide_with_end = self._decided_plainly()
        if self.selection is not None:  # what earlier processes learned of the tasks
            for key, rewards in await store.task_outcomes(self.run_id, self.env_id):
                self.selection.observe(key, rewards)
        await self._reap_dead(resume=True)  # `_resume` below runs what goes back to waiting
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat, tg)
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
            # Only the episodes this process runs: one still "running" belongs to a process that
            # stopped, and is resolved by the heartbeat's reaper, which then decides the group.
            await self._start_waiting(tg, g["group_id"], g["waiting"])
            resumed += len(g["waiting"])
        return resumed

    async def _start_waiting(self, tg: anyio.abc.TaskGroup, group_id: int, waiting: list[int]) -> None:
        """Run admitted episodes that no process runs: never started, or resumed after their
        serve died (those re-run their persisted turns first)."""
        store = self.ctx.store
        summaries = {e.id: e for e in await store.group_episodes(group_id)}
        task_row = await store.get_task(summaries[waiting[0]].task_id)
        task = Task(id=task_row["key"], data=task_row["payload"])
        if self.oldest is not None:  # its first tokens' version unknown here: as old as can train
            self.oldest.admitted(group_id, -1)
        for eid in waiting:
            self._pending[group_id] = self._pending.get(group_id, 0) + 1
            resume = summaries[eid].num_turns > 0
            self.stats.resumed += resume
            tg.start_soon(self._take_slot_and_run, group_id, eid, task, summaries[eid].seed, resume)

    async def _take_slot_and_run(self, group_id: int, episode_id: int, task: Task,
                                 seed: int | None, resume: bool) -> None:  # fmt: skip
        try:
            await self._slots.acquire()  # released by `_run_episode`
        except anyio.get_cancelled_exc_class():
            await self._interrupt_unstarted(episode_id)
            raise
        await self._run_episode(group_id, episode_id, task, seed, resume)

    async def _interrupt_unstarted(self, episode_id: int) -> None:
        """Interrupted before its runner started it: it ends like the running ones do."""
        with anyio.CancelScope(shield=True):
            try:
                await self.ctx.store.fail_episode(
                    episode_id, "Interrupted", "interrupted: serve shut down before running it")
            except StoreError:
                pass  # its runner got to end it after all

    async def _reap_dead(self, tg: anyio.abc.TaskGroup | None = None, *, resume: bool) -> bool:
        """Episodes of a serve that died (silent for `stale_after_s`): with `resume`, resumable
        ones go back to waiting (and, with `tg`, this process resumes them now); the rest fail
        as interrupted. True if there were any."""
        store, cfg, run_id = self.ctx.store, self.ctx.cfg, self.run_id
        assert run_id is not None
        resumable = resume and cfg.max_resumes > 0 and make(self.env_id, **self.env_kwargs).resumable
        back = await store.resume_interrupted(
            stale_after_s=cfg.stale_after_s, run_id=run_id, env_ids=[self.env_id],
            max_resumes=cfg.max_resumes) if resumable else []  # fmt: skip
        failed = await store.resolve_interrupted(stale_after_s=cfg.stale_after_s, run_id=run_id)
        if back or failed:
            log.warning("a stopped process left %d episodes running: %d resumed here, %d failed "
                        "as interrupted", len(back) + len(failed), len(back), len(failed))
        if back and tg is not None:
            by_group: dict[int, list[int]] = {}
            for e in await store.episodes_by_id(back):
                by_group.setdefault(e.group_id, []).append(e.id)
            for group_id, ids in by_group.items():
                await self._start_waiting(tg, group_id, ids)
        return bool(back or failed)

    async def _admit_loop(self, tg: anyio.abc.TaskGroup, budget: int | None) -> None:
        store, cfg, run_id = self.ctx.store, self.ctx.cfg, self.run_id
        assert run_id is not None
        n = cfg.group_size
        tasks = self._tasks(await store.count_tasks(run_id, self.env_id))
        drawn: tuple[int, Task] | None = None  # a task whose admission was refused: tried again
        while (budget is None or budget > 0) and not self._stopping:
            size = n if budget is None else min(n, budget)
            held = False
            # Only the waits are cancelled by a graceful stop, never a store write in progress.
            with anyio.CancelScope() as self._admission_wait:
                # Before the slot: an episode of the oldest group waiting for one (resumed) must
                # get it. Only this loop admits, so the window cannot close meanwhile.
                await self._wait_for_oldest_group()
                await self._slots.acquire()
                held = True
                # Checked once the first slot is ours, right before admitting: a check made
                # before waiting for it could be stale by the time the group starts.
                served = await self._wait_within_staleness()
            self._admission_wait = None
            if self._stopping:
                if held:
                    self._slots.release()
                return
            if drawn is None:
                drawn = next(tasks)
                while self.selection is not None and not self.selection.admit(drawn[1].id):
                    # Recorded as drawn (no group), so a restart continues the stream after it.
                    await store.add_task(run_id, self.env_id, drawn[1].id, drawn[1].data)
                    self.stats.skipped_tasks += 1
                    drawn = next(tasks)
            index, task = drawn
            seeds = [_seed(cfg.seed, index, i) for i in range(size)]
            # Its first episode starts with the admission: it runs at once, in the slot taken.
            # The served version is checked against the newest in the same transaction.
            admitted = await store.admit_task(run_id, self.env_id, task.id, task.data, size, seeds,
                                              start=self.ctx.owner, served_version=served,
                                              max_staleness=self.max_staleness)  # fmt: skip
            if admitted is None:  # the trainer published a version since the check: wait again
                self.stats.waits_for_staleness += 1
                self._slots.release()
                with anyio.CancelScope() as self._admission_wait:
                    await anyio.sleep(self.version_poll_s)
                self._admission_wait = None
                continue
            drawn = None
            group_id, episodes = admitted
            self._pending[group_id] = size
            if self.oldest is not None:
                self.oldest.admitted(group_id, served)
            if self.selection is not None:
                self._task_keys[group_id] = task.id
            self.stats.admitted += size
            if budget is not None:
                budget -= size
            await self._start_in_turn(tg, group_id, list(zip(episodes, seeds)), task)

    async def _start_in_turn(self, tg: anyio.abc.TaskGroup, group_id: int,
                             episodes: list[tuple[int, int]], task: Task) -> None:  # fmt: skip
        """Start an admitted group's episodes as slots free up (the first slot is held, and
        the first episode was started with the admission, `Store.admit_task(start=...)`): a
        graceful stop does not interrupt this, since they are admitted; a hard one ends
        those not yet started as interrupted, as the running ones end."""
        for i, (eid, seed) in enumerate(episodes):
            if i:
                try:
                    await self._slots.acquire()
                except anyio.get_cancelled_exc_class():
                    for unstarted, _ in episodes[i:]:
                        await self._interrupt_unstarted(unstarted)
                    raise
            tg.start_soon(functools.partial(self._run_episode, group_id, eid, task, seed, started=i == 0))

    async def _wait_for_oldest_group(self) -> None:
        """Block while one more group could let the trainer step past the oldest group this
        process runs before training it (`protect_oldest_group`; agent_rl/rollout/oldest_group.py).
        Checked before the admission slot is taken, so a resumed episode of that group waiting
        for a slot gets one; the counts it reads change as groups end here (woken at once) or
        in other processes and the trainer (polled)."""
        if self.oldest is None:
            return
        store, run_id = self.ctx.store, self.run_id
        assert run_id is not None
        measure, siblings = self.staleness
        while True:
            ended = self._group_ended
            latest = await store.latest_version(run_id)
            queued, ready = await store.queued_groups(
                run_id, floor=latest - self.max_staleness, measure=measure, siblings=siblings)
            # Ready within the bound, held by a step, running beside the oldest, and the new one.
            ahead = ready + await store.claimed_groups(run_id) + (queued - ready - 1) + 1
            if not self.oldest.would_pass(latest, ahead):
                return
            self.stats.waits_for_oldest += 1
            with anyio.move_on_after(self.version_poll_s):
                await ended.wait()

    def _tasks(self, skip: int) -> Iterator[tuple[int, Task]]:
        source = make(self.env_id, **self.env_kwargs).task_source(self.ctx.cfg.split)
        for index, task in enumerate(source.stream(self.ctx.cfg.seed)):
            if index >= skip:
                yield index, task

    async def _wait_within_staleness(self) -> int:
        """Block while the served policy is more than eta versions behind the newest one, while
        `max_queued_groups` groups are already queued for the trainer or `max_ready_groups` of
        them have finished and wait for it (what is admitted now would age past the bound
        before its turn), or while no engine answers (a
        crashed engine being restarted): new episodes wait instead of failing one after another.
        Returns the served version. Without a queue bound the newest version is not read here:
        the admission checks the served version against it in its own transaction
        (`Store.admit_task(served_version=...)`; a read per admission cost as much CPU as a
        call's turn write, with groups of one)."""
        unavailable = False
        bounded = bool(self.max_queued_groups or self.max_ready_groups)
        while True:
            latest = await self.ctx.store.latest_version(self.run_id) if bounded else 0  # type: ignore[arg-type]
            served = await self._served_version()
            if served is None:
                if not unavailable:
                    log.warning("no engine answers; admission waits for one")
                    unavailable = True
            elif bounded and (served < latest - self.max_staleness or await self._at_capacity(latest)):
                self.stats.waits_for_staleness += 1
            else:
                if unavailable:
                    log.info("an engine answers again; admission resumes")
                return served
            await anyio.sleep(self.version_poll_s)

    async def _at_capacity(self, latest: int) -> bool:
        if not self.max_queued_groups and not self.max_ready_groups:
            return False
        # Ready groups already below the trainer's floor do not count: it filters them at its
        # next step, and while it waits for fresh ones they must not hold admission back.
        assert self.run_id is not None
        measure, siblings = self.staleness
        queued, ready = await self.ctx.store.queued_groups(
            self.run_id, floor=latest - self.max_staleness, measure=measure, siblings=siblings)
        full = ((bool(self.max_queued_groups) and queued >= self.max_queued_groups)
                or (bool(self.max_ready_groups) and ready >= self.max_ready_groups))
        if full and not self._told_capacity:
            log.info("admission waits: %d groups are queued for training, %d of them ready "
                     "(rollout.max_queued_groups, rollout.max_ready_groups); is `agent-rl train` "
                     "running? Set rollout.max_queued_groups = 0 to collect episodes without "
                     "training", queued, ready)
        self._told_capacity = full
        return full

    async def _served_version(self) -> int | None:
        """The policy version the engines serve, or None if none answers. An answer is reused
        for `version_poll_s` (what admission waits between two checks anyway): asked for every
        admitted group, it was a request to the engine per episode with groups of one."""
        now = time.monotonic()
        if self._served is not None and now - self._served[1] < self.version_poll_s:
            return self._served[0]
        self._served = None
        try:
            info = await self.ctx.client.model_info()
        except (EngineError, OSError) as e:
            log.debug("model_info failed: %s", e)
            return None
        self._served = (policy_version(info.get("weight_version")), now)
        return self._served[0]

    def _decided_plainly(self) -> bool:
        """Whether a group's decision needs nothing but its episodes' rows: no group reward
        hook, no task selection, and no zero-variance filter (or groups of one, which it never
        filters). Its last episode's end then decides it in the same transaction, without a
        read of the group's episodes (`Store.end_episode_and_group`)."""
        cfg = self.ctx.cfg
        hook = make(self.env_id, **self.env_kwargs).has_group_reward()
        return not hook and self.selection is None and (not cfg.filter_zero_variance or cfg.group_size == 1)

    async def _run_episode(self, group_id: int, episode_id: int, task: Task, seed: int | None,
                           resume: bool = False, *, started: bool = False) -> None:  # fmt: skip
        runner: EpisodeRunner | None = None
        try:
            if self.gateway is not None:  # an agent env: its program drives the episode
                runner = AgentRunner(self.ctx, self.gateway, episode_id, self.env_id, task, seed,
                                     self.env_kwargs)
            else:
                prefix = await recorded_turns(self.ctx.store, episode_id, observations=True) if resume else None
                runner = EpisodeRunner(self.ctx, episode_id, self.env_id, task, seed, self.env_kwargs,
                                       prefix=prefix, resume=resume)
            runner.started = started
            if self._decide_with_end:
                runner.decide_group = group_id
            await runner.run()
        except anyio.get_cancelled_exc_class():
            await self._interrupt_unstarted(episode_id)  # a no-op once its runner started
            raise
        except StoreError as e:
            # Another serve process started it first, or the store refused a write: the episode
            # is that process's, or is resolved as interrupted when its heartbeat goes stale.
            log.warning("episode %d: %s", episode_id, e)
        finally:
            self._slots.release()
        self._pending[group_id] -= 1
        if self._pending[group_id] == 0:
            # Decided before it leaves `_pending`, so `run` does not return with it undecided
            # (here, unless its last episode's end decided it already).
            if runner is None or runner.group_status is None:
                await self._complete_group(group_id)
            del self._pending[group_id]
            if self.oldest is not None:
                self.oldest.ended(group_id)
            self._group_ended.set()
            self._group_ended = anyio.Event()

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
        if self.selection is not None and filter_reason is None and episodes:
            key = self._task_keys.pop(group_id, None)
            if key is None:  # resumed after a restart
                key = (await store.get_task(episodes[0].task_id))["key"]
            self.selection.observe(key, values)
        if filter_reason is None and cfg.filter_zero_variance and len(values) > 1 and max(values) == min(values):
            filter_reason = f"zero reward variance (all {values[0]:g})"
        try:
            await store.complete_group(group_id, filter_reason=filter_reason, rewards=rewards)
        except StoreError as e:
            # Another process still runs some of its episodes (e.g. one resumed after a crash):
            # whoever ends the last one decides the group.
            log.info("group %d: %s", group_id, e)

    async def _drain(self) -> None:
        while self._pending:
            await anyio.sleep(0.05)

    async def _heartbeat(self, tg: anyio.abc.TaskGroup) -> None:
        """Beat for this process's episodes, and reap other processes': episodes silent for
        `stale_after_s` (their serve died) are resumed here, or end as interrupted, and groups
        left with no running episode are decided."""
        store, run_id = self.ctx.store, self.run_id
        assert run_id is not None
        while True:
            await anyio.sleep(self.ctx.cfg.heartbeat_s)
            try:
                await store.heartbeat(self.ctx.owner)
                # A draining serve takes on no new work: it fails what it cannot finish.
                if not await self._reap_dead(tg, resume=not self._stopping):
                    continue
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

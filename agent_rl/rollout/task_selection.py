"""Task selection: stop admitting, for a while, tasks whose recent groups were all equal.

A group whose rewards are all equal carries no GRPO signal: serve filters it (`zero reward
variance`) and every token it generated is waste, and in a long-tailed env these are often
the longest episodes (a task no sibling can finish fails in all of them). With
`rollout.task_selection = "skip_all_equal"`, a task whose last group was all equal is skipped
for a number of the next times the task stream brings it back, and then tried again: a task
the policy has learned to solve sometimes (or failed to unlearn) comes back. One group with
unequal rewards ends the pause.

How long the pause is comes from the task's track record (a per-task estimate of how often its
groups are all equal, as curricula that drop solved or hopeless tasks keep one):
`rollout.task_pause` draws, twice as many after each further all-equal group in a row (at most
`MAX_BACKOFF` times), scaled by the share of the task's groups so far that were all equal. A task
that never gave a signal is paused in full (share 1); a task whose groups mostly had a signal
and that went all-equal once, by chance (four coin flips that agree, one group in eight), is
paused a draw or two, so a long pause costs the learnable tasks little.

A skipped task is still recorded as drawn (a task row without a group), so a restarted serve
continues the stream where it was; the record is rebuilt from the store's decided groups at
start (`TaskSelection.observe` in group order), so a paused task's pause starts again in full
after a restart.

It acts on tasks that come back (a finite task set cycles; a generator that never repeats a
task gets nothing from it). What it saves is measured by bench/long_tail.py as generated tokens
per trained token.
"""

from __future__ import annotations

import math

MAX_BACKOFF = 8
"""The most a pause grows: `task_pause` x 8 draws of the task after a long all-equal streak."""

MAX_SKIPS_IN_A_ROW = 1000
"""Draws skipped in a row after which the next task is admitted whatever its record (a task set
that is all paused does not stall admission)."""


class TaskSelection:
    """Which drawn tasks to admit, from the rewards of their earlier groups."""

    def __init__(self, pause: int) -> None:
        self.pause = pause
        self._streak: dict[str, int] = {}
        self._groups: dict[str, int] = {}
        """Decided groups of each task (with more than one reward)."""
        self._all_equal: dict[str, int] = {}
        """Of those, the all-equal ones."""
        self._skips_left: dict[str, int] = {}
        self._skipped_in_a_row = 0
        self.skipped = 0
        """Draws skipped by this process."""

    def observe(self, task_key: str, rewards: list[float]) -> None:
        """A group of `task_key` was decided with these rewards (after the group reward hook)."""
        if len(rewards) <= 1:
            return
        self._groups[task_key] = self._groups.get(task_key, 0) + 1
        if max(rewards) == min(rewards):
            self._all_equal[task_key] = self._all_equal.get(task_key, 0) + 1
            streak = self._streak.get(task_key, 0) + 1
            self._streak[task_key] = streak
            self._skips_left[task_key] = self.pause_after(task_key)
        else:
            self._streak.pop(task_key, None)
            self._skips_left.pop(task_key, None)

    def pause_after(self, task_key: str) -> int:
        """Draws to skip after the task's latest all-equal group: `pause` x 2^(streak - 1)
        (at most x `MAX_BACKOFF`) x the share of its groups that were all equal, at least 1."""
        streak = self._streak.get(task_key, 0)
        if streak == 0:
            return 0
        share = self._all_equal.get(task_key, 0) / max(self._groups.get(task_key, 0), 1)
        return max(1, math.ceil(self.pause * min(2 ** (streak - 1), MAX_BACKOFF) * share))

    def admit(self, task_key: str) -> bool:
        """Whether to admit the task drawn now (a skip counts against its pause)."""
        left = self._skips_left.get(task_key, 0)
        if left <= 0 or self._skipped_in_a_row >= MAX_SKIPS_IN_A_ROW:
            self._skipped_in_a_row = 0
            return True
        self._skips_left[task_key] = left - 1
        self._skipped_in_a_row += 1
        self.skipped += 1
        return False

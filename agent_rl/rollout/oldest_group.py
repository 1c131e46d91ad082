"""Admission that keeps the oldest running group's tokens trainable (`rollout.protect_oldest_group`).

Slots free up as episodes end and admission fills them: while a group's long episode runs, the
slots its short siblings left take new groups, which finish first. Every `groups_per_step` of
them is a trainer step, and each step moves the staleness floor (`trainer.max_staleness`) one
version further into the long group: the tokens it sampled before the floor are masked,
generated and never trained. With task selection this is where most of the waste went
(bench/long_tail.py: the freed slots fed short groups past the long learnable ones).

The rule: a group is admitted only if, counting it, the groups that could be trained before the
oldest group this serve still runs (ready within the bound, held by a trainer's step, running
beside it, and the new one: all pessimistically ahead of it) make fewer steps than would move
the floor past that group's first trainable version, `max(v0, latest - eta)`, where v0 is the
version served when it was admitted:

    latest + ahead // groups_per_step <= max(v0, latest - eta) + eta

What it costs: slots the long group's finished siblings freed wait for it (throughput, not
tokens: an idle slot generates nothing to waste). A serve counts the groups it admitted itself
for which is oldest, and the store's for the groups ahead.
"""

from __future__ import annotations


class OldestGroup:
    """The groups this serve runs, in admission order, with the version each was admitted at."""

    def __init__(self, max_staleness: int, groups_per_step: int) -> None:
        self.eta = max_staleness
        self.groups_per_step = max(groups_per_step, 1)
        self._admitted: dict[int, tuple[int, int]] = {}
        """Group id -> (admission order, version served when it was admitted)."""
        self._count = 0

    def admitted(self, group_id: int, version: int) -> None:
        """A group this serve runs from now (admitted, or resumed: `version` its first sample's)."""
        if group_id not in self._admitted:
            self._admitted[group_id] = (self._count, version)
            self._count += 1

    def ended(self, group_id: int) -> None:
        self._admitted.pop(group_id, None)

    def oldest_version(self) -> int | None:
        """The version the oldest running group was admitted at (None: none runs)."""
        if not self._admitted:
            return None
        return min(self._admitted.values())[1]

    def would_pass(self, latest: int, ahead: int) -> bool:
        """Whether admitting one more group could let the trainer step past the oldest running
        group's first trainable tokens: `latest` the newest version, `ahead` the groups that
        could be trained before it, the new one included."""
        v0 = self.oldest_version()
        if v0 is None:
            return False
        first = max(v0, latest - self.eta)
        return latest + ahead // self.groups_per_step > first + self.eta

"""The arithmetic of `rollout.protect_oldest_group` (agent_rl/rollout/oldest_group.py): a group is
admitted only while the groups that could be trained before the oldest running one make too few
trainer steps to move the staleness floor past its first trainable version. serve admitting by
it is tested in tests/rollout/test_admission.py."""

from __future__ import annotations

from agent_rl.rollout.oldest_group import OldestGroup


def test_one_more_group_is_refused_once_it_would_make_the_step_that_masks_the_oldest() -> None:
    og = OldestGroup(max_staleness=1, groups_per_step=2)
    assert not og.would_pass(latest=5, ahead=100)  # nothing runs: nothing to protect
    og.admitted(10, version=5)
    # Admitted at 5, trainer at 5: one step (to 6) keeps a floor of 5; a second would not.
    assert not og.would_pass(latest=5, ahead=3)
    assert og.would_pass(latest=5, ahead=4)
    # A step has passed: the floor is at its first version already, no further step may.
    assert not og.would_pass(latest=6, ahead=1)
    assert og.would_pass(latest=6, ahead=2)


def test_tokens_already_past_the_floor_protect_the_next_version_not_admission_forever() -> None:
    og = OldestGroup(max_staleness=1, groups_per_step=2)
    og.admitted(10, version=5)
    # The trainer is at 8 (its tokens of 5 and 6 are lost): what it samples from 7 on is kept.
    assert not og.would_pass(latest=8, ahead=1)
    assert og.would_pass(latest=8, ahead=2)


def test_the_oldest_is_the_first_admitted_still_running() -> None:
    og = OldestGroup(max_staleness=2, groups_per_step=1)
    og.admitted(10, version=3)
    og.admitted(11, version=4)
    og.admitted(10, version=9)  # admitted once: a second call (resume) keeps its place
    assert og.oldest_version() == 3
    og.ended(10)
    assert og.oldest_version() == 4
    og.ended(11)
    assert og.oldest_version() is None

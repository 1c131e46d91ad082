"""Advantage estimators (trainer/advantages.py) against numbers worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agent_rl.kernel.errors import ConfigError
from trainer.advantages import ESTIMATORS, dr_grpo, get_estimator, grpo, reinforce_pp, rloo

# Group 7 holds four samples; groups 3 and 9 one each.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
GROUPS = torch.tensor([7, 7, 7, 7, 3, 9])


def test_grpo_divides_the_centred_rewards_by_the_group_std() -> None:
    adv = grpo(REWARDS, GROUPS, eps=0.0)
    # group 7: mean 0.5, unbiased std sqrt(1/3); groups 3 and 9 are singletons -> 0
    s = math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0])


def test_dr_grpo_only_centres() -> None:
    assert dr_grpo(REWARDS, GROUPS).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0])


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    # r = 1: the others are {0, 0, 1}, mean 1/3 -> 2/3; r = 0: {1, 0, 1}, mean 2/3 -> -2/3
    third = 2 / 3
    assert rloo(REWARDS, GROUPS).tolist() == pytest.approx([third, -third, -third, third, 0, 0])


def test_reinforce_pp_normalises_over_the_whole_batch() -> None:
    adv = reinforce_pp(REWARDS, GROUPS, eps=0.0)
    # batch mean 8/6 = 4/3; unbiased variance (1 + 16 + 16 + 1 + 1 + 121) / 9 / 5 = 52/15.
    # One baseline for all: the singleton groups get advantages too.
    std = math.sqrt(52 / 15)
    assert adv.tolist() == pytest.approx([(r - 4 / 3) / std for r in REWARDS.tolist()])


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_group_of_one_and_equal_rewards_give_zero(name: str) -> None:
    estimate = ESTIMATORS[name]
    assert estimate(torch.tensor([3.0]), torch.tensor([0])).tolist() == [0.0]
    assert estimate(torch.full((4,), 0.7), torch.tensor([1, 1, 2, 2])).tolist() == [0.0] * 4
    assert estimate(torch.ones(4), torch.zeros(4, dtype=torch.long)).dtype == torch.float32


def test_the_registry_names_each_estimator_and_refuses_others() -> None:
    assert set(ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}
    assert get_estimator("rloo") is rloo
    with pytest.raises(ConfigError, match="trainer.loss.advantage = 'ppo' is not an advantage "
                                          "estimator: write one of dr_grpo, grpo, r"):
        get_estimator("ppo")

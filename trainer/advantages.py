"""Advantage estimators: the step's episode rewards -> one advantage per episode.

`trainer.loss.advantage` names one of `ESTIMATORS`; the data loader (trainer/data.py) calls it
once per step on all the step's episodes (`groups_per_step` groups), so "batch" below is the
step's global batch. Every estimator takes `rewards` [N] float and `group_ids` [N] int (the
samples of one prompt share an id) and returns [N] float32:

- grpo: (r - mean_group) / (std_group + eps), the unbiased std (GRPO);
- dr_grpo: r - mean_group, no std division, which biases towards groups of low variance
  (Dr. GRPO, "Understanding R1-Zero-Like Training");
- rloo: r - the mean of the other samples of its group = n / (n - 1) * (r - mean_group)
  (RLOO, "Back to Basics: Revisiting REINFORCE Style Optimization");
- reinforce_pp: (r - mean_batch) / (std_batch + eps), one baseline for the whole step, so it
  needs no groups (REINFORCE++; its KL term is `trainer.loss.kl_coef`, in the loss).

The group estimators give a group of one sample advantage 0: it carries no comparison.
A new estimator is a function here with `@estimator("name")` and a test in
tests/trainer/test_advantages.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agent_rl.kernel.errors import ConfigError

Estimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

ESTIMATORS: dict[str, Estimator] = {}
"""Every estimator by its `trainer.loss.advantage` name."""

EPS = 1e-6


def estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Register the decorated function as advantage estimator `name`."""

    def register(fn: Estimator) -> Estimator:
        ESTIMATORS[name] = fn
        return fn

    return register


def get_estimator(name: str) -> Estimator:
    """The estimator `trainer.loss.advantage` names; ConfigError listing them if none."""
    if name not in ESTIMATORS:
        raise ConfigError(f"trainer.loss.advantage = {name!r} is not an advantage estimator: "
                          f"write one of {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


def _groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per sample: its group's size and mean reward, and its reward minus that mean (float64)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1
    count = torch.zeros(groups, dtype=torch.float64).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    mean = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, rewards) / count
    return count[inverse], rewards - mean[inverse], inverse


def _in_groups(values: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.where(count > 1, values, torch.zeros_like(values)).float()


@estimator("grpo")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Group-normalised: (r - mean_group) / (std_group + eps)."""
    count, centred, inverse = _groups(rewards.double(), group_ids)
    sq = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64).index_add_(
        0, inverse, centred**2
    )[inverse]
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return _in_groups(centred / (std + eps), count)


@estimator("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Group-centred only: r - mean_group."""
    count, centred, _ = _groups(rewards.double(), group_ids)
    return _in_groups(centred, count)


@estimator("rloo")
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean_{j != i} r_j over its group."""
    count, centred, _ = _groups(rewards.double(), group_ids)
    return _in_groups(centred * count / (count - 1).clamp(min=1), count)


@estimator("reinforce_pp")
def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Batch-normalised with a global baseline: (r - mean_batch) / (std_batch + eps)."""
    r = rewards.double()
    if r.numel() < 2:
        return torch.zeros_like(r).float()
    return ((r - r.mean()) / (r.std() + eps)).float()

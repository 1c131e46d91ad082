"""Synthetic RL batches: random tokens standing in for episodes (prompt, then policy tokens),
rollout logprobs near the policy's, group-normalised advantages. Deterministic per seed."""

from __future__ import annotations

import torch

from trainer.batch import Batch
from trainer.advantages import grpo


def rl_batch(vocab: int, size: int = 8, length: int = 48, seed: int = 0, group: int = 4) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (size, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (size,), generator=g)
    prompt = length // 4
    positions = torch.arange(length).expand(size, -1)
    mask = ((positions >= prompt) & (positions < lengths[:, None])).float()
    tokens = tokens * (positions < lengths[:, None])  # padding id 0 past the end
    rollout = (-torch.rand(size, length, generator=g) * 3 - 4) * mask
    rewards = torch.randint(0, 2, (size,), generator=g).float()
    groups = torch.arange(size) // group
    return Batch(tokens, mask, rollout, grpo(rewards, groups), lengths=lengths)

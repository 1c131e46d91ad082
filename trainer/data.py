"""Claimed store groups -> one training `Batch`, built from the stored token arrays.

Contract: `load_batch(store, claim, version, ...)` reads the claim's completed episodes in ONE
store transaction (`store.claimed_episodes`: the engine's token ids, behaviour logprobs, loss
mask, sampling versions and, for MoE, routed experts, plus each episode's reward); nothing is
re-tokenized. Advantages are GRPO's, normalised within each group. Routed experts keep the
store's encoding of an unknown row (-1, e.g. a turn's last token, never fed back to the engine
in that turn) into the batch, where routing replay leaves such rows to free routing.
`TrainingData` also carries what the step's metrics need: staleness per episode and token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from agent_rl.store import Claim, Store, TokenArrays
from agent_rl.store.staleness import Measure
from agent_rl.store.staleness import staleness as staleness_of
from trainer.batch import Batch
from trainer.loss import grpo_advantages


@dataclass
class TrainingData:
    """One step's batch and its bookkeeping (episode order = batch row order)."""

    batch: Batch
    episode_ids: list[int]
    advantages: dict[int, float]
    staleness: list[float]
    """Per episode: the current policy version (before this step) minus its sampling version
    (`agent_rl.store.staleness`; 0: fully on-policy)."""
    model_tokens: int
    lengths: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


def to_batch(
    arrays: list[TokenArrays], advantages: list[float], use_experts: bool = True
) -> Batch:
    """Pad token arrays into a Batch; experts only when every episode carries them."""
    experts = [a.routed_experts for a in arrays]
    routed = None
    if use_experts and experts and all(e is not None for e in experts):
        routed = [torch.from_numpy(np.asarray(e, dtype=np.int64)) for e in experts]
    return Batch.from_sequences(
        [a.token_ids.tolist() for a in arrays],
        [a.loss_mask.astype(np.float32).tolist() for a in arrays],
        [a.logprobs.astype(np.float32).tolist() for a in arrays],
        advantages,
        routed_experts=routed,
        topk=int(routed[0].shape[2]) if routed else 0,
    )


async def load_batch(
    store: Store,
    claim: Claim,
    version: int,
    *,
    measure: Measure = "tokens",
    std_normalize: bool = True,
    use_experts: bool = True,
) -> TrainingData:
    """Read the claim's completed episodes and build the step's batch (see module docstring)."""
    episodes = await store.claimed_episodes(claim)
    if not episodes:
        raise ValueError(f"claim {claim.claim_id} holds no completed episodes")
    arrays = [e.tokens for e in episodes]
    rewards = [e.reward for e in episodes]
    adv = grpo_advantages(
        torch.tensor(rewards), torch.tensor([e.group_id for e in episodes]),
        std_normalize=std_normalize,
    ).tolist()
    staleness = [
        0.0 if e.sampled.get(measure) is None else staleness_of(version, e.sampled[measure])
        for e in episodes
    ]
    episode_ids = [e.id for e in episodes]
    return TrainingData(
        batch=to_batch(arrays, adv, use_experts),
        episode_ids=episode_ids,
        advantages=dict(zip(episode_ids, adv)),
        staleness=staleness,
        model_tokens=int(sum(int(a.loss_mask.sum()) for a in arrays)),
        lengths=[len(a) for a in arrays],
        rewards=rewards,
    )

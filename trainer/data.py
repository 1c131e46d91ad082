"""Claimed store groups -> one training `Batch`, built from the stored token arrays.

Contract: `load_batch(store, claim, version, floor, ...)` reads the claim's completed episodes in
ONE store transaction (`store.claimed_episodes`: the engine's token ids, behaviour logprobs, loss
mask, sampling versions and, for MoE, routed experts, plus each episode's reward); nothing is
re-tokenized. Tokens sampled below the staleness floor keep their place in the context but get
loss mask 0 (`agent_rl.store.staleness`). Advantages come from the estimator `advantage` names
(trainer/advantages.py), over all the claim's episodes: a stale sibling (every model token below
the floor) is in its group's baseline, but is no batch row, and goes back to the store as
filtered (`TrainingData.stale_siblings`). Routed experts keep the store's
encoding of an unknown row (-1, e.g. a turn's last token, never fed back to the engine in that
turn) into the batch, where routing replay leaves such rows to free routing.
An episode whose conversation was rewritten (an agent's history summarised or edited, through
the gateway) has more than one segment: each is a batch row of its own, with the episode's
advantage, so no segment's tokens attend to another's (`ClaimedEpisode.segments`).
`TrainingData` also carries what the step's metrics need: staleness per episode and token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from agent_rl.store import Claim, Store, TokenArrays
from agent_rl.store.staleness import Measure, trained_tokens
from agent_rl.store.staleness import staleness as staleness_of
from trainer.batch import Batch
from trainer.advantages import get_estimator


@dataclass
class TrainingData:
    """One step's batch and its bookkeeping (episode order = batch row order)."""

    batch: Batch
    episode_ids: list[int]
    """The episodes trained (at least one batch row each)."""
    advantages: dict[int, float]
    """Every claimed episode's advantage, stale siblings' included."""
    staleness: list[float]
    """Per trained episode: the current policy version (before this step) minus the mean
    version of its trained tokens (`agent_rl.store.staleness`; 0: fully on-policy)."""
    model_tokens: int
    """Tokens trained on (loss mask 1)."""
    stale_tokens: int = 0
    """Model tokens of the trained episodes left out for being sampled below the staleness floor
    (a stale sibling's are not counted here: the store records the episode as filtered)."""
    row_episodes: list[int] = field(default_factory=list)
    """The episode of each batch row, in row order (an episode of several segments has one row
    per segment, consecutive); empty: one row per episode, as `episode_ids`."""
    lengths: list[int] = field(default_factory=list)
    """Tokens of each batch row."""
    rewards: list[float] = field(default_factory=list)
    """Every claimed episode's reward."""
    stale_siblings: dict[int, str] = field(default_factory=dict)
    """Episodes whose every model token was sampled below the floor -> the reason recorded:
    counted in their group's baseline, no row of the batch."""

    def rows_of_episodes(self) -> list[int]:
        return self.row_episodes or self.episode_ids


def to_batch(
    arrays: list[TokenArrays], advantages: list[float], use_experts: bool = True
) -> Batch:
    """Pad token arrays into a Batch; experts only when every episode carries them. The arrays
    go into the batch's tensors as they are (no round trip through Python lists)."""
    experts = [a.routed_experts for a in arrays]
    routed = None
    if use_experts and experts and all(e is not None for e in experts):
        routed = [torch.from_numpy(np.asarray(e, dtype=np.int64)) for e in experts]
    return Batch.from_sequences(
        [a.token_ids for a in arrays],
        [a.loss_mask for a in arrays],
        [a.logprobs for a in arrays],
        advantages,
        routed_experts=routed,
        topk=int(routed[0].shape[2]) if routed else 0,
    )


async def load_batch(
    store: Store,
    claim: Claim,
    version: int,
    floor: int | None = None,
    *,
    measure: Measure = "tokens",
    advantage: str = "grpo",
    use_experts: bool = True,
) -> TrainingData:
    """Read the claim's completed episodes and build the step's batch (see module docstring)."""
    episodes = await store.claimed_episodes(claim)
    if not episodes:
        raise ValueError(f"claim {claim.claim_id} holds no completed episodes")
    rewards = [e.reward for e in episodes]
    adv = get_estimator(advantage)(
        torch.tensor(rewards), torch.tensor([e.group_id for e in episodes])
    ).tolist()
    arrays, row_adv, row_episodes, staleness, stale_tokens = [], [], [], [], 0
    episode_ids: list[int] = []
    stale_siblings: dict[int, str] = {}
    for e, a in zip(episodes, adv):
        tokens = e.tokens
        keep = trained_tokens(tokens.versions, floor, measure)
        sampled = tokens.loss_mask.astype(bool)
        if sampled.any() and not (sampled & keep).any():
            stale_siblings[e.id] = (
                f"stale sibling: every token was sampled by policy version "
                f"{int(tokens.versions[sampled].max())} or older, below the trainer's staleness "
                f"floor {floor}; its reward counted in its group's baseline"
            )
            continue
        stale_tokens += int((sampled & ~keep).sum())
        e = replace(e, tokens=replace(
            tokens, loss_mask=np.where(keep, tokens.loss_mask, 0).astype(tokens.loss_mask.dtype)))
        staleness.append(staleness_of(version, tokens.versions[keep]))
        episode_ids.append(e.id)
        for segment in e.segments():
            arrays.append(segment)
            row_adv.append(a)
            row_episodes.append(e.id)
    if not arrays:
        raise ValueError(f"claim {claim.claim_id}: every episode is below the staleness floor")
    return TrainingData(
        batch=to_batch(arrays, row_adv, use_experts),
        episode_ids=episode_ids,
        advantages={e.id: a for e, a in zip(episodes, adv)},
        row_episodes=row_episodes if len(row_episodes) != len(episode_ids) else [],
        staleness=staleness,
        model_tokens=int(sum(int(a.loss_mask.sum()) for a in arrays)),
        stale_tokens=stale_tokens,
        lengths=[len(a) for a in arrays],
        rewards=rewards,
        stale_siblings=stale_siblings,
    )

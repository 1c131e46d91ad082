"""Claimed store groups -> one training `Batch`, built from the stored token arrays.

Contract: `load_batch(store, claim, version, ...)` reads every completed episode of the claim's
groups with `store.episode_tokens` (the engine's token ids, behaviour logprobs, loss mask,
sampling versions and, for MoE, routed experts) and its reward from `store.group_episodes`;
nothing is re-tokenized. Advantages are GRPO's, normalised within each group. Routed-expert rows
of -1 (the last token of a turn, never fed back to the engine in that turn) are marked unknown
(`routed_valid` False): `fill_unknown_experts` gives them the trainer's own free routing, the
routing the engine would have chosen when it fed that token back in the next turn.
`TrainingData` also carries what the step's metrics need: staleness per episode and token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from agent_rl.store import Claim, Store, TokenArrays
from trainer.batch import Batch
from trainer.loss import grpo_advantages


@dataclass
class TrainingData:
    """One step's batch and its bookkeeping (episode order = batch row order)."""

    batch: Batch
    episode_ids: list[int]
    advantages: dict[int, float]
    staleness: list[int]
    """Per episode: the current policy version (before this step) minus the oldest version that
    sampled one of its tokens (0: fully on-policy)."""
    model_tokens: int
    lengths: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


def _topk(arrays: list[TokenArrays]) -> int:
    for a in arrays:
        if a.routed_experts is not None:
            return int(a.routed_experts.shape[2])
    return 0


def to_batch(
    arrays: list[TokenArrays], advantages: list[float], use_experts: bool = True
) -> Batch:
    """Pad token arrays into a Batch; experts only when every episode carries them."""
    routed = None
    topk = _topk(arrays)
    unknown: list[np.ndarray] = []
    if use_experts and topk and all(a.routed_experts is not None for a in arrays):
        routed = []
        for a in arrays:
            rows = np.array(a.routed_experts, dtype=np.int64)
            missing = (rows < 0).any(axis=(1, 2))
            rows[missing] = np.arange(topk)  # placeholder; marked invalid below
            routed.append(torch.from_numpy(rows))
            unknown.append(missing)
    batch = Batch.from_sequences(
        [a.token_ids.tolist() for a in arrays],
        [a.loss_mask.astype(np.float32).tolist() for a in arrays],
        [a.logprobs.astype(np.float32).tolist() for a in arrays],
        advantages,
        routed_experts=routed,
        topk=topk,
    )
    if routed is not None and batch.routed_valid is not None:
        valid = batch.routed_valid.clone()
        for i, missing in enumerate(unknown):
            valid[i, : len(missing)] &= ~torch.from_numpy(missing)
        batch = replace(batch, routed_valid=valid)
    return batch


async def load_batch(
    store: Store,
    claim: Claim,
    version: int,
    *,
    std_normalize: bool = True,
    use_experts: bool = True,
) -> TrainingData:
    """Read the claim's completed episodes and build the step's batch (see module docstring)."""
    arrays: list[TokenArrays] = []
    episode_ids: list[int] = []
    rewards: list[float] = []
    groups: list[int] = []
    for group in claim.groups:
        summaries = {e.id: e for e in await store.group_episodes(group.id)}
        for eid in group.episode_ids:
            summary = summaries.get(eid)
            if summary is None or summary.status != "completed":
                continue
            arrays.append(await store.episode_tokens(eid))
            episode_ids.append(eid)
            rewards.append(float(summary.reward or 0.0))
            groups.append(group.id)
    if not arrays:
        raise ValueError(f"claim {claim.claim_id} holds no completed episodes")
    adv = grpo_advantages(
        torch.tensor(rewards), torch.tensor(groups), std_normalize=std_normalize
    ).tolist()
    staleness = []
    for a in arrays:
        sampled = a.versions[a.versions >= 0]
        staleness.append(version - int(sampled.min()) if sampled.size else 0)
    return TrainingData(
        batch=to_batch(arrays, adv, use_experts),
        episode_ids=episode_ids,
        advantages=dict(zip(episode_ids, adv)),
        staleness=staleness,
        model_tokens=int(sum(int(a.loss_mask.sum()) for a in arrays)),
        lengths=[len(a) for a in arrays],
        rewards=rewards,
    )


@torch.no_grad()
def fill_unknown_experts(engine: Any, batch: Batch) -> Batch:
    """Give rows without recorded experts the trainer's free routing (one no-grad forward).

    Replay forces every row's experts; a placeholder on an unknown row would perturb the hidden
    states of the tokens after it. Free routing is what the engine itself computed for that
    token when the next turn's prefill fed it back. Rows stay `routed_valid` False, so they are
    not counted in the mismatch fraction. Skipped under sequence parallelism (each rank sees a
    chunk of the sequence; the placeholders stay).
    """
    replay = getattr(engine, "replay", None)
    if (
        replay is None
        or batch.routed_experts is None
        or batch.routed_valid is None
        or bool(batch.routed_valid.all())
        or replay.sequence_parallel
    ):
        return batch
    experts = batch.routed_experts.clone()
    size = engine.cfg.micro_batch_size
    for start in range(0, batch.size, size):
        mb = batch.rows(slice(start, start + size))
        positions = torch.arange(mb.length).unsqueeze(0).expand(mb.size, -1)
        assert mb.routed_experts is not None and mb.routed_valid is not None
        with replay.forward_context(mb.routed_experts, mb.routed_valid, False) as mismatch:
            engine.model(mb.tokens, positions, None)
        free = mismatch.free_experts(mb.size).to(experts.dtype)  # [b, T, L, k]
        unknown = ~mb.routed_valid
        experts[start : start + mb.size][unknown] = free[unknown]
    return replace(batch, routed_experts=experts)

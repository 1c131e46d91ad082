"""RL and SFT losses over per-token logprobs, with the per-step metrics that come from them.

Shapes: every per-token tensor is [B, T] float, aligned so that position t scores token t+1 of
the padded sequence (the engine does the shift); `mask` is 1.0 on tokens the policy produced
(loss mask), 0.0 on prompt, tool observations and padding. Advantages are per sequence [B].

Three logprobs meet in the policy loss:
- `logprobs`: the current policy pi_theta (with grad);
- `old_logprobs`: the proximal policy pi_old the PPO ratio is taken against (the trainer's own
  logprobs before this step's update; with one optimizer step per batch this is
  `logprobs.detach()`, so the ratio is 1 and clipping only matters across repeated steps);
- `rollout_logprobs`: the behaviour policy mu that actually sampled the tokens (SGLang's).
  Truncated importance sampling (TIS) multiplies each token's loss by
  min(pi_old / mu, tis_cap): it corrects both staleness and train/inference numerics mismatch
  without letting one rare token dominate the gradient.

`loss_type`: "grpo" and "ppo" are the same token-level PPO-clip objective (they differ only in
where the advantages come from: group-normalised rewards vs. given ones); "gspo" uses GSPO's
sequence-level ratio exp(mean_t log(pi_theta/pi_old)), clipped per sequence, with a
sequence-level TIS weight (geometric mean of the token ratios pi_old/mu, truncated).

Aggregation (`aggregate`): "token-mean" = sum over all loss tokens / their count;
"seq-mean-token-sum" = mean over sequences of each sequence's token sum; "seq-mean-token-mean" =
mean over sequences of each sequence's token mean. Denominators may be passed in so that
micro-batches and data-parallel ranks sum to the exact global value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossType = Literal["grpo", "gspo", "ppo"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages: (r - mean_group) / (std_group + eps), or r - mean_group.

    `rewards` [N] float, `group_ids` [N] int (samples of one prompt share an id). The std is the
    unbiased sample std; a group of one sample gets advantage 0 (it carries no comparison).
    """
    rewards = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1
    count = torch.zeros(groups, dtype=torch.float64).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    mean = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, rewards) / count
    centered = rewards - mean[inverse]
    if std_normalize:
        sq = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, centered**2)
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        centered = centered / (std[inverse] + eps)
    centered = torch.where(count[inverse] > 1, centered, torch.zeros_like(centered))
    return centered.float()


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: Aggregation, denominator: float | None = None
) -> torch.Tensor:
    """Reduce [B, T] per-token values to a scalar; `denominator` overrides the local token count
    ("token-mean") or sequence count (the seq modes), for micro-batch/DP-exact totals."""
    masked = values * mask
    if mode == "token-mean":
        return masked.sum() / (denominator if denominator is not None else mask.sum().clamp(min=1))
    per_seq = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {mode!r}")
    return per_seq.sum() / (denominator if denominator is not None else max(values.shape[0], 1))


@dataclass(frozen=True)
class PolicyLossConfig:
    """The knobs of `policy_loss` (TrainerConfig carries the user-facing copies)."""

    loss_type: LossType = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    tis_cap: float | None = 2.0
    kl_coef: float = 0.0
    aggregation: Aggregation = "token-mean"


@dataclass
class LossOutput:
    """The loss to backpropagate and token-mean metrics (floats) over this batch's loss tokens."""

    loss: torch.Tensor
    metrics: dict[str, float]
    tokens: int


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    denominator: float | None = None,
) -> LossOutput:
    """Clipped policy-gradient loss (PPO/GRPO token ratios or GSPO sequence ratios) with
    optional TIS against the rollout's logprobs and optional k3 KL to a reference policy."""
    mask = mask.to(logprobs.dtype)
    old = old_logprobs.detach()
    adv = advantages.detach().to(logprobs.dtype)[:, None]
    log_ratio = logprobs - old
    tokens = mask.sum().clamp(min=1)
    if cfg.loss_type == "gspo":
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        # s_i,t = sg[s_i] * pi/sg[pi]: equals s_i in value, carries the sequence ratio's gradient.
        ratio = torch.exp(seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach())
    elif cfg.loss_type in ("grpo", "ppo"):
        ratio = torch.exp(log_ratio)
    else:
        raise ValueError(f"unknown loss_type {cfg.loss_type!r}")
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)

    metrics: dict[str, float] = {}
    if rollout_logprobs is not None:
        behaviour_gap = old - rollout_logprobs.detach()
        metrics["train_rollout_logprob_abs_diff"] = float(
            (behaviour_gap.abs() * mask).sum() / tokens
        )
        if cfg.tis_cap:
            if cfg.loss_type == "gspo":
                seq_gap = (behaviour_gap * mask).sum(-1) / mask.sum(-1).clamp(min=1)
                weight = torch.exp(seq_gap)[:, None].expand_as(per_token)
            else:
                weight = torch.exp(behaviour_gap)
            metrics["tis_capped_fraction"] = float(
                ((weight > cfg.tis_cap).to(mask.dtype) * mask).sum() / tokens
            )
            weight = weight.clamp(max=cfg.tis_cap)
            metrics["tis_weight_mean"] = float((weight * mask).sum() / tokens)
            per_token = per_token * weight
    if ref_logprobs is not None and cfg.kl_coef:
        kl = k3_kl(logprobs, ref_logprobs.detach())
        metrics["ref_kl"] = float((kl.detach() * mask).sum() / tokens)
        per_token = per_token + cfg.kl_coef * kl

    loss = aggregate(per_token, mask, cfg.aggregation, denominator)
    with torch.no_grad():
        metrics["clip_fraction"] = clip_fraction(unclipped, clipped, mask)
        metrics["policy_kl"] = float((k3_kl(old, logprobs.detach()) * mask).sum() / tokens)
        metrics["ratio_mean"] = float((ratio.detach() * mask).sum() / tokens)
    return LossOutput(loss=loss, metrics=metrics, tokens=int(mask.sum()))


def sft_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    aggregation: Aggregation = "token-mean",
    denominator: float | None = None,
) -> LossOutput:
    """Cross-entropy on the loss-mask tokens (negative logprob, aggregated)."""
    mask = mask.to(logprobs.dtype)
    loss = aggregate(-logprobs, mask, aggregation, denominator)
    nll = float((-logprobs.detach() * mask).sum() / mask.sum().clamp(min=1))
    return LossOutput(loss=loss, metrics={"nll": nll}, tokens=int(mask.sum()))


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0, unbiased)."""
    diff = ref_logprobs - logprobs
    return torch.exp(diff) - diff - 1


def clip_fraction(unclipped: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of loss tokens whose objective took the clipped branch (no gradient through it)."""
    taken = (clipped > unclipped).to(mask.dtype)
    return float((taken * mask).sum() / mask.sum().clamp(min=1))

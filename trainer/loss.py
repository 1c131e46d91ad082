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

The policy loss (`trainer.loss.policy_loss`) is one function of `POLICY_LOSSES` that turns the
step's logprobs and per-sequence advantages into a per-token loss; `policy_loss` around it adds
what every loss shares (the k3 KL to the reference, aggregation, the policy's drift metric).
- "grpo": token-level PPO-clip, ratio pi_theta / pi_old per token, TIS per token;
- "gspo": GSPO's sequence-level ratio exp(mean_t log(pi_theta/pi_old)), clipped per sequence,
  with a sequence-level TIS weight (geometric mean of the token ratios pi_old/mu, truncated);
- "cispo": CISPO's clipped importance weight on a REINFORCE term, TIS per token.
Where the advantages come from is chosen apart (`trainer.loss.advantage`, trainer/advantages.py).
A new loss is a function here with `@loss("name")` and a test in tests/trainer/test_loss.py.

Aggregation (`aggregate`): "token-mean" = sum over all loss tokens / their count;
"seq-mean-token-sum" = mean over sequences of each sequence's token sum; "seq-mean-token-mean" =
mean over sequences of each sequence's token mean. Denominators may be passed in so that
micro-batches and data-parallel ranks sum to the exact global value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from agent_rl.config.trainer import LossConfig
from agent_rl.kernel.errors import ConfigError

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


@dataclass
class LossOutput:
    """The loss to backpropagate and token-mean metrics (floats) over this batch's loss tokens."""

    loss: torch.Tensor
    metrics: dict[str, float]
    tokens: int


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy loss sees; every tensor [B, T] but `advantages`, [B, 1]."""

    logprobs: torch.Tensor
    """pi_theta, with grad."""
    old_logprobs: torch.Tensor
    """pi_old, detached."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """The loss mask, float."""
    behaviour_gap: torch.Tensor | None
    """log pi_old - log mu (the rollout's), detached; None without rollout logprobs."""


PolicyLoss = Callable[[PolicyInputs, LossConfig, dict[str, float]], torch.Tensor]
"""(inputs, knobs, metrics to add to) -> the per-token loss [B, T] before KL and aggregation."""

POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Every policy loss by its `trainer.loss.policy_loss` name."""


def loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register the decorated function as policy loss `name`."""

    def register(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name] = fn
        return fn

    return register


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss `trainer.loss.policy_loss` names; ConfigError listing them if none."""
    if name not in POLICY_LOSSES:
        raise ConfigError(f"trainer.loss.policy_loss = {name!r} is not a policy loss: "
                          f"write one of {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    denominator: float | None = None,
) -> LossOutput:
    """`cfg.policy_loss`'s per-token loss, plus the k3 KL to a reference policy when given,
    aggregated; with the step's metrics."""
    fn = get_policy_loss(cfg.policy_loss)
    mask = mask.to(logprobs.dtype)
    old = old_logprobs.detach()
    tokens = mask.sum().clamp(min=1)
    metrics: dict[str, float] = {}
    gap = None
    if rollout_logprobs is not None:
        gap = old - rollout_logprobs.detach()
        metrics["train_rollout_logprob_abs_diff"] = float((gap.abs() * mask).sum() / tokens)
    adv = advantages.detach().to(logprobs.dtype)[:, None]
    per_token = fn(PolicyInputs(logprobs, old, adv, mask, gap), cfg, metrics)
    if ref_logprobs is not None and cfg.kl_coef:
        kl = k3_kl(logprobs, ref_logprobs.detach())
        metrics["ref_kl"] = float((kl.detach() * mask).sum() / tokens)
        per_token = per_token + cfg.kl_coef * kl
    total = aggregate(per_token, mask, cfg.aggregation, denominator)
    metrics["policy_kl"] = float((k3_kl(old, logprobs.detach()) * mask).sum() / tokens)
    return LossOutput(loss=total, metrics=metrics, tokens=int(mask.sum()))


@loss("grpo")
def ppo_clip(x: PolicyInputs, cfg: LossConfig, metrics: dict[str, float]) -> torch.Tensor:
    """Token-level PPO-clip: max(-A r_t, -A clip(r_t)), r_t = pi_theta / pi_old per token."""
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    return _clipped(x, cfg, ratio, x.behaviour_gap, metrics)


@loss("gspo")
def gspo(x: PolicyInputs, cfg: LossConfig, metrics: dict[str, float]) -> torch.Tensor:
    """GSPO: `ppo_clip`'s clip on the sequence's ratio (the geometric mean of its tokens')."""
    seq_log_ratio = _seq_mean(x.logprobs - x.old_logprobs, x.mask)
    # s_i,t = sg[s_i] * pi/sg[pi]: equals s_i in value, carries the sequence ratio's gradient.
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + x.logprobs - x.logprobs.detach())
    gap = x.behaviour_gap
    if gap is not None:
        gap = _seq_mean(gap, x.mask)[:, None].expand_as(x.logprobs)
    return _clipped(x, cfg, ratio, gap, metrics)


@loss("cispo")
def cispo(x: PolicyInputs, cfg: LossConfig, metrics: dict[str, float]) -> torch.Tensor:
    """CISPO (MiniMax-M1): -sg(clip(r_t)) A log pi_theta per token. The importance weight is
    clipped, not the update, so every token keeps its gradient, A clip(r_t) grad log pi."""
    ratio = torch.exp(x.logprobs - x.old_logprobs).detach()
    weight = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    tokens = x.mask.sum().clamp(min=1)
    metrics["clip_fraction"] = float(((weight != ratio).to(x.mask.dtype) * x.mask).sum() / tokens)
    metrics["ratio_mean"] = float((ratio * x.mask).sum() / tokens)
    per_token = -x.advantages * weight * x.logprobs
    if x.behaviour_gap is not None and cfg.tis_cap:
        per_token = per_token * tis_weight(x.behaviour_gap, x.mask, cfg.tis_cap, metrics)
    return per_token


def _clipped(x: PolicyInputs, cfg: LossConfig, ratio: torch.Tensor,
             log_tis: torch.Tensor | None, metrics: dict[str, float]) -> torch.Tensor:
    """PPO's pessimistic clip of -A * ratio, weighted by TIS; adds its metrics."""
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    tokens = x.mask.sum().clamp(min=1)
    metrics["clip_fraction"] = clip_fraction(unclipped.detach(), clipped.detach(), x.mask)
    metrics["ratio_mean"] = float((ratio.detach() * x.mask).sum() / tokens)
    if log_tis is not None and cfg.tis_cap:
        per_token = per_token * tis_weight(log_tis, x.mask, cfg.tis_cap, metrics)
    return per_token


def tis_weight(log_weight: torch.Tensor, mask: torch.Tensor, cap: float,
               metrics: dict[str, float]) -> torch.Tensor:
    """Truncated importance weights min(exp(log_weight), cap); adds their metrics."""
    tokens = mask.sum().clamp(min=1)
    weight = torch.exp(log_weight)
    metrics["tis_capped_fraction"] = float(((weight > cap).to(mask.dtype) * mask).sum() / tokens)
    weight = weight.clamp(max=cap)
    metrics["tis_weight_mean"] = float((weight * mask).sum() / tokens)
    return weight


def _seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


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

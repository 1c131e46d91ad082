"""Losses against values computed by hand (numbers in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from agent_rl.config.trainer import LossConfig
from agent_rl.kernel.errors import ConfigError
from trainer.loss import POLICY_LOSSES, aggregate, get_policy_loss, k3_kl, policy_loss, sft_loss


def test_aggregations() -> None:
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(v, m, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert aggregate(v, m, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(v, m, "token-mean", denominator=7.0).item() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        aggregate(v, m, "nope")  # type: ignore[arg-type]


def _cfg(**kw: object) -> LossConfig:
    base = {
        "policy_loss": "grpo",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.3,
        "tis_cap": None,
        "kl_coef": 0.0,
        "aggregation": "token-mean",
    }
    base.update(kw)
    return LossConfig(**base)  # type: ignore[arg-type]


def test_grpo_is_ppo_clip_token_level() -> None:
    # ratios 1.5 (A=+1: clipped to 1.3), 0.5 (A=+1: unclipped, min picks 0.5), 0.5 (A=-1: clipped
    # to 0.8 -> loss 0.8), 1.1 (A=-1: inside the range -> 1.1)
    old = torch.zeros(2, 2)
    lp = torch.log(torch.tensor([[1.5, 0.5], [0.5, 1.1]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    out = policy_loss(lp, old, adv, torch.ones(2, 2), _cfg())
    assert out.loss.item() == pytest.approx((-1.3 - 0.5 + 0.8 + 1.1) / 4)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 4)
    out.loss.backward()
    # clipped tokens carry no gradient; d(-A r)/d lp = -A r for the others, / 4 tokens
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.1 / 4])


def test_grpo_on_policy_gradient_is_advantage_weighted_logprob() -> None:
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out = policy_loss(lp, lp.detach(), torch.tensor([2.0]), mask, _cfg())
    assert out.loss.item() == pytest.approx(-2.0)  # ratio 1: -A per token, mean over 2 tokens
    out.loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -1.0, -1.0])
    assert out.metrics["policy_kl"] == 0.0 and out.metrics["clip_fraction"] == 0.0


def test_gspo_sequence_ratio_and_clip() -> None:
    # seq 0: token log-ratios 0.1, 0.3 -> s = exp(0.2) = 1.2214 > 1 + 0.001 -> clipped (A>0)
    # seq 1: token log-ratios 0.0002, -0.0002 -> s = 1 -> unclipped; loss = -A * 1
    lp = torch.tensor([[0.1, 0.3], [0.0002, -0.0002]], requires_grad=True)
    old = torch.zeros(2, 2)
    cfg = _cfg(
        policy_loss="gspo", clip_eps_low=0.001, clip_eps_high=0.001,
        aggregation="seq-mean-token-mean",
    )
    out = policy_loss(lp, old, torch.tensor([1.0, 2.0]), torch.ones(2, 2), cfg)
    assert out.loss.item() == pytest.approx((-1.001 + -2.0) / 2, rel=1e-6)
    out.loss.backward()
    # seq 1 gradient: d(-A s)/d lp_t = -A * s / |y| / 2 sequences = -2 * 1 / 2 / 2
    assert lp.grad[0].tolist() == [0.0, 0.0]
    assert lp.grad[1].tolist() == pytest.approx([-0.5, -0.5], rel=1e-3)


def test_cispo_clips_the_weight_and_keeps_every_token_s_gradient() -> None:
    # ratios 1.5 (weight clipped to 1.3), 0.5 (clipped to 0.8), 1.1 (inside: 1.1); A = +1, -1, +1
    old = torch.zeros(1, 3)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0]])  # per token here: three one-token sequences
    out = policy_loss(lp.view(3, 1), old.view(3, 1), adv.view(3), torch.ones(3, 1),
                      _cfg(policy_loss="cispo"))
    lps = [math.log(1.5), math.log(0.5), math.log(1.1)]
    assert out.loss.item() == pytest.approx((-1.3 * lps[0] + 0.8 * lps[1] - 1.1 * lps[2]) / 3)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 3)
    out.loss.backward()
    # -A * weight / 3 tokens: the clipped tokens too (PPO-clip would give them 0)
    assert lp.grad.flatten().tolist() == pytest.approx([-1.3 / 3, 0.8 / 3, -1.1 / 3])


def test_tis_truncates_train_over_rollout_ratio() -> None:
    # pi_old/mu = e^1 = 2.718 (capped at 2) and e^-1 = 0.368; on-policy ratio 1, A = 1
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[-2.0, -1.0]])
    out = policy_loss(
        lp,
        lp.detach(),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        _cfg(tis_cap=2.0),
        rollout_logprobs=rollout,
    )
    assert out.loss.item() == pytest.approx(-(2.0 + math.exp(-1)) / 2)
    assert out.metrics["tis_capped_fraction"] == 0.5
    assert out.metrics["train_rollout_logprob_abs_diff"] == pytest.approx(1.0)
    out.loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-1.0, -math.exp(-1) / 2])


def test_k3_kl_penalty() -> None:
    lp = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5]])
    # k3 = e^-0.5 - (-0.5) - 1 = 0.10653
    assert k3_kl(lp, ref).item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    out = policy_loss(
        lp, lp.detach(), torch.tensor([0.0]), torch.ones(1, 1), _cfg(kl_coef=0.5), ref_logprobs=ref
    )
    assert out.loss.item() == pytest.approx(0.5 * (math.exp(-0.5) - 0.5))
    assert out.metrics["ref_kl"] == pytest.approx(math.exp(-0.5) - 0.5)


def test_sft_loss_is_masked_nll() -> None:
    lp = torch.tensor([[-1.0, -2.0, -4.0]])
    out = sft_loss(lp, torch.tensor([[0.0, 1.0, 1.0]]))
    assert out.loss.item() == pytest.approx(3.0)
    assert out.tokens == 2


def test_the_registry_names_each_loss_and_refuses_others() -> None:
    assert {"grpo", "gspo"} <= set(POLICY_LOSSES)
    with pytest.raises(ConfigError, match="trainer.loss.policy_loss = 'nope' is not a policy "
                                          "loss: write one of"):
        get_policy_loss("nope")
    with pytest.raises(ConfigError, match="is not a policy loss"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1),
                    _cfg().model_copy(update={"policy_loss": "nope"}))

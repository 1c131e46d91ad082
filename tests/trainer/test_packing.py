"""Packed micro-batches (`trainer.max_tokens_per_micro_batch`) compute what padded ones do:
the same logprobs, loss and gradients to 1e-6 in fp32, for a dense model and for a MoE model
replaying routed experts (real megatron-core on CPU, one process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agent_rl.config import TrainerConfig
from tests.trainer._batches import rl_batch
from trainer.arch import ModelArch
from trainer.batch import Batch
from trainer.learner import learner
from trainer.packing import packed, plan


def test_plan_fills_bins_first_fit_and_keeps_every_row_once() -> None:
    lengths = [30, 5, 70, 12, 40, 8, 100]
    bins = plan(lengths, 64)
    assert sorted(r for b in bins for r in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) == 1 or sum(lengths[r] for r in b) <= 64
    assert [6] in bins and [2] in bins  # longer than the budget: alone


def test_a_packed_row_keeps_each_sequence_to_itself() -> None:
    batch = rl_batch(50, size=3, length=10)
    (micro,) = packed(batch, 64, multiple=4)
    pk = micro.packed
    assert pk is not None and pk.tokens.shape[1] % 4 == 0
    n = [int(x) for x in batch.lengths[micro.rows]]
    starts = [0, n[0], n[0] + n[1]]
    assert pk.positions[0, starts[1]] == 0 and pk.positions[0, starts[1] + 1] == 1
    allowed = ~pk.attention_mask[0, 0]
    # The second sequence's first token sees itself only; its last sees its own tokens only.
    assert allowed[starts[1]].nonzero().flatten().tolist() == [starts[1]]
    last = starts[2] - 1
    assert allowed[last].nonzero().flatten().tolist() == list(range(starts[1], starts[2]))


def _step(model: Path, batch: Batch, **cfg: Any) -> dict[str, Any]:
    config = TrainerConfig(optim={"lr": 1e-3}, routing_replay=True, **cfg)
    with learner(model, config) as e:
        logprobs = e.logprobs(batch)["logprobs"]
        metrics = e.rl_step(batch)
        grads = [p.main_grad.detach().clone() for p in e.module.parameters()]
    return {"logprobs": logprobs, "metrics": metrics, "grads": grads}


def _compare(padded: dict[str, Any], pack: dict[str, Any], batch: Batch) -> None:
    mask = batch.loss_mask.bool()
    diff = (padded["logprobs"] - pack["logprobs"])[mask].abs().max().item()
    assert diff < 1e-6, f"logprobs differ by {diff:.2e}"
    for key in ("loss", "entropy", "tokens", "train_rollout_logprob_abs_diff"):
        assert abs(padded["metrics"][key] - pack["metrics"][key]) < 1e-6, key
    worst = max((a - b).abs().max().item() for a, b in zip(padded["grads"], pack["grads"]))
    assert worst < 1e-6, f"gradients differ by {worst:.2e}"
    assert max(g.abs().max().item() for g in pack["grads"]) > 1e-4  # there was a gradient


@pytest.mark.slow
def test_packed_equals_padded_dense(tiny_dense_model: Path) -> None:
    vocab = ModelArch.from_hf_dir(tiny_dense_model).vocab_size
    batch = rl_batch(vocab, size=8, length=48)
    padded = _step(tiny_dense_model, batch, micro_batch_size=3)
    pack = _step(tiny_dense_model, batch, max_tokens_per_micro_batch=96)
    _compare(padded, pack, batch)


@pytest.mark.slow
def test_packed_equals_padded_moe_with_routing_replay(tiny_moe_model: Path) -> None:
    arch = ModelArch.from_hf_dir(tiny_moe_model)
    base = rl_batch(arch.vocab_size, size=6, length=40, seed=1)
    g = torch.Generator().manual_seed(2)
    experts = torch.stack([torch.randperm(arch.num_experts, generator=g)[: arch.moe_topk]
                           for _ in range(6 * 40 * arch.num_layers)])  # fmt: skip
    experts = experts.reshape(6, 40, arch.num_layers, arch.moe_topk)
    positions = torch.arange(40).expand(6, -1)
    experts[positions >= base.lengths[:, None]] = -1  # padding: unknown
    batch = Batch(base.tokens, base.loss_mask, base.rollout_logprobs, base.advantages, experts,
                  base.lengths)
    padded = _step(tiny_moe_model, batch, micro_batch_size=4)
    pack = _step(tiny_moe_model, batch, max_tokens_per_micro_batch=80)
    _compare(padded, pack, batch)
    assert padded["metrics"]["routing_mismatch_fraction"] == pytest.approx(
        pack["metrics"]["routing_mismatch_fraction"], abs=1e-9)


def test_entropy_of_a_one_row_micro_batch_is_not_clobbered(tiny_dense_model: Path) -> None:
    """Scoring a row's tokens must not change its logits before the entropy reads them (one row
    is what every packed micro-batch is, and a padded one of micro_batch_size 1)."""
    vocab = ModelArch.from_hf_dir(tiny_dense_model).vocab_size
    batch = rl_batch(vocab, size=4, length=24)
    out = []
    for size in (4, 1):
        with learner(tiny_dense_model, TrainerConfig(micro_batch_size=size)) as e:
            out.append(e.logprobs(batch, entropy=True)["entropy"])
    mask = batch.loss_mask.bool()
    assert (out[0] - out[1])[mask].abs().max().item() < 1e-6

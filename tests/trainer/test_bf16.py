"""`trainer.dtype = "bf16"`: bf16 parameters and activations, fp32 master weights and optimizer
state, logits and losses in fp32; checkpoints resume it exactly and the export holds the
weights it computes with (real megatron-core on CPU, one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_rl.config import TrainerConfig
from tests.trainer._batches import rl_batch
from trainer.arch import ModelArch
from trainer.learner import learner

pytestmark = pytest.mark.slow


def test_a_bf16_step_trains_with_fp32_master_weights_and_reports_the_rollout_gap(
    tiny_moe_model: Path, tmp_path: Path
) -> None:
    vocab = ModelArch.from_hf_dir(tiny_moe_model).vocab_size
    batch = rl_batch(vocab, size=4)
    with learner(tiny_moe_model, TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4)) as e:
        fp32 = e.logprobs(batch)["logprobs"]
    # The rollout's logprobs are the fp32 policy's, as an fp32 engine's would be.
    rollout = type(batch)(batch.tokens, batch.loss_mask, fp32 * batch.loss_mask, batch.advantages,
                          None, batch.lengths)  # fmt: skip
    cfg = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=2, dtype="bf16")
    with learner(tiny_moe_model, cfg) as e:
        assert {p.dtype for p in e.module.parameters()} == {torch.bfloat16}
        masters = [p for group in e.optimizer.param_groups for p in group["params"]]
        assert masters and {p.dtype for p in masters} == {torch.float32}
        before = e.logprobs(rollout)["logprobs"]
        assert before.dtype == torch.float32
        metrics = e.rl_step(rollout)
        gap = ((before - fp32).abs() * batch.loss_mask).sum() / batch.loss_mask.sum()
        # bf16 rounding shows as a train-vs-rollout gap, measured as it is: not zero, small.
        assert 1e-5 < metrics["train_rollout_logprob_abs_diff"] < 0.05
        assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(float(gap), rel=1e-3)
        assert metrics["update_ok"] == 1.0 and metrics["grad_norm"] > 0
        saved = e.save_checkpoint(tmp_path / "ckpt")
        expected = e.rl_step(rollout)
        ours = e.logprobs(rollout)["logprobs"]
        out = e.export_hf(tmp_path / "export")
    with learner(tiny_moe_model, cfg) as e:
        assert e.load_checkpoint(saved) == 1
        resumed = e.rl_step(rollout)
    assert resumed["loss"] == expected["loss"] and resumed["grad_norm"] == expected["grad_norm"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=batch.tokens).logits, -1)
    ref = ref[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    # The export's weights are the bf16 ones; an fp32 forward of them differs by rounding only.
    diff = ((ours[:, 1:] - ref).abs() * batch.loss_mask[:, 1:]).sum() / batch.loss_mask[:, 1:].sum()
    assert diff < 0.05

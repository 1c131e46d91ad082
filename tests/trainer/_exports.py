"""Checks shared by the family tests on a trained learner's HF export."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from agent_rl.config import TrainerConfig
from trainer.batch import Batch
from trainer.learner import learner


def assert_loads_back_exactly(out: Path, exported: dict[str, torch.Tensor], batch: Batch,
                              ours: torch.Tensor, label: str) -> None:
    """The export `out` (its tensors `exported`) loads back into megatron to the bit, and into
    transformers with the learner's logprobs `ours` on `batch` (within 1e-5)."""
    with learner(out, TrainerConfig(micro_batch_size=4)) as back:
        again = back.hf_state_dict()
        assert set(again) == set(exported)
        assert all(torch.equal(again[k], exported[k]) for k in exported)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=batch.tokens).logits, -1)
    ref = ref[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    diff = ((ours[:, 1:] - ref).abs() * batch.loss_mask[:, 1:]).max().item()
    print(f"{label}: export vs learner max |logprob diff| {diff:.2e}")
    assert diff < 1e-5

"""Checks shared by the family tests: a trained learner's HF export, and an MoE family served by
SGLang's CPU engine after every weight sync, against the learner with routing replay."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM

from agent_rl.config import TrainerConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.sglang.generation import Generation
from tests.trainer._syncs import assert_every_sync_serves_the_learner
from trainer.batch import Batch
from trainer.learner import Learner, learner

if TYPE_CHECKING:
    from agent_rl.engine.launcher import EngineServer


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


def assert_engine_logprobs_and_experts_replay(
    model_dir: Path, sglang_server_factory: Callable[..., EngineServer], label: str
) -> None:
    """SGLang's CPU engine (an engine of its own), started on the MoE model `model_dir`, serves
    the learner's weights after each weight sync (disk, distributed, tensor; a step before each:
    tests/trainer/_syncs.py), then samples tokens whose logprobs are the learner's (mean within
    1e-5), with the engine's routed experts replayed in the learner (R3): SGLang reports a row per
    decoder layer, the dense first ones included, which replay drops; every fed token has its
    experts in every MoE layer."""
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 300, 12, 13, 14, 15]]
    server = sglang_server_factory(model_dir, moe_routing_replay=True)

    async def sample() -> list[Generation]:
        # top-k given: the engine's model path is the disk sync's export, gone by now
        async with EngineClient(server.url, moe_topk=e.arch.moe_topk) as client:
            params = {"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 0}
            return [await client.generate(p, params, return_routed_experts=True) for p in prompts]

    cfg = TrainerConfig(micro_batch_size=4, routing_replay=True, optim={"lr": 1e-3})
    with learner(model_dir, cfg) as e:
        try:
            assert_every_sync_serves_the_learner(e, server.url, label)
            generations = asyncio.run(sample())
        finally:
            server.stop()  # its ~2 GB back before the rest of the session
        _assert_replayed(e, prompts, generations, label)


def _assert_replayed(e: Learner, prompts: list[list[int]], generations: list[Generation],
                     label: str) -> None:
    """The learner's logprobs of the engine's samples, its experts replayed, are the engine's."""
    arch = e.arch
    for p, g in zip(prompts, generations):
        assert g.routed_experts is not None
        assert g.routed_experts.shape == (len(p) + len(g.output_ids) - 1, arch.num_layers,
                                          arch.moe_topk)  # fmt: skip
    batch = Batch.from_sequences(
        [p + g.output_ids for p, g in zip(prompts, generations)],
        loss_masks=[[0.0] * len(p) + [1.0] * len(g.output_ids)
                    for p, g in zip(prompts, generations)],
        rollout_logprobs=[[0.0] * len(p) + list(g.logprobs or [])
                          for p, g in zip(prompts, generations)],
        advantages=[1.0, -1.0, 0.5],
        routed_experts=[torch.from_numpy(g.routed_experts.copy()) for g in generations],
        topk=arch.moe_topk,
    )  # fmt: skip
    ours = e.logprobs(batch)["logprobs"]
    metrics = e.rl_step(batch)
    mask = batch.loss_mask
    diff = (ours - batch.rollout_logprobs).abs() * mask
    mean = float(diff.sum() / mask.sum())
    print(f"trainer vs SGLang ({label}, R3): mean |logprob diff| {mean:.2e}, max "
          f"{diff.max().item():.2e} over {int(mask.sum())} tokens; free routing differs on "
          f"{metrics['routing_mismatch_fraction']:.4f} of tokens")
    assert mask.sum() >= 3 * 8 and mean <= 1e-5
    moe = batch.routed_experts[:, :, arch.dense_layers:]
    fed = torch.arange(batch.tokens.shape[1]) < batch.lengths[:, None] - 1
    assert (moe[fed] >= 0).all()
    assert metrics["routing_mismatch_fraction"] <= 0.02

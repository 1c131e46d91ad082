"""The trainer scores SGLang's rollouts as SGLang did: same weights, fp32, CPU.

Episodes are sampled by the session's real SGLang server (tiny-moe, routed experts returned);
the trainer recomputes the logprobs of the sampled tokens from the same HF directory, replaying
the engine's experts (R3). Also checks SGLang's routed-experts layout against the trainer's free
routing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from agent_rl.config import TrainerConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.sglang.generation import Generation
from agent_rl.engine.launcher import EngineServer
from trainer.batch import Batch
from trainer.learner import learner

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 300, 12, 13, 14, 15]]


def _sample(url: str) -> list[Generation]:
    async def go() -> list[Generation]:
        async with EngineClient(url) as client:
            params = {"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 0}
            return [await client.generate(p, params, return_routed_experts=True) for p in PROMPTS]

    return asyncio.run(go())


def test_trainer_logprobs_match_sglang_rollouts(
    sglang_moe_server: EngineServer, tiny_moe_model: Path
) -> None:
    generations = _sample(sglang_moe_server.url)
    tokens = [p + g.output_ids for p, g in zip(PROMPTS, generations)]
    batch = Batch.from_sequences(
        tokens,
        loss_masks=[
            [0.0] * len(p) + [1.0] * len(g.output_ids) for p, g in zip(PROMPTS, generations)
        ],
        rollout_logprobs=[
            [0.0] * len(p) + list(g.logprobs or []) for p, g in zip(PROMPTS, generations)
        ],
        advantages=[1.0, -1.0, 0.5],
        routed_experts=[torch.from_numpy(g.routed_experts.copy()) for g in generations],
        topk=2,
    )
    for g, seq in zip(generations, tokens):
        assert g.routed_experts is not None and g.routed_experts.shape[0] == len(seq) - 1
    with learner(tiny_moe_model, TrainerConfig(micro_batch_size=4, routing_replay=True)) as e:
        ours = e.logprobs(batch)["logprobs"]
        mask = batch.loss_mask
        diff = float(((ours - batch.rollout_logprobs).abs() * mask).sum() / mask.sum())
        metrics = e.rl_step(batch)
    print(
        f"trainer vs SGLang logprobs: mean abs diff {diff:.2e} over {int(mask.sum())} tokens; "
        f"free routing differs from SGLang's on {metrics['routing_mismatch_fraction']:.4f} "
        "of tokens"
    )
    assert diff <= 1e-4
    assert abs(metrics["train_rollout_logprob_abs_diff"] - diff) < 1e-6
    # Same weights, same numbers: the trainer's own routing agrees with the engine's.
    assert metrics["routing_mismatch_fraction"] <= 0.02

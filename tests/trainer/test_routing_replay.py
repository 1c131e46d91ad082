"""Routing replay (R3) on the tiny MoE preset with real megatron-core RouterReplay."""

from __future__ import annotations

from pathlib import Path

import torch

from agent_rl.config import TrainerConfig
from tests.trainer._batches import rl_batch
from trainer.arch import ModelArch
from trainer.batch import Batch
from trainer.learner import learner
from trainer.routing_replay import RoutingReplay, from_sglang


def test_sglang_layout_is_shifted_and_padded() -> None:
    # two sequences of 4 and 2 tokens: SGLang reports n-1 rows of [layers=1, topk=2]
    a = torch.tensor([[[5, 6]], [[7, 1]], [[2, 3]]])
    b = torch.tensor([[[4, 0]]])
    experts = from_sglang([a, b], length=4, topk=2)
    assert experts.shape == (2, 4, 1, 2)
    assert torch.equal(experts[0, :3], a) and torch.equal(experts[1, :1], b)
    valid = Batch(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2), experts)
    assert valid.routed_valid.tolist() == [[True, True, True, False], [True, False, False, False]]
    assert experts[1, 1:].flatten().tolist() == [-1] * 6  # unknown: the store's encoding


def test_megatron_layout_is_sequence_major() -> None:
    replay = RoutingReplay(sequence_parallel=False)
    t = torch.arange(2 * 3).reshape(2, 3)  # [B=2, T=3]: value = b * 3 + t
    assert replay._megatron_layout(t).tolist() == [0, 3, 1, 4, 2, 5]  # row = t * B + b


def _used_experts(module: torch.nn.Module, sink: list[torch.Tensor]) -> list:
    """Forward hooks that note the experts each router actually dispatched to."""
    handles = []
    for name, sub in module.named_modules():
        if name.endswith("mlp.router"):

            def hook(mod, inputs, output):  # type: ignore[no-untyped-def]
                routing_map = output[1]
                sink.append(routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1))

            handles.append(sub.register_forward_hook(hook))
    return handles


def test_replay_uses_the_given_experts_and_reports_mismatch(tiny_moe_model: Path) -> None:
    arch = ModelArch.from_hf_dir(tiny_moe_model)
    base = rl_batch(arch.vocab_size, size=4, length=32)
    cfg = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4, routing_replay=True)
    with learner(tiny_moe_model, cfg) as e:
        assert e.routing_replay is not None
        # What free routing picks for these tokens, as SGLang would report it ([n-1, L, k]).
        filler = from_sglang([torch.zeros(31, arch.num_layers, 2, dtype=torch.long)] * 4, 32, 2)
        with e.routing_replay.forward_context(filler, replay=False) as seen:
            e.model(base.tokens, torch.arange(32).expand(4, -1), None)
        stacked = torch.stack(seen.free, dim=1)  # [T*B, L, k], sequence-major
        free = stacked.reshape(32, 4, *stacked.shape[1:]).transpose(0, 1)  # [B, T, L, k]
        recorded = [free[i, :-1] for i in range(4)]
        # Rollout experts that differ from free routing: rotate every expert id by one.
        rotated = [(r + 1) % arch.num_experts for r in recorded]

        def with_experts(routed: list[torch.Tensor]) -> Batch:
            experts = from_sglang(routed, 32, arch.moe_topk)
            return Batch(base.tokens, base.loss_mask, base.rollout_logprobs, base.advantages, experts)

        # Replay on: the routers dispatch exactly to the given experts, for every token.
        used: list[torch.Tensor] = []
        handles = _used_experts(e.module, used)
        e.logprobs(with_experts(rotated))
        for h in handles:
            h.remove()
        for layer, chosen in enumerate(used):
            given = torch.stack(rotated)[:, :, layer].transpose(0, 1).reshape(-1, 2)  # [(T-1)*B, k]
            chosen = chosen.reshape(32, 4, 2)[:-1].reshape(-1, 2)
            agree = (chosen.sort(-1).values == given.sort(-1).values).all(-1).float().mean()
            assert agree.item() == 1.0
        # Rows without engine routing (a store writes -1) are routed freely, the rest replayed.
        experts = from_sglang(rotated, 32, arch.moe_topk)
        experts[:, ::3] = -1
        ok = (experts >= 0).all(-1).all(-1)
        used.clear()
        handles = _used_experts(e.module, used)
        with e.routing_replay.forward_context(experts, replay=True) as seen:
            e.model(base.tokens, torch.arange(32).expand(4, -1), None)
        for h in handles:
            h.remove()
        for layer, chosen in enumerate(used):
            given = experts[:, :, layer].transpose(0, 1).reshape(-1, 2)  # sequence-major
            rows = ok.transpose(0, 1).reshape(-1)
            expect = torch.where(rows[:, None], given, seen.free[layer])
            assert torch.equal(chosen.sort(-1).values, expect.sort(-1).values)
        # Free routing (what the same forward would have picked) differs on every rotated token.
        on = e.rl_step(with_experts(rotated))
        assert on["routing_mismatch_fraction"] == 1.0

    cfg_off = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4, routing_replay=False)
    with learner(tiny_moe_model, cfg_off) as e:
        same = e.rl_step(with_experts(recorded))
        print(f"replay off, recorded experts: mismatch {same['routing_mismatch_fraction']:.3f}")
        assert same["routing_mismatch_fraction"] == 0.0
        off = e.rl_step(with_experts(rotated))
        print(f"replay off, rotated experts: mismatch {off['routing_mismatch_fraction']:.3f}")
        assert off["routing_mismatch_fraction"] > 0

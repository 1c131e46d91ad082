"""Routing replay (R3): train a MoE model with the experts the rollout engine chose.

Layouts:
- SGLang returns, per sequence of n tokens, `routed_experts` [n-1, layers, topk]: row j holds
  the experts that processed token j (the last token was sampled, never fed back).
- The batch carries them token-aligned and padded: `routed_experts` [B, T, layers, topk] long
  (`from_sglang` builds it), `NO_EXPERT` (-1, `agent_rl.kernel.encoding`) on every row the
  engine did not report: the one encoding of "no routed experts for this token", the same the
  store writes.
- megatron's RouterReplay takes, per MoE layer in build order, [s*b, topk] in sequence-major
  order ([T, B] flattened); with sequence parallelism each TP rank's routers see only its
  contiguous chunk of T, so each rank is given its chunk.
Rows without engine routing (-1: padding, or a turn's last token, which the engine never fed
back in that turn) are routed freely, never replayed: free routing is what the engine itself
computed for that token when the next turn's prefill fed it back.
With pipeline parallelism a stage's routers are those of its own layers: it is given the
experts of its layers (`first_layer` on), and whether a token's free routing differs in some
layer is decided over all stages (`differing_on_any_stage`) once the step's forwards are done.

`RoutingReplay.forward_context(experts, replay=...)` wraps one forward: with replay on, the
routers use the given experts on known rows and free routing (top-k of the same router scores)
elsewhere, and we note what free routing would have picked everywhere; with replay off, the
routers route freely and we record it.
Either way `mismatch` counts tokens whose free routing differs from the recorded experts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from agent_rl.kernel.encoding import NO_EXPERT


def from_sglang(routed: Sequence[torch.Tensor | np.ndarray], length: int, topk: int) -> torch.Tensor:
    """Pad per-sequence routed experts (SGLang's [n_i - 1, L, k], or the store's [n_i, L, k]
    with -1 rows) to [B, length, L, k], -1 past each sequence's rows."""
    layers = routed[0].shape[1]
    out = torch.full((len(routed), length, layers, topk), NO_EXPERT, dtype=torch.long)
    for i, r in enumerate(routed):
        n = min(r.shape[0], length)
        out[i, :n] = torch.as_tensor(r[:n], dtype=torch.long)
    return out


def _sp_chunk(t: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice along the sequence dim when sequence parallelism splits it."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    return t.chunk(tp, dim=0)[ps.get_tensor_model_parallel_rank()] if tp > 1 else t


@dataclass
class Mismatch:
    """Counts over the valid tokens of the batch (all sequence-parallel chunks) and layers;
    `free` holds this rank's chunk only."""

    differing_tokens: int = 0
    """Over this pipeline stage's layers (all of them with pp = 1)."""
    tokens: int = 0
    per_layer: list[float] = field(default_factory=list)
    """This stage's layers'."""
    free: list[torch.Tensor] = field(default_factory=list)
    """Free-routing top-k per MoE layer of this stage, megatron layout ([T_chunk * B, k])."""
    differing: torch.Tensor | None = None
    """[T_chunk * B] bool, this rank's chunk: free routing differs in one of this stage's layers."""

    @property
    def fraction(self) -> float:
        return self.differing_tokens / self.tokens if self.tokens else 0.0


class RoutingReplay:
    """Drives megatron's RouterReplay instances of one model (they are process-global)."""

    def __init__(
        self, sequence_parallel: bool, first_layer: int = 0, num_layers: int | None = None,
        dense_layers: int = 0,
    ) -> None:  # fmt: skip
        """This process's routers are the model's MoE layers `first_layer` on (its pipeline
        stage's, counted among the MoE layers); the routed experts it is given cover
        `num_layers` MoE layers (default: its own) after `dense_layers` first layers without a
        router, which the engine reports too (SGLang: a row per decoder layer) and replay drops."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.routers = list(RouterReplay.global_router_replay_instances)
        self.sequence_parallel = sequence_parallel
        self.layers = slice(first_layer, first_layer + len(self.routers))
        self.num_layers = len(self.routers) if num_layers is None else num_layers
        self.dense_layers = dense_layers

    @contextmanager
    def forward_context(self, experts: torch.Tensor, replay: bool) -> Iterator[Mismatch]:
        """Around one forward of a [B, T] batch: `experts` [B, T, L, k], -1 on unknown rows."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        if experts.shape[2] != self.dense_layers + self.num_layers:
            raise ValueError(
                f"routed experts have {experts.shape[2]} layers, the model has "
                f"{self.num_layers} MoE layers" + (
                    f" after {self.dense_layers} dense ones" if self.dense_layers else "")
            )
        experts = experts[:, :, self.dense_layers:]
        stage = experts[:, :, self.layers]
        per_layer = [self._megatron_layout(stage[:, :, layer]) for layer in range(stage.shape[2])]
        valid_rows = self._megatron_layout((experts >= 0).all(-1).all(-1))
        free: list[torch.Tensor] = []
        result = Mismatch()
        if replay:
            RouterReplay.set_replay_data(per_layer)
            for router in self.routers:
                # instance attribute only: megatron's class is untouched
                router.get_replay_topk = _noting_free(router, free, valid_rows)
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield result
            if not replay:
                free = [r.get_recorded_indices() for r in self.routers]
            any_diff = torch.zeros_like(valid_rows)
            counts = []
            for given, chosen in zip(per_layer, free):
                diff = (given.sort(-1).values != chosen.sort(-1).values).any(-1) & valid_rows
                counts.append(diff.sum())
                any_diff |= diff
            totals = torch.stack([any_diff.sum(), valid_rows.sum(), *counts]).double()
            if self.sequence_parallel:  # each TP rank saw its own chunk of the sequence
                from megatron.core import parallel_state as ps

                dist.all_reduce(totals, group=ps.get_tensor_model_parallel_group())
            result.differing_tokens, result.tokens = int(totals[0]), int(totals[1])
            result.per_layer = [float(c) / max(result.tokens, 1) for c in totals[2:]]
            result.free = [f.detach().clone() for f in free]
            result.differing = any_diff
        finally:
            for router in self.routers:
                router.__dict__.pop("get_replay_topk", None)
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()

    def differing_on_any_stage(self, seen: Sequence[Mismatch]) -> int:
        """Tokens of these forwards (this rank's, in order) whose free routing differs in a MoE
        layer of any pipeline stage: each stage's per-token flags, OR-ed over the pipeline group.
        A collective: every stage calls it, after the same forwards."""
        from megatron.core import parallel_state as ps

        flags = torch.cat([m.differing for m in seen if m.differing is not None]).to(torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group())
        total = flags.sum().double().reshape(1)
        if self.sequence_parallel:  # each TP rank saw its own chunk of the sequence
            dist.all_reduce(total, group=ps.get_tensor_model_parallel_group())
        return int(total)

    def _megatron_layout(self, t: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> this rank's [T_chunk * B, ...], sequence-major."""
        seq_major = t.transpose(0, 1).contiguous()
        if self.sequence_parallel:
            seq_major = _sp_chunk(seq_major)
        return seq_major.reshape(-1, *t.shape[2:])


def _noting_free(router: Any, sink: list[torch.Tensor], valid: torch.Tensor) -> Any:
    """The router's get_replay_topk that notes the free top-k of the same scores and replays
    only the valid rows (the others keep their free routing)."""
    original = type(router).get_replay_topk.__get__(router)

    def get_replay_topk(  # type: ignore[no-untyped-def]
        scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        with torch.no_grad():
            _, free = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
        sink.append(free)
        target = router.target_topk_idx.to(free.device)
        router.target_topk_idx = torch.where(valid[:, None].to(free.device), target, free)
        return original(scores, topk, num_groups, group_topk, default_compute_topk)

    return get_replay_topk

"""Micro-batches: padded rows, or sequences packed into one row by token budget.

A step's `Batch` is padded to its longest sequence, so a batch of agentic episodes, whose
lengths are heavy-tailed, is mostly padding. With `trainer.max_tokens_per_micro_batch` the
learner instead packs sequences, first-fit by decreasing length, into rows of at most that many
tokens (a longer sequence is a row of its own) and runs one row per micro-batch:

- attention stays inside each sequence: a block-diagonal causal mask (`Packed.attention_mask`,
  True = masked, as megatron-core's local attention takes it; TransformerEngine's packed-sequence
  parameters would do the same on GPU);
- each token keeps its position within its own sequence, for RoPE too (`per_token_rope`), so a
  packed token is computed as it is in its padded row;
- routed experts (MoE routing replay) are packed alongside the tokens;
- the per-position scores (logprobs, entropy) are gathered back into the padded layout
  (`Packed.unpack`, differentiable), where the losses are taken exactly as for padded
  micro-batches: same masks, advantages and global denominators, so losses and gradients are the
  padded path's up to float summation order.

Without a budget, micro-batches are `micro_batch_size` consecutive padded rows, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from agent_rl.kernel.encoding import NO_EXPERT
from trainer.batch import Batch


@dataclass(frozen=True)
class Packed:
    """One packed row and how its positions map back to the padded rows it holds."""

    tokens: torch.Tensor
    """[1, P] long."""
    positions: torch.Tensor
    """[1, P] long: each token's position within its own sequence."""
    attention_mask: torch.Tensor
    """[1, 1, P, P] bool, True where attention is masked: block-diagonal causal."""
    routed_experts: torch.Tensor | None
    """[1, P, layers, topk] long, NO_EXPERT (-1) where unknown (and on padding)."""
    index: torch.Tensor
    """[b, T-1] long: the packed position whose score belongs to (row, t) of the padded layout
    (position t scores token t+1)."""
    valid: torch.Tensor
    """[b, T-1] bool: (row, t) scores a real token of that row."""

    def unpack(self, scores: torch.Tensor) -> torch.Tensor:
        """Packed per-position scores [1, P-1] -> the padded layout [b, T-1] (0 elsewhere)."""
        return torch.where(self.valid, scores[0][self.index], torch.zeros((), dtype=scores.dtype))


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the step's batch processed together."""

    rows: torch.Tensor
    """[b] long: which rows of the step's batch."""
    batch: Batch
    """Those rows, padded as in the step's batch (masks, advantages, rollout logprobs)."""
    packed: Packed | None = None
    """Set when the rows run as one packed row."""


def row_lengths(batch: Batch) -> list[int]:
    """Real tokens of each row (the whole row when the batch does not record them)."""
    if batch.lengths is None:
        return [batch.length] * batch.size
    return [int(n) for n in batch.lengths]


def plan(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows grouped first-fit by decreasing length into bins of at most `budget` tokens (a
    longer row is a bin of its own); bins in the order they were opened."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        n = lengths[row]
        for i, free in enumerate(room):
            if n <= free:
                bins[i].append(row)
                room[i] -= n
                break
        else:
            bins.append([row])
            room.append(budget - n)
    return bins


def padded(batch: Batch, size: int) -> list[MicroBatch]:
    """`size` consecutive rows per micro-batch."""
    return [MicroBatch(torch.arange(i, min(i + size, batch.size)), batch.rows(slice(i, i + size)))
            for i in range(0, batch.size, size)]  # fmt: skip


def packed(batch: Batch, budget: int, multiple: int = 1) -> list[MicroBatch]:
    """One packed row per micro-batch (see the module docstring); rows are padded to a multiple
    of `multiple` tokens (sequence parallelism splits them over the TP ranks)."""
    lengths = row_lengths(batch)
    return [_pack(batch, rows, lengths, multiple) for rows in plan(lengths, budget)]


def _pack(batch: Batch, rows: list[int], lengths: list[int], multiple: int) -> MicroBatch:
    used = sum(lengths[r] for r in rows)
    total = max(used, 2)
    total += -total % multiple
    tokens = torch.zeros(1, total, dtype=torch.long)
    positions = torch.zeros(1, total, dtype=torch.long)
    # Padding gets sequence ids of its own, so each padding token attends to itself only.
    sequence = -1 - torch.arange(total)
    experts = None
    if batch.routed_experts is not None:
        experts = torch.full((1, total, *batch.routed_experts.shape[2:]), NO_EXPERT, dtype=torch.long)
    T = batch.length
    index = torch.zeros(len(rows), T - 1, dtype=torch.long)
    valid = torch.zeros(len(rows), T - 1, dtype=torch.bool)
    offset = 0
    for i, r in enumerate(rows):
        n = lengths[r]
        tokens[0, offset : offset + n] = batch.tokens[r, :n]
        positions[0, offset : offset + n] = torch.arange(n)
        sequence[offset : offset + n] = i
        if experts is not None:
            experts[0, offset : offset + n] = batch.routed_experts[r, :n]
        index[i, : n - 1] = torch.arange(offset, offset + n - 1)
        valid[i, : n - 1] = True
        offset += n
    same = sequence[:, None] == sequence[None, :]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    mask = ~(same & causal)
    pk = Packed(tokens, positions, mask[None, None], experts, index, valid)
    ids = torch.tensor(rows, dtype=torch.long)
    return MicroBatch(ids, batch.rows(ids), pk)


@contextmanager
def per_token_rope(model: Any, positions: torch.Tensor) -> Iterator[None]:
    """Within the block, the model's rotary embeddings rotate each token by its own position
    ([s, b, 1, dim], which megatron-core's apply broadcasts) instead of by its index in the
    row: the model's one, or each attention layer's own (latent attention's, whose YaRN
    returns its cos/sin factor beside); a model without rotary embedding is left alone."""
    ropes = [m for name, m in model.named_modules() if name.split(".")[-1] == "rotary_pos_emb"]
    length = int(positions.max()) + 1
    index = positions.transpose(0, 1)

    def per_token(original: Any) -> Any:
        def forward(max_seq_len: int, offset: int = 0, *args: Any, **kwargs: Any) -> Any:
            out = original(length, offset, *args, **kwargs)  # [L, 1, 1, dim] (, factor)
            if isinstance(out, tuple):
                return (out[0][:, 0][index], *out[1:])
            return out[:, 0][index]

        return forward

    for rope in ropes:
        rope.forward = per_token(rope.forward)
    try:
        yield
    finally:
        for rope in ropes:
            del rope.forward  # the class's method again

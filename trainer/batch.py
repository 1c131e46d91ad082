"""The padded token batch the trainer consumes: token ids exactly as the engine saw them.

All per-token tensors are token-aligned ([B, T], right-padded): entry t describes token t.
- `tokens` long: prompt, completions and tool observations, concatenated, never re-tokenized.
- `loss_mask` float: 1.0 on tokens the policy sampled, 0.0 on prompt/tool/padding. Token 0 has
  no prediction, so its mask must be 0.
- `rollout_logprobs` float: the engine's logprob of token t when it sampled it (0 elsewhere).
- `advantages` float [B]: one per sequence (RL); zeros for SFT.
- `routed_experts` long [B, T, layers, topk]: MoE routing the engine used for token t,
  `NO_EXPERT` (-1, `agent_rl.kernel.encoding`) where it is unknown (padding; a turn's last
  token, which the engine never fed back in that turn), the one encoding the store, the batch
  and routing replay share; `routed_valid` [B, T] marks the rows that are known
  (trainer.routing_replay.from_sglang pads SGLang's per-sequence output).
- `lengths` long [B]: the real tokens of each row (set by `from_sequences`), which packing
  (trainer.packing) uses to leave the padding out.
`from_sequences` pads ragged per-episode lists; `pad_to` extends T (sequence parallelism needs
T divisible by the TP size); `rows` takes a micro-batch or a data-parallel shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from agent_rl.kernel.encoding import NO_EXPERT


@dataclass(frozen=True)
class Batch:
    """One (micro-)batch of padded sequences; see the module docstring for each field."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    routed_experts: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    """[B] long: real tokens of each row (padding after them); None: unknown (the whole row)."""

    @property
    def routed_valid(self) -> torch.Tensor | None:
        """[B, T] bool: the rows whose routing the engine recorded."""
        if self.routed_experts is None:
            return None
        return (self.routed_experts >= 0).all(-1).all(-1)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    @classmethod
    def from_sequences(
        cls,
        tokens: Sequence[Sequence[int]],
        loss_masks: Sequence[Sequence[float]],
        rollout_logprobs: Sequence[Sequence[float]] | None = None,
        advantages: Sequence[float] | None = None,
        routed_experts: Sequence[torch.Tensor] | None = None,
        topk: int = 0,
    ) -> Batch:
        """Right-pad ragged sequences (token-aligned lists or numpy arrays, of equal length
        per sequence)."""
        from trainer.routing_replay import from_sglang

        length = max(len(t) for t in tokens)
        n = len(tokens)
        ids = torch.zeros(n, length, dtype=torch.long)
        mask = torch.zeros(n, length)
        lps = torch.zeros(n, length)
        for i, seq in enumerate(tokens):
            if len(loss_masks[i]) != len(seq):
                raise ValueError(
                    f"sequence {i}: {len(loss_masks[i])} mask entries for {len(seq)} tokens"
                )
            ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[i, : len(seq)] = torch.tensor(loss_masks[i], dtype=torch.float32)
            if rollout_logprobs is not None:
                lps[i, : len(seq)] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
        adv = torch.tensor(advantages if advantages is not None else [0.0] * n, dtype=torch.float32)
        experts = None
        if routed_experts is not None:
            experts = from_sglang(routed_experts, length, topk)
        lengths = torch.tensor([len(t) for t in tokens], dtype=torch.long)
        return cls(ids, mask, lps, adv, experts, lengths)

    def pad_to(self, length: int) -> Batch:
        """The same batch with T extended to `length` by padding (mask 0)."""
        extra = length - self.length
        if extra <= 0:
            return self

        def pad(t: torch.Tensor | None, value: float = 0) -> torch.Tensor | None:
            if t is None:
                return None
            shape = (t.shape[0], extra, *t.shape[2:])
            return torch.cat([t, torch.full(shape, value, dtype=t.dtype)], dim=1)

        return replace(
            self,
            tokens=pad(self.tokens),
            loss_mask=pad(self.loss_mask),
            rollout_logprobs=pad(self.rollout_logprobs),
            routed_experts=pad(self.routed_experts, NO_EXPERT),
        )

    def rows(self, index: slice | torch.Tensor) -> Batch:
        """The sub-batch of the given rows."""

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return Batch(
            self.tokens[index],
            self.loss_mask[index],
            self.rollout_logprobs[index],
            self.advantages[index],
            take(self.routed_experts),
            take(self.lengths),
        )

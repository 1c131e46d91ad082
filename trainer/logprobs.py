"""Per-token logprobs and entropy from vocab-parallel logits.

Logits come out of GPTModel as [B, T, V/tp] (each TP rank holds a slice of the vocabulary).
Position t predicts token t+1, so both functions return [B, T-1], the score of tokens 1..T-1;
the engine re-aligns them with the token-aligned batch. The softmax statistics are reduced over
the tensor-parallel group, so the result is the same for any TP size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token[t+1] | tokens[:t+1]) for t < T-1, differentiable: [B, T-1] float32."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # Always a copy: megatron's softmax works in place and must not clobber the caller's logits
    # (`.contiguous()` alone returned a view for one row, where the transpose is contiguous
    # already, and the entropy then read the softmaxed logits).
    shifted = logits[:, :-1].transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format,
                                                  copy=True)
    nll = vocab_parallel_cross_entropy(shifted, tokens[:, 1:].transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at positions 0..T-2: [B, T-1] float32 (no grad)."""
    from megatron.core import parallel_state as ps

    x = logits[:, :-1].float()
    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    peak = x.max(-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - peak)
    z = e.sum(-1)
    ez = (e * x).sum(-1)
    if tp > 1:
        dist.all_reduce(z, group=group)
        dist.all_reduce(ez, group=group)
    return torch.log(z) + peak.squeeze(-1) - ez / z

"""Multi-token prediction (MTP) draft losses in the learner's layout (`trainer.mtp_layers`).

The draft of depth j (trainer.mtp_model) predicts, at position t, token t+1+j. `mtp_scores`
turns its logits into logprobs laid out as the policy's are ([B, T-1], position t, 0 where the
token lies past the row) and `shifted_mask` moves the loss mask to those targets, so the learner
takes the MTP loss on exactly the policy's own sampled tokens (loss mask 1), packed or padded.

`acceptance` and `accepted_length` measure the draft without a speculative engine: per anchor,
the chance speculative sampling accepts each depth's draft token (sum over the vocabulary of
min(p_policy, q_draft), teacher-forced on the stored tokens) and the expected number of the k
drafts accepted.
"""

from __future__ import annotations

import torch

from trainer.logprobs import token_logprobs


def mtp_scores(logits: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """Logprobs [b, s-1] of the depth-`depth` (1-based) draft: position t scores token
    t+1+depth; the last `depth` positions, whose token lies past the row, are 0."""
    b, s = tokens.shape
    if s - depth < 2:
        return torch.zeros(b, s - 1)
    scored = token_logprobs(logits[:, : s - depth], tokens[:, depth:])
    return torch.cat([scored, torch.zeros(b, depth, dtype=scored.dtype)], dim=1)


def shifted_mask(mask: torch.Tensor, depth: int) -> torch.Tensor:
    """The loss mask [B, T-1] of the policy's tokens (position t: token t+1) moved to the
    depth-`depth` draft's targets (position t: token t+1+depth), 0 past the row."""
    out = torch.zeros_like(mask)
    if depth < mask.shape[1]:
        out[:, : mask.shape[1] - depth] = mask[:, depth:]
    return out


@torch.no_grad()
def acceptance(policy: torch.Tensor, draft: torch.Tensor, depth: int) -> torch.Tensor:
    """Expected acceptance of the depth-`depth` draft under speculative sampling, [b, s-1] in
    the `mtp_scores` layout: at anchor t, sum over the vocabulary of min(p, q), with p the
    policy's distribution of token t+1+depth (its logits at t+depth) and q the draft's there
    (its logits at t); 0 on the last `depth` anchors. Logits are vocab-parallel [b, s, V/tp]."""
    b, s = policy.shape[:2]
    if s - depth < 2:
        return torch.zeros(b, s - 1)
    p = _softmax(policy[:, depth : s - 1])
    q = _softmax(draft[:, : s - 1 - depth])
    overlap = _tp_sum(torch.minimum(p, q).sum(-1))
    return torch.cat([overlap, torch.zeros(b, depth)], dim=1)


@torch.no_grad()
def acceptance_at(policy: torch.Tensor, draft: torch.Tensor, depth: int, rows: torch.Tensor,
                  anchors: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`acceptance` at the anchors (rows[k], anchors[k]) of the logits' layout only, [N]: the
    step scores the drafts on the policy's tokens alone, and the two softmaxes over the
    vocabulary at every position cost as much as a fifth of a small model's step."""
    p = _softmax(policy[rows, anchors + depth])
    q = _softmax(draft[rows, anchors])
    return _tp_sum(torch.minimum(p, q).sum(-1))


def accepted_length(alphas: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    """Expected draft tokens accepted at each anchor when k = len(alphas) are proposed: the
    sum over i <= k of the chance that drafts 1..i are all accepted (prod of their acceptances),
    a draft whose target is not a policy token (mask 0: past the turn) never accepted."""
    run = torch.ones_like(alphas[0])
    total = torch.zeros_like(alphas[0])
    for alpha, mask in zip(alphas, masks):
        run = run * alpha * mask
        total = total + run
    return total


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over a vocabulary split across the tensor-parallel group (fp32)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    x = logits.float()
    peak = x.max(-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(x - peak)
    return e / _tp_sum(e.sum(-1, keepdim=True))


def _tp_sum(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    return t

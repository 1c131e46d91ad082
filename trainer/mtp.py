"""Multi-token prediction (MTP) draft losses in the learner's layout (`trainer.mtp.layers`).

The draft of depth j (trainer.mtp_model) predicts, at position t, token t+1+j. The learner
scores it at its anchors only, the positions whose depth-j target is a policy token (the loss
mask moved to the targets by `shifted_mask`): the draft's head runs there alone
(`MTPGPTModel.draft_logits`) and `draft_terms` gives its loss there, the targets' nll and its
acceptance, so the MTP loss covers exactly the policy's own sampled tokens, packed or padded.

`overlap` and `accepted_length` measure the draft without a speculative engine: per anchor,
the chance speculative sampling accepts each depth's draft token (sum over the vocabulary of
min(p_policy, q_draft), teacher-forced on the stored tokens) and the expected number of the k
drafts accepted. `acceptance` is the same over every position, the reference it is tested against.
"""

from __future__ import annotations

import torch


def draft_scores(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logprobs [N] of `targets` [N] under a draft's logits at its anchors [N, V/tp]
    (vocab-parallel), differentiable."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # A copy: megatron's softmax works in place, and the acceptance reads these logits after.
    x = logits.to(torch.float32, copy=True).unsqueeze(1)
    return -vocab_parallel_cross_entropy(x, targets.unsqueeze(1)).squeeze(1)


def draft_terms(
    draft: torch.Tensor, policy: torch.Tensor, targets: torch.Tensor, objective: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per anchor [N], from the draft's logits at the anchors [N, V/tp] (vocab-parallel), the
    policy's logits of the same tokens [N, V/tp] and the sampled `targets` [N]:
    - the loss to `objective` (`trainer.mtp.objective`), differentiable in the draft's logits
      only (the draft follows the policy): nll, the sampled tokens' cross-entropy; kl, the
      forward KL divergence from the policy's distribution; tv, the total variation distance to
      it, one minus the acceptance;
    - the nll of the targets and the expected acceptance (`overlap`), detached.
    kl and tv gather vocab-parallel logits whole (each of their terms needs the full softmax):
    the loss is then the same on every TP rank, as megatron's cross-entropy is, and each
    rank's gradient is its vocabulary shard's. Their nll and acceptance come from the same
    two distributions, so scoring costs nll's one softmax pass beside the acceptance's."""
    if objective == "nll":
        nll = -draft_scores(draft, targets)
        return nll, nll.detach(), overlap(policy, draft.detach())
    if objective not in ("kl", "tv"):
        raise ValueError(f"unknown MTP objective {objective!r}")
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather

    log_q = torch.log_softmax(gather(draft.float()), dim=-1)
    with torch.no_grad():
        log_p = torch.log_softmax(gather(policy.float()), dim=-1)
        p = log_p.exp()
        nll = -log_q.gather(-1, targets[:, None]).squeeze(-1)
    with torch.set_grad_enabled(objective == "tv"):  # kl's loss does not go through it
        accepted = torch.minimum(p, log_q.exp()).sum(-1)
    loss = (p * (log_p - log_q)).sum(-1) if objective == "kl" else 1.0 - accepted
    return loss, nll, accepted.detach()


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
def overlap(policy: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """`acceptance` at anchors only, [N]: the sum over the vocabulary of min(p, q), from the
    policy's logits of the anchors' target tokens and the draft's logits there, both [N, V/tp]."""
    return _tp_sum(torch.minimum(_softmax(policy), _softmax(draft)).sum(-1))


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

"""Multi-token prediction (MTP) draft losses in the learner's layout (`trainer.mtp_layers`).

The draft of depth j (trainer.mtp_model) predicts, at position t, token t+1+j. `mtp_scores`
turns its logits into logprobs laid out as the policy's are ([B, T-1], position t, 0 where the
token lies past the row) and `shifted_mask` moves the loss mask to those targets, so the learner
takes the MTP loss on exactly the policy's own sampled tokens (loss mask 1), packed or padded.
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

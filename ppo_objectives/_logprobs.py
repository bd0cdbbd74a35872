"""Log-probabilities of chosen tokens at chosen positions (inputs validated by the caller)."""

from __future__ import annotations

import torch
from torch import Tensor


def gathered_log_probs(logits: Tensor, positions: Tensor, targets: Tensor, *, return_entropy: bool, chunk_size: int | None):
    """``log_softmax(logits[b, positions[b, j]])[targets[b, j]]`` in float32 (float64 for float64 logits), and optionally the entropy."""
    b, t, v = logits.shape
    cd = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, v)).to(cd)
    lse = torch.logsumexp(rows, dim=-1)
    logp = rows.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not return_entropy:
        return logp, None
    p = torch.softmax(rows, dim=-1)
    entropy = lse - (p * rows).sum(-1)
    return logp, entropy

"""Fast masked GAE kernels (inputs already validated by ``functional.masked_gae``).

Contract: ``rewards``, ``values`` float ``[N, R]`` of one dtype, ``mask`` bool ``[N, R]``,
``bootstrap_value`` float ``[N]`` or ``None``; returns raw advantages ``[N, R]``,
exactly 0 at masked positions. Masked positions are skipped by the recursion.
"""

from __future__ import annotations

import torch
from torch import Tensor

BACKENDS = ("auto", "loop", "torch", "triton")


def select_backend(device: torch.device, backend: str = "auto") -> str:
    """Pick the GAE implementation: ``"loop"``, ``"torch"`` or ``"triton"``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "torch"
    if backend == "triton":
        raise ValueError("backend='triton' is not available in this build; use backend='torch'")
    return backend


def gae_advantages_torch(rewards: Tensor, values: Tensor, mask: Tensor, gamma, lam, bootstrap_value: Tensor | None) -> Tensor:
    """Compact valid tokens to the left of each row, recurse over time, scatter back."""
    n, r = rewards.shape
    rank = torch.cumsum(mask, dim=-1) - 1
    dump = torch.full_like(rank, r)
    idx = torch.where(mask, rank, dump)
    zeros = rewards.new_zeros(n, r + 1)
    rc = zeros.scatter(1, idx, torch.where(mask, rewards, 0.0))[:, :r]
    vc = zeros.scatter(1, idx, torch.where(mask, values, 0.0))[:, :r]
    count = mask.sum(-1, keepdim=True)
    boot = rewards.new_zeros(n, 1) if bootstrap_value is None else bootstrap_value.reshape(n, 1)
    pos = torch.arange(r, device=rewards.device)
    valid_c = pos < count
    next_v = torch.cat([vc[:, 1:], rewards.new_zeros(n, 1)], dim=-1)
    next_v = torch.where(pos + 1 < count, next_v, boot)
    delta = torch.where(valid_c, rc + gamma * next_v - vc, 0.0)
    adv_c = torch.zeros_like(delta)
    last = rewards.new_zeros(n)
    for t in range(r - 1, -1, -1):
        last = delta[:, t] + gamma * lam * last
        adv_c[:, t] = last
    adv_c = torch.cat([adv_c, rewards.new_zeros(n, 1)], dim=-1)
    return torch.where(mask, adv_c.gather(1, idx), 0.0)

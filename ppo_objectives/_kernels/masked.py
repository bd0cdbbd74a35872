"""The unchecked arithmetic of the functional core: masked statistics, aggregation, the PPO, KL and value losses.

Every function here takes inputs that a public call has already checked, once: per-token
float tensors of one shape on one device, ``m`` a bool mask of that shape (or ``None`` where
said), hyper-parameters in range, an aggregation name of ``_validate.AGGREGATIONS`` and a
checked ``normalizer`` (``_validate.check_normalizer``) or ``None``. The public functions of
:mod:`ppo_objectives.functional` check and call these; :class:`~ppo_objectives.loss.TokenPPOLoss`
and :class:`~ppo_objectives.transforms.KLPenaltyTransform` check their batch at their edge
and call these directly, so one call checks each tensor once. The formulas, their sources
and examples are in the docstrings of the public functions named in each line below.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ppo_objectives._validate import compute_dtype


def rows(x: Tensor) -> Tensor:
    """View ``[*B, R]`` as ``[prod(B), R]`` (also for R = 0 or empty batches)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def all_reduce_sum(t: Tensor, process_group) -> Tensor:
    """Sum ``t`` over the ranks of ``process_group`` (no-op for ``None``); not differentiable."""
    if process_group is None:
        return t
    import torch.distributed as dist

    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=process_group)
    return out


def world_size(process_group) -> int:
    if process_group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(process_group)


def masked_sum(x: Tensor, m: Tensor, dim: int | tuple[int, ...] | None = None, *, keepdim: bool = False) -> Tensor:
    """``functional.masked_sum``: accumulated and returned in the compute dtype (float32 for half inputs)."""
    cd = compute_dtype(x)
    xs = torch.where(m, x.to(cd), torch.zeros((), dtype=cd, device=x.device))
    if dim is None:
        return xs.sum().reshape([1] * x.dim()) if keepdim else xs.sum()
    return xs.sum(dim=dim, keepdim=keepdim)


def masked_mean(x: Tensor, m: Tensor) -> Tensor:
    """``functional.masked_mean(x, m)`` over every position, in the compute dtype."""
    total = masked_sum(x, m)
    return total / m.sum().to(total.dtype).clamp(min=1)


def masked_moments(
    x: Tensor, m: Tensor | None, unbiased: bool, process_group, *, zero_off_mask: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean, var, x - mean)`` over the valid positions (the centred values are 0 at masked positions):
    three passes over the data, two when ``x`` is known to be exactly 0 off the mask (``zero_off_mask``,
    the raw GAE advantages); ``m=None``: every position is valid."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if m is None:  # every position valid (the GAE of unmasked rows)
        total, n = x.sum(), torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device)
    else:
        total, n = (x if zero_off_mask else torch.where(m, x, zero)).sum(), m.sum().to(x.dtype)
    if process_group is not None:
        both = all_reduce_sum(torch.stack([total.detach(), n]), process_group)
        total, n = total + (both[0] - total.detach()), both[1]
    mean = total / n.clamp(min=1)
    centred = x - mean if m is None else torch.where(m, x - mean, zero)
    sq = (centred * centred).sum()
    if process_group is not None:
        sq = sq + (all_reduce_sum(sq, process_group) - sq.detach())
    var = sq / (n - 1).clamp(min=1) if unbiased else sq / n.clamp(min=1)
    return mean, var, centred


def whiten(
    x: Tensor, m: Tensor, *, shift_mean: bool = True, unbiased: bool = False, eps: float = 1e-8, process_group=None
) -> Tensor:
    """``functional.masked_whiten``."""
    cd = compute_dtype(x)
    mean, var, centred = masked_moments(x.to(cd), m, unbiased, process_group)
    out = centred * torch.rsqrt(var + eps)  # 0 at masked positions
    if not shift_mean:
        out = torch.where(m, out + mean, torch.zeros((), dtype=cd, device=x.device))
    return out.to(x.dtype)


def explained_variance(values: Tensor, returns: Tensor, m: Tensor) -> Tensor:
    """``functional.explained_variance``."""
    cd = compute_dtype(values, returns)
    v, r = values.detach().to(cd), returns.detach().to(cd)
    var_r = masked_moments(r, m, False, None)[1]
    var_res = masked_moments(r - torch.where(m, v, 0.0), m, False, None)[1]
    # a variance below the rounding of the numbers' own scale is rounding, not spread: the first iteration of a
    # run that no answer solves has returns of 0 plus KL terms of 1e-8, and 1 - var_res / var_r read -3e9 there
    n = m.sum().clamp(min=1)
    scale = (torch.where(m, r * r + v * v, 0.0).sum() / n).clamp(min=torch.finfo(cd).tiny)
    spread = var_r > torch.finfo(cd).eps * scale
    safe = torch.where(spread, var_r, torch.ones_like(var_r))
    return torch.where(spread, 1.0 - var_res / safe, torch.zeros_like(var_r))


def normalizer(m: Tensor, aggregation: str, process_group=None) -> Tensor:
    """``functional.loss_normalizer``."""
    R = m.shape[-1]
    fm = rows(m)
    if aggregation in ("token-sum", "token-sum-norm"):  # a constant: the same on every rank and micro-batch
        count = torch.tensor(1.0 if aggregation == "token-sum" else float(R), device=m.device)
        return count.clamp(min=1) / world_size(process_group)
    if aggregation == "token-mean":
        count = fm.sum()
    elif aggregation == "seq-mean-token-sum-norm":
        count = torch.tensor(fm.shape[0] * R, device=m.device)
    else:
        count = fm.any(-1).sum()
    count = all_reduce_sum(count.to(torch.float32), process_group)
    return count.clamp(min=1) / world_size(process_group)


def aggregate(per_token: Tensor, m: Tensor, aggregation: str, norm: Tensor | float | None) -> Tensor:
    """``functional.aggregate_loss``; ``norm`` is the checked ``normalizer=`` or ``None`` (the local count)."""
    if norm is None:
        norm = normalizer(m, aggregation)
    flat, fm = rows(per_token.to(compute_dtype(per_token))), rows(m)
    if aggregation in ("token-mean", "seq-mean-token-sum-norm", "token-sum", "token-sum-norm"):
        numerator = masked_sum(flat, fm)
    else:
        seq = masked_sum(flat, fm, dim=-1)
        if aggregation == "seq-mean-token-mean":
            seq = seq / fm.sum(-1).clamp(min=1).to(per_token.dtype)
        numerator = seq.sum()
    return numerator / norm


def last_valid(m: Tensor) -> Tensor:
    """``functional.last_valid_index``: ``[*B]`` int64, ``-1`` for a row with no valid token."""
    if m.shape[-1] == 0:
        return torch.full(m.shape[:-1], -1, dtype=torch.long, device=m.device)
    positions = torch.arange(m.shape[-1], device=m.device)
    return torch.where(m, positions, -1).amax(-1)


def standardize_unbiased(x: Tensor, m: Tensor) -> Tensor:
    """TorchRL's masked standardisation of GAE advantages: ``(x - mean) / max(std, 1e-4)`` with the unbiased std
    over the valid positions, exactly 0 at masked ones (``MaskedGAE(holes="cut")``)."""
    cd = compute_dtype(x)
    _, var, centred = masked_moments(x.to(cd), m, True, None)
    return (centred / var.sqrt().clamp_min(1e-4)).to(x.dtype)

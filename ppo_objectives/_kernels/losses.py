"""The unchecked arithmetic of the PPO, KL and value losses (the contract of :mod:`ppo_objectives._kernels.masked`).

Formulas, sources and examples: the public functions of :mod:`ppo_objectives.functional`
named in each docstring below, which check their inputs and call these.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppo_objectives._kernels.masked import aggregate, last_valid, masked_mean
from ppo_objectives._validate import compute_dtype


def policy_loss(
    log_prob: Tensor, sample_log_prob: Tensor, advantages: Tensor, m: Tensor, eps_low, eps_high, *,
    dual_clip=None, aggregation: str = "token-mean", norm=None, weights: Tensor | None = None, stats: bool = False,
):  # fmt: skip
    """``functional.ppo_policy_loss``: the loss, or ``(loss, stats)`` with ``stats=True``; ``weights`` checked.

    A valid token whose weight is exactly 0 is rejected: it leaves ``m`` (:func:`kept_mask`)."""
    cd = compute_dtype(log_prob, sample_log_prob, advantages)
    zero = torch.zeros((), dtype=cd, device=log_prob.device)
    if weights is not None:
        m = kept_mask(m, weights)
    log_ratio = torch.where(m, log_prob.to(cd) - sample_log_prob.to(cd), zero)
    adv = torch.where(m, advantages.to(cd), zero)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)
    if weights is not None:
        per_token = per_token * torch.where(m, weights.detach().to(cd), zero)
    loss = aggregate(per_token, m, aggregation, norm)
    if not stats:
        return loss
    with torch.no_grad():
        dual = None
        if dual_clip is not None:
            dual = (adv < 0) & (-adv * dual_clip < torch.maximum(unclipped, clipped))
        return loss, _ratio_stats(ratio.detach(), log_ratio.detach(), m, eps_low, eps_high, dual)


def kept_mask(m: Tensor, weights: Tensor) -> Tensor:
    """``m`` without the tokens whose weight is exactly 0 (``functional.ppo_policy_loss``'s rejection)."""
    return m & (weights.detach() != 0)


def _ratio_stats(r: Tensor, log_ratio: Tensor, m: Tensor, eps_low, eps_high, dual: Tensor | None) -> dict[str, Tensor]:
    """The diagnostics of ``functional.ppo_policy_loss(return_stats=True)``, masked to the valid tokens."""
    cd = r.dtype
    zero = torch.zeros((), dtype=cd, device=r.device)
    low, high = r < 1.0 - eps_low, r > 1.0 + eps_high
    fm = lambda b: masked_mean(b.to(cd), m)  # noqa: E731 - fraction of valid tokens
    n = m.sum().to(cd)
    sum_w = torch.where(m, r, zero).sum()
    sum_w2 = torch.where(m, r * r, zero).sum()
    ess = torch.where(n > 0, sum_w**2 / (n * sum_w2).clamp(min=torch.finfo(cd).tiny), zero)
    return {
        "clip_fraction": fm(low | high),
        "clip_fraction_low": fm(low),
        "clip_fraction_high": fm(high),
        "dual_clip_fraction": fm(torch.zeros_like(m) if dual is None else dual),
        "kl_approx": masked_mean(0.5 * log_ratio**2, m),
        # log_ratio is 0 at masked positions, so the max of an empty mask is 0
        "kl_approx_token_max": (0.5 * log_ratio**2).max() if log_ratio.numel() else zero,
        "mean_ratio": masked_mean(r, m),
        # ratios are positive, so a 0 appended makes the max of an empty mask 0
        "max_ratio": torch.cat([torch.where(m, r, zero).flatten(), zero.reshape(1)]).max(),
        "ESS": ess,
    }


def kl_values(log_prob: Tensor, ref_log_prob: Tensor, estimator: str, clamp: float | None) -> Tensor:
    """The per-token estimate of compute-dtype log-probs (``functional.kl_estimate`` without its weight)."""
    d = ref_log_prob - log_prob
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        k3 = torch.expm1(d) - d
        if estimator == "k3+":  # the value of (clamped) k3, the gradient of k2
            k2 = 0.5 * d * d
            value = k3 if clamp is None else k3.clamp(-clamp, clamp)
            return k2 + (value - k2).detach()
        kl = k3
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl


def kl_estimate(
    log_prob: Tensor, ref_log_prob: Tensor, estimator: str, clamp: float | None = None,
    sample_log_prob: Tensor | None = None, score_grad: bool = False,
) -> Tensor:  # fmt: skip
    """``functional.kl_estimate``."""
    cd = compute_dtype(*(t for t in (log_prob, ref_log_prob, sample_log_prob) if t is not None))
    lp = log_prob.to(cd)
    kl = kl_values(lp, ref_log_prob.to(cd), estimator, clamp)
    weight = None
    if sample_log_prob is not None:  # sampled from pi_old: weight by pi / pi_old (the gradient flows through it)
        weight = torch.exp(lp - sample_log_prob.to(cd).detach())
        kl = weight * kl
    if score_grad:  # the value of kl, the gradient w * log(pi / pi_ref) * grad log pi
        coef = (lp - ref_log_prob.to(cd)).detach() * (1.0 if weight is None else weight.detach())
        kl = kl.detach() + (lp - lp.detach()) * coef
    return kl


def masked_log_probs(m: Tensor, log_prob: Tensor, *others: Tensor | None) -> tuple[Tensor | None, ...]:
    """``log_prob`` and ``others`` (cast to its dtype) with 0 at masked positions: never read there."""
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return tuple(None if t is None else torch.where(m, t.to(log_prob.dtype), zero) for t in (log_prob, *others))


def reference_kl(
    log_prob: Tensor, ref_log_prob: Tensor, m: Tensor, *, estimator: str = "k3", clamp: float | None = None,
    sample_log_prob: Tensor | None = None, score_grad: bool = False, aggregation: str = "token-mean", norm=None,
) -> Tensor:  # fmt: skip
    """``functional.reference_kl_penalty`` of the masked log-probs of :func:`masked_log_probs`."""
    kl = kl_estimate(log_prob, ref_log_prob, estimator, clamp, sample_log_prob, score_grad)
    return aggregate(kl, m, aggregation, norm)


def masked_kl(log_prob: Tensor, ref_log_prob: Tensor, m: Tensor, estimator: str, clamp: float | None) -> Tensor:
    """``functional.masked_kl_estimate`` of the masked log-probs of :func:`masked_log_probs`: per token, exactly 0
    at masked positions."""
    kl = kl_estimate(log_prob, ref_log_prob, estimator, clamp)
    return torch.where(m, kl + 0.0, torch.zeros((), dtype=kl.dtype, device=kl.device))  # + 0.0: no -0.0


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, m: Tensor, clip_value, *, aggregation: str = "token-mean",
    norm=None, stats: bool = False,
):  # fmt: skip
    """``functional.clipped_value_loss``: the loss, or ``(loss, {"value_clip_fraction": ...})`` with ``stats``."""
    cd = compute_dtype(values, old_values, returns)
    zero = torch.zeros((), dtype=cd, device=values.device)
    v = torch.where(m, values.to(cd), zero)
    v_old = torch.where(m, old_values.to(cd), zero)
    ret = torch.where(m, returns.to(cd), zero)
    v_clip = torch.clamp(v, v_old - clip_value, v_old + clip_value)
    unclipped = (v - ret) ** 2
    clipped = (v_clip - ret) ** 2
    loss = aggregate(0.5 * torch.maximum(unclipped, clipped), m, aggregation, norm)
    if not stats:
        return loss
    with torch.no_grad():
        return loss, {"value_clip_fraction": masked_mean((clipped > unclipped).to(cd), m)}


def penalized_rewards(rewards: Tensor, kl: Tensor, m: Tensor, coeff) -> Tensor:
    """``functional.kl_penalized_rewards`` once its per-token ``kl`` is known: ``rewards`` per token ``[*B, R]``, or
    one score per row ``[*B]`` placed on the row's last valid token (every row has one: checked)."""
    if rewards.shape == kl.shape:
        dense = rewards
    else:
        at_last = m & (torch.arange(kl.shape[-1], device=m.device) == last_valid(m).unsqueeze(-1))
        dense = torch.where(at_last, rewards.unsqueeze(-1), torch.zeros((), dtype=rewards.dtype, device=rewards.device))
    coeff = torch.as_tensor(coeff, device=kl.device).to(kl.dtype)
    return torch.where(m, dense - coeff * kl, torch.zeros((), dtype=rewards.dtype, device=rewards.device))

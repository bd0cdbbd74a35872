"""Reference implementations: plain Python loops over floats that share no code with the package.

:func:`reference_gae_response` and :func:`reference_gae_collector` (the semantics of
:func:`~ppo_objectives.functional.masked_gae`, ``docs/design.md`` "GAE semantics"),
:func:`reference_gae_tensordict` (what :class:`~ppo_objectives.value.gae.MaskedGAE`
writes), :func:`reference_ppo_policy_loss`, :func:`reference_kl` (k1 / k2 / k3), and the
log-probabilities of chosen tokens, :func:`reference_log_probs` and :func:`reference_response_log_probs`
(the semantics of :func:`~ppo_objectives.functional.response_log_probs`).
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDictBase
from torch import Tensor

# --------------------------------------------------------------------------- #
# Reference implementations: plain Python loops over floats
# --------------------------------------------------------------------------- #


def whiten(adv: Tensor, mask: Tensor) -> Tensor:
    """Whitened over the valid entries (biased variance, eps 1e-8), 0 elsewhere: plain Python sums."""
    vals = [a for a, m in zip(adv.reshape(-1).tolist(), mask.reshape(-1).tolist()) if m]
    n = len(vals)
    mean = sum(vals) / n if n else 0.0
    var = sum((a - mean) ** 2 for a in vals) / n if n else 0.0
    scale = 1.0 / math.sqrt(var + 1e-8)
    out = [(a - mean) * scale if m else 0.0 for a, m in zip(adv.reshape(-1).tolist(), mask.reshape(-1).tolist())]
    return torch.tensor(out, dtype=torch.float64).reshape(adv.shape)


def _rows_of(x: Tensor | None, shape: torch.Size, name: str, *, as_bool: bool = False) -> list[list] | None:
    """``x`` as a list of rows of Python numbers (``[*B, T]`` flattened to rows)."""
    if x is None:
        return None
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but the rewards have shape {tuple(shape)}; use [*B, T]")
    flat = x.detach().reshape(-1, shape[-1]).cpu()
    return (flat > 0.5 if not x.dtype == torch.bool else flat).tolist() if as_bool else flat.double().tolist()


def _gae_rows(r, v, m, gamma, lmbda, ends, end_values):
    """Raw advantages, row by row, over the valid steps: the recursion of ``docs/design.md``."""
    out = []
    for b in range(len(r)):
        T = len(r[b])
        adv = [0.0] * T
        valid = [t for t in range(T) if m[b][t]]
        next_v, next_a = 0.0, 0.0
        for i in range(len(valid) - 1, -1, -1):
            t = valid[i]
            if i == len(valid) - 1 or ends[b][t]:  # a trajectory ends here: bootstrap, carry nothing
                next_v, next_a = end_values[b][t], 0.0
            delta = r[b][t] + gamma * next_v - v[b][t]
            adv[t] = delta + gamma * lmbda * next_a
            next_v, next_a = v[b][t], adv[t]
        out.append(adv)
    return out


def _gae_out(adv_rows, v, m, shape, average_gae):
    adv = torch.tensor(adv_rows, dtype=torch.float64).reshape(shape)
    values = torch.tensor(v, dtype=torch.float64).reshape(shape)
    mask = torch.tensor(m, dtype=torch.bool).reshape(shape)
    ret = torch.where(mask, adv + values, 0.0)
    return (whiten(adv, mask) if average_gae else adv), ret


def _check_rewards(rewards: Tensor) -> torch.Size:
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point() or rewards.dim() < 1:
        raise TypeError("rewards must be a floating-point tensor [*B, T]")
    return rewards.shape


def reference_gae_response(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor | None,
    gamma: float,
    lmbda: float,
    *,
    bootstrap_value: Tensor | None = None,
    average_gae: bool = False,
) -> tuple[Tensor, Tensor]:
    """GAE of response rows, one trajectory per row, as a plain loop (the response form of ``masked_gae``).

    For each row, backwards over its valid steps only (``t + 1`` is the next
    valid step; masked steps are never read)::

        next_v, next_a = bootstrap_value[b] (0 by default), 0
        delta = r[t] + gamma * next_v - v[t];  A[t] = delta + gamma * lmbda * next_a
        next_v, next_a = v[t], A[t]

    Returns are the raw advantages plus the values; with ``average_gae=True`` the
    advantages are whitened over the valid steps of the whole batch (biased
    variance, ``(A - mean) / sqrt(var + 1e-8)``), as
    :func:`~ppo_objectives.functional.masked_gae` does by default. Both outputs
    are 0 off the mask. Computed in float64 with Python floats.

    Args:
        rewards / values: ``[*B, T]`` float tensors.
        mask: ``[*B, T]`` bool or {0, 1}, or ``None`` (all valid).
        gamma / lmbda: discount and GAE lambda.
        bootstrap_value: ``[*B]`` value after each row's last valid step.
        average_gae: whiten the advantages (default False, unlike ``masked_gae``).

    Returns:
        ``(advantages, returns)``, float64 ``[*B, T]``.

    Example:
        >>> r, v = torch.tensor([[0.0, 0.0, 1.0, 5.0]]), torch.tensor([[0.5, 0.5, 0.5, float("nan")]])
        >>> reference_gae_response(r, v, torch.tensor([[1, 1, 1, 0]]), 1.0, 1.0)[0]
        tensor([[0.5000, 0.5000, 0.5000, 0.0000]], dtype=torch.float64)
    """
    shape = _check_rewards(rewards)
    r, v = _rows_of(rewards, shape, "rewards"), _rows_of(values, shape, "values")
    m = _rows_of(mask, shape, "mask", as_bool=True) if mask is not None else [[True] * shape[-1] for _ in r]
    if bootstrap_value is None:
        boot = [0.0] * len(r)
    else:
        if bootstrap_value.shape != shape[:-1]:
            raise ValueError(f"bootstrap_value has shape {tuple(bootstrap_value.shape)}, expected [*B] = {tuple(shape[:-1])}")
        boot = bootstrap_value.detach().reshape(-1).double().cpu().tolist()
    ends = [[False] * shape[-1] for _ in r]
    end_values = [[boot[b]] * shape[-1] for b in range(len(r))]
    return _gae_out(_gae_rows(r, v, m, gamma, lmbda, ends, end_values), v, m, shape, average_gae)


def _complete_flags(done, terminated, truncated):
    """TorchRL's flag completion, on lists of rows of bools: ``(done, terminated)``."""
    if done is None and terminated is None and truncated is None:
        raise ValueError("give at least one of done, terminated, truncated")
    rows = len(next(f for f in (done, terminated, truncated) if f is not None))
    T = len(next(f for f in (done, terminated, truncated) if f is not None)[0]) if rows else 0

    def get(f, b, t):
        return None if f is None else bool(f[b][t])

    d_out, te_out = [], []
    for b in range(rows):
        d_row, te_row = [], []
        for t in range(T):
            d, te, tr = get(done, b, t), get(terminated, b, t), get(truncated, b, t)
            if d is None:
                d = bool(te) or bool(tr)
            if te is None:
                te = d and not tr if tr is not None else d
            d_row.append(d)
            te_row.append(te)
        d_out.append(d_row)
        te_out.append(te_row)
    return d_out, te_out


def reference_gae_collector(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor | None,
    gamma: float,
    lmbda: float,
    *,
    done: Tensor | None = None,
    terminated: Tensor | None = None,
    truncated: Tensor | None = None,
    mask: Tensor | None = None,
    average_gae: bool = False,
) -> tuple[Tensor, Tensor]:
    """GAE of TorchRL collector rows (several trajectories per row) as a plain loop.

    The semantics of :func:`~ppo_objectives.functional.masked_gae` with
    ``done`` / ``terminated`` / ``next_values`` (``docs/design.md``, "GAE
    semantics"): backwards over the valid steps of each row; a valid step with
    ``done`` ends a trajectory, and so does the row's last valid step (the batch
    boundary). At an end nothing is carried from the right and the next value is
    0 if the step is ``terminated``, else ``next_values`` there (0 when
    ``next_values`` is ``None``). Missing flags are completed as TorchRL does: no
    ``done`` is ``terminated | truncated``; no ``terminated`` is
    ``done & ~truncated`` (``done`` when ``truncated`` is missing too). Returns,
    whitening and the zeros off the mask as in :func:`reference_gae_response`.

    Args:
        rewards / values / next_values: ``[*B, T]`` float tensors.
        gamma / lmbda: discount and GAE lambda.
        done / terminated / truncated: ``[*B, T]`` bool flags (at least one).
        mask: ``[*B, T]`` bool or {0, 1}, or ``None`` (all valid).
        average_gae: whiten the advantages (default False).

    Returns:
        ``(advantages, returns)``, float64 ``[*B, T]``.

    Example:
        >>> r, v = torch.ones(1, 4), torch.zeros(1, 4)
        >>> done = torch.tensor([[False, True, False, False]])
        >>> nv = torch.tensor([[0.0, 0.0, 0.0, 2.0]])   # the last trajectory is cut: bootstrap 2
        >>> reference_gae_collector(r, v, nv, 1.0, 1.0, done=done)[0]
        tensor([[2., 1., 4., 3.]], dtype=torch.float64)
    """
    shape = _check_rewards(rewards)
    r, v = _rows_of(rewards, shape, "rewards"), _rows_of(values, shape, "values")
    nv = _rows_of(next_values, shape, "next_values") if next_values is not None else [[0.0] * shape[-1] for _ in r]
    m = _rows_of(mask, shape, "mask", as_bool=True) if mask is not None else [[True] * shape[-1] for _ in r]
    d, te = _complete_flags(
        *(_rows_of(f, shape, name, as_bool=True) for f, name in ((done, "done"), (terminated, "terminated"), (truncated, "truncated")))
    )
    end_values = [[0.0 if te[b][t] else nv[b][t] for t in range(shape[-1])] for b in range(len(r))]
    return _gae_out(_gae_rows(r, v, m, gamma, lmbda, d, end_values), v, m, shape, average_gae)


def _time_last(x: Tensor, shape: torch.Size) -> Tensor:
    return x.reshape(shape) if x.shape == shape + (1,) else x


def reference_gae_tensordict(
    td: TensorDictBase, gamma: float, lmbda: float, *, average_gae: bool = False
) -> tuple[Tensor, Tensor]:
    """What :class:`~ppo_objectives.value.gae.MaskedGAE` (default keys) writes for ``td``, from the loops.

    Reads ``("next", "reward")``, ``state_value``, ``mask`` (optional) and, when
    any flag ``("next", "done" / "terminated" / "truncated")`` is present (the
    collector form), the flags and ``("next", "state_value")``; otherwise the
    response form. The time axis is the last of ``state_value``, a trailing 1 is
    TorchRL's per-step layout when the other dims are the TensorDict's batch
    dims, two or more of them, or one with the flags present (a ``[B]``
    TensorDict with ``[B, 1]`` entries and no flags holds responses of one
    token); the outputs come back in the layout of ``state_value``.

    Args:
        td: a batch of any of the three layouts.
        gamma / lmbda: discount and GAE lambda.
        average_gae: whiten the advantages (``MaskedGAE(average_gae=...)``).

    Returns:
        ``(advantage, value_target)``, float64, in the layout of ``state_value``.

    Example:
        >>> from ppo_objectives.testing import collector_batch
        >>> td = collector_batch(num_envs=2, steps=6, seed=1)
        >>> adv, target = reference_gae_tensordict(td, gamma=0.9, lmbda=0.8)
        >>> adv.shape
        torch.Size([2, 6, 1])
    """
    value = td.get("state_value", None)
    reward = td.get(("next", "reward"), None)
    if value is None or reward is None:
        raise KeyError("reference_gae_tensordict needs 'state_value' and ('next', 'reward') in the TensorDict")
    flags = {k: td.get(("next", k), None) for k in ("done", "terminated", "truncated")}
    has_flags = any(f is not None for f in flags.values())
    # [B] with [B, 1] entries and no flags: responses of one token (the response layout), not one trajectory
    trailing = value.ndim == td.batch_dims + 1 and value.shape[-1] == 1 and (td.batch_dims > 1 or has_flags)
    shape = value.shape[:-1] if trailing else value.shape
    r, v = _time_last(reward, shape), _time_last(value, shape)
    m = td.get("mask", None)
    m = None if m is None else _time_last(m, shape)
    if all(f is None for f in flags.values()):
        adv, ret = reference_gae_response(r, v, m, gamma, lmbda, average_gae=average_gae)
    else:
        nv = td.get(("next", "state_value"), None)
        if nv is None:
            raise KeyError("collector form: ('next', 'state_value') is needed to bootstrap truncated trajectories")
        flags = {k: None if f is None else _time_last(f, shape).bool() for k, f in flags.items()}
        adv, ret = reference_gae_collector(r, v, _time_last(nv, shape), gamma, lmbda, mask=m, average_gae=average_gae, **flags)
    if trailing:
        adv, ret = adv.unsqueeze(-1), ret.unsqueeze(-1)
    return adv, ret


def reference_ppo_policy_loss(
    log_prob: Tensor,
    sample_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor | None,
    clip_epsilon: float | tuple[float, float],
    *,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """PPO's clipped surrogate loss, token mean over the valid tokens, as a plain loop.

    Per valid token, with ``ratio = exp(log_prob - sample_log_prob)``::

        L = max(-A * ratio, -A * clamp(ratio, 1 - eps_low, 1 + eps_high))
        L = min(L, -A * dual_clip)            where A < 0, with dual_clip
        L = w * L                             with weights

    then the mean over the valid tokens (0 for an empty mask), the default of
    :func:`~ppo_objectives.functional.ppo_policy_loss`. A token of weight 0 is
    rejected: it is not counted among the valid tokens.

    Args:
        log_prob / sample_log_prob / advantages: ``[*B, R]`` float tensors.
        mask: ``[*B, R]`` bool or {0, 1}, or ``None`` (all valid).
        clip_epsilon: ``eps`` for both sides, or a pair ``(eps_low, eps_high)``.
        dual_clip: optional constant ``c > 1``.
        weights: optional ``[*B, R]`` per-token weights ``w`` (e.g. rollout-correction weights), read on the
            valid tokens only.

    Returns:
        A float64 scalar tensor.

    Example:
        >>> old = torch.full((1, 3), 0.2).log()
        >>> new = torch.log(torch.tensor([[0.3, 0.2, 0.1]]))   # ratios 1.5, 1.0, 0.5
        >>> reference_ppo_policy_loss(new, old, torch.tensor([[1.0, 1.0, -1.0]]), None, 0.2)
        tensor(-0.4667, dtype=torch.float64)
        >>> w = torch.tensor([[0.0, 3.0, 1.0]])                 # (3 * -1.0 + 1 * 0.8) / 2: the first is rejected
        >>> reference_ppo_policy_loss(new, old, torch.tensor([[1.0, 1.0, -1.0]]), None, 0.2, weights=w)
        tensor(-1.1000, dtype=torch.float64)
    """
    shape = _check_rewards(log_prob)
    new, old = _rows_of(log_prob, shape, "log_prob"), _rows_of(sample_log_prob, shape, "sample_log_prob")
    adv = _rows_of(advantages, shape, "advantages")
    m = _rows_of(mask, shape, "mask", as_bool=True) if mask is not None else [[True] * shape[-1] for _ in new]
    w = _rows_of(weights, shape, "weights") if weights is not None else [[1.0] * shape[-1] for _ in new]
    eps_low, eps_high = clip_epsilon if isinstance(clip_epsilon, (tuple, list)) else (clip_epsilon, clip_epsilon)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    total, n = 0.0, 0
    for b in range(len(new)):
        for t in range(shape[-1]):
            if not m[b][t] or w[b][t] == 0.0:
                continue
            a = adv[b][t]
            ratio = math.exp(new[b][t] - old[b][t])
            loss = max(-a * ratio, -a * min(max(ratio, lo), hi))
            if dual_clip is not None and a < 0:
                loss = min(loss, -a * dual_clip)
            total += w[b][t] * loss
            n += 1
    return torch.tensor(total / max(n, 1), dtype=torch.float64)


def reference_kl(log_prob: Tensor, ref_log_prob: Tensor, estimator: str = "k3", *, mask: Tensor | None = None) -> Tensor:
    """Per-token KL estimates of ``KL(pi || pi_ref)`` from sampled tokens, element by element.

    With ``d = ref_logp - logp``: ``"k1"`` is ``-d``, ``"k2"`` is ``d^2 / 2``,
    ``"k3"`` is ``exp(d) - d - 1`` (Schulman 2020, "Approximating KL
    Divergence"); ``"k3+"`` has k3's value (its gradient differs, which a value
    reference cannot show). With ``mask``, 0 off the mask (never read there), as
    :func:`~ppo_objectives.functional.masked_kl_estimate`.

    Args:
        log_prob / ref_log_prob: ``[*B, R]`` float tensors.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"k3+"``.
        mask: optional ``[*B, R]`` bool or {0, 1}.

    Returns:
        float64 ``[*B, R]``.

    Example:
        >>> lp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
        >>> [round(float(reference_kl(lp, ref, e)), 4) for e in ("k1", "k2", "k3")]
        [0.6931, 0.2402, 0.1931]
    """
    estimators = {
        "k1": lambda d: -d,
        "k2": lambda d: 0.5 * d * d,
        "k3": lambda d: math.expm1(d) - d,
        "k3+": lambda d: math.expm1(d) - d,
    }
    if estimator not in estimators:
        raise ValueError(f"estimator={estimator!r} is not one of {tuple(estimators)}")
    shape = log_prob.shape
    if shape == torch.Size([]):
        return reference_kl(log_prob.reshape(1), ref_log_prob.reshape(1), estimator).reshape(())
    lp, ref = _rows_of(log_prob, shape, "log_prob"), _rows_of(ref_log_prob, shape, "ref_log_prob")
    m = _rows_of(mask, shape, "mask", as_bool=True) if mask is not None else [[True] * shape[-1] for _ in lp]
    f = estimators[estimator]
    out = [[f(ref[b][t] - lp[b][t]) if m[b][t] else 0.0 for t in range(shape[-1])] for b in range(len(lp))]
    return torch.tensor(out, dtype=torch.float64).reshape(shape)


def reference_log_probs(
    logits: Tensor, targets: Tensor, *, return_entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities of chosen tokens (and the entropies) under their logits, one position at a time.

    For every position ``i`` of ``targets``, with ``x = logits[i]`` (its ``V`` logits) in float64::

        log p = x[targets[i]] - logsumexp(x);   entropy = -sum_v p_v log p_v

    A Python loop over the positions, a few float64 torch operations on each row of
    ``V`` logits, so gradients flow back to ``logits``: a reference for backward
    passes as well as values. Half-precision logits are read as they are (rounded),
    then upcast.

    Args:
        logits: ``[*S, V]`` float tensor.
        targets: ``[*S]`` integer token ids in ``[0, V)``.
        return_entropy: also return the entropies.

    Returns:
        float64 ``[*S]`` log-probabilities on the device of ``logits``, or
        ``(log_probs, entropies)``.

    Example:
        >>> logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))
        >>> logp, ent = reference_log_probs(logits, torch.tensor([0, 2]), return_entropy=True)
        >>> logp.exp()
        tensor([0.5000, 0.7000], dtype=torch.float64)
        >>> round(float(ent[0]), 4)                    # 0.5 log 2 + 2 * 0.25 log 4
        1.0397
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError("logits must be a floating-point tensor [*S, V]")
    if not isinstance(targets, Tensor) or targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError("targets must be an integer tensor [*S]")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets has shape {tuple(targets.shape)}, expected {tuple(logits.shape[:-1])} (logits without V)")
    V = logits.shape[-1]
    rows, ids = logits.reshape(-1, V), targets.reshape(-1).tolist()
    logps, ents = [], []
    for i, t in enumerate(ids):
        if not 0 <= t < V:
            raise ValueError(f"targets holds {t}, outside [0, V = {V})")
        x = rows[i].double()
        logq = x - torch.logsumexp(x, 0)
        logps.append(logq[t])
        ents.append(-(logq.exp() * logq).sum())
    empty = torch.zeros(targets.shape, dtype=torch.float64, device=logits.device)
    logp = torch.stack(logps).reshape(targets.shape) if ids else empty
    if not return_entropy:
        return logp
    return logp, (torch.stack(ents).reshape(targets.shape) if ids else empty.clone())


def reference_response_log_probs(
    logits: Tensor, input_ids: Tensor, prompt_lens: Tensor, response_len: int, *, return_entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """The response tokens' log-probabilities (and entropies) from a causal LM's logits, one token at a time.

    Row ``b``'s response starts at column ``prompt_lens[b]`` of ``input_ids``; its token
    ``j`` (column ``p + 1`` with ``p = prompt_lens[b] - 1 + j``) is predicted by the logits
    at column ``p``, the one before it. Each token is scored by
    :func:`reference_log_probs`: the semantics of
    :func:`~ppo_objectives.functional.response_log_probs`.

    Args:
        logits: ``[B, T, V]`` float logits of the whole sequence.
        input_ids: ``[B, T]`` integer token ids (prompt then response).
        prompt_lens: ``[B]`` prompt lengths, each ``>= 1``, with ``prompt_lens[b] + response_len <= T``.
        response_len: ``R``.
        return_entropy: also return the entropies.

    Returns:
        float64 ``[B, R]`` log-probabilities, or ``(log_probs, entropies)`` (differentiable, as
        :func:`reference_log_probs`).

    Example:
        >>> logits = torch.zeros(1, 4, 8)                  # uniform over 8 tokens
        >>> ids = torch.tensor([[5, 1, 2, 3]])             # prompt [5], response [1, 2, 3]
        >>> reference_response_log_probs(logits, ids, torch.tensor([1]), 3)   # log(1/8)
        tensor([[-2.0794, -2.0794, -2.0794]], dtype=torch.float64)
    """
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError("logits must be a [B, T, V] tensor")
    B, T = logits.shape[:2]
    if not isinstance(input_ids, Tensor) or input_ids.shape != (B, T):
        raise ValueError(f"input_ids must be a [B, T] = {(B, T)} tensor")
    lens = prompt_lens.reshape(-1).tolist()
    if len(lens) != B:
        raise ValueError(f"prompt_lens has {len(lens)} entries, expected B = {B}")
    rows, cols = [], []
    for b in range(B):
        for j in range(response_len):
            p = int(lens[b]) - 1 + j
            if not 0 <= p < T - 1:
                raise ValueError(f"row {b}: response token {j} sits at column {p + 1}, outside the T = {T} columns")
            rows.append(b)
            cols.append(p)
    scored = logits[rows, cols].reshape(B, response_len, logits.shape[-1])
    targets = input_ids[rows, [p + 1 for p in cols]].reshape(B, response_len)
    return reference_log_probs(scored, targets, return_entropy=return_entropy)

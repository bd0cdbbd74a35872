"""The functional core of token-level PPO: pure tensor math, torch only.

Every number the TorchRL modules of this package compute is computed here, so
the whole algorithm can be read in one file and tested without TensorDicts.
The five functions marked *MiniMind* follow the PPO stage of MiniMind's
``trainer/train_ppo.py`` number for number; the rest are what users of verl /
OpenRLHF / TRL expect beyond it. Arguments carry TorchRL's names, the same from
the CLI to the arithmetic (``docs/design.md``, "Names"): ``log_prob`` (the policy
being optimised), ``sample_log_prob`` (the policy that sampled), ``ref_log_prob``,
``rollout_log_prob``, ``lmbda``, ``aggregation``, ``clip_epsilon``, ``clip_value``.

Shape letters (used in every docstring below):

- ``B``: batch dimensions (one or more leading dims, written ``*B``), or a
  single batch dim where a function says ``[B]``.
- ``T``: the full sequence length (prompt + response) of ``input_ids``/``logits``.
- ``R``: the response length (tokens the policy generated, padded).
- ``V``: the vocabulary size.

Conventions (see docs/design.md):

- ``mask`` is always "True = this token takes part". Bool masks are used as
  they are; integer or floating masks must hold only 0 and 1.
- Masked positions never influence valid ones: rewards, values or log-probs
  there may be garbage (even NaN) and every output at a valid position is
  unchanged. Per-token outputs are exactly 0 at masked positions.
- An empty mask gives 0, never NaN.
- Math runs in float32 or better, even for bf16/fp16 inputs.

Value checks that have to read tensor data (mask values of a non-bool mask,
positions inside the sequence, hyper-parameters given as CPU tensors) run
eagerly and are skipped inside ``torch.compile``; :func:`value_checks` turns
them off for a hot loop. Shape, dtype and device checks are always on.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ppo_objectives import _validate
from ppo_objectives._kernels import gae as _gae_fast
from ppo_objectives._kernels import losses as L
from ppo_objectives._kernels import masked as K
from ppo_objectives._kernels import logprobs as _logprobs
from ppo_objectives._validate import value_checks

__all__ = [
    "adaptive_kl_coeff",
    "aggregate_loss",
    "approx_kl",
    "clipped_value_loss",
    "explained_variance",
    "kl_estimate",
    "kl_penalized_rewards",
    "last_valid_index",
    "length_adaptive_lmbda",
    "loss_normalizer",
    "masked_gae",
    "masked_gae_reference",
    "masked_kl_estimate",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "reference_kl_penalty",
    "response_log_probs",
    "response_log_probs_from_hidden",
    "resolve_done_flags",
    "response_logp_positions",
    "rollout_correction_weights",
    "turn_gae",
    "value_checks",
]

AGGREGATIONS = _validate.AGGREGATIONS
KL_ESTIMATORS = _validate.KL_ESTIMATORS



# --------------------------------------------------------------------------- #
# Masked statistics
# --------------------------------------------------------------------------- #


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None, *, keepdim: bool = False) -> Tensor:
    """Sum of ``x`` over valid positions (NaN at masked positions is ignored).

    Accumulated and returned in float32 for half-precision inputs (float64 for
    float64), so 70,000 float16 ones sum to 70,000, not ``inf``.

    Args:
        x: ``[*B, R]`` float tensor.
        mask: ``[*B, R]`` bool or {0, 1} tensor, True = take part.
        dim: dimensions to reduce; all of them when ``None``.
        keepdim: keep reduced dimensions with size 1.

    Example:
        >>> import torch
        >>> masked_sum(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([True, False, True]))
        tensor(4.)
    """
    _validate.check_float("x", x)
    m = _validate.check_mask(mask, x.shape, "x")
    _validate.check_same_device(x=x, mask=mask)
    return K.masked_sum(x, m, dim, keepdim=keepdim)





def masked_mean(
    x: Tensor,
    mask: Tensor,
    dim: int | tuple[int, ...] | None = None,
    *,
    keepdim: bool = False,
    process_group=None,
) -> Tensor:
    """Mean of ``x`` over valid positions: ``sum(x * m) / max(sum(m), 1)``.

    An empty mask (or an empty slice along ``dim``) gives 0. Masked positions
    may hold NaN or inf; they are never read into the arithmetic. Sum and count
    are accumulated in float32 for half-precision inputs and the mean is
    returned in float32 (float64 for float64): a float16 sum would overflow
    past 65,504 and a float16 count past 65,504 tokens would make every mean 0.

    Args:
        x: ``[*B, R]`` float tensor.
        mask: ``[*B, R]`` bool or {0, 1} tensor.
        dim: dimensions to reduce; all of them when ``None``.
        keepdim: keep reduced dimensions with size 1.
        process_group: a ``torch.distributed`` group: the mean over the valid
            tokens of every rank (``dim=None`` only; one all-reduce). Meant for
            statistics and diagnostics: the gradient flows through the local
            sum only. For losses use :func:`loss_normalizer`.

    Example:
        >>> import torch
        >>> x = torch.tensor([[1.0, 2.0, 9.0], [4.0, float("inf"), 0.0]])
        >>> m = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> masked_mean(x, m)            # (1 + 2 + 4) / 3
        tensor(2.3333)
        >>> masked_mean(x, m, dim=-1)    # per row: (1 + 2) / 2 and 4 / 1
        tensor([1.5000, 4.0000])
        >>> masked_mean(x, torch.zeros_like(m))
        tensor(0.)
    """
    _validate.check_float("x", x)
    m = _validate.check_mask(mask, x.shape, "x")
    _validate.check_same_device(x=x, mask=mask)
    if process_group is not None and dim is not None:
        raise ValueError("masked_mean: process_group needs dim=None (a global mean over every rank's tokens)")
    if dim is None:
        total = K.masked_sum(x, m)
        count = m.sum().to(total.dtype)
        if process_group is not None:
            both = K.all_reduce_sum(torch.stack([total.detach(), count]), process_group)
            total, count = total + (both[0] - total.detach()), both[1]
        out = total / count.clamp(min=1)
        return out.reshape([1] * x.dim()) if keepdim else out
    total = K.masked_sum(x, m, dim, keepdim=keepdim)
    count = m.sum(dim=dim, keepdim=keepdim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(x: Tensor, mask: Tensor, *, unbiased: bool = False, process_group=None) -> Tensor:
    """Variance of ``x`` over all valid positions (a scalar).

    ``var = sum(m * (x - mean)^2) / n`` (biased, MiniMind's default) or
    ``/ (n - 1)`` with ``unbiased=True``. Fewer than one valid token (two when
    unbiased) gives 0. Computed and returned in float32 for half-precision
    inputs (float64 for float64).

    Args:
        x: ``[*B, R]`` float tensor.
        mask: ``[*B, R]`` bool or {0, 1} tensor.
        unbiased: use Bessel's correction.
        process_group: a ``torch.distributed`` group: the variance over the
            valid tokens of every rank (two all-reduces: exact two-pass variance).

    Example:
        >>> import torch
        >>> x = torch.tensor([1.0, 3.0, 100.0])
        >>> m = torch.tensor([True, True, False])
        >>> masked_var(x, m)                 # mean 2, ((1-2)^2 + (3-2)^2) / 2
        tensor(1.)
        >>> masked_var(x, m, unbiased=True)  # ... / (2 - 1)
        tensor(2.)
    """
    _validate.check_float("x", x)
    m = _validate.check_mask(mask, x.shape, "x")
    _validate.check_same_device(x=x, mask=mask)
    return K.masked_moments(x.to(_validate.compute_dtype(x)), m, unbiased, process_group)[1]



def masked_whiten(
    x: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    unbiased: bool = False,
    eps: float = 1e-8,
    process_group=None,
) -> Tensor:
    """Whiten ``x`` with the mean and variance of its valid positions.

    ``(x - mean) * rsqrt(var + eps)`` with the statistics over every valid
    token of the whole batch (biased variance by default, as in MiniMind).
    With ``shift_mean=False`` the mean is added back (TRL's option): only the
    scale changes. Masked positions of the output are exactly 0.

    Args:
        x: ``[*B, R]`` float tensor.
        mask: ``[*B, R]`` bool or {0, 1} tensor.
        shift_mean: subtract the mean (True) or keep it.
        unbiased: Bessel-corrected variance.
        eps: added to the variance before the square root.
        process_group: a ``torch.distributed`` group: whiten with the
            statistics of every rank's valid tokens, so N ranks with B rows
            each give the whitening of one process with N * B rows.

    Returns:
        ``[*B, R]`` tensor of ``x``'s dtype.

    Example:
        >>> import torch
        >>> x = torch.tensor([[1.0, 3.0, float("nan")]])
        >>> masked_whiten(x, torch.tensor([[True, True, False]]))  # mean 2, var 1
        tensor([[-1.,  1.,  0.]])
    """
    _validate.check_float("x", x)
    m = _validate.check_mask(mask, x.shape, "x")
    _validate.check_positive("eps", eps)
    return K.whiten(x, m, shift_mean=shift_mean, unbiased=unbiased, eps=eps, process_group=process_group)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Fraction of the returns' variance the critic explains, over valid tokens.

    ``1 - var(R - V) / var(R)``: 1 is a perfect critic, 0 no better than a
    constant, negative worse than one. 0 when the mask is empty or ``var(R)``
    is at the rounding of the numbers' scale (below the dtype's ``eps`` times
    the mean of ``R**2 + V**2``): returns that are all equal up to rounding
    have no spread to explain (never NaN). Returned detached.

    Args:
        values: ``[*B, R]`` critic values ``V``.
        returns: ``[*B, R]`` value targets ``R``.
        mask: ``[*B, R]`` bool or {0, 1} tensor.

    Example:
        >>> import torch
        >>> r = torch.tensor([1.0, 2.0, 3.0, 4.0])
        >>> explained_variance(r, r, torch.ones(4, dtype=torch.bool))
        tensor(1.)
        >>> explained_variance(torch.zeros(4), r, torch.ones(4, dtype=torch.bool))
        tensor(0.)
    """
    m = _validate.check_token_tensors(mask, values=values, returns=returns)
    return K.explained_variance(values, returns, m)


# --------------------------------------------------------------------------- #
# Log-probabilities of the response tokens  (MiniMind 1: positions)
# --------------------------------------------------------------------------- #


def response_logp_positions(prompt_lens: Tensor, response_len: int) -> Tensor:
    """Positions of the logits that predict each response token (*MiniMind*).

    With a prompt of ``P_b`` tokens followed by the response, response token
    ``j`` sits at index ``P_b + j`` of the sequence and is predicted by the
    logits at index ``P_b - 1 + j``. So ``positions[b, j] = prompt_lens[b] - 1 + j``,
    MiniMind's ``logp_pos``.

    Args:
        prompt_lens: ``[B]`` integer tensor, prompt length of each row (>= 1).
        response_len: ``R``, the (padded) response length, >= 1.

    Returns:
        ``[B, R]`` int64 tensor on the device of ``prompt_lens``.

    Example:
        >>> import torch
        >>> response_logp_positions(torch.tensor([3, 1]), 4)
        tensor([[2, 3, 4, 5],
                [0, 1, 2, 3]])
    """
    _validate.check_tensor("prompt_lens", prompt_lens)
    if prompt_lens.dim() != 1:
        raise ValueError(f"prompt_lens must be 1-D [B], got shape {tuple(prompt_lens.shape)}")
    if prompt_lens.is_floating_point() or prompt_lens.dtype == torch.bool or prompt_lens.is_complex():
        raise TypeError(f"prompt_lens must be an integer tensor, got dtype {prompt_lens.dtype}; use .long()")
    if isinstance(response_len, bool) or not isinstance(response_len, int):
        raise TypeError(f"response_len must be an int, got {type(response_len).__name__}")
    if response_len < 1:
        raise ValueError(f"response_len={response_len} must be >= 1: there is no response token to score")
    if _validate.checking_values() and prompt_lens.numel() > 0 and bool((prompt_lens < 1).any()):
        raise ValueError(
            f"prompt_lens must be >= 1 (the first response token needs a token before it), "
            f"got min {int(prompt_lens.min())}"
        )
    j = torch.arange(response_len, device=prompt_lens.device)
    return prompt_lens.long().unsqueeze(1) - 1 + j


def response_log_probs(
    logits: Tensor,
    input_ids: Tensor,
    prompt_lens: Tensor,
    response_len: int,
    *,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities (and entropies) of the response tokens.

    ``logp[b, j] = log_softmax(logits[b, p])[input_ids[b, p + 1]]`` with
    ``p = prompt_lens[b] - 1 + j`` (:func:`response_logp_positions`); equal
    to MiniMind's ``log_softmax(logits[:, :-1]).gather(labels).gather(logp_pos)``.
    Computed in float32 even for half-precision logits, without a full
    ``[B, T, V]`` float32 log-softmax: rows are processed in chunks.
    ``entropy[b, j] = -sum_v p_v log p_v`` of the same distribution.

    Args:
        logits: ``[B, T, V]`` float logits of the whole sequence.
        input_ids: ``[B, T]`` integer token ids (prompt then response).
        prompt_lens: ``[B]`` prompt lengths.
        response_len: ``R``; requires ``prompt_lens[b] + R <= T``.
        return_entropy: also return the ``[B, R]`` entropies.
        chunk_size: rows (positions) per chunk; ``None`` picks one.
        temperature: score ``log_softmax(logits / temperature)`` (divided after the upcast), the
            distribution of a policy sampling at that temperature; ``1.0`` (no division) by default.

    Returns:
        ``[B, R]`` log-probs in float32 (float64 for float64 logits), or ``(logp, entropy)``.

    Example:
        >>> import torch
        >>> logits = torch.zeros(1, 4, 8)                  # uniform over 8 tokens
        >>> ids = torch.tensor([[5, 1, 2, 3]])             # prompt [5], response [1, 2, 3]
        >>> logp, ent = response_log_probs(logits, ids, torch.tensor([1]), 3, return_entropy=True)
        >>> logp                                           # log(1/8)
        tensor([[-2.0794, -2.0794, -2.0794]])
        >>> ent                                            # log(8)
        tensor([[2.0794, 2.0794, 2.0794]])
    """
    _validate.check_float("logits", logits)
    _validate.check_tensor("input_ids", input_ids)
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    if input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)} but logits has shape {tuple(logits.shape)}; "
            f"input_ids must be [B, T] with the B and T of logits"
        )
    _validate.check_same_device(logits=logits, input_ids=input_ids, prompt_lens=prompt_lens)
    if prompt_lens.shape != logits.shape[:1]:
        raise ValueError(f"prompt_lens has shape {tuple(prompt_lens.shape)}, expected [B] = [{logits.shape[0]}]")
    if chunk_size is not None:
        _validate.check_int("chunk_size", chunk_size, low=1, what=" or None (rows per chunk)")
    temperature = _validate.check_positive("temperature", temperature, what=" (the sampling temperature the logits "
                                           "are divided by; 1.0 scores the model's own distribution)")
    positions = response_logp_positions(prompt_lens, response_len)
    T = logits.shape[1]
    if _validate.checking_values() and positions.numel() > 0 and bool((positions[:, -1] + 1 >= T).any()):
        worst = int(prompt_lens.max())
        raise ValueError(
            f"positions outside the sequence: prompt_lens up to {worst} with response_len={response_len} "
            f"needs T >= {worst + response_len}, but logits/input_ids have T={T}; pad the sequences or "
            f"shorten response_len"
        )
    targets = input_ids.gather(1, positions + 1)
    V = logits.shape[-1]
    if _validate.checking_values() and targets.numel() > 0 and bool(((targets < 0) | (targets >= V)).any()):
        bad = targets[(targets < 0) | (targets >= V)].flatten()[:3].tolist()
        raise ValueError(
            f"input_ids holds response token ids outside the vocabulary [0, V={V}) of the logits, "
            f"such as {bad}; check the tokenizer / model pairing or the padding id"
        )
    logp, entropy = _logprobs.gathered_log_probs(
        logits, positions, targets, return_entropy=return_entropy, chunk_size=chunk_size, temperature=temperature
    )
    return (logp, entropy) if return_entropy else logp


def response_log_probs_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    input_ids: Tensor,
    prompt_lens: Tensor,
    response_len: int,
    *,
    lm_head_bias: Tensor | None = None,
    mask: Tensor | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities (and entropies) of the response tokens from the last hidden states.

    The positions and tokens of :func:`response_log_probs`, with the LM head folded in::

        logp[b, j]    = log_softmax(hidden[b, p] @ W^T + bias)[input_ids[b, p + 1]],  p = prompt_lens[b] - 1 + j
        entropy[b, j] = -sum_v q_v log q_v,  q = softmax(hidden[b, p] @ W^T + bias)

    The ``[B, T, V]`` logits are never formed: the scored rows are walked in chunks (rows per
    chunk from a fixed memory budget, or ``chunk_size``), each chunk projected
    (``hidden[rows] @ W^T + bias``, in the dtype of ``hidden``; ``W`` and ``bias`` are cast to it),
    upcast to float32 and reduced to a log-sum-exp; the backward recomputes each chunk's logits
    and adds ``d logits @ W`` into the hidden states' gradient and ``d logits^T @ hidden[rows]``
    into the head's (float32 accumulation). Positions where ``mask`` is False are not projected
    at all and are exactly 0, with zero gradient, in both outputs; ``hidden`` and ``input_ids``
    there may hold anything. Selecting the masked rows reads ``mask`` (one host
    synchronisation); ``mask=None`` scores every position without one. The kernel is
    ``ppo_objectives/_kernels/logprobs.py``; the design follows fused linear cross-entropy kernels.

    Args:
        hidden: ``[B, T, C]`` float last hidden states (the input of the LM head).
        lm_head_weight: ``[V, C]`` float LM-head weight (``nn.Linear(C, V).weight``).
        input_ids: ``[B, T]`` integer token ids (prompt then response).
        prompt_lens: ``[B]`` prompt lengths.
        response_len: ``R``; requires ``prompt_lens[b] + R <= T``.
        lm_head_bias: ``[V]`` float LM-head bias, or ``None``.
        mask: ``[B, R]`` bool / {0, 1} (True = score this token), or ``None`` for every token.
        return_entropy: also return the ``[B, R]`` entropies.
        chunk_size: rows (positions) per chunk; ``None`` picks one.
        temperature: score ``log_softmax((hidden @ W^T + bias) / temperature)`` (divided after the upcast),
            the distribution of a policy sampling at that temperature; ``1.0`` (no division) by default.

    Returns:
        ``[B, R]`` log-probs in float32 (float64 for float64 ``hidden``), or ``(logp, entropy)``.

    Example:
        >>> import torch
        >>> hidden = torch.zeros(1, 4, 2)                  # zero hidden states: uniform logits
        >>> weight = torch.randn(8, 2)                     # V = 8, C = 2
        >>> ids = torch.tensor([[5, 1, 2, 3]])             # prompt [5], response [1, 2, 3]
        >>> mask = torch.tensor([[True, True, False]])     # the last token is padding
        >>> logp, ent = response_log_probs_from_hidden(hidden, weight, ids, torch.tensor([1]), 3, mask=mask,
        ...                                            return_entropy=True)
        >>> logp                                           # log(1/8), 0 off the mask
        tensor([[-2.0794, -2.0794,  0.0000]])
        >>> ent                                            # log(8)
        tensor([[2.0794, 2.0794, 0.0000]])
    """
    weight, bias = _check_lm_head(hidden, lm_head_weight, lm_head_bias)
    _validate.check_tensor("input_ids", input_ids)
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    _validate.check_tensor("prompt_lens", prompt_lens)
    if mask is not None:
        _validate.check_tensor("mask", mask)
    B, T, _ = hidden.shape
    if input_ids.shape != (B, T):
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)} but hidden has shape {tuple(hidden.shape)}; "
            f"input_ids must be [B, T] with the B and T of hidden"
        )
    _validate.check_same_device(hidden=hidden, lm_head_weight=weight, lm_head_bias=bias, input_ids=input_ids,
                                prompt_lens=prompt_lens, mask=mask)  # fmt: skip
    if prompt_lens.shape != (B,):
        raise ValueError(f"prompt_lens has shape {tuple(prompt_lens.shape)}, expected [B] = [{B}]")
    if chunk_size is not None:
        _validate.check_int("chunk_size", chunk_size, low=1, what=" or None (rows per chunk)")
    temperature = _validate.check_positive("temperature", temperature, what=" (the sampling temperature the logits "
                                           "are divided by; 1.0 scores the model's own distribution)")
    positions = response_logp_positions(prompt_lens, response_len)
    m = None if mask is None else _validate.check_mask(mask, positions.shape, "the [B, response_len] log-probs")
    if _validate.checking_values() and positions.numel() > 0 and bool((positions[:, -1] + 1 >= T).any()):
        worst = int(prompt_lens.max())
        raise ValueError(
            f"positions outside the sequence: prompt_lens up to {worst} with response_len={response_len} "
            f"needs T >= {worst + response_len}, but hidden/input_ids have T={T}; pad the sequences or "
            f"shorten response_len"
        )
    targets = input_ids.gather(1, positions + 1)
    V = weight.shape[0]
    if _validate.checking_values() and targets.numel() > 0:
        bad = (targets < 0) | (targets >= V)
        bad = bad if m is None else bad & m  # token ids off the mask are never read
        if bool(bad.any()):
            raise ValueError(
                f"input_ids holds response token ids outside the vocabulary [0, V={V}) of lm_head_weight, "
                f"such as {targets[bad][:3].tolist()}; check the tokenizer / model pairing or the padding id "
                f"(or mask those positions out)"
            )
    logp, entropy = _logprobs.gathered_log_probs_from_hidden(
        hidden, weight, bias, positions, targets, m, return_entropy=return_entropy, chunk_size=chunk_size,
        temperature=temperature,
    )
    return (logp, entropy) if return_entropy else logp


def _check_lm_head(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Shapes of ``hidden [B, T, C]``, ``weight [V, C]`` and ``bias [V]`` (all floating point)."""
    _validate.check_float("hidden", hidden)
    _validate.check_float("lm_head_weight", weight)
    if hidden.dim() != 3:
        raise ValueError(
            f"hidden must be [B, T, C] (the model's last hidden states), got shape {tuple(hidden.shape)}; "
            f"add the batch dim with hidden[None] for one sequence"
        )
    if weight.dim() != 2:
        raise ValueError(
            f"lm_head_weight must be [V, C] (the weight of nn.Linear(C, V)), got shape {tuple(weight.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight has shape {tuple(weight.shape)} but hidden has width C={hidden.shape[-1]} "
            f"(shape {tuple(hidden.shape)}); the head must be [V, C] for hidden states of width C: pass "
            f"lm_head.weight itself, not its transpose, and the hidden states the head reads"
        )
    if bias is not None:
        _validate.check_float("lm_head_bias", bias)
        if bias.shape != weight.shape[:1]:
            raise ValueError(
                f"lm_head_bias has shape {tuple(bias.shape)} but lm_head_weight has V={weight.shape[0]} rows; "
                f"the bias must be [V] (lm_head.bias), or None for a head without bias"
            )
    return weight, bias


# --------------------------------------------------------------------------- #
# Masked GAE  (MiniMind 2)
# --------------------------------------------------------------------------- #


def resolve_done_flags(done, terminated, truncated):
    """Complete TorchRL's three trajectory-end flags from the ones given: ``(done, terminated, truncated)``.

    The one rule every layer of this package uses (``MaskedGAE``, ``LLMToTokenBatch``):
    a missing ``done`` is ``terminated | truncated``; a missing ``terminated`` is
    ``done & ~truncated`` (``done`` when ``truncated`` is missing too: an end with no
    other word is a termination, as in TorchRL); a missing ``truncated`` is
    ``done & ~terminated``. Works on bool tensors (any shape, all the same) or Python
    bools; at least one flag must be given.

    Example:
        >>> resolve_done_flags(True, None, None)          # done alone: a termination
        (True, True, False)
        >>> resolve_done_flags(None, None, True)          # truncated alone: done, not terminated
        (True, False, True)
    """
    if done is None and terminated is None and truncated is None:
        raise ValueError("resolve_done_flags needs at least one of done, terminated, truncated")
    tensors = isinstance(next(f for f in (done, terminated, truncated) if f is not None), Tensor)

    def either(a, b):
        if a is None or b is None:
            return a if b is None else b
        return a | b if tensors else bool(a) or bool(b)

    def but_not(a, b):
        if b is None:
            return a
        return a & ~b if tensors else bool(a) and not bool(b)

    if done is None:
        done = either(terminated, truncated)
    if terminated is None:
        terminated = but_not(done, truncated)
    if truncated is None:
        truncated = but_not(done, terminated)
    if not tensors:
        done, terminated, truncated = bool(done), bool(terminated), bool(truncated)
    return done, terminated, truncated


def _gae_inputs(token_rewards, values, mask, gamma, lmbda, bootstrap_value, done=None, terminated=None, next_values=None):
    """Validate the GAE arguments; return flat ``[N, R]`` compute-dtype tensors.

    With trajectory ends (``done`` / ``terminated`` / ``next_values``) the row bootstrap is
    folded into ``(ends, end_values)`` (:func:`_segment_ends`) and returned as ``None``.
    """
    _validate.check_float("token_rewards", token_rewards)
    _validate.check_float("values", values)
    _validate.check_same_shape("token_rewards", token_rewards, values=values)
    if token_rewards.dim() < 1:
        raise ValueError("token_rewards must have a time axis: shape [*B, R], got a scalar")
    shape = token_rewards.shape
    m = None if mask is None else _validate.check_mask(mask, shape, "token_rewards")
    flags = {
        name: None if x is None else _validate.check_mask(x, shape, "token_rewards", name=name)
        for name, x in (("done", done), ("terminated", terminated))
    }
    _validate.check_unit_interval("gamma", gamma)
    if not _is_row_lmbda(lmbda):
        _validate.check_unit_interval("lmbda", lmbda)
    _validate.check_same_device(
        token_rewards=token_rewards, values=values, mask=mask, bootstrap_value=bootstrap_value,
        done=done, terminated=terminated, next_values=next_values,
    )  # fmt: skip
    batch_shape = shape[:-1]
    if bootstrap_value is not None:
        _validate.check_float("bootstrap_value", bootstrap_value)
        if bootstrap_value.shape != batch_shape:
            raise ValueError(
                f"bootstrap_value has shape {tuple(bootstrap_value.shape)} but must be [*B] = {tuple(batch_shape)}: "
                f"one value per row, used after that row's last valid token (pass 0 for rows that terminated)"
            )
    if next_values is not None:
        _validate.check_float("next_values", next_values)
        _validate.check_same_shape("token_rewards", token_rewards, next_values=next_values)
        if bootstrap_value is not None:
            raise ValueError(
                "bootstrap_value and next_values are exclusive: next_values already holds the value after "
                "every step, the last valid one included; drop bootstrap_value"
            )
    extra = tuple(x for x in (bootstrap_value, next_values) if x is not None)
    cd = _validate.compute_dtype(token_rewards, values, *extra)
    r = K.rows(token_rewards.to(cd))
    v = K.rows(values.to(cd))
    boot = None if bootstrap_value is None else bootstrap_value.to(cd).reshape(-1)
    if isinstance(gamma, Tensor):
        gamma = gamma.to(cd).reshape(())
    if _is_row_lmbda(lmbda):
        lmbda = _check_row_lmbda(lmbda, batch_shape).to(cd).reshape(-1)  # [N]: one lambda per row
    elif isinstance(lmbda, Tensor):
        lmbda = lmbda.to(cd).reshape(())
    m = None if m is None else K.rows(m)
    ends = end_values = None
    if flags["done"] is not None or flags["terminated"] is not None or next_values is not None:
        rows = lambda x: None if x is None else K.rows(x)  # noqa: E731
        nv = None if next_values is None else K.rows(next_values.to(cd))
        ends, end_values = _segment_ends(m, r.shape, rows(flags["done"]), rows(flags["terminated"]), nv, boot)
        boot = None
    return r, v, m, gamma, lmbda, boot, ends, end_values, cd


def _segment_ends(m, shape, done, terminated, next_values, boot) -> tuple[Tensor, Tensor]:
    """Trajectory ends of collector rows and the value each end bootstraps from (``[N, R]``).

    An end is a valid step with ``done`` (``terminated`` when ``done`` is not given); the
    kernels also end each row's trajectory at its last valid step (the batch boundary). The
    end value is 0 when ``terminated`` (by default: when ``done``), else ``next_values``
    there. Without ``next_values`` every ``done`` step bootstraps 0 and the last valid step
    (when not done) takes ``bootstrap_value`` (0 if ``None``).
    """
    ended = done if done is not None else terminated
    if ended is None:  # only next_values: one trajectory per row, bootstrapped from its last step
        ended = torch.zeros(shape, dtype=torch.bool, device=next_values.device)
    zero = torch.zeros((), dtype=torch.float32 if next_values is None else next_values.dtype, device=ended.device)
    if next_values is not None:
        term = terminated if terminated is not None else ended
        end_values = torch.where(term, zero, next_values)
    else:
        term = ended if terminated is None else ended | terminated
        row = zero.expand(shape) if boot is None else boot.unsqueeze(-1).expand(shape)
        end_values = torch.where(term, zero.to(row.dtype), row)
    return (ended if m is None else ended & m), end_values


def _is_row_lmbda(lmbda) -> bool:
    return isinstance(lmbda, Tensor) and lmbda.dim() > 0


def _check_row_lmbda(lmbda: Tensor, batch_shape: torch.Size) -> Tensor:
    """A per-row ``lmbda`` ``[*B]``: floating, one value per row, each in [0, 1] (one host read)."""
    if not lmbda.is_floating_point() or lmbda.shape != batch_shape:
        raise ValueError(
            f"lmbda has shape {tuple(lmbda.shape)} and dtype {lmbda.dtype}; a per-row lambda must be a floating tensor of "
            f"shape [*B] = {tuple(batch_shape)} (one value per row), or pass one float for every row"
        )
    if _validate.checking_values() and lmbda.numel():
        lo, hi = torch.stack([lmbda.min(), lmbda.max()]).tolist()
        if not (0.0 <= lo and hi <= 1.0):
            raise ValueError(f"lmbda holds {lo if lo < 0 else hi}, outside [0, 1]: every row's GAE lambda must be in "
                             f"[0, 1] (length_adaptive_lmbda clamps its values)")
    return lmbda


def _per_row_lmbda(kernel, r, v, m, gamma, lmbda: Tensor, boot, ends, end_values) -> Tensor:
    """Raw advantages with one ``lmbda`` per row (``lmbda [N]``): the kernel once per distinct value, on its rows
    (one host read of the distinct values)."""
    adv = torch.zeros_like(r)
    for value in torch.unique(lmbda).tolist():
        rows = (lmbda == value).nonzero().squeeze(-1)
        sub = lambda x: None if x is None else x[rows]  # noqa: E731
        adv[rows] = kernel(r[rows], v[rows], sub(m), gamma, value, sub(boot), sub(ends), sub(end_values))
    return adv


def length_adaptive_lmbda(mask: Tensor, alpha: float, floor: float = 0.0) -> Tensor:
    """VAPO's length-adaptive GAE lambda of each row, ``lmbda = 1 - 1 / (alpha * l)``, clamped to [floor, 1].

    Yue et al. 2025, "VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning
    Tasks" (arXiv:2504.05118): with ``l`` the row's number of valid tokens, the sum of the
    lambda-weights ``1 / (1 - lmbda) = alpha * l`` grows with the response, so a long response's
    advantage keeps the reward's signal over its whole length while a short one still has a
    low-variance bootstrap from the critic. A row with no valid token gets 0.

    Args:
        mask: ``[*B, R]`` bool or {0, 1}, True = token takes part.
        alpha: ``> 0`` (VAPO: 0.05 for responses of hundreds to thousands of tokens; a short
            response needs a larger one).
        floor: the smallest lambda, in [0, 1]: ``1 - 1 / (alpha * l)`` is negative for ``l < 1 / alpha``
            (VAPO's 0.05 gives every answer under 20 tokens lambda 0, one TD step on the critic's guess);
            a floor keeps short answers on more of their reward.

    Returns:
        ``[*B]`` float32: pass it as ``lmbda=`` to :func:`masked_gae`.

    Example:
        >>> length_adaptive_lmbda(torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]), alpha=0.5)
        tensor([0.5000, 0.0000, 0.0000])
        >>> length_adaptive_lmbda(torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]), alpha=0.5, floor=0.9)
        tensor([0.9000, 0.9000])
    """
    _validate.check_positive("alpha", alpha)
    _validate.check_unit_interval("floor", floor)
    m = _validate.check_mask(mask, mask.shape if isinstance(mask, Tensor) else torch.Size(), "mask")
    if m.dim() < 1:
        raise ValueError("mask must have a time axis: shape [*B, R], got a scalar")
    n = m.sum(-1).to(torch.float32)
    return torch.where(n > 0, 1.0 - 1.0 / (alpha * n.clamp(min=1.0)), 0.0).clamp(float(floor), 1.0)


def _gae_finish(adv_raw, v, m, average_gae, shape, out_dtype, process_group=None):
    """Returns = raw advantages + values; whiten the advantages; zero masked positions."""
    zero = torch.zeros((), dtype=adv_raw.dtype, device=adv_raw.device)
    returns = adv_raw + v if m is None else torch.where(m, adv_raw + v, zero)
    adv = adv_raw
    if average_gae:  # masked_whiten(adv_raw, m), knowing that every kernel writes exact zeros off the mask
        _, var, centred = K.masked_moments(adv_raw, m, False, process_group, zero_off_mask=True)
        adv = centred * torch.rsqrt(var + 1e-8)
    return adv.reshape(shape).to(out_dtype), returns.reshape(shape).to(out_dtype)


def masked_gae_reference(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lmbda: float,
    *,
    average_gae: bool = True,
    bootstrap_value: Tensor | None = None,
    done: Tensor | None = None,
    terminated: Tensor | None = None,
    next_values: Tensor | None = None,
    process_group=None,
) -> tuple[Tensor, Tensor]:
    """The readable loop version of :func:`masked_gae` (same semantics, same outputs).

    A backward loop over time that carries, per row, the value and the
    advantage of the next *valid* token and leaves masked positions alone::

        next_v, next_a = bootstrap (or 0), 0
        for t = R-1 .. 0:
            if mask[t]:
                if end[t]:                      # trajectory ends here (collector rows)
                    next_v, next_a = end_value[t], 0
                delta  = r[t] + gamma * next_v - v[t]
                A[t]   = delta + gamma * lmbda * next_a
                next_v, next_a = v[t], A[t]

    ``end`` and ``end_value`` come from ``done`` / ``terminated`` / ``next_values`` as
    :func:`masked_gae` describes; without them no step is an end.

    Example:
        >>> import torch
        >>> r = torch.tensor([[0.0, 0.0, 1.0]])
        >>> v = torch.zeros(1, 3)
        >>> m = torch.ones(1, 3, dtype=torch.bool)
        >>> masked_gae_reference(r, v, m, 1.0, 0.5, average_gae=False)[0]  # 1 * 0.5^k back from the end
        tensor([[0.2500, 0.5000, 1.0000]])
    """
    out_dtype = values.dtype if isinstance(values, Tensor) else None
    r, v, m, gamma, lmbda, boot, ends, end_values, _ = _gae_inputs(
        token_rewards, values, mask, gamma, lmbda, bootstrap_value, done, terminated, next_values
    )
    adv = _gae_loop(r, v, m, gamma, lmbda, boot, ends, end_values)
    return _gae_finish(adv, v, m, average_gae, token_rewards.shape, out_dtype, process_group)


def _gae_loop(r: Tensor, v: Tensor, m: Tensor, gamma, lmbda, boot: Tensor | None, ends=None, end_values=None) -> Tensor:
    """Raw advantages ``[N, R]`` of validated rows: the backward loop over valid tokens."""
    N, R = r.shape
    next_v = r.new_zeros(N) if boot is None else boot
    next_a = r.new_zeros(N)
    adv = torch.zeros_like(r)
    seen = torch.zeros(N, dtype=torch.bool, device=r.device)  # a valid step lies to the right
    if m is None:
        m = torch.ones(r.shape, dtype=torch.bool, device=r.device)
    for t in range(R - 1, -1, -1):
        valid = m[:, t]
        if ends is not None:  # the last valid step of a row ends its trajectory too
            end = ends[:, t] | ~seen
            next_v = torch.where(end, end_values[:, t].to(r.dtype), next_v)
            next_a = torch.where(end, 0.0, next_a)
            seen = seen | valid
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lmbda * next_a
        adv[:, t] = torch.where(valid, a, 0.0)
        next_v = torch.where(valid, v[:, t], next_v)
        next_a = torch.where(valid, a, next_a)
    return adv


def masked_gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lmbda: float,
    *,
    average_gae: bool = True,
    bootstrap_value: Tensor | None = None,
    done: Tensor | None = None,
    terminated: Tensor | None = None,
    next_values: Tensor | None = None,
    backend: str = "auto",
    process_group=None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid tokens of each row (*MiniMind*).

    Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation" (arXiv:1506.02438)::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lmbda * A_{t+1}
        returns = A (raw, before whitening) + V

    Our masked semantics: the recursion runs over the valid tokens of a row
    only, so ``t + 1`` means "the next valid token". Holes (left padding,
    tool or user tokens inside a response) are skipped, and rewards or values
    there are never read (garbage and NaN are fine). After the last valid
    token the next value is 0 (terminal), or ``bootstrap_value[b]`` for a
    row cut short (truncated). Then, with ``average_gae=True``, the advantages
    are whitened over the valid tokens of the whole batch with the biased
    variance, ``(A - mean) * rsqrt(var + 1e-8)`` (:func:`masked_whiten`).
    Outputs are exactly 0 at masked positions. With right padding and zero
    rewards and values at padding this is MiniMind's loop exactly.

    **Rows holding several trajectories** (TorchRL's collector layout ``[N, T]``)
    pass ``done`` and/or ``terminated`` (and ``next_values``). A valid step with
    ``done`` ends its trajectory (``terminated`` stands for ``done`` when ``done``
    is not given), and so does the last valid step of the row (the batch boundary
    cut it). At an end nothing is carried from the right (zero decay) and the
    next value is a bootstrap: 0 when the step is ``terminated`` (``terminated``
    defaults to ``done``; complete a TorchRL triple with
    :func:`resolve_done_flags`), else ``next_values`` at that step (TorchRL's
    ``("next", "state_value")``: truncated trajectories and the boundary cut).
    Without ``next_values`` every end bootstraps 0, except the last valid step,
    which takes ``bootstrap_value`` if given. On unmasked data with consistent
    flags (terminated implies done) this equals
    :class:`torchrl.objectives.value.GAE`. Flags and next values are read at
    valid trajectory ends only, never at masked steps.

    Args:
        token_rewards: ``[*B, R]`` per-token rewards.
        values: ``[*B, R]`` critic values ``V_t``.
        mask: ``[*B, R]`` bool or {0, 1}, True = token takes part; ``None``:
            every step takes part (TorchRL collector rows without a mask; the
            same numbers as an all-True mask, without packing the rows).
        gamma: discount in [0, 1] (MiniMind: 1.0).
        lmbda: GAE lambda in [0, 1] (MiniMind: 0.95), or a ``[*B]`` tensor giving each row
            its own (:func:`length_adaptive_lmbda`; the fast backends then run once per distinct
            value, after one host read of the values).
        average_gae: whiten the advantages (returns always use the raw ones).
        bootstrap_value: ``[*B]`` value after the last valid token of each
            row (0 for rows that terminated); ``None`` means all terminated.
            Exclusive with ``next_values``.
        done: ``[*B, R]`` bool or {0, 1}: the trajectory ends after this step.
        terminated: ``[*B, R]`` bool or {0, 1}: it ends in a terminal state
            (bootstrap 0). A ``done`` step that is not ``terminated`` is truncated.
        next_values: ``[*B, R]`` value of the state after each step, read only at
            trajectory ends that are not terminated.
        backend: ``"auto"`` (fastest available), ``"torch"`` (vectorised),
            ``"triton"`` (CUDA kernel) or ``"loop"`` (:func:`masked_gae_reference`).
            Every backend takes both layouts.
        process_group: a ``torch.distributed`` group: whiten over the valid
            tokens of every rank (data-parallel training gives the numbers of
            one process holding the whole batch).

    Returns:
        ``(advantages, returns)``, both ``[*B, R]`` in the dtype of ``values``.

    Example:
        >>> import torch
        >>> r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
        >>> v = torch.tensor([[0.5, 0.5, 0.5, float("nan")]])  # last token is padding
        >>> m = torch.tensor([[1, 1, 1, 0]])
        >>> adv, ret = masked_gae(r, v, m, gamma=1.0, lmbda=1.0, average_gae=False)
        >>> adv                                      # reward-to-go minus value
        tensor([[0.5000, 0.5000, 0.5000, 0.0000]])
        >>> ret
        tensor([[1., 1., 1., 0.]])

        Two trajectories in one row: the first terminates after step 1, the second is
        cut by the row's end and bootstraps from its next value 2:

        >>> r = torch.ones(1, 4)
        >>> done = torch.tensor([[False, True, False, False]])
        >>> nv = torch.tensor([[0.0, 0.0, 0.0, 2.0]])
        >>> masked_gae(r, torch.zeros(1, 4), torch.ones(1, 4), 1.0, 1.0, average_gae=False,
        ...            done=done, next_values=nv)[0]
        tensor([[2., 1., 4., 3.]])
    """
    if not isinstance(backend, str) or backend not in _gae_fast.BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {_gae_fast.BACKENDS}")
    out_dtype = values.dtype if isinstance(values, Tensor) else None
    r, v, m, gamma_, lam_, boot, ends, end_values, _ = _gae_inputs(
        token_rewards, values, mask, gamma, lmbda, bootstrap_value, done, terminated, next_values
    )
    chosen = _gae_fast.select_backend(r.device, backend)
    if chosen == "loop":
        kernel = _gae_loop
    else:
        kernel = _gae_fast.gae_advantages_triton if chosen == "triton" else _gae_fast.gae_advantages_torch
    if r.numel() == 0:
        adv = torch.zeros_like(r)
    elif _is_row_lmbda(lam_) and chosen != "loop":  # the fast kernels take one lambda: group the rows by theirs
        adv = _per_row_lmbda(kernel, r, v, m, gamma_, lam_, boot, ends, end_values)
    else:
        adv = kernel(r, v, m, gamma_, lam_, boot, ends, end_values)
    return _gae_finish(adv, v, m, average_gae, token_rewards.shape, out_dtype, process_group)


# --------------------------------------------------------------------------- #
# Loss aggregation
# --------------------------------------------------------------------------- #


def turn_gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lmbda: float,
    *,
    average_gae: bool = True,
    process_group=None,
) -> tuple[Tensor, Tensor]:
    """GAE over the assistant's turns instead of its tokens (turn-level PPO, Li et al. 2025, "Turn-PPO",
    arXiv:2512.17008).

    A row's turns are its runs of valid tokens; the holes between them are the environment's
    tokens (a tool's reply). Turn ``k`` is one step of the turn-level MDP: its reward ``R_k`` is
    the sum of its tokens' rewards (the KL penalties and, on the last turn, the score), its value
    ``V_k`` the value at its first token (the state the turn is taken in)::

        delta_k = R_k + gamma * V_{k+1} - V_k          (V after the last turn: 0)
        A_k     = delta_k + gamma * lmbda * A_{k+1}

    Every token of turn ``k`` gets ``A_k`` (whitened over the valid tokens with ``average_gae``,
    as :func:`masked_gae` does) and the value target ``A_k + V_k`` (raw), so the critic learns
    each turn's return at every token of it and is read at each turn's first token. Rewards and
    values at masked positions are never read. A single-turn row is one step: ``A = R - V_0``,
    a learned baseline per response.

    Args:
        token_rewards, values: ``[*B, R]`` float.
        mask: ``[*B, R]`` bool or {0, 1}: the assistant's tokens.
        gamma, lmbda: in [0, 1], per turn.
        average_gae: whiten the advantages over the valid tokens (returns use the raw ones).
        process_group: whiten over the valid tokens of every rank.

    Returns:
        ``(advantages, returns)``, both ``[*B, R]`` in the dtype of ``values``, 0 at masked positions.

    Example:
        >>> import torch
        >>> r = torch.tensor([[0.0, 0.0, 9.0, 0.0, 1.0]])   # turn 1: tokens 0-1, tool reply at 2, turn 2: 3-4
        >>> v = torch.tensor([[0.2, 0.7, 9.0, 0.4, 0.9]])
        >>> m = torch.tensor([[1, 1, 0, 1, 1]])
        >>> adv, ret = turn_gae(r, v, m, gamma=1.0, lmbda=1.0, average_gae=False)
        >>> adv                                              # 1 - V_0 = 0.8 on turn 1, 1 - V_1 = 0.6 on turn 2
        tensor([[0.8000, 0.8000, 0.0000, 0.6000, 0.6000]])
        >>> ret
        tensor([[1., 1., 0., 1., 1.]])
    """
    if mask is None:
        raise ValueError("turn_gae needs mask: a row's turns are its runs of valid tokens")
    out_dtype = values.dtype if isinstance(values, Tensor) else None
    r, v, m, gamma, lmbda, _, _, _, _ = _gae_inputs(token_rewards, values, mask, gamma, lmbda, None)
    start = m & ~torch.nn.functional.pad(m[:, :-1], (1, 0), value=False)  # [N, R] each turn's first token
    turn = start.long().cumsum(-1) - 1  # the turn index of each valid token (-1 before the first)
    n_turns = (turn.max(-1).values + 1) if turn.numel() else turn.new_zeros(turn.shape[0])
    K_ = max(int(n_turns.max()) if n_turns.numel() else 0, 1)
    idx = turn.clamp(min=0)
    zero = r.new_zeros(())
    turn_r = r.new_zeros(r.shape[0], K_).scatter_add_(1, idx, torch.where(m, r, zero))
    turn_v = v.new_zeros(v.shape[0], K_).scatter_add_(1, idx, torch.where(start, v, zero))  # one start per turn
    turn_m = torch.arange(K_, device=m.device) < n_turns[:, None]
    turn_a, _ = masked_gae(turn_r, turn_v, turn_m, gamma, lmbda, average_gae=False)
    adv = torch.where(m, turn_a.gather(1, idx), zero)
    base = torch.where(m, turn_v.gather(1, idx), zero)
    return _gae_finish(adv, base, m, average_gae, token_rewards.shape, out_dtype, process_group)


def loss_normalizer(mask: Tensor, aggregation: str = "token-mean", *, process_group=None) -> Tensor:
    """The denominator :func:`aggregate_loss` divides by, optionally global across ranks.

    ``token-mean``: the number of valid tokens; ``seq-mean-token-mean`` and
    ``seq-mean-token-sum``: the number of sequences with at least one valid
    token; ``seq-mean-token-sum-norm``: ``num_sequences * R``; ``token-sum``: 1;
    ``token-sum-norm``: ``R``. At least 1.

    With a ``process_group`` the count is summed over the ranks (one
    all-reduce: compute it once per optimizer step and pass it as
    ``normalizer=`` to every loss) and divided by the world size. Each rank's
    loss is then ``world_size * local_numerator / global_count``, so that the
    gradient averaging of DistributedDataParallel gives exactly the gradient
    of one process holding every rank's rows; a rank with no valid token
    contributes 0 and never blocks the others. The constants of ``token-sum``
    and ``token-sum-norm`` are not summed over ranks (the global loss is the
    global token sum over the same constant), only divided by the world size.

    Gradient accumulation: computed on the whole optimizer step's mask and
    passed as ``normalizer=`` to each micro-batch's loss, the micro-batch
    gradients add up to the whole batch's gradient in every mode
    (``token-sum`` and ``token-sum-norm`` need nothing passed: their constant
    does not depend on the rows).

    Args:
        mask: ``[*B, R]`` bool or {0, 1}.
        aggregation: an aggregation mode of :func:`aggregate_loss`.
        process_group: a ``torch.distributed`` group, or ``None`` for this process alone.

    Returns:
        a 0-d float32 tensor on the mask's device.

    Example:
        >>> import torch
        >>> m = torch.tensor([[1, 1, 0], [0, 0, 0]])
        >>> loss_normalizer(m), loss_normalizer(m, "seq-mean-token-sum"), loss_normalizer(m, "seq-mean-token-sum-norm")
        (tensor(2.), tensor(1.), tensor(6.))
    """
    _validate.check_aggregation(aggregation)
    m = _validate.check_tensor("mask", mask)
    if m.dim() < 1:
        raise ValueError("mask must have a token axis: shape [*B, R], got a scalar")
    return K.normalizer(_validate.check_mask(mask, mask.shape, "mask"), aggregation, process_group)



def aggregate_loss(
    per_token: Tensor, mask: Tensor, aggregation: str = "token-mean", *, normalizer: Tensor | float | None = None
) -> Tensor:
    """Reduce a per-token loss ``[*B, R]`` to a scalar over the valid tokens.

    Modes (verl's ``agg_loss`` names where the definition is the same; where it
    is not, the difference is said):

    - ``"token-mean"``: ``sum(L * m) / sum(m)``, every valid token weighs the
      same (MiniMind, the default; verl's ``token-mean``).
    - ``"seq-mean-token-mean"``: mean over tokens within each sequence, then
      mean over the sequences that have at least one valid token (verl takes
      the mean over every row, empty ones included).
    - ``"seq-mean-token-sum"``: sum over tokens within each sequence, then mean
      over sequences with at least one valid token (verl: over every row).
    - ``"seq-mean-token-sum-norm"``: sum over all valid tokens divided by
      ``num_sequences * R``, i.e. the mean over sequences of the token sums
      divided by the padded length ``R`` (Dr. GRPO's constant normaliser,
      Liu et al. 2025, arXiv:2503.20783): long answers are not down-weighted.
      verl's mode of this name divides the token sum by ``R`` only; that is
      ``"token-sum-norm"`` here.
    - ``"token-sum"``: the plain sum over valid tokens (verl's ``token-sum``).
    - ``"token-sum-norm"``: the sum over valid tokens divided by ``R``, a
      constant that depends on no row (verl's ``seq-mean-token-sum-norm`` with
      its default scale, the response length); pass ``normalizer=`` for another
      constant (e.g. a maximum generation length).

    Sequences are the rows of the flattened leading dims. An empty mask gives 0.
    Each mode is ``numerator / normalizer`` with the denominator of
    :func:`loss_normalizer`; pass ``normalizer=`` (e.g. a count global over
    data-parallel ranks) to replace the local one.

    Args:
        per_token: ``[*B, R]`` float per-token loss.
        mask: ``[*B, R]`` bool or {0, 1}.
        aggregation: one of the six modes above.
        normalizer: optional positive denominator (0-d tensor or float).

    Example:
        >>> import torch
        >>> L = torch.tensor([[1.0, 3.0], [6.0, 0.0]])
        >>> m = torch.tensor([[1, 1], [1, 0]])
        >>> aggregate_loss(L, m)                           # (1 + 3 + 6) / 3
        tensor(3.3333)
        >>> aggregate_loss(L, m, "seq-mean-token-mean")    # (2 + 6) / 2
        tensor(4.)
        >>> aggregate_loss(L, m, "seq-mean-token-sum")     # (4 + 6) / 2
        tensor(5.)
        >>> aggregate_loss(L, m, "seq-mean-token-sum-norm")  # 10 / (2 * 2)
        tensor(2.5000)
        >>> aggregate_loss(L, m, "token-sum"), aggregate_loss(L, m, "token-sum-norm")  # 10 and 10 / 2
        (tensor(10.), tensor(5.))
        >>> aggregate_loss(L, m, normalizer=10.0)          # (1 + 3 + 6) / 10
        tensor(1.)
    """
    _validate.check_float("per_token", per_token)
    _validate.check_aggregation(aggregation)
    if per_token.dim() < 1:
        raise ValueError("per_token must have a token axis: shape [*B, R], got a scalar")
    m = _validate.check_mask(mask, per_token.shape, "per_token")
    return K.aggregate(per_token, m, aggregation, _validate.check_normalizer(normalizer, per_token))



# --------------------------------------------------------------------------- #
# Clipped policy loss  (MiniMind 3)
# --------------------------------------------------------------------------- #


def ppo_policy_loss(
    log_prob: Tensor,
    sample_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_epsilon: float | tuple[float, float],
    *,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    normalizer: Tensor | float | None = None,
    return_stats: bool = False,
    weights: Tensor | None = None,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate objective, as a loss to minimise (*MiniMind*).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms"
    (arXiv:1707.06347)::

        ratio = exp(log_prob - sample_log_prob)
        L_t   = max(-A_t * ratio, -A_t * clamp(ratio, 1 - eps_low, 1 + eps_high))

    aggregated over valid tokens (token mean by default, :func:`aggregate_loss`).
    No KL term inside: add :func:`reference_kl_penalty` yourself (MiniMind adds
    ``kl_reward_coeff * kl_ref`` to this loss).

    Options beyond MiniMind:

    - ``clip_epsilon=(eps_low, eps_high)``: an upper clip different from the lower one
      ("clip-higher", DAPO, Yu et al. 2025, arXiv:2503.14476).
    - ``dual_clip``: a constant ``c > 1``; where ``A < 0`` the loss is capped at
      ``-c * A`` (Ye et al. 2020, arXiv:1912.09729), so a huge ratio on a bad
      action cannot blow up the loss.
    - ``weights``: detached per-token weights ``w_t`` multiplying ``L_t`` before
      the aggregation (``agg(w_t L_t)``), e.g. the rollout-correction weights of
      :func:`rollout_correction_weights`. A valid token whose weight is exactly 0
      is **rejected**: it leaves the mask, so it counts neither in the
      denominator (the token count of ``token-mean``, the per-row token count of
      ``seq-mean-token-mean``) nor in the sequences of the ``seq-mean-*``
      modes once its row has no kept token, nor in the statistics. With 3 of 5
      tokens rejected, ``token-mean`` divides by 2, not 5 (a rejected token would
      otherwise shrink the loss by 5/2 for taking no part). The constant
      normalisers of ``token-sum``, ``token-sum-norm`` and
      ``seq-mean-token-sum-norm`` do not depend on which tokens take part and do
      not change. A given ``normalizer=`` is used as it is: compute it on the kept
      tokens, ``loss_normalizer(mask & (weights != 0), ...)``. The masking
      rollout-correction modes give weight 0 to exactly the tokens they reject;
      truncated IS (``token-tis``, ``seq-tis``) never gives 0.

    Args:
        log_prob: ``[*B, R]`` log-probs under the policy being optimised.
        sample_log_prob: ``[*B, R]`` log-probs under the policy that sampled.
        advantages: ``[*B, R]`` (typically whitened) advantages.
        mask: ``[*B, R]`` bool or {0, 1}.
        clip_epsilon: ``eps`` > 0 for both sides (MiniMind: 0.2), or a pair
            ``(eps_low, eps_high)`` (TorchRL's form).
        dual_clip: optional ``c > 1``.
        aggregation: see :func:`aggregate_loss`.
        normalizer: replaces the local denominator (see :func:`loss_normalizer`).
        return_stats: also return a dict of detached, masked diagnostics:
            ``clip_fraction`` (ratio outside ``[1-eps_low, 1+eps_high]``, MiniMind's
            ``clipfrac``), ``clip_fraction_low``, ``clip_fraction_high``,
            ``kl_approx`` (:func:`approx_kl`), ``kl_approx_token_max`` (its largest
            per-token value ``max_t 0.5 (new - old)^2``: a spike on one token that the
            mean hides), ``mean_ratio``, ``max_ratio``,
            ``ESS`` (normalised effective sample size of the ratios,
            ``(sum w)^2 / (n sum w^2)``, 1 when all ratios are equal) and
            ``dual_clip_fraction``. The names are those of TorchRL's ``ClipPPOLoss``
            outputs.
        weights: optional ``[*B, R]`` float per-token weights (detached; never
            read at masked positions; 0 rejects the token, see above). ``None``
            (default): every weight 1.

    Returns:
        scalar loss (float32, or float64 for float64 inputs), or ``(loss, stats)``.

    Example:
        >>> import torch
        >>> old = torch.log(torch.tensor([[0.2, 0.2, 0.2]]))
        >>> new = torch.log(torch.tensor([[0.3, 0.2, 0.1]]))   # ratios 1.5, 1.0, 0.5
        >>> adv = torch.tensor([[1.0, 1.0, -1.0]])
        >>> m = torch.ones(1, 3, dtype=torch.bool)
        >>> # max(-1.5, -1.2) = -1.2;  max(-1, -1) = -1;  max(0.5, 0.8) = 0.8;  mean = -1.4 / 3
        >>> ppo_policy_loss(new, old, adv, m, 0.2)
        tensor(-0.4667)
        >>> loss, stats = ppo_policy_loss(new, old, adv, m, 0.2, return_stats=True)
        >>> stats["clip_fraction"], stats["clip_fraction_high"], stats["clip_fraction_low"]
        (tensor(0.6667), tensor(0.3333), tensor(0.3333))
    """
    m = _validate.check_token_tensors(mask, log_prob=log_prob, sample_log_prob=sample_log_prob, advantages=advantages)
    eps_low, eps_high = _validate.check_clip_epsilon(clip_epsilon)
    if dual_clip is not None:
        dual_clip = _validate.check_positive("dual_clip", dual_clip, above=1.0, what=" (the dual-clip constant c must exceed 1)")
    _validate.check_aggregation(aggregation)
    if weights is not None:
        _validate.check_float("weights", weights)
        _validate.check_same_shape("log_prob", log_prob, weights=weights)
        _validate.check_same_device(log_prob=log_prob, weights=weights)
    _validate.check_log_probs(dict(log_prob=log_prob, sample_log_prob=sample_log_prob), "ppo_policy_loss", m)
    return L.policy_loss(
        log_prob, sample_log_prob, advantages, m, eps_low, eps_high, dual_clip=dual_clip, aggregation=aggregation,
        norm=_validate.check_normalizer(normalizer, log_prob), weights=weights, stats=return_stats,
    )


def approx_kl(log_prob: Tensor, sample_log_prob: Tensor, mask: Tensor) -> Tensor:
    """MiniMind's early-stop signal: masked mean of ``0.5 * (new - old)^2`` (the k2 estimator).

    Returned detached. Shapes ``[*B, R]``.

    Example:
        >>> import torch
        >>> approx_kl(torch.tensor([0.0, -2.0]), torch.tensor([-1.0, -2.0]), torch.tensor([True, True]))
        tensor(0.2500)
    """
    m = _validate.check_token_tensors(mask, log_prob=log_prob, sample_log_prob=sample_log_prob)
    _validate.check_log_probs(dict(log_prob=log_prob, sample_log_prob=sample_log_prob), "approx_kl", m)
    cd = _validate.compute_dtype(log_prob, sample_log_prob)
    d = torch.where(m, log_prob.detach().to(cd) - sample_log_prob.detach().to(cd), 0.0)
    return K.masked_mean(0.5 * d * d, m)



# --------------------------------------------------------------------------- #
# Rollout correction (training / inference mismatch)
# --------------------------------------------------------------------------- #

ROLLOUT_CORRECTION_MODES = ("token-tis", "token-mis", "seq-tis", "seq-mis", "icepop", "geo-mask")
# the modes that reject (weight 0) instead of truncating: ppo_policy_loss drops their rejected tokens from its mask
ROLLOUT_REJECTION_MODES = ("token-mis", "seq-mis", "icepop", "geo-mask")
_TWO_SIDED = ("icepop", "geo-mask")  # the lower bound defaults to 1 / threshold_high


def rollout_correction_weights(
    sample_log_prob: Tensor,
    rollout_log_prob: Tensor,
    mask: Tensor,
    mode: str = "token-tis",
    *,
    threshold_high: float = 2.0,
    threshold_low: float | None = None,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """Per-token importance weights that correct for rollouts sampled by another engine.

    When the rollouts come from an inference engine (vLLM, ...) or a stale
    policy, the sampling log-probs ``rollout_log_prob`` differ from the trainer's
    old-policy log-probs ``sample_log_prob``. With the per-token ratio
    ``w_t = pi_old / pi_rollout = exp(sample_log_prob_t - rollout_log_prob_t)`` over the
    valid tokens, and ``C = threshold_high``, ``c = threshold_low``::

        token-tis:  W_t = min(w_t, C)                                       truncated IS
        token-mis:  W_t = w_t if w_t <= C (and w_t >= c when c is given), else 0
        icepop:     W_t = w_t if c <= w_t <= C, else 0                      c defaults to 1 / C
        seq-tis:    W_t = min(S, C),  S = prod_t w_t = exp(sum_t log w_t)   one weight per sequence
        seq-mis:    W_t = S if S <= C (and S >= c when c is given), else 0  the whole sequence
        geo-mask:   W_t = 1 if c <= G <= C, else 0,  G = exp(mean_t log w_t),  c defaults to 1 / C

    Token-level truncated IS (TIS) follows Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training"; masked IS (MIS) and the
    sequence-level variants Liu et al. 2025, "When Speed Kills Stability"; IcePop
    is the two-sided token mask of the Ling team's Ring-1T report (2025). IcePop and
    token-mis compute the same formula: they differ only in the default lower
    bound (token-mis is one-sided unless ``threshold_low`` is given, IcePop masks
    both tails, ``c = 1 / C`` by default). ``geo-mask`` is a rejection filter:
    a kept sequence is not reweighted (weight 1), and the geometric mean does not
    grow with the length as the product ``S`` does. The products and means are
    taken in log space (no overflow) over the valid tokens of each row; the
    bounds are inclusive. Pass the weights to :func:`ppo_policy_loss`
    (``weights=``): there a weight of 0, a rejection, takes the token out of the
    loss's mask, denominators included (see its ``weights``). Everything is detached and computed in float32 (or float64);
    garbage at masked positions is never read and the weights there are 0.

    Args:
        sample_log_prob: ``[*B, R]`` log-probs of the sampled tokens under the trainer's old policy.
        rollout_log_prob: ``[*B, R]`` log-probs of the same tokens under the engine that sampled them.
        mask: ``[*B, R]`` bool or {0, 1}.
        mode: one of ``"token-tis"`` (default), ``"token-mis"``, ``"seq-tis"``,
            ``"seq-mis"``, ``"icepop"``, ``"geo-mask"``.
        threshold_high: ``C`` >= 1 (finite), the upper bound. Default 2.0.
        threshold_low: ``c`` in ``(0, 1]``, the lower bound of the masking modes
            (refused by the truncation modes); ``None``: no lower bound for
            token-mis / seq-mis, ``1 / C`` for icepop / geo-mask.
        return_stats: also return a dict of detached, masked diagnostics:
            ``clip_fraction`` (valid tokens whose weight was truncated),
            ``mask_fraction`` (valid tokens whose weight was set to 0),
            ``seq_clip_fraction`` / ``seq_mask_fraction`` (rows with a valid token
            among those with a truncated / zeroed one: in the sequence modes the
            whole sequence), ``ESS`` (``(sum W)^2 / (n sum W^2)`` over the ``n``
            valid tokens, in (0, 1]; 0 when every weight is 0), ``mean_weight``
            and ``max_weight`` (over the valid tokens; 0 for an empty mask).

    Returns:
        ``[*B, R]`` weights (float32, or float64 for float64 inputs), or ``(weights, stats)``.

    Example:
        >>> import torch
        >>> old = torch.log(torch.tensor([[0.05, 0.1, 0.3]]))   # ratios 0.5, 1, 3 against the rollout's 0.1
        >>> roll, m = torch.full((1, 3), 0.1).log(), torch.ones(1, 3, dtype=torch.bool)
        >>> rollout_correction_weights(old, roll, m, "token-tis")
        tensor([[0.5000, 1.0000, 2.0000]])
        >>> rollout_correction_weights(old, roll, m, "icepop", threshold_low=0.6)
        tensor([[0., 1., 0.]])
        >>> rollout_correction_weights(old, roll, m, "seq-tis")   # product 1.5 <= 2
        tensor([[1.5000, 1.5000, 1.5000]])
        >>> w, stats = rollout_correction_weights(old, roll, m, "token-mis", return_stats=True)
        >>> w, stats["mask_fraction"], stats["seq_mask_fraction"]
        (tensor([[0.5000, 1.0000, 0.0000]]), tensor(0.3333), tensor(1.))
    """
    m = _validate.check_token_tensors(mask, sample_log_prob=sample_log_prob, rollout_log_prob=rollout_log_prob)
    high, low = _rollout_thresholds(mode, threshold_high, threshold_low)
    _validate.check_log_probs(dict(sample_log_prob=sample_log_prob, rollout_log_prob=rollout_log_prob),
                              "rollout_correction_weights", m)
    cd = _validate.compute_dtype(sample_log_prob, rollout_log_prob)
    zero = torch.zeros((), dtype=cd, device=sample_log_prob.device)
    log_w = torch.where(m, sample_log_prob.detach().to(cd) - rollout_log_prob.detach().to(cd), zero)
    log_high, log_low = math.log(high), (-math.inf if low is None else math.log(low))
    if mode in ("seq-tis", "seq-mis", "geo-mask"):
        total = log_w.sum(-1, keepdim=True)  # log S: 0 at masked positions, so only valid tokens count
        score = total / m.sum(-1, keepdim=True).clamp(min=1).to(cd) if mode == "geo-mask" else total
        score = score.expand_as(log_w)
        log_value = torch.zeros_like(log_w) if mode == "geo-mask" else score
    else:
        score = log_value = log_w
    if mode.endswith("tis"):
        clipped, rejected = m & (score > log_high), torch.zeros_like(m)
        log_value = torch.clamp(log_value, max=log_high)
    else:
        clipped, rejected = torch.zeros_like(m), m & ((score > log_high) | (score < log_low))
    weights = torch.where(m & ~rejected, torch.exp(log_value), zero)
    if not return_stats:
        return weights
    return weights, _rollout_stats(weights, m, clipped, rejected)


def _rollout_thresholds(mode: str, threshold_high: float, threshold_low: float | None) -> tuple[float, float | None]:
    """The validated ``(C, c)`` of :func:`rollout_correction_weights` (``c`` is ``None``: no lower bound)."""
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"mode={mode!r} is not one of {ROLLOUT_CORRECTION_MODES}")
    high = float(_validate.check_positive("threshold_high", threshold_high))
    if high < 1.0:
        raise ValueError(
            f"threshold_high={high} must be >= 1: a bound below 1 also cuts tokens whose ratio is 1 (no mismatch)"
        )
    if threshold_low is None:
        return high, (1.0 / high if mode in _TWO_SIDED else None)
    if mode.endswith("tis"):
        raise ValueError(
            f"threshold_low={threshold_low!r} is not used by mode={mode!r} (truncation caps the weight from above "
            "only); leave it None, or choose a masking mode (token-mis, seq-mis, icepop, geo-mask)"
        )
    low = float(_validate.check_positive("threshold_low", threshold_low))
    if low > 1.0:
        raise ValueError(f"threshold_low={low} must be <= 1: a bound above 1 also drops tokens whose ratio is 1")
    return high, low


def _rollout_stats(w: Tensor, m: Tensor, clipped: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    """The diagnostics of :func:`rollout_correction_weights` (``w`` is 0 at masked positions)."""
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    rows = m.any(-1)
    sum_w, sum_w2 = w.sum(), (w * w).sum()
    n = m.sum().to(w.dtype)
    return {
        "clip_fraction": K.masked_mean(clipped.to(w.dtype), m),
        "mask_fraction": K.masked_mean(rejected.to(w.dtype), m),
        "seq_clip_fraction": K.masked_mean(clipped.any(-1).to(w.dtype), rows),
        "seq_mask_fraction": K.masked_mean(rejected.any(-1).to(w.dtype), rows),
        "ESS": torch.where(sum_w2 > 0, sum_w**2 / (n * sum_w2).clamp(min=torch.finfo(w.dtype).tiny), zero),
        "mean_weight": K.masked_mean(w, m),
        # weights are >= 0, so a 0 appended makes the max of an empty mask 0
        "max_weight": torch.cat([w.flatten(), zero.reshape(1)]).max(),
    }


# --------------------------------------------------------------------------- #
# Reference KL  (MiniMind 4)
# --------------------------------------------------------------------------- #


def kl_estimate(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    estimator: str = "k3",
    *,
    clamp: float | None = None,
    sample_log_prob: Tensor | None = None,
    score_grad: bool = False,
) -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``.

    Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html).
    With ``d = ref_log_prob - log_prob = log(pi_ref / pi)``:

    - ``"k1"``: ``-d``, unbiased, high variance, can be negative (the in-reward choice);
    - ``"k2"``: ``d^2 / 2``, biased, low variance, gradient of a proper divergence;
    - ``"k3"``: ``exp(d) - d - 1``, unbiased, low variance, always >= 0 (MiniMind);
    - ``"k3+"``: the value of k3 with the gradient of k2 (straight-through:
      ``k2 + stop_grad(k3 - k2)``), since k3's own gradient is a biased
      estimate of the KL gradient when used as a loss.

    ``clamp`` limits the estimate to ``[-clamp, clamp]`` (verl's low-var-KL
    uses 10): for k1, k2 and k3 the clamped value is the estimate, so its
    gradient is 0 where the clamp is active; for ``"k3+"`` only the value is
    clamped, ``k2 + stop_grad(clamp(k3) - k2)``, and the gradient stays k2's
    whatever the value (a clamped straight-through estimator that lost its
    gradient past the clamp would stop pulling the policy back exactly where it
    drifted furthest). Computed in float32 or better; returned in that dtype.

    ``sample_log_prob``: the tokens were sampled from an older policy ``pi_old`` (the
    PPO epochs after the first minibatch step), so the estimate is importance
    weighted, ``exp(log_prob - sample_log_prob) * estimate`` (DeepSeek-V3.2's correction),
    the gradient flowing through the weight too. Its expectation under
    ``pi_old`` is the base estimator's under ``pi``; for k3 the gradient of that
    expectation is exactly ``grad KL(pi || pi_ref)`` (the weight's own gradient
    turns k3's into ``E_pi[log(pi / pi_ref) grad log pi]``). On-policy
    (``sample_log_prob == log_prob``) the value is the base estimator's.

    ``score_grad=True`` keeps the value and replaces the gradient by the
    score-function form of ``grad KL(pi || pi_ref)``,
    ``w * log(pi / pi_ref) * grad log pi`` (``w`` the detached importance weight,
    1 without ``sample_log_prob``): unbiased whatever the estimator, where the
    gradients of k1 (0 in expectation) and k3 (the forward KL's direction) are not.
    This is the unbiased-gradient option of OpenRLHF.

    Args:
        log_prob: ``[*B, R]`` log-probs of the sampled tokens under ``pi``.
        ref_log_prob: ``[*B, R]`` log-probs of the same tokens under ``pi_ref``.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``, ``"k3+"``.
        clamp: optional positive bound (on the estimate before the weight).
        sample_log_prob: optional ``[*B, R]`` log-probs of the tokens under the
            sampling policy: importance weight the estimate.
        score_grad: the value of the estimate with the score-function gradient.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([0.5]))
        >>> ref = torch.log(torch.tensor([0.25]))   # d = log(0.5) = -0.6931
        >>> [round(float(kl_estimate(lp, ref, e)), 4) for e in ("k1", "k2", "k3")]
        [0.6931, 0.2402, 0.1931]
    """
    tensors = dict(log_prob=log_prob, ref_log_prob=ref_log_prob) | ({} if sample_log_prob is None else dict(sample_log_prob=sample_log_prob))
    _validate.check_token_tensors(None, **tensors)
    clamp = _validate.check_kl_options(estimator, clamp)
    _validate.check_log_probs(tensors)
    return L.kl_estimate(log_prob, ref_log_prob, estimator, clamp, sample_log_prob, score_grad)



def reference_kl_penalty(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    mask: Tensor,
    *,
    estimator: str = "k3",
    clamp: float | None = None,
    sample_log_prob: Tensor | None = None,
    score_grad: bool = False,
    aggregation: str = "token-mean",
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """Masked mean of the per-token KL to the reference policy (*MiniMind*).

    Default: MiniMind's k3, ``mean over valid tokens of exp(d) - d - 1`` with
    ``d = ref_log_prob - log_prob``. Other estimators and aggregation modes
    via :func:`kl_estimate` and :func:`aggregate_loss`. Garbage at masked
    positions is never read.

    Args:
        log_prob: ``[*B, R]`` log-probs under the current policy (carries the gradient).
        ref_log_prob: ``[*B, R]`` log-probs under the frozen reference.
        mask: ``[*B, R]`` bool or {0, 1}.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` (default) or ``"k3+"``.
        clamp: optional bound on the per-token estimate.
        sample_log_prob: optional ``[*B, R]`` sampling log-probs: importance weight the
            estimate (DeepSeek-V3.2's correction, see :func:`kl_estimate`).
        score_grad: the score-function (unbiased) gradient, see :func:`kl_estimate`.
        aggregation: see :func:`aggregate_loss`.
        normalizer: replaces the local denominator (see :func:`loss_normalizer`).

    Example:
        >>> import torch
        >>> pol = torch.log(torch.tensor([[0.5, 0.5]]))
        >>> ref = torch.log(torch.tensor([[0.25, 0.5]]))
        >>> reference_kl_penalty(pol, ref, torch.tensor([[1, 1]]))  # (0.1931 + 0) / 2
        tensor(0.0966)
    """
    old = {} if sample_log_prob is None else dict(sample_log_prob=sample_log_prob)
    m = _validate.check_token_tensors(mask, log_prob=log_prob, ref_log_prob=ref_log_prob, **old)
    _validate.check_aggregation(aggregation)
    clamp = _validate.check_kl_options(estimator, clamp)
    lp, ref, old = L.masked_log_probs(m, log_prob, ref_log_prob, sample_log_prob)
    _validate.check_log_probs(dict(log_prob=lp, ref_log_prob=ref, sample_log_prob=old))
    return L.reference_kl(lp, ref, m, estimator=estimator, clamp=clamp, sample_log_prob=old, score_grad=score_grad,
                          aggregation=aggregation, norm=_validate.check_normalizer(normalizer, log_prob))


def last_valid_index(mask: Tensor) -> Tensor:
    """Position of the last valid token of each row: ``[*B]`` int64, ``-1`` for a row with none.

    Where a sequence-level score goes (:func:`kl_penalized_rewards`), and where
    the reward of a response is read back.

    Args:
        mask: ``[*B, R]`` bool or {0, 1}, True = token takes part.

    Example:
        >>> import torch
        >>> last_valid_index(torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]]))
        tensor([ 1,  3, -1])
    """
    mask = _validate.check_tensor("mask", mask)
    if mask.dim() < 1:
        raise ValueError(f"mask must be [*B, R], got a scalar of shape {tuple(mask.shape)}")
    m = _validate.check_mask(mask, mask.shape, "mask")
    return K.last_valid(m)


def masked_kl_estimate(
    log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor, estimator: str = "k1", *, clamp: float | None = None
) -> Tensor:
    """:func:`kl_estimate` per token, exactly 0 at masked positions (never read there).

    Args:
        log_prob: ``[*B, R]`` log-probs of the sampled tokens under the sampling policy.
        ref_log_prob: ``[*B, R]`` log-probs of the same tokens under the reference.
        mask: ``[*B, R]`` bool or {0, 1}.
        estimator: ``"k1"`` (default: the unbiased in-reward choice), ``"k2"``, ``"k3"``, ``"k3+"``.
        clamp: optional bound on the per-token estimate.

    Returns:
        ``[*B, R]`` in the dtype of ``log_prob`` (float32 or better).

    Example:
        >>> import torch
        >>> lp, ref = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, float("nan")]])
        >>> masked_kl_estimate(lp, ref, torch.tensor([[True, False]]))
        tensor([[0.5000, 0.0000]])
    """
    m = _validate.check_token_tensors(mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    return _checked_masked_kl(log_prob, ref_log_prob, m, estimator, clamp)


def _checked_masked_kl(log_prob: Tensor, ref_log_prob: Tensor, m: Tensor, estimator: str, clamp) -> Tensor:
    """:func:`masked_kl_estimate` of checked token tensors and bool mask: checks the estimator, the clamp and
    that the valid values are log-probs, then computes."""
    clamp = _validate.check_kl_options(estimator, clamp)
    lp, ref = L.masked_log_probs(m, log_prob, ref_log_prob)
    _validate.check_log_probs(dict(log_prob=lp, ref_log_prob=ref))
    return L.masked_kl(lp, ref, m, estimator, clamp)



def kl_penalized_rewards(
    rewards: Tensor,
    sample_log_prob: Tensor,
    ref_log_prob: Tensor,
    mask: Tensor,
    kl_reward_coeff: Tensor | float,
    *,
    estimator: str = "k1",
    clamp: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token rewards with the reference-KL penalty: the reward PPO's critic learns.

    Ziegler et al. 2019 (arXiv:1909.08593), Stiennon et al. 2020; the shape of
    torchtune's ``rlhf.get_rewards_ppo``. For every valid token ``t``::

        kl_t      = KL_est(logps_t, ref_logps_t)                 # k1 = sample_log_prob - ref_log_prob by default
        reward_t  = r_t - kl_reward_coeff * kl_t                         # per-token rewards [*B, R], or
        reward_t  = score * [t == last valid] - kl_reward_coeff * kl_t   # one score per sequence [*B]

    A sequence-level score lands on the last valid token only, never on every
    token; a score on a row without a valid token is refused (it would be
    dropped; this check reads the mask, so it is skipped under
    :func:`value_checks` ``(False)`` and inside ``torch.compile``). Both
    outputs are exactly 0 at masked positions, whose inputs are never read.

    Args:
        rewards: ``[*B, R]`` per-token rewards, or ``[*B]`` one score per sequence.
        sample_log_prob: ``[*B, R]`` log-probs of the sampled tokens under the sampling policy.
        ref_log_prob: ``[*B, R]`` log-probs of the same tokens under the frozen reference.
        mask: ``[*B, R]`` bool or {0, 1}, True = response token.
        kl_reward_coeff: the penalty weight ``beta`` (float or a one-element tensor).
        estimator, clamp: see :func:`kl_estimate`.

    Returns:
        ``(rewards, kl)``: ``[*B, R]`` penalised rewards (dtype of ``rewards``) and
        the per-token KL (dtype of ``sample_log_prob``).

    Example:
        >>> import torch
        >>> lp, ref = torch.full((2, 3), -1.0), torch.tensor([[-1.5, -1.0, -1.0], [-1.0, -1.0, -1.0]])
        >>> m = torch.tensor([[True, True, True], [True, True, False]])
        >>> r, kl = kl_penalized_rewards(torch.tensor([1.0, 3.0]), lp, ref, m, 0.1)
        >>> r                                # row 0: -0.1 * 0.5 on token 0, score 1 on token 2
        tensor([[-0.0500,  0.0000,  1.0000],
                [ 0.0000,  3.0000,  0.0000]])
    """
    _validate.check_float("rewards", rewards)
    m = _validate.check_token_tensors(mask, sample_log_prob=sample_log_prob, ref_log_prob=ref_log_prob)
    kl = _checked_masked_kl(sample_log_prob, ref_log_prob, m, estimator, clamp)
    _validate.check_same_device(rewards=rewards, sample_log_prob=sample_log_prob)
    shape = sample_log_prob.shape
    if rewards.shape == shape[:-1]:
        _validate.check_scored_rows(m)
    elif rewards.shape != shape:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)} but sample_log_prob define [*B, R] = {tuple(shape)}: expected a "
            f"per-token reward {tuple(shape)} or one score per sequence {tuple(shape[:-1])}; broadcasting it "
            "would mix tokens of different sequences"
        )
    return L.penalized_rewards(rewards, kl, m, kl_reward_coeff), kl


def adaptive_kl_coeff(
    coeff: Tensor, kl: Tensor | float, target: float, horizon: float, n_steps: int = 1, *, clip: float = 0.2
) -> Tensor:
    """One step of the adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, section 2.2)::

        e     = clip(kl / target - 1, -clip, clip)      # proportional error
        beta' = beta * (1 + e * n_steps / horizon)

    A non-finite ``kl`` (e.g. NaN from an empty batch) leaves ``beta`` unchanged.
    ``clip * n_steps >= horizon`` is refused (``beta`` could reach 0 or flip sign).
    No host synchronisation: ``kl`` may be a CUDA tensor.

    Args:
        coeff: ``[]`` the current ``beta``.
        kl: the observed KL, in the units of ``target`` (per sequence or per token).
        target: the KL to steer towards; horizon: adaptation horizon in samples;
        n_steps: samples behind ``kl``; clip: bound on the proportional error.

    Returns:
        ``[]`` the new ``beta`` (a new tensor; ``coeff`` is not modified).

    Example:
        >>> import torch
        >>> adaptive_kl_coeff(torch.tensor(0.2), 12.0, target=6.0, horizon=100, n_steps=10)
        tensor(0.2040)
    """
    coeff = _validate.check_float("coeff", coeff)
    if n_steps * clip >= horizon:
        raise ValueError(
            f"n_steps={n_steps} with horizon={horizon} and clip={clip}: a step of "
            f"clip * n_steps / horizon >= 1 could make the KL coefficient zero or negative; use a horizon "
            f"larger than clip * n_steps (samples per update)"
        )
    kl = torch.as_tensor(kl, dtype=coeff.dtype, device=coeff.device).detach().reshape(())
    error = torch.clamp(kl / target - 1.0, -clip, clip)
    error = torch.where(torch.isfinite(error), error, torch.zeros_like(error))
    return coeff * (1.0 + error * (n_steps / horizon))


# --------------------------------------------------------------------------- #
# Clipped value loss  (MiniMind 5)
# --------------------------------------------------------------------------- #


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_value: float,
    *,
    aggregation: str = "token-mean",
    normalizer: Tensor | float | None = None,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss (*MiniMind*)::

        V_clip = clamp(V, V_old - c, V_old + c)
        L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

    aggregated over valid tokens (token mean by default). The critic may move
    its estimate at most ``c`` from the rollout's before the gradient of the
    pessimistic branch vanishes.

    Args:
        values: ``[*B, R]`` current critic values ``V`` (carry the gradient).
        old_values: ``[*B, R]`` values at rollout time ``V_old``.
        returns: ``[*B, R]`` value targets ``R`` (raw advantages + old values).
        mask: ``[*B, R]`` bool or {0, 1}.
        clip_value: ``c`` > 0 (MiniMind: 0.2).
        aggregation: see :func:`aggregate_loss`.
        normalizer: replaces the local denominator (see :func:`loss_normalizer`).
        return_stats: also return ``{"value_clip_fraction": ...}``, the fraction
            of valid tokens whose clipped branch is the larger (its gradient is 0).

    Example:
        >>> import torch
        >>> V, V_old, R = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
        >>> # token 0: max((1-0)^2, (0.2-0)^2) = 1;  token 1: max((0-1)^2, (0-1)^2) = 1;  0.5 * mean = 0.5
        >>> clipped_value_loss(V, V_old, R, torch.tensor([[1, 1]]), 0.2)
        tensor(0.5000)
    """
    m = _validate.check_token_tensors(mask, values=values, old_values=old_values, returns=returns)
    c = _validate.check_positive("clip_value", clip_value)
    _validate.check_aggregation(aggregation)
    return L.value_loss(values, old_values, returns, m, c, aggregation=aggregation,
                        norm=_validate.check_normalizer(normalizer, values), stats=return_stats)

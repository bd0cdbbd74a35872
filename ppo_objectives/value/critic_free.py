"""Critic-free advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) on the masked response layout.

Shape letters (used in every docstring below):

- ``B``: the responses (rows) of the batch; ``*B`` when there are several batch dims.
- ``R``: the response length (one row per sampled response, padded; see
  ``ppo_objectives/llm/layouts.py``).

Each response has a per-sequence ``score`` ``[*B]`` and a ``group`` id ``[*B]``
(int64): the responses sampled for the same prompt share an id (any integers,
not necessarily contiguous). The group statistics are taken over every row of
the batch with that id. The per-token advantages ``[*B, R]`` hold the row's
advantage at its valid tokens and exactly 0 at masked ones; masked entries of
the inputs are never read (garbage and NaN are fine), and a row without valid
tokens is all 0. Arithmetic is float32 (float64 inputs stay float64); the
output has the dtype of the scores (rewards for REINFORCE++).

**Non-finite inputs.** A NaN or inf score of a row with valid tokens, or
reward at a valid token, would make advantages NaN/inf (a whole group's, or
with the whitening the whole batch's): it is a ``ValueError`` naming the input
and the first such row or position, as in
:class:`~ppo_objectives.value.gae.MaskedGAE`. The check reads the result (one
host read per call) and is skipped under
:func:`~ppo_objectives.functional.value_checks` ``(False)`` and inside
``torch.compile``.

The group sums are vectorised (``index_add_`` over the group index of
``torch.unique``, no loop over rows or groups). ``torch.unique`` is the one
host synchronisation (its output size depends on the data) besides the
finiteness check; nothing else reads back to the host.

The estimators have no critic: the TorchRL classes write ``value_target``
equal to the advantage (so keys that TorchRL's losses expect exist) and a
``critic_free`` entry (bool, the TensorDict's batch shape) that marks it so, and
the loss runs without a critic, ``TokenPPOLoss(actor, None)``; a loss with a
critic refuses such a batch rather than regress its critic onto advantages.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import dispatch
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.objectives.value import ValueEstimatorBase

from ppo_objectives import _td as TD
from ppo_objectives import _validate
from ppo_objectives import functional as F

__all__ = [
    "GROUP_KINDS",
    "GroupAdvantage",
    "ReinforcePlusPlus",
    "dr_grpo_advantages",
    "grpo_advantages",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
]

#: The ``kind`` values of :class:`GroupAdvantage`.
GROUP_KINDS = ("grpo", "dr_grpo", "rloo")


def _check_scores(scores: object, group: object, mask: object) -> tuple[Tensor, Tensor, Tensor]:
    """Validated ``(scores, group, bool mask)``: scores ``[*B]``, group ``[*B]`` integer, mask ``[*B, R]``."""
    scores = _validate.check_float("scores", scores)
    group = _validate.check_tensor("group", group)
    mask = _validate.check_tensor("mask", mask)
    if mask.dim() < 1 or mask.shape[:-1] != scores.shape:
        raise ValueError(
            f"scores has shape {tuple(scores.shape)} but mask has shape {tuple(mask.shape)}: expected "
            f"one score per row, scores of shape mask.shape[:-1] = {tuple(mask.shape[:-1])}"
        )
    if group.shape != scores.shape:
        raise ValueError(
            f"group has shape {tuple(group.shape)} but scores has shape {tuple(scores.shape)}: give one "
            f"group id per response (int64, the same id for the responses to the same prompt)"
        )
    if group.dtype.is_floating_point or group.dtype.is_complex or group.dtype == torch.bool:
        raise TypeError(f"group must be an integer tensor of group ids, got dtype {group.dtype}")
    _validate.check_same_device(scores=scores, group=group, mask=mask)
    return scores, group, _validate.check_mask(mask, mask.shape, "mask")


def _group_moments(s: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row ``(group size n, group mean, unbiased group variance)`` of flat float ``s`` ``[B]``.

    The variance is ``sum((s - mean)^2) / (n - 1)`` (``torch.std``'s), 0 for a group of one. A group
    whose scores are all equal gets its score as its mean and variance 0 exactly: the rounding of
    ``sum / n`` (``16 * 0.7 / 16 != 0.7`` in float32) would otherwise leave ``s - mean`` at a few ulps,
    which a division by the equally tiny std turns into advantages of order 0.1.
    """
    _, inverse = torch.unique(group.reshape(-1), return_inverse=True)  # the host synchronisation
    zeros = torch.zeros(s.shape[0], dtype=s.dtype, device=s.device)
    n = zeros.clone().index_add_(0, inverse, torch.ones_like(s))[inverse]
    mean = zeros.clone().index_add_(0, inverse, s)[inverse] / n
    high = zeros.scatter_reduce(0, inverse, s, "amax", include_self=False)[inverse]
    low = zeros.scatter_reduce(0, inverse, s, "amin", include_self=False)[inverse]
    equal = high == low
    mean = torch.where(equal, s, mean)
    sq = (s - mean) ** 2
    var = zeros.clone().index_add_(0, inverse, sq)[inverse] / (n - 1).clamp(min=1)
    return n, mean, var


#: What each input's check says: where a bad value sits and how to fix it.
_SCORE_FIX = ("the row {pos}, a response with valid tokens",
              "fix the reward function for that response, or drop the response from the batch")
_REWARD_FIX = ("the valid position {pos}",
               "fix the reward function (or the shaping, e.g. a KL penalty) there, or mask the token out "
               "(mask False: masked tokens may hold anything, they are never read)")


def _check_finite(method: str, adv: Tensor, inputs: list[tuple[str, Tensor, Tensor, tuple[str, str]]],
                  overflow: str) -> None:
    """The advantages ``adv`` are finite, else a ``ValueError`` naming the first of ``inputs`` (``(name, tensor,
    bool where it is read, (where, fix))``) that holds NaN/inf where it is read, and its first such position. One
    host read when all is well; skipped under ``value_checks(False)`` and ``torch.compile``."""
    if not _validate.checking_values() or not adv.numel() or bool(torch.isfinite(adv).all()):
        return
    found = _validate.first_non_finite([(name, x, read) for name, x, read, _ in inputs])
    if found is not None:
        name, pos, value = found
        where, fix = next(text for n, _, _, text in inputs if n == name)
        raise ValueError(f"{method}: {name} holds {value} at {where.format(pos=pos)}, so the advantages would be "
                         f"NaN/inf; {fix}")
    raise ValueError(f"{method}: the advantages are not finite although {overflow}; rescale them")


def _broadcast(per_row: Tensor, m: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``per_row`` ``[*B]`` at the valid tokens of ``m`` ``[*B, R]``, exactly 0 elsewhere."""
    zero = torch.zeros((), dtype=per_row.dtype, device=per_row.device)
    return torch.where(m, per_row.unsqueeze(-1), zero).to(out_dtype)


def _row_scores(scores: Tensor, m: Tensor) -> Tensor:
    """Flat compute-dtype scores ``[B]``, 0 for rows without valid tokens (their score is never read)."""
    s = scores.reshape(-1).to(_validate.compute_dtype(scores))
    return torch.where(m.any(-1).reshape(-1), s, torch.zeros((), dtype=s.dtype, device=s.device))


def grpo_advantages(
    scores: Tensor, group: Tensor, mask: Tensor, *, scale: str | None = "std", eps: float = 1e-6
) -> Tensor:
    """GRPO's group-normalised outcome advantage, on every valid token of the response.

    Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300)::

        A_i = (score_i - mean_g) / (std_g + eps)      scale="std"
        A_i =  score_i - mean_g                       scale=None (Dr. GRPO)

    over the group ``g`` of response ``i``. ``std_g`` is the **unbiased**
    standard deviation (Bessel's correction, ``torch.std``'s default), as in
    DeepSeekMath, TRL's ``GRPOTrainer`` and verl's ``compute_grpo_outcome_advantage``
    (which also adds ``eps = 1e-6``). A group of one response gets advantage 0
    (its score is its mean; verl instead gives it mean 0 and std 1, i.e. its raw
    score). A group whose scores are all equal gets 0.

    Every row takes part in the statistics of its group, including rows without
    valid tokens (their score counts as 0; give such rows their own group id to
    keep them out). A NaN or inf score of a row with valid tokens is a
    ``ValueError`` naming the row.

    Args:
        scores: ``[*B]`` float per-response score.
        group: ``[*B]`` integer group ids (the same id for the responses to one prompt).
        mask: ``[*B, R]`` bool or {0, 1}, True = token takes part.
        scale: ``"std"`` (GRPO) or ``None`` (no division, Dr. GRPO).
        eps: added to the standard deviation (verl: 1e-6).

    Returns:
        ``[*B, R]`` advantages of the scores' dtype, 0 at masked tokens.

    Example:
        >>> import torch
        >>> scores = torch.tensor([1.0, 0.0, 5.0, 2.0])
        >>> group = torch.tensor([7, 7, 3, 9])             # two responses to prompt 7, one each to 3 and 9
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
        >>> grpo_advantages(scores, group, mask)            # std of {1, 0} is 0.7071
        tensor([[ 0.7071,  0.7071,  0.0000],
                [-0.7071,  0.0000,  0.0000],
                [ 0.0000,  0.0000,  0.0000],
                [ 0.0000,  0.0000,  0.0000]])
    """
    if scale not in ("std", None):
        raise ValueError(f"scale={scale!r} is not one of 'std' (GRPO) or None (Dr. GRPO: no std division)")
    _validate.check_positive("eps", eps)
    scores, group, m = _check_scores(scores, group, mask)
    s = _row_scores(scores, m)
    _, mean, var = _group_moments(s, group)
    adv = s - mean
    if scale == "std":
        adv = adv / (var.sqrt() + eps)
    _check_finite("GRPO" if scale == "std" else "Dr. GRPO", adv, [("scores", scores, m.any(-1), _SCORE_FIX)],
                  "the scores of the rows with valid tokens are finite (an overflow of very large scores)")
    return _broadcast(adv.reshape(scores.shape), m, scores.dtype)


def dr_grpo_advantages(scores: Tensor, group: Tensor, mask: Tensor) -> Tensor:
    """Dr. GRPO's advantage: the group mean subtracted, no division by the group's std.

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783)::

        A_i = score_i - mean_g

    :func:`grpo_advantages` with ``scale=None``. Dr. GRPO also removes the
    length normalisation of the loss: pair it with a constant normaliser,
    ``TokenPPOLoss(..., aggregation="token-sum-norm")`` or
    ``"seq-mean-token-sum-norm"`` (:func:`ppo_objectives.functional.aggregate_loss`).

    Args:
        scores: ``[*B]`` float per-response score.
        group: ``[*B]`` integer group ids.
        mask: ``[*B, R]`` bool or {0, 1}, True = token takes part.

    Returns:
        ``[*B, R]`` advantages of the scores' dtype, 0 at masked tokens.

    Example:
        >>> import torch
        >>> dr_grpo_advantages(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0, 0, 0]), torch.ones(3, 2))
        tensor([[ 0.,  0.],
                [-1., -1.],
                [ 1.,  1.]])
    """
    return grpo_advantages(scores, group, mask, scale=None)


def rloo_advantages(scores: Tensor, group: Tensor, mask: Tensor) -> Tensor:
    """REINFORCE leave-one-out: the score minus the mean score of the *other* responses of its group.

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
    Ahmadian et al. 2024 (arXiv:2402.14740)::

        A_i = score_i - (sum_g - score_i) / (n_g - 1) = n_g / (n_g - 1) * (score_i - mean_g)

    A group of one response gets 0 (there is no other response to compare with).
    A NaN or inf score of a row with valid tokens is a ``ValueError`` naming the row.

    Args:
        scores: ``[*B]`` float per-response score.
        group: ``[*B]`` integer group ids.
        mask: ``[*B, R]`` bool or {0, 1}, True = token takes part.

    Returns:
        ``[*B, R]`` advantages of the scores' dtype, 0 at masked tokens.

    Example:
        >>> import torch
        >>> rloo_advantages(torch.tensor([3.0, 0.0, 0.0, 4.0]), torch.tensor([1, 1, 1, 2]), torch.ones(4, 1))
        tensor([[ 3.0000],
                [-1.5000],
                [-1.5000],
                [ 0.0000]])
    """
    scores, group, m = _check_scores(scores, group, mask)
    s = _row_scores(scores, m)
    n, mean, _ = _group_moments(s, group)
    adv = torch.where(n > 1, n / (n - 1).clamp(min=1) * (s - mean), torch.zeros((), dtype=s.dtype, device=s.device))
    _check_finite("RLOO", adv, [("scores", scores, m.any(-1), _SCORE_FIX)],
                  "the scores of the rows with valid tokens are finite (an overflow of very large scores)")
    return _broadcast(adv.reshape(scores.shape), m, scores.dtype)


def reinforce_plus_plus_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    scores: Tensor | None = None,
    group: Tensor | None = None,
    whiten: bool = True,
    eps: float = 1e-8,
    process_group=None,
) -> Tensor:
    """REINFORCE++: discounted returns over the valid tokens, whitened over the batch (no critic).

    Hu 2025, "REINFORCE++" (arXiv:2501.03262)::

        G_t = sum_{t' >= t, valid} gamma^k r_t'    (k: the number of valid tokens between t and t')
        A   = (G - mean) / sqrt(var + eps)          mean, var over every valid token of the batch

    The returns are :func:`ppo_objectives.functional.masked_gae` with zero values
    and ``lmbda = 1``: it skips masked tokens (holes such as tool tokens are
    skipped, not treated as ends; the discount counts valid tokens only) and
    never reads them. The whitening is
    :func:`ppo_objectives.functional.masked_whiten` (biased variance).

    **REINFORCE++-baseline** (``scores`` and ``group`` given): the group mean of
    the scores is subtracted from the reward of each row's last valid token
    (where the score sits in the response layout), i.e. ``score_i - mean_g``
    replaces ``score_i`` in the return, before the whitening.

    A NaN or inf reward at a valid token (or score of a row with valid tokens) is
    a ``ValueError`` naming the position: the whitening would spread it to every
    advantage of the batch.

    Args:
        token_rewards: ``[*B, R]`` per-token rewards (the score on the last valid token,
            plus any shaping such as a KL penalty).
        mask: ``[*B, R]`` bool or {0, 1}, True = token takes part.
        gamma: discount in [0, 1].
        scores: ``[*B]`` per-response scores, for the baseline (with ``group``).
        group: ``[*B]`` integer group ids, for the baseline (with ``scores``).
        whiten: whiten the returns (REINFORCE++) or return them raw.
        eps: added to the variance before the square root.
        process_group: a ``torch.distributed`` group: whiten with the statistics of
            every rank's valid tokens.

    Returns:
        ``[*B, R]`` advantages of the rewards' dtype, 0 at masked tokens.

    Example:
        >>> import torch
        >>> r = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 2.0, 9.0]])
        >>> m = torch.tensor([[True, False, True], [True, True, False]])
        >>> reinforce_plus_plus_advantages(r, m, gamma=0.5, whiten=False)    # the hole is skipped
        tensor([[0.5000, 0.0000, 1.0000],
                [1.0000, 2.0000, 0.0000]])
    """
    r = _validate.check_float("token_rewards", token_rewards)
    m = _validate.check_mask(mask, r.shape, "token_rewards")
    _validate.check_unit_interval("gamma", gamma)
    if (scores is None) != (group is None):
        raise ValueError("the REINFORCE++ baseline needs both scores= and group= (or neither: no baseline)")
    cd = _validate.compute_dtype(r)
    zero = torch.zeros((), dtype=cd, device=r.device)
    r = torch.where(m, r.to(cd), zero)
    if scores is not None:
        scores, group, m = _check_scores(scores, group, m)
        s = _row_scores(scores, m)
        _, mean, _ = _group_moments(s, group)
        last = torch.arange(r.shape[-1], device=r.device) == F.last_valid_index(m).unsqueeze(-1)
        r = r - torch.where(last, mean.reshape(scores.shape).unsqueeze(-1), zero)
    returns, _ = F.masked_gae(r, torch.zeros_like(r), m, gamma, 1.0, average_gae=False)
    if whiten:
        returns = F.masked_whiten(returns, m, eps=eps, process_group=process_group)
    adv = torch.where(m, returns, zero)
    inputs = [("token_rewards", token_rewards, m, _REWARD_FIX)]
    if scores is not None:
        inputs.append(("scores", scores, m.any(-1), _SCORE_FIX))
    elsewhere = "" if process_group is None else ", or a NaN/inf on another rank of process_group"
    _check_finite("REINFORCE++", adv, inputs,
                  f"the rewards at the valid tokens are finite (an overflow of very large rewards{elsewhere})")
    return adv.to(token_rewards.dtype)


class _CriticFree(ValueEstimatorBase):
    """What the critic-free estimators share: they write ``advantage``, its copy
    ``value_target`` (there is no critic) and the ``critic_free`` marker, computed by
    ``_estimate`` without gradient.

    ``critic_free = True`` tells a loss that its critic would be regressed onto advantages
    (:meth:`~ppo_objectives.loss.TokenPPOLoss.make_value_estimator` refuses that), and so does the
    ``critic_free`` entry for a batch that reaches the loss with its advantages already written
    (:class:`~ppo_objectives.loss.TokenPPOLoss` with a critic refuses it). ``aggregation`` is the
    aggregation the method's objective is defined with (``None``: any).
    """

    critic_free = True
    aggregation: str | None = None

    @property
    def out_keys(self):
        return [self.tensor_keys.advantage, self.tensor_keys.value_target, self.tensor_keys.critic_free]

    @dispatch
    def forward(self, tensordict: TensorDictBase, *, params=None, target_params=None) -> TensorDictBase:
        """Compute ``advantage`` (and its copy ``value_target``) and write them into ``tensordict`` (returned),
        with ``critic_free`` (bool, ``tensordict.batch_size``, all True): the value target is the advantage."""
        adv = self._estimate(tensordict)
        tensordict.set(self.tensor_keys.advantage, adv)
        tensordict.set(self.tensor_keys.value_target, adv.clone())
        tensordict.set(self.tensor_keys.critic_free,
                       torch.ones(tensordict.batch_size, dtype=torch.bool, device=adv.device))  # fmt: skip
        return tensordict

    def value_estimate(self, tensordict: TensorDictBase, target_params=None, next_value=None, **kwargs) -> Tensor:
        """The advantage of :meth:`forward` (the value target is the advantage), without writing anything."""
        return self._estimate(tensordict)

    def _estimate(self, td: TensorDictBase) -> Tensor:
        raise NotImplementedError


class GroupAdvantage(_CriticFree):
    """Group-relative advantages (GRPO, Dr. GRPO, RLOO) as a TorchRL value estimator, no critic.

    ``kind="grpo"``: :func:`grpo_advantages` (``(score - mean_g) / (std_g + eps)``,
    unbiased std); ``"dr_grpo"``: :func:`dr_grpo_advantages` (``score - mean_g``;
    pair with ``aggregation="token-sum-norm"`` or ``"seq-mean-token-sum-norm"``);
    ``"rloo"``: :func:`rloo_advantages` (``score_i`` minus the mean of the other
    scores of its group). The row's advantage goes on each of its valid tokens.

    Keys read (names via :meth:`set_keys`):

    ================== ========= ==================================================
    key (field)        shape     meaning
    ================== ========= ==================================================
    ``"score"`` score  [*B]      per-response score (float)
    ``"group"`` group  [*B]      integer group ids: one id per prompt
    ``"mask"`` mask    [*B, R]   bool or {0, 1}: the response tokens (required)
    ================== ========= ==================================================

    Keys written: ``"advantage"`` ``[*B, R]``, 0 at masked tokens,
    ``"value_target"``, a copy of the advantage, and ``"critic_free"`` (bool, the
    TensorDict's batch shape, all True): there is no critic, train with
    ``TokenPPOLoss(actor, None)`` (no critic loss; a loss with a critic refuses the
    batch). Computed without gradient.

    Args:
        kind: one of :data:`GROUP_KINDS`.

    Keyword Args:
        eps: added to the group std (``kind="grpo"``; verl: 1e-6).
        device: forwarded to :class:`~torchrl.objectives.value.ValueEstimatorBase`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict(
        ...     {"score": torch.tensor([1.0, 0.0, 3.0]), "group": torch.tensor([0, 0, 1]),
        ...      "mask": torch.tensor([[True, True], [True, False], [True, True]])},
        ...     batch_size=[3],
        ... )
        >>> GroupAdvantage("rloo")(td)["advantage"]
        tensor([[ 1.,  1.],
                [-1.,  0.],
                [ 0.,  0.]])
    """

    @dataclass
    class _AcceptedKeys:
        """Configurable TensorDict keys of :class:`GroupAdvantage` (set them with :meth:`set_keys`).

        Attributes:
            advantage: where the advantage is written. Defaults to ``"advantage"``.
            value_target: where the copy of the advantage is written. Defaults to ``"value_target"``.
            critic_free: where the marker is written (bool, the TensorDict's batch shape, True: this
                row's value target is its advantage). Defaults to ``"critic_free"``.
            score: the per-response score ``[*B]``. Defaults to ``"score"``.
            group: the group ids ``[*B]``. Defaults to ``"group"``.
            mask: the response tokens ``[*B, R]``. Defaults to ``"mask"``.
            value: unused (no critic); kept for TorchRL's losses. Defaults to ``"state_value"``.
            sample_log_prob: unused; kept for losses that forward it. Defaults to
                ``"sample_log_prob"`` (or ``"action_log_prob"`` when
                :func:`~tensordict.nn.composite_lp_aggregate` is off).
        """

        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        critic_free: NestedKey = "critic_free"
        score: NestedKey = "score"
        group: NestedKey = "group"
        mask: NestedKey = "mask"
        value: NestedKey = "state_value"
        sample_log_prob: NestedKey | None = None

        def __post_init__(self):
            if self.sample_log_prob is None:
                self.sample_log_prob = TD.default_log_prob_key()

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(self, kind: str = "grpo", *, eps: float = 1e-6, device: torch.device | None = None):
        if kind not in GROUP_KINDS:
            raise ValueError(f"kind={kind!r} is not one of {GROUP_KINDS}; for REINFORCE++ use ReinforcePlusPlus")
        _validate.check_positive("eps", eps)
        super().__init__(value_network=None, device=device)
        self.kind = kind
        self.eps = float(eps)
        # Dr. GRPO's unbiased objective: token losses summed, divided by a constant (Liu et al. 2025)
        self.aggregation = "token-sum-norm" if kind == "dr_grpo" else None

    @property
    def in_keys(self):
        return [self.tensor_keys.score, self.tensor_keys.group, self.tensor_keys.mask]

    def _estimate(self, td: TensorDictBase) -> Tensor:
        keys, name = self.tensor_keys, "GroupAdvantage"
        score = TD.require(td, keys.score, module=name, what="the per-response scores [*B]")
        group = TD.require(
            td, keys.group, module=name, what="the group ids [*B]", fix="store one int64 id per prompt"
        )
        mask = TD.require(td, keys.mask, module=name, what="the response mask [*B, R]")
        self._warn_if_all_singletons(group)
        with torch.no_grad():
            if self.kind == "rloo":
                return rloo_advantages(score, group, mask)
            return grpo_advantages(score, group, mask, scale="std" if self.kind == "grpo" else None, eps=self.eps)

    def _warn_if_all_singletons(self, group: Tensor) -> None:
        """Once per estimator: every group of the batch has one response, so every advantage is 0."""
        if getattr(self, "_warned_singletons", False) or not _validate.checking_values() or group.numel() < 2:
            return
        if int(torch.unique(group.reshape(-1)).numel()) == group.numel():
            self._warned_singletons = True
            warnings.warn(
                f"GroupAdvantage({self.kind!r}): every group in this batch of {group.numel()} responses has one "
                f"response, so every advantage is 0 and the policy will not learn; sample several responses per "
                f"prompt with the same group id (TokenLMEnv(group_size=G) writes 'group'; python -m "
                f"ppo_objectives.train --group-size G)",
                UserWarning,
                stacklevel=4,
            )

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, eps={self.eps}"


class ReinforcePlusPlus(_CriticFree):
    """REINFORCE++ (and REINFORCE++-baseline) as a TorchRL value estimator, no critic.

    :func:`reinforce_plus_plus_advantages`: the discounted returns of the per-token
    rewards over the valid tokens (holes skipped), whitened over the valid tokens
    of the batch; with ``baseline=True`` the group mean of the scores is first
    subtracted at each row's last valid token.

    Keys read (names via :meth:`set_keys`):

    ============================== ========= ==========================================
    key (field)                    shape     meaning
    ============================== ========= ==========================================
    ``("next", "reward")`` reward  [*B, R]   per-token reward (score on the last token)
    ``"mask"`` mask                [*B, R]   bool or {0, 1}; a missing mask counts every token
    ``"score"`` score              [*B]      ``baseline=True`` only: per-response score
    ``"group"`` group              [*B]      ``baseline=True`` only: integer group ids
    ============================== ========= ==========================================

    Keys written: ``"advantage"`` ``[*B, R]``, 0 at masked tokens,
    ``"value_target"``, a copy of the advantage, and ``"critic_free"`` (bool, the
    TensorDict's batch shape, all True): there is no critic, train with
    ``TokenPPOLoss(actor, None)`` (a loss with a critic refuses the batch).
    Computed without gradient.

    Args:
        gamma: discount in [0, 1] (REINFORCE++: 1.0).
        baseline: subtract the group mean of the scores (REINFORCE++-baseline).

    Keyword Args:
        whiten: whiten the returns over the batch (default True).
        eps: added to the variance in the whitening.
        device: forwarded to :class:`~torchrl.objectives.value.ValueEstimatorBase`.
        process_group: a ``torch.distributed`` group: whiten over every rank's valid tokens.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict(
        ...     {("next", "reward"): torch.tensor([[0.0, 1.0], [0.0, 3.0]]), "mask": torch.ones(2, 2).bool()},
        ...     batch_size=[2],
        ... )
        >>> ReinforcePlusPlus(gamma=1.0, whiten=False)(td)["advantage"]
        tensor([[1., 1.],
                [3., 3.]])
    """

    @dataclass
    class _AcceptedKeys:
        """Configurable TensorDict keys of :class:`ReinforcePlusPlus` (set them with :meth:`set_keys`).

        Attributes:
            advantage: where the advantage is written. Defaults to ``"advantage"``.
            value_target: where the copy of the advantage is written. Defaults to ``"value_target"``.
            critic_free: where the marker is written (bool, the TensorDict's batch shape, True: this
                row's value target is its advantage). Defaults to ``"critic_free"``.
            reward: the per-token reward, read under ``"next"``. Defaults to ``"reward"``.
            mask: the response tokens ``[*B, R]``. Defaults to ``"mask"``.
            score: the per-response score (baseline only). Defaults to ``"score"``.
            group: the group ids (baseline only). Defaults to ``"group"``.
            value: unused (no critic); kept for TorchRL's losses. Defaults to ``"state_value"``.
            sample_log_prob: unused; kept for losses that forward it. Defaults to
                ``"sample_log_prob"`` (or ``"action_log_prob"`` when
                :func:`~tensordict.nn.composite_lp_aggregate` is off).
        """

        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        critic_free: NestedKey = "critic_free"
        reward: NestedKey = "reward"
        mask: NestedKey = "mask"
        score: NestedKey = "score"
        group: NestedKey = "group"
        value: NestedKey = "state_value"
        sample_log_prob: NestedKey | None = None

        def __post_init__(self):
            if self.sample_log_prob is None:
                self.sample_log_prob = TD.default_log_prob_key()

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        gamma: float = 1.0,
        baseline: bool = False,
        *,
        whiten: bool = True,
        eps: float = 1e-8,
        device: torch.device | None = None,
        process_group=None,
    ):
        _validate.check_unit_interval("gamma", gamma)
        _validate.check_positive("eps", eps)
        super().__init__(value_network=None, device=device)
        self.gamma = float(gamma)
        self.baseline = bool(baseline)
        self.whiten = bool(whiten)
        self.eps = float(eps)
        self.process_group = process_group

    @property
    def in_keys(self):
        keys = [("next", self.tensor_keys.reward), self.tensor_keys.mask]
        return keys + ([self.tensor_keys.score, self.tensor_keys.group] if self.baseline else [])

    def _estimate(self, td: TensorDictBase) -> Tensor:
        keys, name = self.tensor_keys, "ReinforcePlusPlus"
        reward = TD.require(td, ("next", keys.reward), module=name, what="the per-token rewards [*B, R]")
        ref = f"reward {('next', keys.reward)!r}"
        mask = TD.mask_or_all(td.get(keys.mask, None), f"mask {keys.mask!r}", reward.shape, ref, reward.device)
        score = group = None
        if self.baseline:
            score = TD.require(td, keys.score, module=name, what="the per-response scores [*B]",
                               fix="or use baseline=False")  # fmt: skip
            group = TD.require(td, keys.group, module=name, what="the group ids [*B]",
                               fix="store one int64 id per prompt")  # fmt: skip
        with torch.no_grad():
            return reinforce_plus_plus_advantages(
                reward, mask, gamma=self.gamma, scores=score, group=group, whiten=self.whiten, eps=self.eps,
                process_group=self.process_group,
            )  # fmt: skip

    def extra_repr(self) -> str:
        return f"gamma={self.gamma}, baseline={self.baseline}, whiten={self.whiten}"

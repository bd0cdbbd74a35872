"""TokenPPOLoss: TorchRL's ``LossModule`` interface over the PPO functions of :mod:`ppo_objectives.functional`.

Shape letters (used in every docstring below):

- ``B``: batch dimensions (one sampled response per row), written ``*B`` when several.
- ``R``: the response length (tokens the policy generated, padded).

Per-token entries may be stored ``[*B, R]`` (LLM layout) or ``[*B, R, 1]``
(TorchRL's per-step layout); both are adapted at the module edge and nothing
is broadcast: an entry of any other shape (a per-sequence advantage ``[B]``,
say) is an error that names it. The module maps keys and holds hyper-parameters;
every number comes from the functional core (``docs/design.md``, "Layers").
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase, TensorDictParams
from tensordict.nn import TensorDictModule, dispatch
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.objectives import LossModule
from torchrl.objectives.utils import ValueEstimators, dispatch_value_estimator
from torchrl.objectives.value import ValueEstimatorBase

from ppo_objectives import _td as TD
from ppo_objectives import _validate
from ppo_objectives import functional as F
from ppo_objectives._kernels import losses as L
from ppo_objectives._kernels import masked as K
from ppo_objectives.value.gae import MaskedGAE

__all__ = ["MINIMIND_PPO_DEFAULTS", "TokenPPOLoss"]

#: MiniMind's PPO hyper-parameters (``trainer/train_ppo.py``), as :meth:`TokenPPOLoss.minimind` sets them.
MINIMIND_PPO_DEFAULTS: dict[str, Any] = {
    "clip_epsilon": 0.2,  # --clip_epsilon: ratio clipped to [0.8, 1.2]
    "critic_coeff": 0.5,  # --vf_coef: weight of the (0.5 * squared error) value loss
    "kl_to_ref_coeff": 0.02,  # --kl_coef: weight of the k3 reference KL added to the policy loss
    "kl_estimator": "k3",  # exp(d) - d - 1, d = ref_log_prob - logp
    "clip_value": 0.2,  # --cliprange_value: V may move 0.2 from the rollout value
    "entropy_coeff": 0.0,  # no entropy bonus
    "aggregation": "token-mean",  # masked mean over all valid tokens of the minibatch
    "normalize_advantage": False,  # whitened once per rollout, in GAE (average_gae=True)
    "gamma": 1.0,  # --gamma
    "lmbda": 0.95,  # --lam
}

_ESTIMATOR_KEYS = (
    "advantage", "value_target", "value", "reward", "done", "terminated", "truncated", "mask", "critic_free",
)  # fmt: skip


def _check_hyperparameters(*, dual_clip, aggregation, kl_estimator, kl_clamp, clip_value, **coeffs) -> None:
    if dual_clip is not None:
        _validate.check_positive("dual_clip", dual_clip, above=1.0, what=" (the dual-clip constant c must exceed 1)")
    _validate.check_aggregation(aggregation)
    if kl_estimator not in F.KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={kl_estimator!r} is not one of {F.KL_ESTIMATORS}")
    if kl_clamp is not None:
        _validate.check_positive("kl_clamp", kl_clamp)
    if clip_value is not None:
        _validate.check_positive("clip_value", clip_value)
    for name, x in coeffs.items():
        if not _validate.is_real(x, low=0):
            raise ValueError(f"{name}={x!r} must be a float >= 0 and finite (0 switches that term off)")


def _build_value_estimator(value_type: Any, critic_network, hyperparams: dict) -> ValueEstimatorBase:
    if isinstance(value_type, ValueEstimatorBase):
        return value_type
    if value_type is MaskedGAE:
        return MaskedGAE(**{"value_network": critic_network, **hyperparams})
    if isinstance(value_type, type) and issubclass(value_type, ValueEstimatorBase):
        return value_type(**hyperparams)
    raise NotImplementedError(
        f"value_type={value_type!r} is not supported by TokenPPOLoss; pass a MaskedGAE instance "
        "(or ValueEstimators.GAE for unmasked collector data)"
    )


_GAE_ON_MASKED_DATA = (
    "TokenPPOLoss: the value estimator is {name}, which reads unmasked collector data [N, T] with ('next', 'done') "
    "flags, but this batch {why} (the response layout of trajectories_to_llm_batch, or the full-sequence layout "
    "of LLMToTokenBatch); it would compute on padding and holes, or fail inside TensorDict. Response-layout data "
    "needs MaskedGAE: loss.make_value_estimator(MaskedGAE()) (the default), or store "
    "'advantage' and 'value_target' before the loss"
)

_EMPTY_MASK_WARNING = (
    "TokenPPOLoss: the mask of this batch has no valid token (every entry is False), so every loss term and "
    "diagnostic is exactly 0 and the update does nothing; this is a likely mistake (a mask built with the wrong "
    "polarity, or a batch of empty responses). True marks the tokens that take part"
)


class TokenPPOLoss(LossModule):
    """Token-level clipped PPO with a critic and a reference-KL penalty, for language models.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347),
    per response token ``t`` with ``ratio_t = exp(log_prob_t - sample_log_prob_t)``::

        loss_objective = agg( max(-A_t ratio_t, -A_t clamp(ratio_t, 1 - eps_low, 1 + eps_high)) )
        loss_critic    = critic_coeff * agg( 0.5 max((V_t - G_t)^2, (clamp(V_t, V_old +- c) - G_t)^2) )
        loss_kl_ref    = kl_to_ref_coeff * agg( KL_est(log_prob_t, ref_log_prob_t) )      (k3 by default)
        loss_entropy   = -entropy_coeff * agg( H_t )

    ``agg`` is the masked aggregation :func:`ppo_objectives.functional.aggregate_loss`
    (token mean by default). Summing the ``loss_*`` entries gives MiniMind's total
    loss (``policy_loss + kl_reward_coeff * kl_ref + vf_coef * value_loss``). The arithmetic
    is :func:`~ppo_objectives.functional.ppo_policy_loss`,
    :func:`~ppo_objectives.functional.clipped_value_loss` and
    :func:`~ppo_objectives.functional.reference_kl_penalty`.

    **Networks.** ``actor_network`` is a TensorDict module that reads the token
    entries it needs (e.g. ``"tokens"``, ``"prompt_lens"``) and writes
    ``"log_prob"`` ``[B, R]``, the log-probability of each response token under
    the current policy, and optionally ``"entropy"`` ``[B, R]``. ``critic_network``
    reads the same kind of entries and writes ``"state_value"`` ``[B, R]``. Both
    run once per call; the input entries are treated as constants (detached).
    Their ``in_keys`` are checked on the input before anything runs: a missing
    entry is a ``KeyError`` naming it and the network (for a raw collector batch:
    convert it with :func:`~ppo_objectives.llm.layouts.trajectories_to_llm_batch`).

    **Batch shape.** The TensorDict needs at least one batch dimension: ``[B]``
    (the response layout, ``[B, S]`` inputs next to ``[B, R]`` per-token entries)
    or ``[*B, R]``. ``in_keys`` lists what the loss reads (``mask``,
    ``sample_log_prob``, ``advantage``; ``ref_log_prob`` when ``kl_to_ref_coeff > 0``;
    ``value_target`` and, with ``clip_value``, ``state_value`` when there is a
    critic) and the networks' ``in_keys``, so ``td.select(*loss.in_keys)`` keeps
    the inputs of one call on a batch whose advantages are computed (the value
    estimator's entries, read only when ``advantage`` is missing, are not listed,
    nor is ``critic_free``, read only to refuse a batch).

    **Critic-free advantages.** :class:`~ppo_objectives.value.critic_free.GroupAdvantage` and
    :class:`~ppo_objectives.value.critic_free.ReinforcePlusPlus` have no critic: their
    ``value_target`` is a copy of the advantage, and they mark the batch with a
    ``critic_free`` entry. Train on them with ``TokenPPOLoss(actor, None)``. A loss with
    a critic refuses them rather than regress its critic onto advantages: as its value
    estimator (:meth:`make_value_estimator`), and as a batch whose ``critic_free``
    entry is set while its ``value_target`` still equals its ``advantage`` (a
    ``ValueError``; the comparison is one host read, only on marked batches, skipped
    under :func:`~ppo_objectives.functional.value_checks` ``(False)``). A batch whose
    advantages were recomputed since, e.g. by :class:`MaskedGAE`, passes.

    **Missing or empty mask.** Without a ``mask`` entry every token takes part
    (TorchRL's convention: collector batches have no mask), so a padded batch
    stored without its mask trains on its padding. A mask with no valid token
    gives exactly 0 for every term; since that is a likely mistake, the loss warns
    (a ``UserWarning``, shown once by Python's default warning filter) when a
    non-empty batch has no valid token; the check
    reads the mask (one host read) and is skipped under
    :func:`~ppo_objectives.functional.value_checks` ``(False)`` and ``torch.compile``.

    Keys read (names via :meth:`set_keys`; per-token tensors ``[*B, R]`` or ``[*B, R, 1]``):

    ======================== =================================================================
    key (field)              meaning
    ======================== =================================================================
    ``"tokens"`` tokens      token ids, if the networks read them (only the networks' in_keys
                             are listed in ``in_keys``)
    ``"mask"`` mask          response tokens that take part (bool or {0, 1}); optional: a
                             missing mask counts every token (TorchRL's convention)
    ``"sample_log_prob"``    log-probs under the sampling policy (required)
    ``"rollout_log_prob"``   log-probs under the engine that sampled the tokens (e.g. vLLM);
                             required when rollout_correction is set, else never read
    ``"ref_log_prob"``       log-probs under the frozen reference (required when kl_to_ref_coeff > 0)
    ``"advantage"``          per-token advantages; computed by the value estimator when absent
    ``"value_target"``       returns ``G_t`` for the critic (required with a critic)
    ``"critic_free"``        written by the critic-free estimators; with a critic, a batch
                             carrying it is refused (see "Critic-free advantages")
    ``"state_value"`` value  critic values at rollout time ``V_old`` (required when clip_value)
    ``"log_prob"``           written by the actor network (field ``log_prob``)
    ``"entropy"``            optionally written by the actor network (field ``entropy``)
    ======================== =================================================================

    Output: a TensorDict with no batch dimension holding

    * ``loss_objective``, ``loss_critic`` (with a critic), ``loss_kl_ref``, ``loss_entropy``
      (0 when there is no entropy bonus): the terms to sum and backpropagate;
    * detached diagnostics, every one masked to the valid tokens: ``clip_fraction``,
      ``clip_fraction_low``, ``clip_fraction_high`` (ratio outside the clip range),
      ``kl_approx`` (mean of ``0.5 (log_prob - sample_log_prob)^2``, MiniMind's early-stop
      signal: the training loop compares it with ``--early-stop-kl``; the loss itself never
      stops), ``kl_approx_token_max`` (its largest per-token value),
      ``mean_ratio``, ``max_ratio``, ``ESS`` (normalised
      effective sample size of the ratios, in (0, 1]), ``kl_ref`` (the aggregated
      reference KL, when ``ref_log_prob`` is given), ``entropy`` (when the actor writes
      it), ``value_clip_fraction`` (tokens whose clipped value branch is active),
      ``explained_variance`` of the returns by the current critic, and
      ``dual_clip_fraction`` when ``dual_clip`` is set;
    * with ``rollout_correction``, the diagnostics of
      :func:`~ppo_objectives.functional.rollout_correction_weights` prefixed ``rollout_``:
      ``rollout_clip_fraction``, ``rollout_mask_fraction``, ``rollout_seq_clip_fraction``,
      ``rollout_seq_mask_fraction``, ``rollout_ESS``, ``rollout_mean_weight``,
      ``rollout_max_weight``.

    Args:
        actor_network: module writing ``log_prob`` (and optionally ``entropy``).
        critic_network: module writing ``state_value``; ``None`` for no critic loss.

    Keyword Args:
        clip_epsilon: ``eps`` (symmetric) or ``(eps_low, eps_high)`` (DAPO clip-higher). Default 0.2.
        dual_clip: dual-clip constant ``c > 1`` (Ye et al. 2020), or ``None``.
        critic_coeff: weight of the value loss. Default 0.5 (MiniMind's ``vf_coef``).
        clip_value: value clip range ``c`` (MiniMind 0.2), or ``None`` for the unclipped loss.
        kl_to_ref_coeff: weight of the reference KL. Default 0.02 (MiniMind). 0 disables it.
        kl_estimator: ``"k1"``, ``"k2"``, ``"k3"`` (default) or ``"k3+"``.
        kl_clamp: optional bound on the per-token KL estimate.
        kl_importance_weighted: weight the per-token KL by ``pi / pi_old``
            (``exp(log_prob - sample_log_prob)``, DeepSeek-V3.2's correction): the
            minibatches after the first step are sampled from the rollout policy, not
            the current one. Default ``False`` (MiniMind).
        entropy_coeff: weight of the entropy bonus. Default 0.
        entropy_bonus: require an entropy from the actor; default ``entropy_coeff != 0``.
        aggregation: ``"token-mean"`` (default), ``"seq-mean-token-mean"``,
            ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``, ``"token-sum"`` or
            ``"token-sum-norm"`` (see :func:`~ppo_objectives.functional.aggregate_loss`).
        normalize_advantage: whiten the advantages over the valid tokens of each call.
        rollout_correction: correct for rollouts sampled by another engine or a stale
            policy: ``"token-tis"``, ``"token-mis"``, ``"seq-tis"``, ``"seq-mis"``,
            ``"icepop"`` or ``"geo-mask"`` (the ``mode`` of
            :func:`~ppo_objectives.functional.rollout_correction_weights`, fed with
            ``sample_log_prob`` and ``rollout_log_prob``); the per-token weights multiply
            the clipped surrogate (the ``weights=`` of
            :func:`~ppo_objectives.functional.ppo_policy_loss`). ``None`` (default): off,
            ``rollout_log_prob`` is not read. The masking modes (``token-mis``,
            ``seq-mis``, ``icepop``, ``geo-mask``) reject tokens or whole sequences:
            rejection is a mask on the policy-gradient term only. A rejected token
            leaves ``loss_objective``'s denominator (and a sequence with no kept token
            its sequence count) and the ratio diagnostics (``clip_fraction``,
            ``kl_approx``, ``mean_ratio``, ...). ``loss_critic``, ``loss_entropy`` and
            ``loss_kl_ref`` keep every valid token: the critic still learns the value of
            the states the rollout visited, and the entropy bonus and the reference KL
            still regularise the policy there; only the importance-weighted policy
            gradient of a token whose sampler disagrees is dropped.
        rollout_threshold_high: the upper bound ``C`` >= 1 of the weights. Default 2.0.
        rollout_threshold_low: the lower bound of the masking modes, or ``None`` (their default).
        functional: hold the network parameters as TensorDictParams (TorchRL's default).
        device: device of the coefficient buffers.

    The default value estimator (used when ``advantage`` is missing) is
    :class:`~ppo_objectives.value.gae.MaskedGAE` with its defaults (``gamma=1.0, lmbda=0.95``, MiniMind's);
    change it with :meth:`make_value_estimator`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> class Zero(torch.nn.Module):           # log_prob = log(0.5) + w (w = 0), value = u
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(()))
        ...     def forward(self, tokens):
        ...         return torch.full(tokens.shape, 0.5).log() + self.w
        >>> actor = TensorDictModule(Zero(), in_keys=["tokens"], out_keys=["log_prob"])
        >>> critic = TensorDictModule(Zero(), in_keys=["tokens"], out_keys=["state_value"])
        >>> td = TensorDict(
        ...     {
        ...         "tokens": torch.tensor([[5, 6, 0]]),
        ...         "mask": torch.tensor([[True, True, False]]),
        ...         "sample_log_prob": torch.full((1, 3), 0.5).log(),   # ratio 1
        ...         "ref_log_prob": torch.full((1, 3), 0.5).log(),      # no drift: KL 0
        ...         "advantage": torch.tensor([[1.0, -1.0, 99.0]]),
        ...         "value_target": torch.tensor([[0.0, 0.0, 99.0]]),
        ...         "state_value": torch.zeros(1, 3),
        ...     },
        ...     batch_size=[1, 3],
        ... )
        >>> loss = TokenPPOLoss(actor, critic, clip_value=None)
        >>> out = loss(td)
        >>> round(out["loss_objective"].item(), 4)   # mean(-1 * 1, +1 * 1) over the two valid tokens
        0.0
        >>> round(out["loss_critic"].item(), 4)      # 0.5 * 0.5 * mean((log 0.5 - 0)^2)
        0.1201
        >>> out["clip_fraction"], out["kl_approx"], out["kl_ref"], out["ESS"]
        (tensor(0.), tensor(0.), tensor(0.), tensor(1.))
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_critic', 'loss_entropy', 'loss_kl_ref', 'loss_objective']
    """

    @dataclass
    class _AcceptedKeys:
        """Configurable TensorDict keys of :class:`TokenPPOLoss` (set them with :meth:`set_keys`).

        Attributes:
            tokens: token ids the networks read. Defaults to ``"tokens"``.
            mask: response tokens that take part. Defaults to ``"mask"``.
            sample_log_prob: log-probs at sampling time. Defaults to ``"sample_log_prob"``.
            rollout_log_prob: log-probs of the engine that sampled the tokens (read only
                with ``rollout_correction``). Defaults to ``"rollout_log_prob"``.
            ref_log_prob: log-probs of the reference policy. Defaults to ``"ref_log_prob"``.
            advantage: per-token advantages. Defaults to ``"advantage"``.
            value_target: returns for the critic. Defaults to ``"value_target"``.
            value: critic values (input: at rollout time; critic output: current).
                Defaults to ``"state_value"``.
            log_prob: the actor network's output log-probs. Defaults to ``"log_prob"``.
            entropy: the actor network's optional output entropy. Defaults to ``"entropy"``.
            reward: forwarded to the value estimator (read under ``"next"``). Defaults to ``"reward"``.
            done: forwarded to the value estimator. Defaults to ``"done"``.
            terminated: forwarded to the value estimator. Defaults to ``"terminated"``.
            truncated: forwarded to the value estimator. Defaults to ``"truncated"``.
            critic_free: the marker of a critic-free estimator's batch (read only with a critic,
                to refuse it; forwarded to the value estimator). Defaults to ``"critic_free"``.
        """

        tokens: NestedKey = "tokens"
        mask: NestedKey = "mask"
        sample_log_prob: NestedKey = "sample_log_prob"
        rollout_log_prob: NestedKey = "rollout_log_prob"
        ref_log_prob: NestedKey = "ref_log_prob"
        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        value: NestedKey = "state_value"
        log_prob: NestedKey = "log_prob"
        entropy: NestedKey = "entropy"
        reward: NestedKey = "reward"
        done: NestedKey = "done"
        terminated: NestedKey = "terminated"
        truncated: NestedKey = "truncated"
        critic_free: NestedKey = "critic_free"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    default_value_estimator = MaskedGAE
    _schedulable_buffers = frozenset(
        {"clip_epsilon_low", "clip_epsilon_high", "critic_coeff", "kl_to_ref_coeff", "entropy_coeff", "clip_value"}
    )

    actor_network: TensorDictModule
    critic_network: TensorDictModule | None
    actor_network_params: TensorDictParams
    critic_network_params: TensorDictParams
    target_actor_network_params: TensorDictParams
    target_critic_network_params: TensorDictParams

    def __init__(
        self,
        actor_network: TensorDictModule,
        critic_network: TensorDictModule | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = 0.2,
        dual_clip: float | None = None,
        critic_coeff: float = 0.5,
        clip_value: float | None = 0.2,
        kl_to_ref_coeff: float = 0.02,
        kl_estimator: str = "k3",
        kl_clamp: float | None = None,
        kl_importance_weighted: bool = False,
        entropy_coeff: float = 0.0,
        entropy_bonus: bool | None = None,
        aggregation: str = "token-mean",
        normalize_advantage: bool = False,
        rollout_correction: str | None = None,
        rollout_threshold_high: float = 2.0,
        rollout_threshold_low: float | None = None,
        functional: bool = True,
        device: torch.device | None = None,
    ):
        if actor_network is None:
            raise TypeError("TokenPPOLoss needs an actor_network that writes per-token 'log_prob'")
        eps_low, eps_high = _validate.check_clip_epsilon(clip_epsilon)
        _check_hyperparameters(
            dual_clip=dual_clip, aggregation=aggregation, kl_estimator=kl_estimator, kl_clamp=kl_clamp,
            clip_value=clip_value, critic_coeff=critic_coeff, kl_to_ref_coeff=kl_to_ref_coeff, entropy_coeff=entropy_coeff,
        )  # fmt: skip
        super().__init__()
        self._functional = functional
        self._in_keys = None
        _attach_networks(self, actor_network, critic_network, functional)
        if device is None:
            device = next(iter(self.parameters()), torch.empty(0, device=torch.get_default_device())).device
        coeffs = {"clip_epsilon_low": eps_low, "clip_epsilon_high": eps_high, "critic_coeff": float(critic_coeff),
                  "kl_to_ref_coeff": float(kl_to_ref_coeff), "entropy_coeff": float(entropy_coeff), "clip_value": clip_value}  # fmt: skip
        for name, value in coeffs.items():
            self.register_coeff_buffer(name, value, device=device, dtype=torch.float32)
        self.dual_clip = dual_clip
        self.kl_estimator = kl_estimator
        self.kl_clamp = kl_clamp
        self.kl_importance_weighted = bool(kl_importance_weighted)
        self.aggregation = aggregation
        self.normalize_advantage = bool(normalize_advantage)
        self.entropy_bonus = (entropy_coeff != 0) if entropy_bonus is None else bool(entropy_bonus)
        self._has_critic = critic_network is not None and critic_coeff != 0
        self._requires_ref = kl_to_ref_coeff != 0
        _set_rollout_correction(self, rollout_correction, rollout_threshold_high, rollout_threshold_low)

    # ------------------------------------------------------------------ presets

    @classmethod
    def minimind(
        cls, actor_network: TensorDictModule, critic_network: TensorDictModule, **overrides: Any
    ) -> TokenPPOLoss:
        """A loss with every hyper-parameter at MiniMind's PPO default (:data:`MINIMIND_PPO_DEFAULTS`).

        clip 0.2 (``--clip_epsilon``), value-loss weight 0.5 (``--vf_coef``), k3 reference
        KL weight 0.02 in the loss (``--kl_coef``), value clip 0.2 (``--cliprange_value``),
        no entropy bonus, token-mean aggregation, advantages whitened once in GAE with
        ``gamma=1.0, lmbda=0.95`` (``--gamma``, ``--lam``: MiniMind's flags). Keyword ``overrides``
        replace any of these. MiniMind's early stop (``--early_stop_kl 0.25``: end the PPO epochs
        once ``kl_approx`` exceeds it) belongs to the training loop, not the loss: see the
        training job's ``--early-stop-kl``.

        Example:
            >>> import torch
            >>> from tensordict.nn import TensorDictModule
            >>> actor = TensorDictModule(torch.nn.Identity(), in_keys=["tokens"], out_keys=["log_prob"])
            >>> critic = TensorDictModule(torch.nn.Identity(), in_keys=["tokens"], out_keys=["state_value"])
            >>> loss = TokenPPOLoss.minimind(actor, critic)
            >>> float(loss.clip_epsilon_low), float(loss.critic_coeff), float(loss.kl_to_ref_coeff), float(loss.clip_value)
            (0.20000000298023224, 0.5, 0.019999999552965164, 0.20000000298023224)
            >>> loss.kl_estimator
            'k3'
            >>> gae = loss.value_estimator
            >>> float(gae.gamma), float(gae.lmbda), gae.average_gae
            (1.0, 0.95, True)
        """
        _check_overrides(overrides)
        cfg = {**MINIMIND_PPO_DEFAULTS, **overrides}
        gamma, lmbda = cfg.pop("gamma"), cfg.pop("lmbda")
        loss = cls(actor_network, critic_network, **cfg)
        loss.make_value_estimator(MaskedGAE(gamma=gamma, lmbda=lmbda, average_gae=True))
        return loss

    # ------------------------------------------------------------------ keys

    @property
    def functional(self) -> bool:
        return self._functional

    def _set_in_keys(self) -> None:
        self._in_keys = _loss_in_keys(self)

    @property
    def in_keys(self):
        if self._in_keys is None:
            self._set_in_keys()
        return self._in_keys

    @in_keys.setter
    def in_keys(self, values):
        self._in_keys = values

    @property
    def out_keys(self):
        keys = ["loss_objective", "loss_kl_ref", "loss_entropy"]
        if self._has_critic:
            keys.insert(1, "loss_critic")
        return keys

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        estimator = getattr(self, "_value_estimator", None)
        if estimator is not None:
            accepted = estimator._AcceptedKeys.__dataclass_fields__
            estimator.set_keys(
                **{name: getattr(self.tensor_keys, name) for name in _ESTIMATOR_KEYS if name in accepted}
            )
        self._set_in_keys()

    def make_value_estimator(self, value_type: Any = None, **hyperparams) -> TokenPPOLoss:
        """Choose how a missing ``advantage`` is computed.

        ``value_type`` may be a value-estimator instance (e.g. ``MaskedGAE(...)``),
        a :class:`~torchrl.objectives.value.ValueEstimatorBase` subclass built with
        ``hyperparams`` (for :class:`MaskedGAE` the defaults are ``gamma=1.0,
        lmbda=0.95`` and the critic as ``value_network``), ``None`` (that default),
        or ``ValueEstimators.GAE`` (TorchRL's GAE: unmasked collector data ``[N, T]``
        with done flags only). TorchRL's GAE knows no mask: on response-layout data
        (a ``mask`` entry, no ``("next", "done")``) the loss refuses to run it and
        names :class:`MaskedGAE` instead. The loss's key names are forwarded to the
        estimator.
        """
        value_type = self.default_value_estimator if value_type is None else value_type
        _check_critic_free(self, value_type)
        if value_type == ValueEstimators.GAE:
            dispatch_value_estimator(self, value_type, supported=(ValueEstimators.GAE,), **hyperparams)
        else:
            self._value_estimator = _build_value_estimator(value_type, self.critic_network, hyperparams)
        self.value_type = type(self._value_estimator)
        self._forward_value_estimator_keys()
        return self

    def reset_parameters_recursive(self) -> None:
        """Re-initialise the actor's and the critic's parameters (functional or not)."""
        for name in ("actor_network", "critic_network"):
            net = getattr(self, name, None)
            if net is not None:
                self._reset_module_parameters(name, net)

    # ------------------------------------------------------------------ forward

    def _run(self, name: str, tensordict: TensorDictBase, *outputs: NestedKey) -> TensorDictBase:
        """Run a network on a shallow copy without its output entries (a stale entry is never read back)."""
        net = getattr(self, name)
        params = getattr(self, f"{name}_params", None) if self.functional else None
        ctx = params.to_module(net, preserve_module_state=False) if params is not None else contextlib.nullcontext()
        with ctx:
            return net(tensordict.exclude(*outputs))

    @dispatch
    def forward(
        self, tensordict: TensorDictBase, *, normalizer: torch.Tensor | float | None = None, process_group=None
    ) -> TensorDictBase:
        """Compute the loss terms and diagnostics of one (mini)batch; ``tensordict`` is not modified.

        ``normalizer``: optional denominator of every ``loss_*`` aggregation (the
        ``normalizer=`` of :func:`~ppo_objectives.functional.aggregate_loss`), e.g.
        ``loss_normalizer(mask, loss.aggregation, process_group=pg)``: the valid-token
        count over all ranks, so that DDP's gradient average equals one process holding
        every rank's rows. ``None``: this minibatch's own count. Diagnostics stay local.

        ``process_group``: the same, counted by the loss (one all-reduce per term that has
        its own denominator). Needed instead of ``normalizer`` with a rejecting
        ``rollout_correction``, whose policy term counts only the kept tokens of every rank.
        """
        _check_denominators(self, normalizer, process_group)
        td = tensordict.clone(False)
        _check_batch_dims(td)
        nets = {"actor_network": self.actor_network}
        if self._has_critic:
            nets["critic_network"] = self.critic_network
        _check_network_inputs(td, nets)
        if td.get(self.tensor_keys.advantage, None) is None:
            _check_advantage_source(self)
            _check_estimator_fits(self.value_estimator, td, self.tensor_keys)
            self.value_estimator(td)
        if self._has_critic:
            _check_not_critic_free(td, self.tensor_keys)
        batch = self._read_batch(td)
        if _validate.checking_values() and batch.mask.numel() and not bool(batch.mask.any()):
            warnings.warn(_EMPTY_MASK_WARNING, UserWarning, stacklevel=2)
        log_prob, entropy = self._actor_outputs(td, batch)
        tensors = {name: getattr(batch, name) for name in _Batch._fields[2:] if getattr(batch, name) is not None}
        _validate.check_same_device(log_prob=log_prob, **tensors)
        logps = dict(log_prob=log_prob, sample_log_prob=batch.sample_log_prob, ref_log_prob=batch.ref_log_prob,
                     rollout_log_prob=batch.rollout_log_prob)  # fmt: skip
        _validate.check_log_probs(logps, "TokenPPOLoss", batch.mask)
        norm = _validate.check_normalizer(normalizer, log_prob)
        norm = norm if process_group is None else K.normalizer(batch.mask, self.aggregation, process_group)
        out = self._policy_terms(batch, log_prob, entropy, norm, process_group)
        if self._has_critic:
            self._critic_terms(td, batch, out, norm)
        return out

    def _read_batch(self, td: TensorDictBase) -> _Batch:
        """The rollout entries as ``[*B, R]`` tensors (detached), with errors that name the missing key."""
        k = self.tensor_keys
        fix = "store the policy's per-token log-probs at rollout time (or rename the key with set_keys(sample_log_prob=...))"
        sample_log_prob = TD.require(td, k.sample_log_prob, module="TokenPPOLoss", what="the sampling log-probs", fix=fix)
        shape, _ = TD.step_shape(sample_log_prob, td.batch_dims, td)
        ref = f"sample_log_prob {k.sample_log_prob!r}"

        def get(key, name, what, fix="", required=True):
            if not required and td.get(key, None) is None:
                return None
            x = TD.require(td, key, module="TokenPPOLoss", what=what, fix=fix)
            return _validate.check_float(name, TD.time_last(x, f"{what} {key!r}", shape, ref)).detach()

        critic = self._has_critic
        return _Batch(
            shape=shape,
            ref=ref,
            sample_log_prob=get(k.sample_log_prob, "sample_log_prob", "sample_log_prob"),
            advantage=get(k.advantage, "advantage", "advantage"),
            mask=TD.mask_or_all(td.get(k.mask, None), f"mask {k.mask!r}", shape, ref, sample_log_prob.device),
            ref_log_prob=get(k.ref_log_prob, "ref_log_prob", "reference log-probs", _REF_FIX, self._requires_ref),
            returns=get(k.value_target, "value_target", "value target", "run the value estimator (MaskedGAE) first")
            if critic else None,
            old_values=get(k.value, "state_value", "rollout values", "needed because clip_value is set",
                           critic and self.clip_value is not None),
            rollout_log_prob=get(k.rollout_log_prob, "rollout_log_prob", "rollout log-probs", _ROLLOUT_FIX,
                                 self.rollout_correction is not None),
        )  # fmt: skip

    def _actor_outputs(self, td: TensorDictBase, batch: _Batch) -> tuple[Tensor, Tensor | None]:
        """The actor's ``[*B, R]`` log-probs (and entropy, when it writes one) under the current parameters."""
        k = self.tensor_keys
        out = self._run("actor_network", td, k.log_prob, k.entropy)
        fix = (f"the actor network did not write it; it must output the per-token log-probs [B, R] of the response "
               f"tokens (its out_keys are {getattr(self.actor_network, 'out_keys', None)})")
        log_prob = TD.require(out, k.log_prob, module="TokenPPOLoss", what="the actor's log-probs", fix=fix,
                              collector_fix=False)
        entropy = out.get(k.entropy, None)
        if self.entropy_bonus:
            fix = ("entropy_coeff is set but the actor network did not write it; return the per-token entropy [B, R] "
                   "from the actor (e.g. response_log_probs(..., return_entropy=True))")
            entropy = TD.require(out, k.entropy, module="TokenPPOLoss", what="the actor's entropy", fix=fix,
                                 collector_fix=False)
        log_prob = _validate.check_float("log_prob", TD.time_last(log_prob, f"actor output {k.log_prob!r}", batch.shape,
                                                                  batch.ref))  # fmt: skip
        if entropy is not None:
            entropy = _validate.check_float("entropy", TD.time_last(entropy, f"actor output {k.entropy!r}", batch.shape,
                                                                    batch.ref))  # fmt: skip
        return log_prob, entropy

    def _policy_terms(self, b: _Batch, log_prob: Tensor, entropy: Tensor | None, norm, process_group) -> TensorDict:
        """``loss_objective``, ``loss_kl_ref``, ``loss_entropy`` and the policy diagnostics (the batch is checked:
        the arithmetic is the functional core's, unchecked). Rejected tokens leave the policy term only."""
        eps_low, eps_high = _validate.check_clip_epsilon((self.clip_epsilon_low, self.clip_epsilon_high))
        advantage = K.whiten(b.advantage, b.mask) if self.normalize_advantage else b.advantage
        weights, rollout_stats = self._rollout_weights(b)
        loss_objective, stats = L.policy_loss(
            log_prob, b.sample_log_prob, advantage, b.mask, eps_low, eps_high, dual_clip=self.dual_clip,
            aggregation=self.aggregation, norm=self._policy_normalizer(b.mask, weights, norm, process_group),
            weights=weights, stats=True,
        )  # fmt: skip
        out = TensorDict({"loss_objective": loss_objective, **rollout_stats})
        zero = loss_objective.new_zeros(())
        out.set("loss_kl_ref", zero)
        if b.ref_log_prob is not None:
            kl_ref = self._reference_kl(b, log_prob, norm)
            out.set("loss_kl_ref", self.kl_to_ref_coeff * kl_ref)
            out.set("kl_ref", kl_ref.detach())
        out.set("loss_entropy", zero)
        if entropy is not None:
            out.set("loss_entropy", -self.entropy_coeff * K.aggregate(entropy, b.mask, self.aggregation, norm))
            out.set("entropy", K.masked_mean(entropy.detach(), b.mask))
        for name, stat in _POLICY_STATS:
            out.set(name, stats[stat])
        if self.dual_clip is not None:
            out.set("dual_clip_fraction", stats["dual_clip_fraction"])
        return out

    def _critic_terms(self, td: TensorDictBase, b: _Batch, out: TensorDict, norm) -> None:
        """``loss_critic``, ``value_clip_fraction`` and ``explained_variance``, written into ``out``."""
        k = self.tensor_keys
        values = TD.require(self._run("critic_network", td, k.value), k.value, module="TokenPPOLoss",
                            what="the critic's values", fix="the critic network did not write its [B, R] values",
                            collector_fix=False)  # fmt: skip
        values = _validate.check_float("state_value", TD.time_last(values, f"critic output {k.value!r}", b.shape, b.ref))
        _validate.check_same_device(state_value=values, mask=b.mask)
        if self.clip_value is None:  # no clipping: with V_old = V both branches are (V - G)^2
            loss_critic = L.value_loss(values, values.detach(), b.returns, b.mask, 1.0, aggregation=self.aggregation,
                                       norm=norm)  # fmt: skip
        else:
            c = _validate.check_positive("clip_value", self.clip_value)
            loss_critic, vstats = L.value_loss(values, b.old_values, b.returns, b.mask, c, aggregation=self.aggregation,
                                               norm=norm, stats=True)  # fmt: skip
            out.set("value_clip_fraction", vstats["value_clip_fraction"])
        out.set("loss_critic", self.critic_coeff * loss_critic)
        out.set("explained_variance", K.explained_variance(values.detach(), b.returns, b.mask))

    def _policy_normalizer(self, m: Tensor, weights: Tensor | None, norm, process_group):
        """The policy term's denominator: the other terms' ``norm``, except under a rejecting rollout correction,
        where it counts the kept tokens only (this batch's, or every rank's with a ``process_group``)."""
        if weights is None or self.rollout_correction not in F.ROLLOUT_REJECTION_MODES:
            return norm
        return None if process_group is None else K.normalizer(L.kept_mask(m, weights), self.aggregation, process_group)

    def _reference_kl(self, b: _Batch, log_prob: Tensor, norm) -> Tensor:
        """The aggregated in-loss KL to the reference (importance weighted with ``kl_importance_weighted``)."""
        old = b.sample_log_prob if self.kl_importance_weighted else None
        lp, ref, old = L.masked_log_probs(b.mask, log_prob, b.ref_log_prob, old)  # checked as log-probs in forward
        return L.reference_kl(lp, ref, b.mask, estimator=self.kl_estimator, clamp=self.kl_clamp, sample_log_prob=old,
                              aggregation=self.aggregation, norm=norm)

    def _rollout_weights(self, b: _Batch) -> tuple[Tensor | None, dict[str, Tensor]]:
        """The rollout-correction weights of a batch and their ``rollout_*`` diagnostics (``None, {}`` when off)."""
        if self.rollout_correction is None:
            return None, {}
        weights, stats = F.rollout_correction_weights(
            b.sample_log_prob, b.rollout_log_prob, b.mask, self.rollout_correction, return_stats=True, **self.rollout_thresholds
        )
        return weights, {f"rollout_{name}": stat for name, stat in stats.items()}


_REF_FIX = (
    "needed because kl_to_ref_coeff > 0 (the in-loss KL to a reference policy): run KLPenaltyTransform(ref) on the batch "
    "first, which writes it (ref = frozen_reference(actor_model, P), or any module writing the reference's "
    "per-token log-probs), or build the loss with kl_to_ref_coeff=0.0 to train without the in-loss KL"
)
_ROLLOUT_FIX = (
    "needed because rollout_correction is set: store the per-token log-probs of the engine that sampled the "
    "tokens (e.g. vLLM's), rename the key with set_keys(rollout_log_prob=...), or set rollout_correction=None"
)


def _check_denominators(loss: TokenPPOLoss, normalizer, process_group) -> None:
    """``normalizer=`` and ``process_group=`` exclude each other, and a rejecting rollout correction needs the
    latter: its policy term counts only the kept tokens, which a fixed count cannot know."""
    if normalizer is not None and process_group is not None:
        raise ValueError("TokenPPOLoss: give normalizer= or process_group=, not both (process_group= computes the "
                         "denominators over every rank itself)")
    if normalizer is not None and loss.rollout_correction in F.ROLLOUT_REJECTION_MODES:
        raise ValueError(
            f"TokenPPOLoss(rollout_correction={loss.rollout_correction!r}) rejects tokens, and a rejected token "
            f"leaves the policy term's denominator, which a fixed normalizer= cannot know; pass "
            f"process_group=pg (or None for this batch alone) instead of normalizer="
        )


def _check_overrides(overrides: dict) -> None:
    """:meth:`TokenPPOLoss.minimind` takes the loss's keyword arguments and MiniMind's ``gamma`` / ``lmbda``."""
    known = set(MINIMIND_PPO_DEFAULTS) | set(inspect.signature(TokenPPOLoss).parameters) - {"actor_network", "critic_network"}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"TokenPPOLoss.minimind() got unknown overrides {sorted(unknown)}")


def _check_critic_free(loss: TokenPPOLoss, estimator) -> None:
    """A critic-free estimator (``critic_free = True``) with a critic is an error; one whose method expects
    another aggregation than the loss's is a warning naming it."""
    if not getattr(estimator, "critic_free", False):
        return
    if loss._has_critic:
        raise ValueError(
            f"TokenPPOLoss: {type(estimator).__name__} has no critic (its value_target is the advantage), but this "
            f"loss has a critic network: it would regress the critic onto advantages; build the loss without one, "
            f"TokenPPOLoss(actor, None, ...)"
        )
    expected = getattr(estimator, "aggregation", None)
    if expected is not None and expected != loss.aggregation:
        warnings.warn(
            f"TokenPPOLoss(aggregation={loss.aggregation!r}) with {estimator!r}: that method's objective is "
            f"defined with aggregation={expected!r}; pass aggregation={expected!r} to the loss",
            UserWarning,
            stacklevel=3,
        )


def _check_not_critic_free(td: TensorDictBase, k) -> None:
    """A loss with a critic refuses a batch marked ``critic_free`` whose ``value_target`` is still a copy of its
    ``advantage`` (a critic-free estimator wrote both): the critic would be regressed onto advantages. One host
    read, only on marked batches; skipped under ``value_checks(False)``."""
    marker = td.get(k.critic_free, None)
    if marker is None or not _validate.checking_values():
        return
    adv, target = td.get(k.advantage, None), td.get(k.value_target, None)
    if not (isinstance(adv, Tensor) and isinstance(target, Tensor)):
        return  # a missing entry is named when the batch is read
    if bool(marker.any()) and torch.equal(adv, target):
        raise ValueError(
            f"TokenPPOLoss: the batch's advantages come from a critic-free estimator (its {k.critic_free!r} entry "
            f"is set and {k.value_target!r} is a copy of {k.advantage!r}), but this loss has a critic network: it "
            f"would regress the critic onto advantages; build the loss without one, TokenPPOLoss(actor, None, ...), "
            f"or compute the advantages with MaskedGAE, which reads the critic's values"
        )


def _check_advantage_source(loss: TokenPPOLoss) -> None:
    """A batch without advantages and a loss without a critic need a critic-free estimator to write them."""
    if not loss._has_critic and not getattr(loss.value_estimator, "critic_free", False):
        raise KeyError(
            f"TokenPPOLoss has no critic and the batch has no {loss.tensor_keys.advantage!r}: a loss without a "
            f"critic cannot compute advantages with GAE; write them first with a critic-free estimator "
            f"(GroupAdvantage('grpo' | 'dr_grpo' | 'rloo') or ReinforcePlusPlus on the batch, or "
            f"loss.make_value_estimator(GroupAdvantage(...))), or give the loss a critic"
        )


def _set_rollout_correction(loss: TokenPPOLoss, mode: str | None, high: float, low: float | None) -> None:
    """Set ``rollout_correction`` and its thresholds, checked by the functional core on an empty batch."""
    if mode is not None:
        empty = torch.zeros(1, 0)
        F.rollout_correction_weights(empty, empty, empty.bool(), mode, threshold_high=high, threshold_low=low)
    loss.rollout_correction = mode
    loss.rollout_thresholds = {} if mode is None else {"threshold_high": high, "threshold_low": low}


def _attach_networks(loss: TokenPPOLoss, actor_network, critic_network, functional: bool) -> None:
    """The actor and the critic as TorchRL's LossModule holds them: functional parameters or plain modules."""
    if functional:
        loss.convert_to_functional(actor_network, "actor_network")
        if critic_network is not None:
            loss.convert_to_functional(critic_network, "critic_network")
        else:
            loss.critic_network = None
            loss.critic_network_params = None
    else:
        loss.actor_network = actor_network
        loss.critic_network = critic_network
        loss.actor_network_params = loss.critic_network_params = None


def _loss_in_keys(loss: TokenPPOLoss) -> list:
    """What one call reads: the loss's own entries (those its settings need) and the networks' in_keys."""
    k = loss.tensor_keys
    critic = getattr(loss, "_has_critic", True)
    keys = [k.mask, k.sample_log_prob]
    if getattr(loss, "rollout_correction", None) is not None:
        keys.append(k.rollout_log_prob)
    if getattr(loss, "_requires_ref", True):
        keys.append(k.ref_log_prob)
    keys.append(k.advantage)
    if critic:
        keys.append(k.value_target)
        if getattr(loss, "clip_value", None) is not None:
            keys.append(k.value)
    for net in (loss.actor_network, loss.critic_network if critic else None):
        for key in getattr(net, "in_keys", []):
            if key not in keys:
                keys.append(key)
    return keys


def _check_batch_dims(td: TensorDictBase) -> None:
    if td.batch_dims < 1:
        raise ValueError(
            f"TokenPPOLoss: the TensorDict has batch_size={tuple(td.batch_size)} (no batch dimension); expected "
            f"[B] (the response layout of trajectories_to_llm_batch: [B, S] inputs, [B, R] per-token entries) "
            f"or [*B, R]; for one response add the batch dim with td.unsqueeze(0)"
        )


def _check_network_inputs(td: TensorDictBase, nets: dict) -> None:
    """Every in_key of the actor (and critic) is in ``td``, else a ``KeyError`` naming it and the network.

    Only :class:`~tensordict.nn.TensorDictModule` networks, which need every in_key; other
    TensorDict modules may read some of theirs optionally and check them themselves."""
    for name, net in nets.items():
        if not isinstance(net, TensorDictModule):
            continue
        for key in net.in_keys:
            TD.require(
                td, key, module="TokenPPOLoss", what=f"an input of the {name}, whose in_keys are {net.in_keys}",
                fix=f"give the batch every entry the {name} reads, or build the {name} with in_keys naming "
                    f"the batch's entries (the response layout has 'input_ids' and 'attention_mask')",
            )  # fmt: skip


def _check_estimator_fits(estimator, td: TensorDictBase, k) -> None:
    """Refuse TorchRL's (unmasked) GAE on masked or response-layout data, naming MaskedGAE."""
    if isinstance(estimator, MaskedGAE):
        return
    from torchrl.objectives.value import GAE

    if not isinstance(estimator, GAE):
        return
    keys = td.keys(include_nested=True)
    if k.mask in keys:
        why = f"holds a mask {k.mask!r} that TorchRL's GAE ignores"
    elif TD.next_key(k.done) not in keys and TD.next_key(k.terminated) not in keys:
        why = f"has no {TD.next_key(k.done)!r} flags"
    else:
        return
    raise ValueError(_GAE_ON_MASKED_DATA.format(name=type(estimator).__name__, why=why))


class _Batch(NamedTuple):
    """The entries :class:`TokenPPOLoss` reads, as ``[*B, R]`` tensors; ``ref`` names the reference shape."""

    shape: torch.Size
    ref: str
    sample_log_prob: Tensor
    advantage: Tensor
    mask: Tensor
    ref_log_prob: Tensor | None
    returns: Tensor | None
    old_values: Tensor | None
    rollout_log_prob: Tensor | None = None


# (loss output, functional.ppo_policy_loss statistic)
_POLICY_STATS = (
    ("clip_fraction", "clip_fraction"),
    ("clip_fraction_low", "clip_fraction_low"),
    ("clip_fraction_high", "clip_fraction_high"),
    ("kl_approx", "kl_approx"),
    ("kl_approx_token_max", "kl_approx_token_max"),
    ("mean_ratio", "mean_ratio"),
    ("max_ratio", "max_ratio"),
    ("ESS", "ESS"),
)

"""MaskedGAE: TorchRL's value-estimator interface over :func:`ppo_objectives.functional.masked_gae`.

Shape letters (used in every docstring below):

- ``B``: batch dimensions of the TensorDict, without the time axis (one or more).
- ``R``: the response length (LLM layout: one row per sampled response, padded).
- ``N, T``: rows and time steps of a TorchRL collector batch (collector layout).

TorchRL stores per-step scalars with a trailing feature dim, ``[*B, T, 1]``;
the functional core works on ``[*B, T]``. This module accepts both at its edge
and writes its outputs in the layout of the value entry it read. Nothing is
broadcast: a tensor whose shape is neither ``[*B, T]`` nor ``[*B, T, 1]`` is an
error, never silently expanded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, dispatch
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.objectives.value import ValueEstimatorBase

from ppo_objectives import _td as TD
from ppo_objectives import _validate
from ppo_objectives import functional as F
from ppo_objectives._kernels import masked as K

__all__ = ["MaskedGAE"]

#: ``MaskedGAE(holes=...)``: skip the invalid steps inside a row (ours), or cut the trajectory there (TorchRL's).
HOLES = ("skip", "cut")
LEVELS = ("token", "turn")


class MaskedGAE(ValueEstimatorBase):
    """Generalised advantage estimation over the valid tokens of each row, as a TorchRL value estimator.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation" (arXiv:1506.02438)::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lmbda * A_{t+1}
        value_target_t = A_t (raw, before whitening) + V_t

    where ``t + 1`` is the next *valid* step (masked steps are skipped, their
    entries never read). The arithmetic is :func:`ppo_objectives.functional.masked_gae`,
    one function for both layouts (see ``ppo_objectives/llm/layouts.py`` and
    ``docs/design.md``); this class maps TensorDict keys to its arguments.

    Two forms, chosen by the presence of done flags:

    * **Response form** (no done flags in the TensorDict): one response per row,
      ``mask`` marks its tokens; after the last valid token the next value is 0
      (the response ended). This is MiniMind's GAE, and what the response layout
      of ``trajectories_to_llm_batch`` and the full-sequence layout of
      ``LLMToTokenBatch`` (holes at user and tool tokens) need.
    * **Collector form** ``[N, T]`` (``("next", "done")`` and/or
      ``("next", "terminated")`` / ``("next", "truncated")`` present, completed
      by :func:`~ppo_objectives.functional.resolve_done_flags`): a row may hold
      several trajectories back to back, the last one cut by the batch boundary.
      The recursion restarts at every ``done``; the next value of a trajectory's
      last step is 0 when ``terminated`` and ``("next", "state_value")`` when
      truncated or cut by the boundary. On unmasked data this equals
      :class:`torchrl.objectives.value.GAE`.

    Keys read (names via :meth:`set_keys`; per-step tensors may be ``[*B, T]`` or ``[*B, T, 1]``):

    ============================== ============= ==========================================
    key (field)                    shape         meaning
    ============================== ============= ==========================================
    ``("next", "reward")`` reward  [*B, T(, 1)]  per-token reward
    ``"state_value"`` value        [*B, T(, 1)]  critic values at rollout time; computed by
                                                 ``value_network`` when absent
    ``"mask"`` mask                [*B, T(, 1)]  bool or {0, 1}; optional: a missing mask
                                                 counts every step (TorchRL's convention)
    ``("next", "done")`` done      [*B, T(, 1)]  optional, selects the collector form
    ``("next", "terminated")``     [*B, T(, 1)]  optional (defaults to done & ~truncated)
    ``("next", "truncated")``      [*B, T(, 1)]  optional (defaults to done & ~terminated)
    ``("next", "state_value")``    [*B, T(, 1)]  collector form: bootstrap values
    ============================== ============= ==========================================

    Masks: ``mask`` (this package's name), else TorchRL's ``valid`` (right-padded
    collector batches), else ``("collector", "mask")``; each renamed with
    :meth:`set_keys`. With TorchRL's ``valid`` contract for right padding the
    numbers are TorchRL's: the recursion stops at the valid-to-padding boundary,
    padded steps get exactly 0 and are left out of the whitening, and the last
    valid step of a row bootstraps from its own ``("next", "state_value")`` unless
    terminated (the collector form's "cut by the boundary"). Where this class goes
    further on purpose: the mask may have holes (left padding, tool and user tokens)
    that the recursion skips rather than stops at, and without done flags a row's
    end is terminal (the response form).

    Batch shape: the time axis is the last dim of the value entry. The
    package's response layout is a ``[B]`` TensorDict holding ``[B, S]`` inputs
    next to ``[B, R]`` per-token entries, and runs as it comes. A trailing
    singleton is read as TorchRL's per-step layout when the other dims are the
    TensorDict's batch dims (``[N, T, 1]`` entries of an ``[N, T]`` TensorDict).
    In a ``[B]`` TensorDict a ``[B, 1]`` entry is a response of one token (the
    rows stay separate episodes) unless the TensorDict carries TorchRL's
    ``("next", "done" | "terminated" | "truncated")`` flags, which mark one
    collector trajectory of ``B`` steps.

    **Missing mask.** Without a ``mask`` entry every step takes part, as in
    TorchRL's collector batches (which have none); a padded response batch stored
    without its mask would run GAE through its padding.

    **Non-finite inputs.** Rewards and values may hold anything (NaN, inf) at
    masked steps. A non-finite reward, value or bootstrap value that reaches a
    valid step (so the advantages would come out NaN or inf) is a ``ValueError``
    naming the entry and the first such position. The check reads the result
    (one host read per call) and is skipped under
    :func:`~ppo_objectives.functional.value_checks` ``(False)`` and inside
    ``torch.compile``.

    Keys written: ``"advantage"`` and ``"value_target"`` in the layout of the
    value entry (``[*B, T]`` or ``[*B, T, 1]``), exactly 0 at masked steps; the
    advantage is whitened over the valid steps of the whole batch when
    ``average_gae=True``.

    **Decoupled and length-adaptive lambda** (VAPO, Yue et al. 2025, arXiv:2504.05118). By
    default one lambda makes both outputs. ``policy_lmbda`` gives the advantage its own
    lambda while ``value_target`` keeps ``lmbda`` (VAPO trains the critic on ``lmbda = 1``,
    unbiased Monte-Carlo targets, and the policy on a smaller one); ``length_alpha`` makes the
    advantage's lambda per row, ``1 - 1 / (length_alpha * l)`` for a row of ``l`` valid steps
    (:func:`~ppo_objectives.functional.length_adaptive_lmbda`). Either one runs GAE twice (the
    target with ``lmbda``, the advantage with the policy's lambda); the response form only.

    **Turn-level GAE** (``level="turn"``; Turn-PPO, arXiv:2512.17008). Each run of valid steps
    of a row (an assistant turn between the environment's holes) is one step of the recursion:
    its reward the sum of its tokens', its value the value at its first token; each token of
    the turn gets the turn's advantage and value target
    (:func:`~ppo_objectives.functional.turn_gae`). ``policy_lmbda`` applies (per turn); the
    response form only.

    Args:
        gamma: discount in [0, 1]. Default 1.0 (MiniMind's, and token-level PPO's for LLMs;
            TorchRL's GAE has no default).
        lmbda: GAE lambda in [0, 1]. Default 0.95 (MiniMind's); the value target's, and the
            advantage's unless ``policy_lmbda`` or ``length_alpha`` is given.
        value_network: optional module writing ``state_value``; only called when
            the value entry is missing (and on ``"next"`` when bootstrap values
            are needed but missing). ``None`` is the usual case for a
            transformer critic that scored the whole sequence at rollout time.

    Functional ``params`` / ``target_params`` (which TorchRL's PPO losses pass to
    :meth:`forward`) are used only when the value network has to run.

    Keyword Args:
        policy_lmbda: the advantage's lambda in [0, 1] (decoupled GAE); ``None``: ``lmbda``.
        length_alpha: ``> 0``: the advantage's lambda per row from its length (length-adaptive
            GAE); exclusive with ``policy_lmbda``.
        length_floor: the smallest length-adaptive lambda, in [0, 1] (default 0).
        average_gae: whiten the advantages over the valid steps (MiniMind: True).
            Default ``False`` as in TorchRL.
        differentiable: keep the autograd graph (default ``False``: computed
            under ``torch.no_grad()``).
        device: device of the ``gamma`` / ``lmbda`` buffers.
        skip_existing: forwarded to :class:`~torchrl.objectives.value.ValueEstimatorBase`.
        process_group: a ``torch.distributed`` group: with ``average_gae=True`` the
            advantages are whitened over the valid steps of every rank, so data-parallel
            ranks get the numbers of one process holding the whole batch (default
            ``None``: this process's batch only).
        holes: what an invalid step inside a row does. ``"skip"`` (default, this package's
            semantics): the recursion runs over the valid steps, ``t + 1`` is the next valid
            one, and advantages are whitened with the biased variance,
            ``(A - mean) * rsqrt(var + 1e-8)``. ``"cut"``: TorchRL's semantics for its
            ``valid`` key (pytorch/rl #4404): each valid step followed by an invalid one (or
            by the row's end) ends a trajectory and bootstraps from its own
            ``("next", "state_value")`` (0 where ``terminated``), and the advantages are
            standardised with the unbiased std, ``(A - mean) / max(std, 1e-4)``; the numbers
            of ``torchrl.objectives.value.GAE`` with ``set_keys(valid=...)``.
        level: ``"token"`` (default): a step per valid token. ``"turn"``: a step per run of
            valid tokens, an assistant turn (:func:`~ppo_objectives.functional.turn_gae`).

    Differences from :class:`torchrl.objectives.value.GAE`: masked steps are
    skipped rather than computed on; inside a trajectory the next value is the
    value of the next valid step (TorchRL reads ``("next", "state_value")`` at
    every step, which is the same number on consistent collector data); without
    done flags the end of each row is terminal (LLM layout); whitening is masked.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict(
        ...     {
        ...         "state_value": torch.tensor([[0.5, 0.5, 0.5, 9.0]]),
        ...         "mask": torch.tensor([[True, True, True, False]]),   # last token is padding
        ...         ("next", "reward"): torch.tensor([[0.0, 0.0, 1.0, 7.0]]),
        ...     },
        ...     batch_size=[1, 4],
        ... )
        >>> gae = MaskedGAE(gamma=1.0, lmbda=1.0)
        >>> td = gae(td)
        >>> td["advantage"]            # reward-to-go 1 minus value 0.5; padding is 0
        tensor([[0.5000, 0.5000, 0.5000, 0.0000]])
        >>> td["value_target"]
        tensor([[1., 1., 1., 0.]])

        Collector layout: two trajectories in one row, the first terminated, the
        second cut by the batch boundary and bootstrapped from ``("next", "state_value")``:

        >>> td = TensorDict(
        ...     {
        ...         "state_value": torch.zeros(1, 4, 1),
        ...         ("next", "state_value"): torch.tensor([[[0.0], [0.0], [0.0], [2.0]]]),
        ...         ("next", "reward"): torch.tensor([[[1.0], [1.0], [1.0], [1.0]]]),
        ...         ("next", "done"): torch.tensor([[[False], [True], [False], [False]]]),
        ...         ("next", "terminated"): torch.tensor([[[False], [True], [False], [False]]]),
        ...     },
        ...     batch_size=[1, 4],
        ... )
        >>> MaskedGAE(gamma=1.0, lmbda=1.0)(td)["advantage"].squeeze(-1)   # 1+1 | 1+1+2, 1+2
        tensor([[2., 1., 4., 3.]])
    """

    @dataclass
    class _AcceptedKeys:
        """Configurable TensorDict keys of :class:`MaskedGAE` (set them with :meth:`set_keys`).

        Attributes:
            advantage: where the advantage is written. Defaults to ``"advantage"``.
            value_target: where the value target (raw advantage + value) is
                written. Defaults to ``"value_target"``.
            value: the critic values; also read under ``"next"`` for bootstrapping.
                Defaults to ``"state_value"``.
            reward: the per-token reward, read under ``"next"``. Defaults to ``"reward"``.
            done: trajectory end flag, read under ``"next"``. Defaults to ``"done"``.
            terminated: termination flag, read under ``"next"``. Defaults to ``"terminated"``.
            truncated: truncation flag, read under ``"next"``. Defaults to ``"truncated"``.
            mask: which steps take part (True) or are skipped. Defaults to ``"mask"``.
            valid: TorchRL's right-padding mask, read when there is no ``mask`` entry.
                Defaults to ``"valid"``.
            collector_mask: the collector's mask, read when there is neither ``mask``
                nor ``valid``. Defaults to ``("collector", "mask")``.
            steps_to_next_obs: multi-step returns are not supported; its presence is
                an error. Defaults to ``"steps_to_next_obs"``.
            sample_log_prob: unused by GAE; kept for losses that forward it.
                Defaults to ``"sample_log_prob"`` (or ``"action_log_prob"`` when
                :func:`~tensordict.nn.composite_lp_aggregate` is off).
        """

        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        value: NestedKey = "state_value"
        reward: NestedKey = "reward"
        done: NestedKey = "done"
        terminated: NestedKey = "terminated"
        truncated: NestedKey = "truncated"
        mask: NestedKey = "mask"
        valid: NestedKey = "valid"
        collector_mask: NestedKey = ("collector", "mask")
        steps_to_next_obs: NestedKey = "steps_to_next_obs"
        sample_log_prob: NestedKey | None = None

        def __post_init__(self):
            if self.sample_log_prob is None:
                self.sample_log_prob = TD.default_log_prob_key()

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    value_network: TensorDictModule | None

    def __init__(
        self,
        gamma: float | Tensor = 1.0,
        lmbda: float | Tensor = 0.95,
        value_network: TensorDictModule | None = None,
        *,
        policy_lmbda: float | None = None,
        length_alpha: float | None = None,
        length_floor: float = 0.0,
        average_gae: bool = False,
        differentiable: bool = False,
        skip_existing: bool | None = None,
        device: torch.device | None = None,
        process_group=None,
        holes: str = "skip",
        level: str = "token",
    ):
        super().__init__(
            value_network=value_network, differentiable=differentiable, skip_existing=skip_existing, device=device
        )
        for name, x in (("gamma", gamma), ("lmbda", lmbda)):
            _validate.check_unit_interval(name, x)
            # float64, cast to the data's compute dtype at use: float64 batches get the exact hyper-parameter
            self.register_buffer(name, torch.as_tensor(x, dtype=torch.float64, device=self._device).clone())
        if policy_lmbda is not None and length_alpha is not None:
            raise ValueError(
                f"MaskedGAE: policy_lmbda={policy_lmbda} and length_alpha={length_alpha} both set the advantage's "
                f"lambda (a fixed one, and one per row from its length); give one of them"
            )
        if policy_lmbda is not None:
            _validate.check_unit_interval("policy_lmbda", policy_lmbda)
        if length_alpha is not None:
            _validate.check_positive("length_alpha", length_alpha)
        _validate.check_unit_interval("length_floor", length_floor)
        self.policy_lmbda, self.length_alpha, self.length_floor = policy_lmbda, length_alpha, float(length_floor)
        self.average_gae = bool(average_gae)
        self.process_group = process_group
        if holes not in HOLES:
            raise ValueError(f"MaskedGAE: holes={holes!r} is not one of {HOLES} (skip: ours; cut: TorchRL's valid key)")
        if holes == "cut" and (policy_lmbda is not None or length_alpha is not None):
            raise ValueError("MaskedGAE: holes='cut' (TorchRL's semantics) takes one lambda: drop policy_lmbda / "
                             "length_alpha, or use holes='skip'")
        self.holes = holes
        if level not in LEVELS:
            raise ValueError(f"MaskedGAE: level={level!r} is not one of {LEVELS} (token: a step per token; turn: a "
                             f"step per assistant turn)")
        if level == "turn" and (holes == "cut" or length_alpha is not None):
            raise ValueError("MaskedGAE: level='turn' runs over the turns between the holes with one lambda per "
                             "batch: drop holes='cut' / length_alpha")
        self.level = level

    @property
    def in_keys(self):
        keys = [
            ("next", self.tensor_keys.reward),
            self.tensor_keys.value,
            self.tensor_keys.mask,
            self.tensor_keys.valid,
            self.tensor_keys.collector_mask,
            TD.next_key(self.tensor_keys.done),
            TD.next_key(self.tensor_keys.terminated),
            TD.next_key(self.tensor_keys.truncated),
            TD.next_key(self.tensor_keys.value),
        ]
        if self.value_network is not None:
            keys += [k for k in self.value_network.in_keys if k not in keys]
        return keys

    @property
    def out_keys(self):
        return [self.tensor_keys.advantage, self.tensor_keys.value_target]

    def _values(self, tensordict: TensorDictBase, key: NestedKey, params, *, next_step: bool, fix: str) -> Tensor:
        """The value entry, computed by ``value_network`` when missing (bootstrap values without gradient)."""
        if self.value_network is None:
            what = "the next values" if next_step else "the critic's values"
            return TD.require(tensordict, key, module="MaskedGAE", what=what, fix=fix, collector_fix=False)
        value = tensordict.get(key, None)
        if value is not None:
            return value
        ctx = (
            params.to_module(self.value_network, preserve_module_state=False)
            if params is not None
            else contextlib.nullcontext()
        )
        with ctx, torch.no_grad() if next_step else contextlib.nullcontext():
            source = tensordict.get("next") if next_step else tensordict
            out = self.value_network(source.copy())
        value = out.get(self.tensor_keys.value)
        tensordict.set(key, value)
        return value

    @dispatch
    def forward(
        self,
        tensordict: TensorDictBase,
        *,
        params: TensorDictBase | None = None,
        target_params: TensorDictBase | None = None,
    ) -> TensorDictBase:
        """Compute ``advantage`` and ``value_target`` and write them into ``tensordict`` (returned).

        Accepts keyword tensors too (``next_reward=``, ``state_value=``, ``mask=``, ...),
        returning ``(advantage, value_target)``.
        """
        # Functional parameters (as TorchRL's PPO losses pass them) are used only if the
        # value network has to run; precomputed values are read as they are.
        params = None if params is None else params.detach()
        next_params = params if target_params is None else target_params
        with torch.set_grad_enabled(self.differentiable):
            adv, target = self._estimate(tensordict, params, next_params)
        tensordict.set(self.tensor_keys.advantage, adv)
        tensordict.set(self.tensor_keys.value_target, target)
        return tensordict

    def value_estimate(self, tensordict: TensorDictBase, target_params=None, next_value=None, **kwargs) -> Tensor:
        """The value target (raw advantage + value) of :meth:`forward`, without writing anything."""
        tensordict = tensordict.copy()
        if next_value is not None:  # given explicitly: the bootstrap values of the collector layout
            tensordict.set(TD.next_key(self.tensor_keys.value), next_value)
        with torch.set_grad_enabled(self.differentiable):
            return self._estimate(tensordict, None, target_params)[1]

    def _estimate(self, tensordict: TensorDictBase, params, next_params) -> tuple[Tensor, Tensor]:
        keys = self.tensor_keys
        if tensordict.batch_dims < 1:
            raise ValueError(
                f"MaskedGAE needs a TensorDict with a time dimension, got batch_size={tuple(tensordict.batch_size)}; "
                "use batch_size [*B, T]"
            )
        if keys.steps_to_next_obs in tensordict.keys(True):
            raise NotImplementedError(
                f"found {keys.steps_to_next_obs!r}: multi-step returns are not supported by MaskedGAE "
                "(the result would ignore the n-step discount); use torchrl.objectives.value.GAE"
            )
        reward = TD.require(tensordict, ("next", keys.reward), module="MaskedGAE", what="the per-step reward",
                            fix="the environment (or a reward transform) writes it under 'next'", collector_fix=False)
        fix = "no value_network was given: store the critic's values at rollout time or pass value_network="
        value = self._values(tensordict, keys.value, params, next_step=False, fix=fix)
        shape, trailing_one = TD.step_shape(value, tensordict.batch_dims, tensordict)
        ref = f"value {keys.value!r}"
        r = TD.time_last(reward, f"reward {('next', keys.reward)!r}", shape, ref)
        v = TD.time_last(value, ref, shape, ref)
        m = None  # None: every step takes part (no packing of the rows)
        for key in (keys.mask, keys.valid, keys.collector_mask):  # the first present, in this order
            m = tensordict.get(key, None)
            if m is not None:
                m = TD.time_last(m, f"mask {TD.key_str(key)}", shape, ref)
                break

        done = tensordict.get(TD.next_key(keys.done), None)
        terminated = tensordict.get(TD.next_key(keys.terminated), None)
        truncated = tensordict.get(TD.next_key(keys.truncated), None)
        ends = {}
        if done is not None or terminated is not None or truncated is not None:
            ends = self._collector_ends(tensordict, next_params, shape, done, terminated, truncated)
        if self.holes == "cut" and m is not None:
            m = _validate.check_mask(m, shape, ref)
            adv, target = self._gae_cut(tensordict, next_params, r, v, m, ends, shape)
        else:
            adv, target = self._gae(r, v, m, ends)
        if _validate.checking_values() and adv.numel():
            if not bool((torch.isfinite(adv).all() & torch.isfinite(target).all())):
                self._raise_non_finite(r, v, m, ends.get("next_values"), shape, ref)
        if trailing_one:
            adv, target = adv.unsqueeze(-1), target.unsqueeze(-1)
        return adv, target

    def _gae(self, r: Tensor, v: Tensor, m: Tensor | None, ends: dict) -> tuple[Tensor, Tensor]:
        """``(advantage, value_target)``: one GAE with ``lmbda``, or the target with ``lmbda`` and the advantage with
        the policy's lambda (``policy_lmbda``, or per row from ``length_alpha``)."""
        kw = dict(process_group=self.process_group, **ends)
        if self.level == "turn":
            return self._turn_gae(r, v, m, ends)
        if self.policy_lmbda is None and self.length_alpha is None:
            return F.masked_gae(r, v, m, self.gamma, self.lmbda, average_gae=self.average_gae, **kw)
        if ends:
            raise ValueError(
                "MaskedGAE: policy_lmbda / length_alpha take the response form (one response per row, no done "
                "flags); this batch has done flags (the collector form): drop them or the decoupled lambda"
            )
        _, target = F.masked_gae(r, v, m, self.gamma, self.lmbda, average_gae=False, **kw)
        if self.length_alpha is not None:
            mask = m if m is not None else torch.ones(r.shape, dtype=torch.bool, device=r.device)
            lmbda = F.length_adaptive_lmbda(mask, self.length_alpha, self.length_floor).to(r.dtype if r.is_floating_point() else None)
        else:
            lmbda = self.policy_lmbda
        adv, _ = F.masked_gae(r, v, m, self.gamma, lmbda, average_gae=self.average_gae, **kw)
        return adv, target

    def _turn_gae(self, r: Tensor, v: Tensor, m: Tensor | None, ends: dict) -> tuple[Tensor, Tensor]:
        """``level="turn"``: the target with ``lmbda``, the advantage with ``policy_lmbda`` (when given), per turn."""
        if ends:
            raise ValueError("MaskedGAE: level='turn' takes the response form (one response per row, no done flags); "
                             "this batch has done flags (the collector form): convert it to the response layout")
        if m is None:
            m = torch.ones(r.shape, dtype=torch.bool, device=r.device)
        adv, target = F.turn_gae(r, v, m, self.gamma, self.lmbda, average_gae=self.average_gae,
                                 process_group=self.process_group)  # fmt: skip
        if self.policy_lmbda is not None:
            adv, _ = F.turn_gae(r, v, m, self.gamma, self.policy_lmbda, average_gae=self.average_gae,
                                process_group=self.process_group)  # fmt: skip
        return adv, target

    def _gae_cut(self, tensordict, next_params, r, v, m: Tensor, ends: dict, shape) -> tuple[Tensor, Tensor]:
        """``holes="cut"``: every valid step before an invalid one ends a trajectory and bootstraps from its next
        value; the advantages are standardised with TorchRL's unbiased formula."""
        key = TD.next_key(self.tensor_keys.value)
        if "next_values" not in ends:
            fix = "holes='cut' bootstraps the step before each invalid one (and a row's last) from its next value"
            nv = self._values(tensordict, key, next_params, next_step=True, fix=fix)
            ends = dict(next_values=TD.time_last(nv, f"next value {key!r}", shape, f"value {key!r}"))
        nxt = torch.cat([m[..., 1:], torch.zeros_like(m[..., :1])], dim=-1)
        cut = m & ~nxt
        no = torch.zeros_like(m)
        done = cut | (no if ends.get("done") is None else ends["done"])
        terminated = no if ends.get("terminated") is None else ends["terminated"]
        adv, target = F.masked_gae(r, v, m, self.gamma, self.lmbda, average_gae=False, done=done,
                                   terminated=terminated, next_values=ends["next_values"])  # fmt: skip
        if self.average_gae:
            adv = K.standardize_unbiased(adv, m)
        return adv, target

    def _raise_non_finite(self, r: Tensor, v: Tensor, m: Tensor | None, nv: Tensor | None, shape, ref) -> None:
        """The advantages are not finite: name the input and the first valid position that made them so."""
        keys = self.tensor_keys
        valid = None if m is None else _validate.check_mask(m, shape, ref)
        entries = [(f"reward {('next', keys.reward)!r}", r), (f"value {keys.value!r}", v)]
        if nv is not None:
            entries.append((f"next value {TD.next_key(keys.value)!r}", nv))
        found = _validate.first_non_finite([(name, x, valid) for name, x in entries])
        if found is not None:
            name, pos, value = found
            raise ValueError(
                f"MaskedGAE: the {name} holds {value} at the valid position {pos}, so the advantages would be "
                f"NaN/inf; fix the reward function or the critic there, or mask the step out (mask False: masked "
                f"steps may hold anything, they are never read)"
            )
        raise ValueError(
            "MaskedGAE: the advantages are not finite although the rewards and values at the valid steps are "
            "(an overflow of very large rewards or values); rescale them"
        )

    def _collector_ends(self, tensordict, next_params, shape, done, terminated, truncated) -> dict[str, Tensor]:
        """``done`` / ``terminated`` / ``next_values`` of the collector layout, as ``masked_gae`` takes them."""
        keys = self.tensor_keys
        ref = f"value {keys.value!r}"

        def flag(x, key):
            x = TD.time_last(x, f"flag {TD.next_key(key)!r}", shape, ref)
            return _validate.check_mask(x, shape, ref, name=f"flag {TD.next_key(key)!r}")

        flags = [None if x is None else flag(x, k) for x, k in
                 ((done, keys.done), (terminated, keys.terminated), (truncated, keys.truncated))]  # fmt: skip
        done, terminated, _ = F.resolve_done_flags(*flags)
        fix = ("done flags are present (collector layout) and no value_network was given; the next values "
               "bootstrap truncated trajectories and rows cut by the batch boundary (using 0 would treat them as "
               "terminated). Store the next values, pass value_network=, or drop the done flags for LLM data where "
               "every row ends its response")
        next_value = self._values(tensordict, TD.next_key(keys.value), next_params, next_step=True, fix=fix)
        nv = TD.time_last(next_value, f"next value {TD.next_key(keys.value)!r}", shape, ref)
        return dict(done=done, terminated=terminated, next_values=nv)

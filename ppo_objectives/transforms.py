"""KLPenaltyTransform and KL-coefficient controllers: the reference-KL penalty in the reward, on TorchRL.

Shape letters (used in every docstring below):

- ``B``: batch dimensions (one sampled response per row), written ``*B`` when several.
- ``R``: the response length (tokens the policy generated, padded), or ``T`` the
  time steps of a collector batch; time is always the last per-token axis.

Per-token entries may be stored ``[*B, R]`` or ``[*B, R, 1]`` (TorchRL's per-step
layout) and are adapted at the edge; nothing is broadcast. The arithmetic is
:func:`ppo_objectives.functional.kl_penalized_rewards` and
:func:`~ppo_objectives.functional.adaptive_kl_coeff` (``docs/design.md``, "Reference KL").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, dispatch
from tensordict.utils import NestedKey, unravel_key
from torch import Tensor, nn
from torchrl.data import Composite, Unbounded
from torchrl.envs import EnvBase
from torchrl.envs.transforms import Compose, Transform

from ppo_objectives import _td as TD
from ppo_objectives import _validate
from ppo_objectives import functional as F
from ppo_objectives._kernels import losses as L
from ppo_objectives._kernels import masked as K

__all__ = ["AdaptiveKLController", "FixedKLController", "KLPenaltyTransform"]

_NESTED_PROTOTYPE_WARNING = "The PyTorch API of nested tensors is in prototype stage"


class FixedKLController(nn.Module):
    """A constant KL coefficient ``beta`` with the controller interface (``update`` does nothing).

    The coefficient is the buffer ``coeff`` (saved in ``state_dict``).

    Example:
        >>> ctl = FixedKLController(0.05)
        >>> ctl.update(torch.tensor(3.0))
        tensor(0.0500)
        >>> ctl.state_dict()
        OrderedDict([('coeff', tensor(0.0500))])
    """

    def __init__(self, coeff: float = 0.05):
        super().__init__()
        if not _validate.is_real(coeff, low=0):
            raise ValueError(f"coeff={coeff!r} must be a float >= 0 and finite (the weight of the KL penalty)")
        self.register_buffer("coeff", torch.tensor(float(coeff)))

    def update(self, kl: Tensor | float, n_steps: int = 1) -> Tensor:
        """Return the (unchanged) coefficient."""
        return self.coeff


class AdaptiveKLController(nn.Module):
    """Adapt ``beta`` so that the observed KL tracks a target (Ziegler et al. 2019, arXiv:1909.08593).

    After each batch of ``n_steps`` samples with observed KL ``kl``::

        e     = clip(kl / target - 1, -clip, clip)      # proportional error, clip = 0.2
        beta <- beta * (1 + e * n_steps / horizon)

    ``kl`` must be in the units of ``target``: the per-sequence KL (the sum over
    a response's tokens, ``KLPenaltyTransform.last_seq_kl``) for the paper's
    targets of a few nats, or a per-token mean (the loss's ``kl_ref``) for a
    per-token target. The state (``coeff``, ``target``, ``horizon``) lives in
    the state dict (``coeff`` a buffer, the rest extra state), so ``state_dict`` /
    ``load_state_dict`` round-trip it. No host synchronisation: ``kl`` may be a
    CUDA tensor.

    Args:
        init_coeff: starting ``beta`` (Ziegler et al. / TRL: 0.2).
        target: target KL (TRL's default 6.0 nats per sequence).
        horizon: the adaptation horizon in samples (TRL's default 10000).
        clip: bound on the proportional error (0.2 in the paper). ``update`` refuses
            ``n_steps`` with ``clip * n_steps >= horizon`` (beta could reach 0 or flip sign).

    Example:
        >>> ctl = AdaptiveKLController(init_coeff=0.2, target=6.0, horizon=100)
        >>> ctl.update(torch.tensor(12.0), n_steps=10)   # e = clip(1, 0.2) = 0.2: beta * (1 + 0.2 * 0.1)
        tensor(0.2040)
        >>> ctl.update(6.0, n_steps=10)                  # on target: unchanged
        tensor(0.2040)
        >>> ctl.update(0.0, n_steps=10)                  # e = -0.2: beta * 0.98
        tensor(0.1999)
    """

    def __init__(self, init_coeff: float = 0.2, target: float = 6.0, horizon: float = 10000, *, clip: float = 0.2):
        super().__init__()
        if not _validate.is_real(init_coeff, low=0):
            raise ValueError(f"init_coeff={init_coeff!r} must be a float >= 0 and finite")
        _validate.check_positive("target", target, what=" (the KL the controller steers towards)")
        _validate.check_positive("horizon", horizon, what=" (samples over which beta adapts)")
        _validate.check_positive("clip", clip)
        self.register_buffer("coeff", torch.tensor(float(init_coeff)))
        self.target, self.horizon, self.clip = float(target), float(horizon), float(clip)

    def get_extra_state(self) -> dict[str, float]:
        return {"target": self.target, "horizon": self.horizon, "clip": self.clip}

    def set_extra_state(self, state: dict[str, float]) -> None:
        self.target, self.horizon, self.clip = (float(state[k]) for k in ("target", "horizon", "clip"))

    def update(self, kl: Tensor | float, n_steps: int = 1) -> Tensor:
        """Move ``coeff`` one step towards the target given the observed ``kl``; return it.

        A non-finite ``kl`` (e.g. NaN from an empty batch) leaves ``coeff`` unchanged.
        """
        self.coeff.copy_(F.adaptive_kl_coeff(self.coeff, kl, self.target, self.horizon, n_steps, clip=self.clip))
        return self.coeff


class KLPenaltyTransform(Transform):
    """Per-token KL to a frozen reference policy, optionally subtracted from the per-token reward.

    For every response token ``t`` (``mask`` True)::

        kl_t     = KL_est(sample_log_prob_t, ref_log_prob_t)        # k1 = logp - ref_logp by default
        reward_t <- reward_t - coeff * kl_t                        (add_to_reward=True)

    ``KL_est`` is :func:`ppo_objectives.functional.kl_estimate` (Schulman 2020,
    "Approximating KL Divergence"); k1 is the unbiased choice inside a reward
    (Ziegler et al. 2019, arXiv:1909.08593; Stiennon et al. 2020); the arithmetic is
    :func:`ppo_objectives.functional.kl_penalized_rewards`. A sequence-level score (one reward per response, shape ``[*B]`` or
    ``[*B, 1]``) is placed on the last valid token and the other tokens get only
    the penalty: the score is never copied onto every token (a score on a row
    without any valid token is refused, since it would be dropped; that check
    reads the mask, so like the functional core's value checks it is skipped
    inside ``torch.compile`` and under ``functional.value_checks(False)``).

    ``ref_log_prob`` is read when present; otherwise ``ref_model`` computes it
    (without gradient): a TensorDict module that reads the token entries and
    writes ``ref_model_log_prob_key`` (default ``"log_prob"``) ``[*B, R]``, the
    same interface as the actor of :class:`~ppo_objectives.loss.TokenPPOLoss`.
    The coefficient comes from ``kl_controller`` (a :class:`FixedKLController`
    when ``coeff`` is a float, or an :class:`AdaptiveKLController`); after each
    call ``last_kl`` (masked mean over tokens) and ``last_seq_kl`` (mean over
    responses of the per-response sum; a row with no valid token is not a
    response and is not counted) hold the observed KL, detached, for
    ``kl_controller.update(...)``.

    Keys (names via :meth:`set_keys`, fields of :class:`KLPenaltyTransform._AcceptedKeys`):

    ================================ ============== =====================================
    key (field)                      shape          role
    ================================ ============== =====================================
    ``"sample_log_prob"`` log_prob   [*B, R(, 1)]   read: sampling policy's log-probs
    ``"ref_log_prob"`` ref_log_prob  [*B, R(, 1)]   read if present, else written
    ``"mask"`` mask                  [*B, R(, 1)]   read (optional): response tokens;
                                                    missing: every token counts
    ``("next", "reward")`` reward    [*B, R(, 1)]   read and written (add_to_reward);
                                     or [*B(, 1)]   a sequence score becomes [*B, R(, 1)]
    ``"kl_penalty"`` kl              [*B, R]        written: per-token KL, 0 where masked
    ================================ ============== =====================================

    A missing ``mask`` counts every token (TorchRL's convention: collector
    batches have none), so the penalty and a sequence score's "last valid token"
    then cover the padding too; give response batches their mask.

    Where it goes: **before the advantages**. With ``add_to_reward=True`` the
    penalty is part of the reward that :class:`~ppo_objectives.value.gae.MaskedGAE`
    turns into advantages and value targets, so it must be applied to a batch
    before GAE runs on it, once per rollout: inside the env, as (part of) a
    collector ``postproc``, or called on the batch (``ppo_objectives/train/``
    calls it between the critic and ``MaskedGAE``). Not in the replay buffer the
    PPO minibatches are drawn from: PPO computes the advantages once per rollout,
    before that buffer is filled, so a penalty applied there on ``extend`` or
    ``sample`` changes a reward that GAE has already read, and the advantages the
    loss trains on never see it.

    * **offline / collector postproc**: ``forward(td)`` (and ``inv(td)``) read
      and write the keys above. The transform is idempotent: when ``kl_key`` is
      already present the data are returned unchanged, so a batch penalised in a
      collector ``postproc`` is not penalised again if the transform runs on it a
      second time (in a replay buffer, say, where only the diagnostics
      ``kl_penalty`` / ``ref_log_prob`` are of use after GAE).
      Ragged batches (a :class:`~tensordict.LazyStackedTensorDict` of responses of
      different lengths, or nested tensors, as TorchRL's LLM collectors produce)
      are handled per response.
    * **inside a TransformedEnv** (one step = one token): at each step the
      policy's ``log_prob_key`` ``[*B]`` of the token just sampled is compared with
      the reference's, ``"reward"`` ``[*B, 1]`` of the step is penalised, and
      ``kl_key`` / ``ref_log_prob_key`` are written into ``"next"`` (zeros at reset).
      ``ref_model`` is required there (the root ``ref_log_prob`` is the previous
      step's observation). The reward spec becomes unbounded; the observation spec
      gains both keys. ``inv`` does nothing inside an env. Steps without the
      policy's log-prob raise, unless ``set_missing_tolerance(True)`` (e.g. for
      ``check_env_specs`` with random actions).

    Args:
        ref_model: optional frozen reference module (see above).

    Keyword Args:
        coeff: KL coefficient (float, default 0.05) or a controller module.
        estimator: ``"k1"`` (default), ``"k2"``, ``"k3"`` or ``"k3+"``.
        clamp: optional bound on the per-token estimate.
        add_to_reward: subtract ``coeff * kl`` from the reward (default True);
            when False only ``kl_key`` and ``ref_log_prob_key`` are written.
        log_prob_key, ref_log_prob_key, ref_model_log_prob_key, mask_key, kl_key, reward_key:
            entry names, the same as ``set_keys(log_prob=..., ...)`` (the reward is read
            under ``"next"`` offline).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict(
        ...     {
        ...         "sample_log_prob": torch.tensor([[-1.0, -1.0, -1.0]]),
        ...         "ref_log_prob": torch.tensor([[-1.5, -1.0, 7.0]]),
        ...         "mask": torch.tensor([[True, True, False]]),
        ...         ("next", "reward"): torch.tensor([[0.0, 2.0, 5.0]]),
        ...     },
        ...     batch_size=[1, 3],
        ... )
        >>> t = KLPenaltyTransform(coeff=0.1)
        >>> td = t(td)
        >>> td["kl_penalty"]                 # k1 = logp - ref_logp; 0 at the padding token
        tensor([[0.5000, 0.0000, 0.0000]])
        >>> td["next", "reward"]             # 0 - 0.1 * 0.5, 2 - 0; padding is 0
        tensor([[-0.0500,  2.0000,  0.0000]])

        A sequence-level score (one per response) lands on the last valid token only:

        >>> td = TensorDict(
        ...     {
        ...         "sample_log_prob": torch.full((2, 3), -1.0),
        ...         "ref_log_prob": torch.full((2, 3), -1.0),
        ...         "mask": torch.tensor([[True, True, True], [True, False, False]]),
        ...         ("next", "reward"): torch.tensor([[1.0], [3.0]]),
        ...     },
        ...     batch_size=[2],
        ... )
        >>> KLPenaltyTransform(coeff=0.1)(td)["next", "reward"]
        tensor([[[0.],
                 [0.],
                 [1.]],
        <BLANKLINE>
                [[3.],
                 [0.],
                 [0.]]])
    """

    @dataclass
    class _AcceptedKeys:
        """Configurable TensorDict keys of :class:`KLPenaltyTransform` (set them with :meth:`set_keys`).

        Attributes:
            log_prob: the sampling policy's log-probs of the sampled tokens. Defaults to ``"sample_log_prob"``.
            ref_log_prob: the reference's log-probs, read if present, else written. Defaults to ``"ref_log_prob"``.
            ref_model_log_prob: what ``ref_model`` writes. Defaults to ``"log_prob"``.
            mask: response tokens that take part (optional entry). Defaults to ``"mask"``.
            kl: the per-token KL written. Defaults to ``"kl_penalty"``.
            reward: the reward, read under ``"next"`` offline. Defaults to ``"reward"``.
        """

        log_prob: NestedKey = "sample_log_prob"
        ref_log_prob: NestedKey = "ref_log_prob"
        ref_model_log_prob: NestedKey = "log_prob"
        mask: NestedKey = "mask"
        kl: NestedKey = "kl_penalty"
        reward: NestedKey = "reward"

    default_keys = _AcceptedKeys
    invertible = False

    def __init__(
        self,
        ref_model: TensorDictModule | None = None,
        *,
        coeff: float | nn.Module = 0.05,
        estimator: str = "k1",
        clamp: float | None = None,
        add_to_reward: bool = True,
        **keys: NestedKey,
    ):
        if estimator not in F.KL_ESTIMATORS:
            raise ValueError(f"estimator={estimator!r} is not one of {F.KL_ESTIMATORS}")
        if clamp is not None:
            _validate.check_positive("clamp", clamp)
        super().__init__(in_keys=[], out_keys=[])
        self.ref_model = ref_model
        self.kl_controller = _as_controller(coeff)
        self.estimator = estimator
        self.clamp = clamp
        self.add_to_reward = bool(add_to_reward)
        self.tensor_keys = self._AcceptedKeys()
        self.set_keys(**{_key_field(name): value for name, value in keys.items()})
        self.register_buffer("last_kl", torch.zeros(()), persistent=False)
        self.register_buffer("last_seq_kl", torch.zeros(()), persistent=False)

    def set_keys(self, **kwargs: NestedKey) -> KLPenaltyTransform:
        """Rename entries, e.g. ``set_keys(log_prob="old_log_prob", reward="score")``; returns ``self``.

        The fields are those of :class:`KLPenaltyTransform._AcceptedKeys`; the constructor's
        ``log_prob_key=``-style keywords are the same thing.
        """
        fields = self._AcceptedKeys.__dataclass_fields__
        for name, value in kwargs.items():
            if name not in fields:
                raise KeyError(f"KLPenaltyTransform.set_keys: {name!r} is not one of {sorted(fields)}")
            if not isinstance(value, (str, tuple)):
                raise TypeError(f"KLPenaltyTransform.set_keys: {name}={value!r} must be a str or a tuple of str")
        self.tensor_keys = replace(self.tensor_keys, **{n: unravel_key(v) for n, v in kwargs.items()})
        k, reward = self.tensor_keys, [TD.next_key(self.tensor_keys.reward)] if self.add_to_reward else []
        self.in_keys = [k.log_prob, k.ref_log_prob, k.mask] + reward
        self.out_keys = [k.kl, k.ref_log_prob] + reward
        return self

    @property
    def coeff(self) -> Tensor:
        """The current KL coefficient (the controller's ``coeff`` buffer)."""
        return self.kl_controller.coeff

    # the constructor's keyword names, kept as read-only attributes
    log_prob_key = property(lambda self: self.tensor_keys.log_prob)
    ref_log_prob_key = property(lambda self: self.tensor_keys.ref_log_prob)
    ref_model_log_prob_key = property(lambda self: self.tensor_keys.ref_model_log_prob)
    mask_key = property(lambda self: self.tensor_keys.mask)
    kl_key = property(lambda self: self.tensor_keys.kl)
    reward_key = property(lambda self: self.tensor_keys.reward)

    # ------------------------------------------------------------------ helpers

    def _in_env(self) -> bool:
        container = self.__dict__.get("_container")
        container = container() if container is not None else None
        while isinstance(container, Compose):
            ref = container.__dict__.get("_container")
            container = ref() if ref is not None else None
        return isinstance(container, EnvBase)

    def _ref_log_prob(self, tensordict: TensorDictBase) -> Tensor:
        k = self.tensor_keys
        if self.ref_model is None:
            return TD.require(tensordict, k.ref_log_prob, module="KLPenaltyTransform", what="the reference log-probs",
                              fix="no ref_model was given: precompute the reference log-probs or pass ref_model=")
        ref = tensordict.get(k.ref_log_prob, None)
        if ref is not None:
            return ref
        with torch.no_grad():
            out = self.ref_model(tensordict.copy())
        fix = "it must output the per-token log-probs of the sampled tokens (set_keys(ref_model_log_prob=...) to its out key)"
        return TD.require(out, k.ref_model_log_prob, module="KLPenaltyTransform", what="the ref_model output", fix=fix).detach()

    def _log_prob(self, tensordict: TensorDictBase) -> Tensor:
        fix = "store the policy's per-token log-probs at rollout time, or name the entry with set_keys(log_prob=...)"
        return TD.require(tensordict, self.tensor_keys.log_prob, module="KLPenaltyTransform", what="the sampling log-probs", fix=fix)

    def _penalize(self, logp: Tensor, ref: Tensor, mask: Tensor | None, reward: Tensor | None, batch_dims: int,
                  td: TensorDictBase | None = None):
        """One dense batch: ``logp`` defines ``[*B, R]``; returns ``(kl [*B, R], ref, mask, new reward or None)``.

        Layout only: the arithmetic is :func:`~ppo_objectives.functional.kl_penalized_rewards`. A
        trailing singleton is TorchRL's per-step layout as :func:`ppo_objectives._td.step_shape` tells it:
        from the flags of ``td`` when the batch dims are its own, per-step for one response's row (``td=None``).
        """
        k = self.tensor_keys
        shape, _ = TD.step_shape(logp, batch_dims, td) if logp.ndim >= 2 else (logp.shape, False)
        if len(shape) < 1:
            raise ValueError(f"KLPenaltyTransform: {k.log_prob!r} has shape {tuple(logp.shape)}; it needs a token axis [*B, R]")
        ref_name = f"log-probs {k.log_prob!r}"
        _validate.check_same_device(sample_log_prob=logp, ref_log_prob=ref, mask=mask, reward=reward)
        logp = TD.time_last(logp, ref_name, shape, ref_name)
        ref = TD.time_last(ref, f"reference log-probs {k.ref_log_prob!r}", shape, ref_name)
        _validate.check_float("sample_log_prob", logp)
        _validate.check_float("ref_log_prob", ref)
        m = TD.mask_or_all(mask, f"mask {k.mask!r}", shape, ref_name, logp.device)
        if reward is None:
            return self._kl(logp, ref, m), ref, m, None
        _validate.check_float("reward", reward)
        per_token = reward.shape in (shape, shape + (1,))
        if not per_token and reward.shape not in (shape[:-1], shape[:-1] + (1,)):
            raise ValueError(
                f"KLPenaltyTransform: reward {TD.next_key(k.reward)!r} has shape {tuple(reward.shape)} but the "
                f"log-probs {k.log_prob!r} define [*B, R] = {tuple(shape)}: expected a per-token reward "
                f"{tuple(shape)} / {tuple(shape + (1,))} or one score per sequence {tuple(shape[:-1])} / "
                f"{tuple(shape[:-1] + (1,))}; broadcasting it would mix tokens of different sequences"
            )
        flat = reward.reshape(shape if per_token else shape[:-1])
        if not per_token:
            try:
                _validate.check_scored_rows(m)
            except ValueError as err:
                raise ValueError(f"KLPenaltyTransform: {err}") from None
        kl = self._kl(logp, ref, m)
        new = L.penalized_rewards(flat, kl, m, self.coeff)
        if per_token:
            return kl, ref, m, new.reshape(reward.shape)
        return kl, ref, m, (new.unsqueeze(-1) if reward.shape == shape[:-1] + (1,) else new)

    def _kl(self, logp: Tensor, ref: Tensor, m: Tensor) -> Tensor:
        """The per-token KL of a checked batch (0 at masked positions), once its valid values read as log-probs."""
        lp, ref_lp = L.masked_log_probs(m, logp, ref)
        _validate.check_log_probs(dict(sample_log_prob=lp, ref_log_prob=ref_lp), where="KLPenaltyTransform")
        return L.masked_kl(lp, ref_lp, m, self.estimator, self.clamp)

    def _record(self, kls: list[Tensor], masks: list[Tensor]) -> None:
        """Observed KL of what was just penalised (detached): masked token mean, and the mean per-response sum over
        the responses with at least one valid token (an empty padding row is no response: it would pull the mean
        towards 0)."""
        with torch.no_grad():
            flat_kl = torch.cat([k.reshape(-1) for k in kls]).float()
            flat_m = torch.cat([m.reshape(-1) for m in masks])
            seq = torch.cat([k.float().sum(-1).reshape(-1) for k in kls])
            rows = torch.cat([m.any(-1).reshape(-1) for m in masks])
            self.last_kl = K.masked_mean(flat_kl, flat_m).to(self.last_kl.device)
            self.last_seq_kl = K.masked_mean(seq, rows).to(self.last_seq_kl.device)

    # ------------------------------------------------------------------ offline path

    def _penalize_one(self, td: TensorDictBase, logp: Tensor, row: bool = False) -> tuple[Tensor, Tensor]:
        """Penalise one dense TensorDict in place (``row``: one response of a ragged stack, time on its first
        dim); returns ``(kl, mask)``."""
        k = self.tensor_keys
        batch_dims, layout = (1, None) if row else (td.batch_dims, td)  # a row's time axis is its first dim
        kl, ref, m, new_reward = self._penalize(
            logp, self._ref_log_prob(td), td.get(k.mask, None), self._get_reward(td), batch_dims, layout
        )
        td.set(k.kl, kl)
        td.set(k.ref_log_prob, ref.reshape(logp.shape))
        if new_reward is not None:
            td.set(TD.next_key(k.reward), new_reward)
        return kl, m

    def _penalize_batch(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict.get(self.tensor_keys.kl, None) is not None:
            return tensordict  # already penalised (collector postproc / extend): do not apply twice
        if self.add_to_reward and tensordict.get("advantage", None) is not None:
            raise ValueError(
                "KLPenaltyTransform: the batch already holds 'advantage', so the advantages were computed from the "
                "reward before this penalty: the penalty would change the reward and never reach them; run "
                "KLPenaltyTransform before MaskedGAE (as the training job does), or pass add_to_reward=False to only "
                "measure the KL"
            )
        if isinstance(tensordict, LazyStackedTensorDict):  # ragged responses: one at a time
            kls, masks = zip(*(self._penalize_one(sub, self._log_prob(sub), row=True) for sub in tensordict.tensordicts))
            self._record(list(kls), list(masks))
            return tensordict
        logp = self._log_prob(tensordict)
        if logp.is_nested:
            return self._apply_nested(tensordict, logp)
        kl, m = self._penalize_one(tensordict, logp)
        self._record([kl], [m])
        return tensordict

    def _get_reward(self, tensordict: TensorDictBase) -> Tensor | None:
        if not self.add_to_reward:
            return None
        fix = "store the per-token (or per-sequence) reward, or pass add_to_reward=False"
        key = TD.next_key(self.tensor_keys.reward)
        return TD.require(tensordict, key, module="KLPenaltyTransform", what="the reward, needed because add_to_reward=True", fix=fix)

    def _apply_nested(self, tensordict: TensorDictBase, logp: Tensor) -> TensorDictBase:
        def rows(x):
            return None if x is None else list(x.unbind(0))

        k = self.tensor_keys
        logps = rows(logp)
        refs = rows(self._ref_log_prob(tensordict))
        masks = rows(tensordict.get(k.mask, None)) or [None] * len(logps)
        rewards = rows(self._get_reward(tensordict)) or [None] * len(logps)
        out = [self._penalize(lp, refs[i], masks[i], rewards[i], 1) for i, lp in enumerate(logps)]
        kls, out_ref, out_m, out_rew = (list(x) for x in zip(*out))
        self._record(kls, out_m)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NESTED_PROTOTYPE_WARNING)
            nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.strided)  # noqa: E731
            tensordict.set(k.kl, nest(kls))
            tensordict.set(k.ref_log_prob, nest(out_ref))
            if self.add_to_reward:
                tensordict.set(TD.next_key(k.reward), nest(out_rew))
        return tensordict

    @dispatch(source="in_keys", dest="out_keys")
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Compute the KL (and penalise the reward) of a batch; returns ``tensordict``, updated in place.

        Keyword tensors work too: ``t(sample_log_prob=..., ref_log_prob=..., mask=..., next_reward=...)``
        returns ``(kl_penalty, ref_log_prob, next_reward)``.
        """
        return self._penalize_batch(tensordict)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        # A replay buffer calls inv() on extend: penalise there. Inside an env, inv() runs on the
        # action before the step, where there is nothing to do (the step itself is handled by _step).
        if self._in_env():
            return tensordict
        return self._penalize_batch(tensordict)

    # ------------------------------------------------------------------ env path

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        k = self.tensor_keys
        logp = tensordict.get(k.log_prob, None)
        if logp is None:
            if self.missing_tolerance:  # e.g. random actions in check_env_specs: no KL to measure
                return self._reset(tensordict, next_tensordict)
            raise TD.missing(tensordict, k.log_prob, module="KLPenaltyTransform", what="the log-prob of the sampled "
                             "token", fix="the policy must write it before env.step; e.g. ProbabilisticActor(..., "
                             "return_log_prob=True), or call set_missing_tolerance(True) to let steps without it "
                             "through unpenalised", collector_fix=False)  # fmt: skip
        if self.ref_model is None:
            raise KeyError(
                "KLPenaltyTransform: inside an env the reference log-prob of each new token must be computed at "
                "that step (the root entry holds the previous step's); pass ref_model="
            )
        ref = self._ref_log_prob(tensordict.exclude(k.ref_log_prob))
        shape, where = next_tensordict.batch_size, "the env's batch"
        logp = TD.time_last(logp, f"log-probs {k.log_prob!r}", shape, where)
        ref = TD.time_last(ref, f"reference log-probs {k.ref_log_prob!r}", shape, where)
        m = TD.mask_or_all(tensordict.get(k.mask, None), f"mask {k.mask!r}", shape, where, logp.device)
        _validate.check_float("sample_log_prob", logp)
        _validate.check_float("ref_log_prob", ref)
        _validate.check_same_device(sample_log_prob=logp, ref_log_prob=ref, mask=m)
        kl = self._kl(logp, ref, m)
        if self.add_to_reward:  # the step's reward [*B, 1]: unmasked, it is the env's to define
            reward = next_tensordict.get(k.reward)
            penalty = (self.coeff.to(device=kl.device, dtype=kl.dtype) * kl).to(reward.dtype)
            next_tensordict.set(k.reward, reward - penalty.reshape(reward.shape))
        next_tensordict.set(k.kl, kl)
        next_tensordict.set(k.ref_log_prob, ref.detach())
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        zeros = torch.zeros(tensordict_reset.batch_size, device=tensordict_reset.device)
        tensordict_reset.set(self.tensor_keys.kl, zeros)
        tensordict_reset.set(self.tensor_keys.ref_log_prob, zeros.clone())
        return tensordict_reset

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        for key in (self.tensor_keys.kl, self.tensor_keys.ref_log_prob):
            observation_spec[key] = Unbounded(
                shape=observation_spec.shape, dtype=torch.float32, device=observation_spec.device
            )
        return observation_spec

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        if self.add_to_reward:
            old = reward_spec[self.tensor_keys.reward]
            # reward - coeff * kl leaves any bounds the env declared.
            reward_spec[self.tensor_keys.reward] = Unbounded(shape=old.shape, dtype=old.dtype, device=old.device)
        return reward_spec

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(estimator={self.estimator!r}, add_to_reward={self.add_to_reward}, "
            f"controller={type(self.kl_controller).__name__}, kl_key={self.tensor_keys.kl!r})"
        )


def _key_field(name: str) -> str:
    """``log_prob_key`` (constructor keyword) -> ``log_prob`` (:meth:`KLPenaltyTransform.set_keys` field)."""
    fields = KLPenaltyTransform._AcceptedKeys.__dataclass_fields__
    if not name.endswith("_key") or name[: -len("_key")] not in fields:
        accepted = ", ".join(f"{f}_key" for f in fields)
        raise TypeError(f"KLPenaltyTransform() got an unexpected keyword argument {name!r} (key keywords: {accepted})")
    return name[: -len("_key")]


def _as_controller(coeff: float | nn.Module) -> nn.Module:
    """A KL controller module: ``coeff`` itself, or a :class:`FixedKLController` for a float."""
    if not isinstance(coeff, nn.Module):
        return FixedKLController(coeff)
    if not hasattr(coeff, "coeff") or not callable(getattr(coeff, "update", None)):
        raise TypeError(
            f"coeff={type(coeff).__name__} is not a KL controller: it needs a 'coeff' buffer and an "
            "update(kl, n_steps) method (use FixedKLController or AdaptiveKLController)"
        )
    return coeff

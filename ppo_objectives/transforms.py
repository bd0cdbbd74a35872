"""KLPenaltyTransform and KL-coefficient controllers: the reference-KL penalty in the reward, on TorchRL.

Shape letters (used in every docstring below):

- ``B``: batch dimensions (one sampled response per row), written ``*B`` when several.
- ``R``: the response length (tokens the policy generated, padded), or ``T`` the
  time steps of a collector batch; time is always the last per-token axis.

Per-token entries may be stored ``[*B, R]`` or ``[*B, R, 1]`` (TorchRL's per-step
layout) and are adapted at the edge; nothing is broadcast. The per-token KL
estimate is :func:`ppo_objectives.functional.kl_estimate`.
"""

from __future__ import annotations

import math
import warnings

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, dispatch
from tensordict.utils import NestedKey
from torch import Tensor, nn
from torchrl.data import Composite, Unbounded
from torchrl.envs import EnvBase
from torchrl.envs.transforms import Compose, Transform

from ppo_objectives import functional as F
from ppo_objectives import _td as TD
from ppo_objectives import _validate

__all__ = ["AdaptiveKLController", "FixedKLController", "KLPenaltyTransform"]

_NESTED_PROTOTYPE_WARNING = "The PyTorch API of nested tensors is in prototype stage"


def _is_nonnegative_float(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _as_tensor(x: Tensor | float, like: Tensor) -> Tensor:
    return torch.as_tensor(x, dtype=like.dtype, device=like.device).detach().reshape(())


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
        if not _is_nonnegative_float(coeff):
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
        if not _is_nonnegative_float(init_coeff):
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
        if n_steps * self.clip >= self.horizon:
            raise ValueError(
                f"n_steps={n_steps} with horizon={self.horizon} and clip={self.clip}: a step of "
                f"clip * n_steps / horizon >= 1 could make the KL coefficient zero or negative; use a horizon "
                f"larger than clip * n_steps (samples per update)"
            )
        kl = _as_tensor(kl, self.coeff)
        error = torch.clamp(kl / self.target - 1.0, -self.clip, self.clip)
        error = torch.where(torch.isfinite(error), error, torch.zeros_like(error))
        self.coeff.mul_(1.0 + error * (n_steps / self.horizon))
        return self.coeff


class KLPenaltyTransform(Transform):
    """Per-token KL to a frozen reference policy, optionally subtracted from the per-token reward.

    For every response token ``t`` (``mask`` True)::

        kl_t     = KL_est(sample_log_prob_t, ref_log_prob_t)        # k1 = logp - ref_logp by default
        reward_t <- reward_t - coeff * kl_t                        (add_to_reward=True)

    ``KL_est`` is :func:`ppo_objectives.functional.kl_estimate` (Schulman 2020,
    "Approximating KL Divergence"); k1 is the unbiased choice inside a reward
    (Ziegler et al. 2019, arXiv:1909.08593; Stiennon et al. 2020). A
    sequence-level score (one reward per response, shape ``[*B]`` or
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
    responses of the per-response sum) hold the observed KL, detached, for
    ``kl_controller.update(...)``.

    Keys (names via the constructor):

    ==================================== ============== =====================================
    key                                  shape          role
    ==================================== ============== =====================================
    ``"sample_log_prob"`` log_prob_key   [*B, R(, 1)]   read: sampling policy's log-probs
    ``"ref_log_prob"`` ref_log_prob_key  [*B, R(, 1)]   read if present, else written
    ``"mask"`` mask_key                  [*B, R(, 1)]   read (optional): response tokens
    ``("next", "reward")`` reward_key    [*B, R(, 1)]   read and written (add_to_reward);
                                         or [*B(, 1)]   a sequence score becomes [*B, R(, 1)]
    ``"kl_penalty"`` kl_key              [*B, R]        written: per-token KL, 0 where masked
    ==================================== ============== =====================================

    Where it runs:

    * **offline / collector postproc / replay buffer**: ``forward(td)`` (and
      ``inv(td)``, which a replay buffer calls on ``extend``) read and write the
      keys above. The transform is idempotent: when ``kl_key`` is already present
      the data are returned unchanged, so a penalty applied by a collector
      ``postproc`` or on ``extend`` is not applied again on ``sample``.
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
        log_prob_key, ref_log_prob_key, ref_model_log_prob_key, mask_key, kl_key:
            entry names (defaults above).
        reward_key: the reward entry, read under ``"next"`` offline (default ``"reward"``).

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

    invertible = False

    def __init__(
        self,
        ref_model: TensorDictModule | None = None,
        *,
        coeff: float | nn.Module = 0.05,
        estimator: str = "k1",
        clamp: float | None = None,
        add_to_reward: bool = True,
        log_prob_key: NestedKey = "sample_log_prob",
        ref_log_prob_key: NestedKey = "ref_log_prob",
        ref_model_log_prob_key: NestedKey = "log_prob",
        mask_key: NestedKey = "mask",
        kl_key: NestedKey = "kl_penalty",
        reward_key: NestedKey = "reward",
    ):
        if estimator not in F.KL_ESTIMATORS:
            raise ValueError(f"estimator={estimator!r} is not one of {F.KL_ESTIMATORS}")
        if clamp is not None:
            _validate.check_positive("clamp", clamp)
        if isinstance(coeff, nn.Module):
            if not hasattr(coeff, "coeff") or not callable(getattr(coeff, "update", None)):
                raise TypeError(
                    f"coeff={type(coeff).__name__} is not a KL controller: it needs a 'coeff' buffer and an "
                    "update(kl, n_steps) method (use FixedKLController or AdaptiveKLController)"
                )
            controller = coeff
        else:
            controller = FixedKLController(coeff)
        in_keys = [log_prob_key, ref_log_prob_key, mask_key] + ([TD.next_key(reward_key)] if add_to_reward else [])
        out_keys = [kl_key, ref_log_prob_key] + ([TD.next_key(reward_key)] if add_to_reward else [])
        super().__init__(in_keys=in_keys, out_keys=out_keys)
        self.ref_model = ref_model
        self.kl_controller = controller
        self.estimator = estimator
        self.clamp = clamp
        self.add_to_reward = bool(add_to_reward)
        self.log_prob_key = log_prob_key
        self.ref_log_prob_key = ref_log_prob_key
        self.ref_model_log_prob_key = ref_model_log_prob_key
        self.mask_key = mask_key
        self.kl_key = kl_key
        self.reward_key = reward_key
        self.register_buffer("last_kl", torch.zeros(()), persistent=False)
        self.register_buffer("last_seq_kl", torch.zeros(()), persistent=False)

    @property
    def coeff(self) -> Tensor:
        """The current KL coefficient (the controller's ``coeff`` buffer)."""
        return self.kl_controller.coeff

    # ------------------------------------------------------------------ helpers

    def _in_env(self) -> bool:
        container = self.__dict__.get("_container")
        container = container() if container is not None else None
        while isinstance(container, Compose):
            ref = container.__dict__.get("_container")
            container = ref() if ref is not None else None
        return isinstance(container, EnvBase)

    def _ref_log_prob(self, tensordict: TensorDictBase) -> Tensor:
        ref = tensordict.get(self.ref_log_prob_key, None)
        if ref is not None:
            return ref
        if self.ref_model is None:
            raise KeyError(
                f"KLPenaltyTransform: {self.ref_log_prob_key!r} is missing and no ref_model was given; "
                "precompute the reference log-probs or pass ref_model="
            )
        with torch.no_grad():
            out = self.ref_model(tensordict.copy())
        ref = out.get(self.ref_model_log_prob_key, None)
        if ref is None:
            raise KeyError(
                f"KLPenaltyTransform: the ref_model did not write {self.ref_model_log_prob_key!r}; it must output "
                "the per-token log-probs of the sampled tokens (set ref_model_log_prob_key= to its out key)"
            )
        return ref.detach()

    def _kl(self, logp: Tensor, ref: Tensor, mask: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        kl = F.kl_estimate(
            torch.where(mask, logp, zero), torch.where(mask, ref.to(logp.dtype), zero), self.estimator, clamp=self.clamp
        )
        return torch.where(mask, kl + 0.0, torch.zeros((), dtype=kl.dtype, device=kl.device))  # + 0.0: no -0.0

    def _penalize(self, logp: Tensor, ref: Tensor, mask: Tensor | None, reward: Tensor | None, batch_dims: int):
        """Dense core: ``logp`` defines ``[*B, R]``; returns ``(kl [*B, R], ref, mask, new reward or None)``.

        A trailing singleton of ``logp`` is TorchRL's per-step layout ``[*batch, 1]`` when
        the other dims are the TensorDict's batch dims (``batch_dims``).
        """
        shape, _ = TD.step_shape(logp, batch_dims) if logp.ndim >= 2 else (logp.shape, False)
        if reward is not None and reward.shape == logp.shape + (1,):
            shape = logp.shape  # [*B, 1] log-probs with a [*B, 1, 1] reward: responses of one token
        if len(shape) < 1:
            raise ValueError(
                f"KLPenaltyTransform: {self.log_prob_key!r} has shape {tuple(logp.shape)}; it needs a token axis [*B, R]"
            )
        ref_name = f"log-probs {self.log_prob_key!r}"
        _validate.check_same_device(sample_log_prob=logp, ref_log_prob=ref, mask=mask, reward=reward)
        logp = TD.time_last(logp, ref_name, shape, ref_name)
        ref = TD.time_last(ref, f"reference log-probs {self.ref_log_prob_key!r}", shape, ref_name)
        _validate.check_float("sample_log_prob", logp)
        _validate.check_float("ref_log_prob", ref)
        m = TD.mask_or_all(mask, f"mask {self.mask_key!r}", shape, ref_name, logp.device)
        kl = self._kl(logp, ref, m)
        if reward is None:
            return kl, ref, m, None
        _validate.check_float("reward", reward)
        coeff = self.coeff.to(device=kl.device, dtype=kl.dtype)
        zero = torch.zeros((), dtype=reward.dtype, device=reward.device)
        if reward.shape in (shape, shape + (1,)):
            dense = TD.time_last(reward, "reward", shape, ref_name)
            new = torch.where(m, dense - coeff * kl, zero)
            return kl, ref, m, new.reshape(reward.shape)
        if reward.shape in (shape[:-1], shape[:-1] + (1,)):
            # A sequence-level score: put it on the last valid token, never on every token.
            score = reward.reshape(shape[:-1])
            if _validate.checking_values() and m.numel() and not bool(m.any(-1).all()):
                empty = (~m.any(-1)).nonzero().flatten()[:5].tolist()
                raise ValueError(
                    f"KLPenaltyTransform: rows {empty} have no valid token (empty mask), so their sequence score "
                    "would be dropped; remove those rows or mark their last token valid"
                )
            positions = torch.arange(shape[-1], device=m.device)
            last = torch.where(m, positions, -1).amax(-1, keepdim=True)
            at_last = m & (positions == last)
            dense = torch.where(at_last, score.unsqueeze(-1), zero)
            new = torch.where(m, dense - coeff * kl, zero)
            return kl, ref, m, (new.unsqueeze(-1) if reward.shape == shape[:-1] + (1,) else new)
        raise ValueError(
            f"KLPenaltyTransform: reward {TD.next_key(self.reward_key)!r} has shape {tuple(reward.shape)} but the log-probs "
            f"{self.log_prob_key!r} define [*B, R] = {tuple(shape)}: expected a per-token reward {tuple(shape)} / "
            f"{tuple(shape + (1,))} or one score per sequence {tuple(shape[:-1])} / {tuple(shape[:-1] + (1,))}; "
            "broadcasting it would mix tokens of different sequences"
        )

    def _record(self, kls: list[Tensor], masks: list[Tensor]) -> None:
        """Observed KL of what was just penalised (detached): masked token mean, mean per-response sum."""
        with torch.no_grad():
            flat_kl = torch.cat([k.reshape(-1) for k in kls]).float()
            flat_m = torch.cat([m.reshape(-1) for m in masks])
            seq = torch.cat([k.sum(-1).reshape(-1) for k in kls]).float()
            self.last_kl = F.masked_mean(flat_kl, flat_m).to(self.last_kl.device)
            self.last_seq_kl = (seq.mean() if seq.numel() else seq.new_zeros(())).to(self.last_seq_kl.device)

    # ------------------------------------------------------------------ offline path

    def _penalize_batch(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict.get(self.kl_key, None) is not None:
            return tensordict  # already penalised (collector postproc / extend): do not apply twice
        if isinstance(tensordict, LazyStackedTensorDict):
            return self._apply_lazy(tensordict)
        logp = tensordict.get(self.log_prob_key, None)
        if logp is None:
            raise KeyError(f"KLPenaltyTransform: the sampling log-probs {self.log_prob_key!r} are missing")
        if logp.is_nested:
            return self._apply_nested(tensordict, logp)
        ref = self._ref_log_prob(tensordict)
        reward = self._get_reward(tensordict)
        kl, ref, m, new_reward = self._penalize(
            logp, ref, tensordict.get(self.mask_key, None), reward, tensordict.batch_dims
        )
        self._record([kl], [m])
        tensordict.set(self.kl_key, kl)
        tensordict.set(self.ref_log_prob_key, ref.reshape(logp.shape))
        if new_reward is not None:
            tensordict.set(TD.next_key(self.reward_key), new_reward)
        return tensordict

    def _get_reward(self, tensordict: TensorDictBase) -> Tensor | None:
        if not self.add_to_reward:
            return None
        reward = tensordict.get(TD.next_key(self.reward_key), None)
        if reward is None:
            raise KeyError(
                f"KLPenaltyTransform: add_to_reward=True but the reward {TD.next_key(self.reward_key)!r} is missing; "
                "store the per-token (or per-sequence) reward, or pass add_to_reward=False"
            )
        return reward

    def _apply_lazy(self, tensordict: LazyStackedTensorDict) -> TensorDictBase:
        kls, masks = [], []
        for sub in tensordict.tensordicts:
            logp = sub.get(self.log_prob_key, None)
            if logp is None:
                raise KeyError(f"KLPenaltyTransform: the sampling log-probs {self.log_prob_key!r} are missing")
            kl, ref, m, new_reward = self._penalize(
                logp, self._ref_log_prob(sub), sub.get(self.mask_key, None), self._get_reward(sub), 1
            )
            sub.set(self.kl_key, kl)
            sub.set(self.ref_log_prob_key, ref.reshape(logp.shape))
            if new_reward is not None:
                sub.set(TD.next_key(self.reward_key), new_reward)
            kls.append(kl)
            masks.append(m)
        self._record(kls, masks)
        return tensordict

    def _apply_nested(self, tensordict: TensorDictBase, logp: Tensor) -> TensorDictBase:
        def rows(x):
            return None if x is None else list(x.unbind(0))

        logps = rows(logp)
        refs = rows(self._ref_log_prob(tensordict))
        masks = rows(tensordict.get(self.mask_key, None)) or [None] * len(logps)
        rewards = rows(self._get_reward(tensordict)) or [None] * len(logps)
        out = [self._penalize(lp, refs[i], masks[i], rewards[i], 1) for i, lp in enumerate(logps)]
        kls, out_ref, out_m, out_rew = (list(x) for x in zip(*out))
        self._record(kls, out_m)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NESTED_PROTOTYPE_WARNING)
            nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.strided)  # noqa: E731
            tensordict.set(self.kl_key, nest(kls))
            tensordict.set(self.ref_log_prob_key, nest(out_ref))
            if self.add_to_reward:
                tensordict.set(TD.next_key(self.reward_key), nest(out_rew))
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
        logp = tensordict.get(self.log_prob_key, None)
        if logp is None:
            if self.missing_tolerance:  # e.g. random actions in check_env_specs: no KL to measure
                return self._reset(tensordict, next_tensordict)
            raise KeyError(
                f"KLPenaltyTransform: the policy must write {self.log_prob_key!r} (the log-prob of the sampled "
                "token) before env.step; e.g. ProbabilisticActor(..., return_log_prob=True), or call "
                "set_missing_tolerance(True) to let steps without it through unpenalised"
            )
        if self.ref_model is None:
            raise KeyError(
                "KLPenaltyTransform: inside an env the reference log-prob of each new token must be computed at "
                "that step (the root entry holds the previous step's); pass ref_model="
            )
        ref = self._ref_log_prob(tensordict.exclude(self.ref_log_prob_key))
        shape = next_tensordict.batch_size
        ref_name = f"log-probs {self.log_prob_key!r}"
        logp = TD.time_last(logp, ref_name, shape, "the env's batch")
        ref = TD.time_last(ref, f"reference log-probs {self.ref_log_prob_key!r}", shape, "the env's batch")
        m = TD.mask_or_all(tensordict.get(self.mask_key, None), f"mask {self.mask_key!r}", shape, "the env's batch", logp.device)
        kl = self._kl(logp, ref, m)
        if self.add_to_reward:
            reward = next_tensordict.get(self.reward_key)
            coeff = self.coeff.to(device=kl.device, dtype=kl.dtype)
            penalty = (coeff * kl).to(reward.dtype)
            next_tensordict.set(self.reward_key, reward - penalty.reshape(reward.shape))
        next_tensordict.set(self.kl_key, kl)
        next_tensordict.set(self.ref_log_prob_key, ref.detach())
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        zeros = torch.zeros(tensordict_reset.batch_size, device=tensordict_reset.device)
        tensordict_reset.set(self.kl_key, zeros)
        tensordict_reset.set(self.ref_log_prob_key, zeros.clone())
        return tensordict_reset

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        for key in (self.kl_key, self.ref_log_prob_key):
            observation_spec[key] = Unbounded(
                shape=observation_spec.shape, dtype=torch.float32, device=observation_spec.device
            )
        return observation_spec

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        if self.add_to_reward:
            old = reward_spec[self.reward_key]
            # reward - coeff * kl leaves any bounds the env declared.
            reward_spec[self.reward_key] = Unbounded(shape=old.shape, dtype=old.dtype, device=old.device)
        return reward_spec

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(estimator={self.estimator!r}, add_to_reward={self.add_to_reward}, "
            f"controller={type(self.kl_controller).__name__}, kl_key={self.kl_key!r})"
        )

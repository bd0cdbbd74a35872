"""The input checks every layer of ``ppo_objectives`` shares (internal).

One place for the rules written in ``docs/design.md``: what a mask may hold,
that per-token tensors have one shape and one device, that hyper-parameters
are finite numbers in their range, and the switch that turns off the checks
which read tensor data (:func:`value_checks`, re-exported by
:mod:`ppo_objectives.functional`). The functional core, the TensorDict modules,
the models and the training job all import this module and nothing private of
each other. Every error names the argument, what was expected and the fix.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import Tensor

AGGREGATIONS = (
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum", "token-sum-norm",
)  # fmt: skip

_VALUE_CHECKS = True


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Turn the data-reading input checks on or off inside a ``with`` block.

    Checks of mask *values* (for non-bool masks), of positions inside the
    sequence and of hyper-parameters given as tensors read tensor data, which
    costs a host synchronisation on CUDA. Turn them off in a tight loop once
    the inputs are known to be good; shape, dtype and device checks stay on.

    Example:
        >>> import torch
        >>> from ppo_objectives.functional import masked_mean
        >>> x, m = torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0])
        >>> with value_checks(False):
        ...     masked_mean(x, m)
        tensor(2.)
    """
    global _VALUE_CHECKS
    previous, _VALUE_CHECKS = _VALUE_CHECKS, bool(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS = previous


def checking_values() -> bool:
    return _VALUE_CHECKS and not torch.compiler.is_compiling()


def check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float(name: str, x: object) -> Tensor:
    x = check_tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor, got dtype {x.dtype}; convert it with {name}.float()"
        )
    return x


def check_same_shape(ref_name: str, ref: Tensor, **others: Tensor) -> None:
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                f"per-token tensors must have identical shapes (nothing is broadcast, since "
                f"broadcasting here would silently mix tokens of different sequences)"
            )


def check_same_device(**tensors: Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}; move them with .to(device)")


def check_token_tensors(mask: object, **tensors: object) -> Tensor | None:
    """The common first lines of a per-token function: every tensor float, of one shape, on one
    device with the mask; returns the mask as bool (``None`` when ``mask`` is ``None``)."""
    for name, t in tensors.items():
        check_float(name, t)
    (ref_name, ref), *_ = tensors.items()
    check_same_shape(ref_name, ref, **dict(list(tensors.items())[1:]))
    check_same_device(**tensors, **({} if mask is None else {"mask": check_tensor("mask", mask)}))
    return None if mask is None else check_mask(mask, ref.shape, ref_name)


def check_mask(mask: object, shape: torch.Size, ref_name: str, *, name: str = "mask") -> Tensor:
    """Validate a mask (or a done flag: ``name=``) and return it as a bool tensor."""
    what = "True = token takes part" if name == "mask" else "True = the trajectory ends at this step"
    mask = check_tensor(name, mask)
    if mask.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but {ref_name} has shape {tuple(shape)}; "
            f"the {name} must have exactly the shape of the per-token tensors (no broadcasting)"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or real with values in {{0, 1}}, got dtype {mask.dtype}")
    out = mask != 0
    if checking_values() and mask.numel() > 0 and not _binary(mask, out):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist()
        raise ValueError(
            f"{name} must hold only 0 and 1 ({what}), found values such as {bad}; "
            f"pass a bool {name}, e.g. {name} > 0.5"
        )
    return out


def _binary(mask: Tensor, nonzero: Tensor) -> bool:
    """Whether a real ``mask`` holds only 0 and 1, in one host read: its range is within [0, 1]
    (NaN fails) and its exact sum equals its count of non-zeros (so every non-zero is 1)."""
    lo, hi = torch.aminmax(mask)
    total = mask.sum(dtype=torch.float64) if mask.is_floating_point() else mask.sum()
    lo, hi, total, count = torch.stack([lo.double(), hi.double(), total.double(), nonzero.sum().double()]).tolist()
    return 0 <= lo and hi <= 1 and total == count


def check_unit_interval(name: str, x: object) -> None:
    if isinstance(x, Tensor):
        if x.numel() != 1 or not x.is_floating_point():
            raise TypeError(f"{name} must be a Python float or a one-element float tensor, got {x.dtype} {tuple(x.shape)}")
        if x.device.type != "cpu" or not checking_values():
            return
        value = float(x)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        value = float(x)
    else:
        raise TypeError(f"{name} must be a float in [0, 1], got {type(x).__name__}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} is outside [0, 1]; discount and trace factors must lie in [0, 1]")


def check_positive(name: str, x: object, *, above: float = 0.0, what: str = "") -> float:
    if isinstance(x, Tensor) and x.numel() == 1:
        if x.device.type != "cpu" or not checking_values():
            return x  # type: ignore[return-value]
        value = float(x)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        value = float(x)
    else:
        raise TypeError(f"{name} must be a positive float, got {type(x).__name__}")
    if not (value > above and math.isfinite(value)):
        raise ValueError(f"{name}={value} must be a finite number > {above}{what}")
    return value


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half precision is promoted)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is not one of {AGGREGATIONS}")


KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")


def check_kl_options(estimator: object, clamp: object) -> float | None:
    """A KL ``estimator`` name and an optional positive ``clamp`` (returned as a float)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not one of {KL_ESTIMATORS}")
    return None if clamp is None else check_positive("clamp", clamp)


# how far above 0 a log-probability may round (a log_softmax of a certain token can come out at +1e-7)
LOG_PROB_TOLERANCE = 1e-3


def check_log_probs(tensors: dict[str, Tensor | None], where: str = "kl_estimate", mask: Tensor | None = None) -> None:
    """Log-probabilities are <= 0: a finite value above ``LOG_PROB_TOLERANCE`` at a valid position is an error
    that names the tensor, its largest value and the fix (probabilities, logits or a sign error give one). Only
    the positions of ``mask`` (all when ``None``) are read, so garbage at padded positions is never judged; NaN
    and -inf pass (an impossible token's log-prob is -inf). One host read for all the tensors; skipped under
    ``value_checks(False)`` and ``torch.compile``."""
    if not checking_values():
        return
    named = [(name, x) for name, x in tensors.items() if x is not None and x.numel() and x.is_floating_point()]
    if not named:
        return
    tops = []
    for _, x in named:
        x = x.detach()
        keep = torch.isfinite(x) if mask is None else torch.isfinite(x) & mask
        tops.append(torch.where(keep, x, float("-inf")).max().float())
    tops = torch.stack(tops).tolist()
    for (name, x), top in zip(named, tops):
        if top > LOG_PROB_TOLERANCE:
            lows = torch.where(torch.isfinite(x.detach()), x.detach(), 0.0)
            what = ("holds no negative value, so it looks like probabilities" if float(lows.min()) >= 0.0
                    else "is not a log-probability")  # fmt: skip
            raise ValueError(
                f"{where}: {name} has a value of {top:.4g} at a valid position, but log-probabilities are <= 0; "
                f"it {what}: pass the log-probs of the sampled tokens (log_softmax(logits).gather(...), or "
                f"torch.log(p)), not probabilities, logits or their negation"
            )


def first_non_finite(inputs: list[tuple[str, Tensor, Tensor | None]]) -> tuple[str, tuple[int, ...], float] | None:
    """``(name, position, value)`` of the first NaN/inf among ``inputs``, each ``(name, tensor, where it is read)``
    (a bool tensor of the tensor's shape, or ``None``: everywhere), in order; ``None`` when all are finite where
    they are read. An estimator whose result is not finite calls it to name the input to fix."""
    for name, x, read in inputs:
        bad = ~torch.isfinite(x) if read is None else ~torch.isfinite(x) & read
        if bool(bad.any()):
            pos = tuple(int(i) for i in bad.nonzero()[0])
            return name, pos, float(x[pos])
    return None


def check_scored_rows(m: Tensor) -> None:
    """Every row that gets a sequence score has a valid token to carry it (one host read; skipped under
    ``value_checks(False)``)."""
    if checking_values() and m.numel() and not bool(m.any(-1).all()):
        idx = (~m.any(-1)).nonzero()[:5]
        empty = idx.flatten().tolist() if idx.shape[1] == 1 else [tuple(i) for i in idx.tolist()]
        raise ValueError(
            f"rows {empty} have no valid token (empty mask), so their sequence score "
            "would be dropped; remove those rows or mark their last token valid"
        )


def check_normalizer(normalizer: object, ref: Tensor) -> Tensor | float | None:
    """A loss's ``normalizer=``: ``None``, a positive float, or a positive one-element float tensor on ``ref``'s
    device (returned 0-d)."""
    if normalizer is None:
        return None
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1 or not normalizer.is_floating_point():
            raise TypeError(f"normalizer must be a positive float or a one-element float tensor, got "
                            f"{normalizer.dtype} {tuple(normalizer.shape)}")
        check_same_device(per_token=ref, normalizer=normalizer)
        check_positive("normalizer", normalizer)
        return normalizer.reshape(())
    return check_positive("normalizer", normalizer)


def check_clip_epsilon(clip_epsilon: object) -> tuple[float, float]:
    """``(eps_low, eps_high)`` of a ``clip_epsilon`` given as one float (symmetric) or a pair (TorchRL's form)."""
    if isinstance(clip_epsilon, (tuple, list)):
        if len(clip_epsilon) != 2:
            raise ValueError(
                f"clip_epsilon={clip_epsilon!r}: give one float (symmetric) or a pair (eps_low, eps_high)"
            )
        low, high = clip_epsilon
        return check_positive("clip_epsilon (low)", low), check_positive("clip_epsilon (high)", high)
    eps = check_positive("clip_epsilon", clip_epsilon)
    return eps, eps


def check_int(name: str, x: object, *, low: int = 1, high: int | None = None, where: str = "", what: str = "") -> int:
    """``x`` if it is an ``int`` (bools refused) in ``[low, high]``, else a ``ValueError``.

    The message reads ``"{where}{name}={x!r} must be an int >= {low}{what}"`` (or ``in [low, high]``):
    ``where`` names the owner (``"TokenLMEnv "``), ``what`` says what the number is.
    """
    if isinstance(x, bool) or not isinstance(x, int) or x < low or (high is not None and x > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{where}{name}={x!r} must be an int {bounds}{what}")
    return x


def is_real(x: object, *, low: float = -math.inf, strict: bool = False) -> bool:
    """Whether ``x`` is a finite Python number (bools excluded) ``>= low`` (``> low`` when ``strict``)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return False
    return x > low if strict else x >= low


def check_token_ids(token_ids: object, model_vocab_size: int, who: str) -> Tensor:
    """``token_ids`` as int64 if it maps task tokens to distinct model tokens: a non-empty 1-D integer
    tensor ``[V_task]`` with every id in ``[0, model_vocab_size)``, else a ``ValueError`` naming ``who``."""
    token_ids = check_tensor("token_ids", token_ids)
    if token_ids.dim() != 1 or token_ids.numel() == 0 or token_ids.is_floating_point() or token_ids.dtype == torch.bool:
        raise ValueError(
            f"{who}: token_ids must be a non-empty 1-D integer tensor [V_task] (the model id of each task token), "
            f"got shape {tuple(token_ids.shape)} and dtype {token_ids.dtype}"
        )
    lo, hi = int(token_ids.min()), int(token_ids.max())
    if lo < 0 or hi >= model_vocab_size:
        raise ValueError(
            f"{who}: token_ids holds model id {lo if lo < 0 else hi}, outside the model's vocabulary [0, "
            f"{model_vocab_size}): the tokenizer does not match the checkpoint's embedding; save the tokenizer "
            f"the model was built for"
        )
    if token_ids.unique().numel() != token_ids.numel():
        raise ValueError(
            f"{who}: token_ids {token_ids.tolist()} maps two task tokens to one model token: the policy could not "
            f"tell them apart; every task token needs its own model token"
        )
    return token_ids.long()

"""TensorDict helpers the TensorDict modules share (internal).

The functional core works on ``[*B, T]`` tensors; TorchRL stores per-step
scalars as ``[*B, T, 1]``. These helpers adapt one to the other at the module
edge, read ``("next", key)`` entries, and fetch required entries with an error
that names the key, the module and the fix (see ``docs/design.md``, "Batch
layouts"). Nothing here broadcasts: a shape that is neither layout is an error.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import composite_lp_aggregate
from tensordict.utils import NestedKey
from torch import Tensor

from ppo_objectives import _validate

_COLLECTOR_FIX = (
    "this TensorDict looks like a raw collector batch ([N, T] steps of TokenLMEnv, with 'action' and "
    "('next', ...) entries); convert it to the response layout first with "
    "ppo_objectives.trajectories_to_llm_batch(batch, prompt_len, max_new_tokens)"
)


def default_log_prob_key() -> str:
    """TorchRL's default name of the sampling log-prob entry: ``"sample_log_prob"``, or
    ``"action_log_prob"`` when :func:`~tensordict.nn.composite_lp_aggregate` is off."""
    return "sample_log_prob" if composite_lp_aggregate(nowarn=True) else "action_log_prob"


def next_key(key: NestedKey) -> tuple[str, ...]:
    """``("next", *key)``: where TorchRL stores what a step produced."""
    return ("next", *key) if isinstance(key, tuple) else ("next", key)


def key_str(key: NestedKey) -> str:
    """A key as it is written in code: ``'mask'`` or ``('next', 'reward')``."""
    return repr(key if isinstance(key, str) else tuple(key))


def looks_like_collector_batch(td: TensorDictBase) -> bool:
    """Whether ``td`` has the per-step layout of a TokenLMEnv collector batch (``action`` and
    ``("next", "done")``, no response ``mask``)."""
    keys = td.keys(include_nested=True)
    return "action" in keys and ("next", "done") in keys and "mask" not in keys


def require(
    td: TensorDictBase, key: NestedKey, *, module: str, what: str, fix: str = "", collector_fix: bool = True
) -> Tensor:
    """``td[key]``, or a ``KeyError`` naming the key, the module and the fix.

    ``what`` says what the entry is (``"the old log-probs"``); ``fix`` how to produce it.
    A raw collector batch given where a response-layout batch is needed gets the converter
    to run as its fix (``collector_fix=False``: the reader is the converter, or reads
    collector batches itself).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"mask": torch.ones(2, 3, dtype=torch.bool)}, [2])
        >>> require(td, "mask", module="Demo", what="the mask").shape
        torch.Size([2, 3])
        >>> require(td, "advantage", module="Demo", what="the advantages", fix="run MaskedGAE first")
        Traceback (most recent call last):
        ...
        KeyError: "Demo: the TensorDict has no 'advantage' (the advantages); run MaskedGAE first"
    """
    x = td.get(key, None)
    if x is not None:
        return x
    raise missing(td, key, module=module, what=what, fix=fix, collector_fix=collector_fix)


def missing(
    td: TensorDictBase, key: NestedKey, *, module: str, what: str, fix: str = "", collector_fix: bool = True
) -> KeyError:
    """The ``KeyError`` of :func:`require`, for a reader that looks the entry up its own way."""
    if collector_fix and looks_like_collector_batch(td):
        fix = _COLLECTOR_FIX
    return KeyError(f"{module}: the TensorDict has no {key_str(key)} ({what})" + (f"; {fix}" if fix else ""))


def time_last(x: Tensor, name: str, shape: torch.Size, ref_name: str) -> Tensor:
    """Return ``x`` as ``[*B, T]``: accept exactly ``shape`` or ``shape + (1,)``, nothing else."""
    if x.shape == shape:
        return x
    if x.shape == shape + (1,):
        return x.squeeze(-1)
    raise ValueError(
        f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(shape)}: expected "
        f"{tuple(shape)} or the TorchRL layout {tuple(shape + (1,))}. Broadcasting it would mix the "
        f"entries of different tokens or sequences; store one value per token (for a sequence-level "
        f"score, put it on the last valid token, e.g. with KLPenaltyTransform)."
    )


_STEP_FLAGS = (("next", "done"), ("next", "terminated"), ("next", "truncated"))


def step_shape(x: Tensor, batch_dims: int, td: TensorDictBase | None = None) -> tuple[torch.Size, bool]:
    """``[*B, T]`` of a per-token entry ``x``, and whether ``x`` carries TorchRL's trailing ``1``.

    Two layouts give an entry one more dim than ``batch_dims``:

    - TorchRL's per-step layout: ``[*N, T]`` batch dims (time among them), entries ``[*N, T, 1]``;
    - the response layout: a ``[B]`` TensorDict (one row per response), entries ``[B, R]``.

    They differ only when the last dim is 1. ``td`` is the TensorDict whose own batch dims
    these are: with two or more the entry is per-step; with one it is per-step only when ``td``
    carries TorchRL's ``("next", "done" | "terminated" | "truncated")`` flags (a collector's
    trajectory ``[T]``), else it is a response layout with ``R = 1`` (one-token answers), whose
    token axis is kept: the rows are never read as the steps of one episode. Without ``td``
    (the caller reads one response's steps, ``batch_dims`` being its time axis) a trailing 1 is
    per-step.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> one_token = TensorDict({"sample_log_prob": torch.zeros(4, 1)}, [4])   # 4 answers of 1 token
        >>> step_shape(one_token["sample_log_prob"], 1, one_token)
        (torch.Size([4, 1]), False)
        >>> trajectory = one_token.clone().set(("next", "done"), torch.zeros(4, 1, dtype=torch.bool))
        >>> step_shape(trajectory["sample_log_prob"], 1, trajectory)     # one trajectory of 4 steps
        (torch.Size([4]), True)
        >>> step_shape(torch.zeros(4, 1), 1)                               # one response's 4 steps
        (torch.Size([4]), True)
    """
    trailing_one = x.ndim == batch_dims + 1 and x.shape[-1] == 1
    if trailing_one and batch_dims == 1 and td is not None:
        keys = td.keys(include_nested=True)
        trailing_one = any(flag in keys for flag in _STEP_FLAGS)
    return (x.shape[:-1] if trailing_one else x.shape), trailing_one


def mask_or_all(mask: Tensor | None, name: str, shape: torch.Size, ref_name: str, device) -> Tensor:
    """The bool ``[*B, T]`` mask (validated), or all True when absent."""
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return _validate.check_mask(time_last(mask, name, shape, ref_name), shape, ref_name)

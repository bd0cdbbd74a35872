"""Assertions for modules built on the package (see :mod:`ppo_objectives.testing`).

:func:`assert_matches_reference`: a tolerance check whose message gives the largest
absolute and relative errors and where. :func:`assert_mask_invariant`: garbage and
NaN at masked positions of a module's per-token inputs change none of its valid
outputs, and masked outputs stay 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor

from ppo_objectives.testing.batches import make_generator

# --------------------------------------------------------------------------- #
# Assertions
# --------------------------------------------------------------------------- #


def _key(k: NestedKey) -> tuple[str, ...]:
    return (k,) if isinstance(k, str) else tuple(k)


def _where(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def assert_matches_reference(
    got: Tensor | float,
    want: Tensor | float,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    mask: Tensor | None = None,
    name: str = "output",
) -> None:
    """Assert ``|got - want| <= atol + rtol * |want|`` everywhere (or on ``mask``), with a message that helps.

    Both are compared in float64; NaN matches only NaN, and infinities must be
    equal. On failure the ``AssertionError`` names the shapes, how many entries
    fail, the largest absolute error and the largest relative error with the
    index where each occurs and the two values there. The defaults suit float32
    results against a float64 reference of a few hundred terms; tighten them
    for float64 code.

    Args:
        got: the value under test (a tensor or a number).
        want: the reference (same shape; a number is compared to a 0-d ``got``).
        atol / rtol: absolute and relative tolerance.
        mask: optional bool tensor of ``got``'s shape: compare only where True.
        name: what is compared, used in the message.

    Example:
        >>> assert_matches_reference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0000001]))
        >>> assert_matches_reference(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), name="advantage")
        Traceback (most recent call last):
        ...
        AssertionError: advantage does not match the reference: 1 of 2 entries differ (atol=1e-05, rtol=0.0001); largest absolute error 0.5 at [1] (got 2.5, want 2); largest relative error 0.25 at [1] (got 2.5, want 2)
    """
    g = torch.as_tensor(got).detach().cpu()
    w = torch.as_tensor(want).detach().cpu()
    if g.shape != w.shape:
        raise AssertionError(
            f"{name} has shape {tuple(g.shape)} but the reference has shape {tuple(w.shape)}; compare tensors of "
            f"one layout (a trailing 1 is TorchRL's per-step layout: squeeze(-1) or unsqueeze(-1) one of them)"
        )
    g, w = g.double(), w.double()
    if mask is not None:
        mask = torch.as_tensor(mask).cpu()
        if mask.shape != g.shape:
            raise AssertionError(f"mask has shape {tuple(mask.shape)} but {name} has shape {tuple(g.shape)}")
        mask = mask.bool() if mask.dtype == torch.bool else mask > 0.5
    else:
        mask = torch.ones(g.shape, dtype=torch.bool)
    both_nan = torch.isnan(g) & torch.isnan(w)
    same = (g == w) | both_nan  # equal infinities included
    err = (g - w).abs()
    finite = torch.isfinite(err)
    close = same | (finite & (err <= atol + rtol * w.abs()))
    bad = mask & ~close
    if not bool(bad.any()):
        return
    n_bad, n = int(bad.sum()), int(mask.sum())
    parts = [f"{name} does not match the reference: {n_bad} of {n} entries differ (atol={atol}, rtol={rtol})"]
    nonfinite = bad & ~finite
    if bool(nonfinite.any()):
        idx = tuple(int(i) for i in nonfinite.nonzero()[0])
        parts.append(
            f"{int(nonfinite.sum())} non-finite mismatch(es), first at {_where(idx)} "
            f"(got {g[idx].item()}, want {w[idx].item()})"
        )
    fin_bad = bad & finite
    if bool(fin_bad.any()):
        abs_err = torch.where(fin_bad, err, -1.0)
        rel_err = torch.where(fin_bad & (w != 0), err / w.abs().clamp(min=torch.finfo(torch.float64).tiny), -1.0)
        for what, e in (("absolute", abs_err), ("relative", rel_err)):
            if not bool((e >= 0).any()):  # every failing entry has want == 0: no relative error to give
                continue
            flat = int(e.reshape(-1).argmax())
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape)) if g.dim() else ()
            parts.append(
                f"largest {what} error {e[idx].item():.6g} at {_where(idx)} (got {g[idx].item():.6g}, want {w[idx].item():.6g})"
            )
    raise AssertionError("; ".join(parts))


@dataclass
class MaskInvariantReport:
    """What :func:`assert_mask_invariant` checked (returned when every check passed).

    Attributes:
        corrupted: the input keys whose masked positions were overwritten.
        outputs: the output keys compared at the valid positions (whole tensors
            for outputs that are not per-token, such as a loss).
        zero_checked: the per-token outputs checked to be exactly 0 off the mask.
        masked_positions: how many positions of the mask are False.
        fills: the values written there, one run of the module each.
    """

    corrupted: list[tuple[str, ...]] = field(default_factory=list)
    outputs: list[tuple[str, ...]] = field(default_factory=list)
    zero_checked: list[tuple[str, ...]] = field(default_factory=list)
    masked_positions: int = 0
    fills: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        show = lambda keys: ", ".join("/".join(k) for k in keys) or "none"  # noqa: E731
        return (
            f"{self.masked_positions} masked positions filled with {', '.join(self.fills)} in: {show(self.corrupted)}; "
            f"valid outputs unchanged: {show(self.outputs)}; exactly 0 off the mask: {show(self.zero_checked)}"
        )


def _same(a: Tensor | None, b: Tensor) -> bool:
    """Whether ``b`` is the input ``a`` passed through (NaN equal to NaN)."""
    if a is None or not isinstance(a, Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _per_token(x: Tensor, core: torch.Size) -> bool:
    return isinstance(x, Tensor) and (x.shape == core or x.shape == core + (1,))


def assert_mask_invariant(
    module: Callable[[TensorDictBase], TensorDictBase],
    td: TensorDictBase,
    *,
    mask_key: NestedKey = "mask",
    corrupt_keys: Sequence[NestedKey] | None = None,
    out_keys: Sequence[NestedKey] | None = None,
    zero_at_masked: bool | Sequence[NestedKey] = True,
    atol: float = 0.0,
    rtol: float = 0.0,
    seed: int = 0,
) -> MaskInvariantReport:
    """Assert that what sits at masked positions of ``td`` changes none of ``module``'s valid outputs.

    The convention of every module of the package (``docs/design.md``,
    "Conventions"): values, rewards, log-probs or flags at masked positions may
    be garbage, even NaN, and every output at a valid position is unchanged;
    per-token outputs are exactly 0 at masked positions. The module is run on a
    clone of ``td``, then on clones whose masked positions hold NaN, then large
    random garbage (and flipped step flags), and the outputs are compared.

    Per-token entries are those of the mask's shape ``[*B, T]`` (or
    ``[*B, T, 1]``). By default every floating-point per-token entry is
    corrupted, and every bool per-token entry under ``"next"`` (TorchRL's
    ``done`` / ``terminated`` / ``truncated``) is flipped; integer entries (token
    ids) and root bool entries (``mask``, ``attention_mask``) are left alone,
    since a network legitimately reads the tokens of holes as context. The
    module must be deterministic (no dropout: put it in ``eval()`` mode), since
    its runs are compared exactly by default.

    Args:
        module: called as ``module(td)``; returns a TensorDict (``MaskedGAE``,
            ``KLPenaltyTransform``, ``TokenPPOLoss``, a ``TensorDictModule``, ...).
        td: the batch; not modified.
        mask_key: the mask entry (True = takes part).
        corrupt_keys: the input entries to corrupt, instead of the default.
        out_keys: the outputs to compare; default: every entry the module wrote (an
            entry of its output that is not an input passed through unchanged), loss
            terms and diagnostics included.
        zero_at_masked: check that per-token outputs are exactly 0 at masked
            positions: ``True`` (every per-token entry the module wrote), ``False``, or
            the keys to check.
        atol / rtol: tolerance at the valid positions (default: exactly equal).
        seed: seed of the garbage.

    Returns:
        A :class:`MaskInvariantReport` of what was checked.

    Raises:
        AssertionError: naming the output, the fill and the first position that changed.

    Example:
        >>> from ppo_objectives import KLPenaltyTransform
        >>> from ppo_objectives.testing import response_batch
        >>> td = response_batch(batch_size=3, response_len=5, seed=0)
        >>> report = assert_mask_invariant(KLPenaltyTransform(coeff=0.1), td)
        >>> report.outputs
        [('next', 'reward'), ('kl_penalty',)]
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"td must be a TensorDict, got {type(td).__name__}")
    m = _invariance_mask(td, mask_key)
    core = m.shape
    corrupt = _keys_to_corrupt(td, mask_key, core, corrupt_keys)

    def run(x: TensorDictBase) -> TensorDictBase:
        out = module(x)
        if not isinstance(out, TensorDictBase):
            raise TypeError(f"assert_mask_invariant: the module returned a {type(out).__name__}, expected a TensorDict")
        return out

    clean = run(td.clone())
    out_list = list(clean.keys(include_nested=True, leaves_only=True))
    written = [_key(k) for k in out_list if isinstance(clean.get(k), Tensor) and not _same(td.get(k, None), clean.get(k))]
    compare = written if out_keys is None else [_key(k) for k in out_keys]
    if not compare:
        raise ValueError("assert_mask_invariant: the module wrote no output to compare; pass out_keys=")
    _check_deterministic(run, td, clean, compare)
    if zero_at_masked is True:
        zero_keys = [k for k in compare if k in written and _per_token(clean.get(k), core)]
    else:
        zero_keys = [] if zero_at_masked is False else [_key(k) for k in zero_at_masked]

    g = make_generator(seed)
    report = MaskInvariantReport(corrupted=corrupt, outputs=compare, zero_checked=zero_keys,
                                 masked_positions=int((~m).sum()))  # fmt: skip
    fills = [("NaN", None), ("random garbage (|x| up to 1e4) and flipped flags", 1e4)]
    for label, scale in fills:
        report.fills.append(label.split(" (")[0])
        bad = run(_corrupted(td, corrupt, m, core, scale, g))
        for k in compare:
            _compare_valid(clean.get(k, None), bad.get(k, None), k, m, core, label, atol, rtol)
        for k in zero_keys:
            for which, res in (("the clean batch", clean), (f"the batch with {label} at masked positions", bad)):
                _check_zero(res.get(k, None), k, m, core, which)
    return report


def _check_deterministic(run, td: TensorDictBase, clean: TensorDictBase, compare: list) -> None:
    """The module gives the same outputs twice on the same clean batch; else no difference can be blamed on the mask."""
    again = run(td.clone())
    for k in compare:
        a, b = clean.get(k, None), again.get(k, None)
        if isinstance(a, Tensor) and isinstance(b, Tensor) and not torch.equal(a.nan_to_num(), b.nan_to_num()):
            raise AssertionError(
                f"assert_mask_invariant: the module is not deterministic: two calls on the same clean batch give "
                f"different {k!r}, so a change under corrupted padding could not be blamed on masking; a module with "
                f"dropout in training mode does this: call module.eval() (or seed it) before the check"
            )


def _invariance_mask(td: TensorDictBase, mask_key: NestedKey) -> Tensor:
    """The bool ``[*B, T]`` mask of ``td``, refusing a missing mask or one with nothing masked."""
    mask = td.get(mask_key, None)
    if mask is None:
        raise KeyError(
            f"assert_mask_invariant: the TensorDict has no mask {mask_key!r}; pass mask_key= or build the batch with "
            f"a mask (e.g. collector_batch(mask='holes'))"
        )
    m = mask if mask.dtype == torch.bool else mask > 0.5
    if m.ndim == td.batch_dims + 1 and m.shape[-1] == 1 and m.ndim >= 2:
        m = m.squeeze(-1)
    if bool(m.all()):
        raise ValueError(
            "assert_mask_invariant: the mask has no masked position, so nothing would be checked; build the batch "
            "with another mask kind (e.g. mask='holes' or 'empty_rows')"
        )
    return m


def _keys_to_corrupt(td: TensorDictBase, mask_key, core, corrupt_keys) -> list:
    """The per-token inputs to corrupt: float entries and step flags under ``"next"`` by default."""
    if corrupt_keys is None:
        corrupt = []
        for k in td.keys(include_nested=True, leaves_only=True):
            x, kk = td.get(k), _key(k)
            if kk == _key(mask_key) or not _per_token(x, core):
                continue
            if x.is_floating_point() or (x.dtype == torch.bool and kk[0] == "next"):
                corrupt.append(kk)
        return corrupt
    corrupt = [_key(k) for k in corrupt_keys]
    for k in corrupt:
        x = td.get(k, None)
        if x is None:
            raise KeyError(f"assert_mask_invariant: corrupt_keys names {k!r}, which is not in the TensorDict")
        if not _per_token(x, core):
            raise ValueError(
                f"assert_mask_invariant: {k!r} has shape {tuple(x.shape)}, not the mask's {tuple(core)} "
                f"(or {tuple(core) + (1,)}); only per-token entries have masked positions"
            )
    return corrupt


def _corrupted(td: TensorDictBase, corrupt, m, core, scale, g) -> TensorDictBase:
    """A clone of ``td`` with NaN (``scale=None``) or garbage of size ``scale`` (and flipped flags)
    at the masked positions of the ``corrupt`` entries."""
    bad_in = td.clone()
    for k in corrupt:
        x = bad_in.get(k)
        mm = m.reshape(x.shape) if x.shape != core else m
        if x.is_floating_point():
            junk = torch.full(x.shape, float("nan")) if scale is None else scale * (2 * torch.rand(x.shape, generator=g) - 1)
            bad_in.set(k, torch.where(mm, x, junk.to(dtype=x.dtype, device=x.device)))
        elif x.dtype == torch.bool:
            bad_in.set(k, torch.where(mm, x, ~x) if scale is not None else x)
        else:
            junk = torch.randint(-1000, 1000, x.shape, generator=g).to(dtype=x.dtype, device=x.device)
            bad_in.set(k, torch.where(mm, x, junk) if scale is not None else x)
    return bad_in


def _compare_valid(a, b, key, m, core, label, atol, rtol) -> None:
    if a is None or b is None:
        raise AssertionError(f"assert_mask_invariant: output {key!r} is missing from the module's output")
    per_token = _per_token(a, core)
    valid = (m.reshape(a.shape) if a.shape != core else m) if per_token else torch.ones(a.shape, dtype=torch.bool)
    try:
        assert_matches_reference(b, a, atol=atol, rtol=rtol, mask=valid.cpu(), name=f"output {key!r}")
    except AssertionError as err:
        where = "at valid positions " if per_token else ""
        raise AssertionError(
            f"assert_mask_invariant: {label} at masked positions of the inputs changed output {key!r} {where}"
            f"(the module reads masked positions): {err}"
        ) from None


def _check_zero(x, key, m, core, which) -> None:
    if x is None or not _per_token(x, core):
        raise AssertionError(
            f"assert_mask_invariant: zero_at_masked names {key!r}, which is not a per-token output of the mask's "
            f"shape {tuple(core)}"
        )
    xc = x.detach().cpu()
    mm = (m.reshape(x.shape) if x.shape != core else m).cpu()
    nonzero = ~mm & ((xc != 0) | torch.isnan(xc))
    if bool(nonzero.any()):
        idx = tuple(int(i) for i in nonzero.nonzero()[0])
        raise AssertionError(
            f"assert_mask_invariant: output {key!r} is not 0 at masked positions with {which}: "
            f"{int(nonzero.sum())} of {int((~mm).sum())} masked entries, first {xc[idx].item()} at "
            f"{_where(idx)}; the package's per-token outputs are exactly 0 there (pass zero_at_masked=False "
            f"if this module does not promise that)"
        )

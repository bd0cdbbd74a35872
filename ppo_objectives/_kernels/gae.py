"""Fast masked GAE kernels behind ``functional.masked_gae`` (inputs already validated there).

Shape letters: ``N`` rows (flattened batch), ``R`` tokens per row, ``L`` the row length padded
to a whole number of blocks, ``C`` the block length.

Contract shared by every backend (``rewards``, ``values`` float ``[N, R]`` of one dtype,
``mask`` bool ``[N, R]`` or ``None`` (every step valid), ``bootstrap_value`` float ``[N]`` or ``None``, ``gamma`` / ``lmbda``
Python floats or 0-d tensors on the rows' device): return the raw (un-whitened) advantages
``[N, R]``, exactly 0 at masked positions, with the recursion of Schulman et al. 2016,
"High-Dimensional Continuous Control Using Generalized Advantage Estimation", run over the
valid tokens of each row only::

    delta_k = r_k + gamma * V_next(k) - V_k,      A_k = delta_k + gamma * lmbda * A_next(k)

where ``next(k)`` is the next *valid* token of the row; after the last valid token
``V_next = bootstrap_value[n]`` (0 when ``None``) and ``A_next = 0``. Values at masked
positions (garbage, NaN, inf) never enter any arithmetic.

Backends
--------
``"torch"`` (:func:`gae_advantages_torch`), any device, no host synchronisation and no
data-dependent shape, so ``torch.compile(fullgraph=True)`` compiles it:

1. compact: ``slot = cumsum(mask)`` gives each valid token its place in a left-packed row;
   one ``scatter`` per input writes it there (masked tokens go to a dump column whose
   garbage is never read into arithmetic);
2. TD errors on the packed rows, where "next valid" is simply "next slot"; the bootstrap is
   added to the packed reward of the last valid slot as ``gamma * bootstrap``;
3. the discounted reverse cumulative sum ``A_k = sum_{j >= k} g^(j-k) delta_j`` with the
   constant decay ``g = gamma * lmbda`` as a blocked matrix product: inside blocks of ``C``
   slots one ``[C, C]`` matrix of ``g^(j-i)`` (``j >= i``), across blocks the same scheme one
   level up with decay ``g^C`` (recursively). Only non-negative powers of ``g`` appear, so
   nothing overflows for ``g < 1``; ``g = 0`` (``0^0 = 1``) and ``g = 1`` are exact cases and
   powers that underflow to 0 stand for contributions below the dtype's resolution;
4. ``gather`` the packed advantages back to the original positions (masked ones read a
   zero column).

``"triton"`` (:func:`gae_advantages_triton`, kernel in ``_kernels.triton_gae``): CUDA only, one
program per row runs a chunked reverse linear scan (``tl.associative_scan``) in one pass
over the inputs. Chosen by ``backend="auto"`` on CUDA tensors when Triton imports.

``"loop"``: the readable Python loop ``functional.masked_gae_reference`` (dispatched there).

Examples
--------
>>> import torch
>>> r = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
>>> v = torch.tensor([[0.5, 0.5, 0.5, float("nan")]])
>>> m = torch.tensor([[True, True, True, False]])
>>> gae_advantages_torch(r, v, m, 1.0, 1.0, None)  # A_k = sum of rewards after k - V_k
tensor([[0.5000, 0.5000, 0.5000, 0.0000]])
>>> select_backend(torch.device("cpu"), "auto")
'torch'
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("auto", "loop", "torch", "triton")

_BLOCK = 64  # block length C of the blocked discounted cumsum; 64 keeps matrices tiny and powers >= g^64

_TRITON_IMPORT_ERROR: str | None = None
_TRITON_CHECKED = False


def _find_triton() -> bool:
    """Whether ``import triton`` works (checked once, never raises)."""
    global _TRITON_CHECKED, _TRITON_IMPORT_ERROR
    if not _TRITON_CHECKED:
        _TRITON_CHECKED = True
        if importlib.util.find_spec("triton") is None:
            _TRITON_IMPORT_ERROR = "No module named 'triton'"
        else:
            try:
                import triton  # noqa: F401
                import triton.language  # noqa: F401
            except Exception as exc:  # a broken install must not break the torch path
                _TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    return _TRITON_IMPORT_ERROR is None


def _constant_result(fn):
    # torch.compile treats the answer as a constant instead of tracing the import machinery
    marker = getattr(getattr(torch, "_dynamo", None), "assume_constant_result", None)
    return marker(fn) if marker is not None else fn


@_constant_result
def triton_available() -> bool:
    """Whether the Triton backend can run here: Triton imports and a CUDA device is visible."""
    return torch.cuda.is_available() and _find_triton()


def select_backend(device: torch.device, backend: str = "auto") -> str:
    """Pick the masked-GAE implementation for rows on ``device``.

    ``"auto"`` gives ``"triton"`` for CUDA tensors when Triton is available (and the call is
    not being traced by ``torch.compile``, which fuses the torch path itself), else
    ``"torch"``. Explicit ``"loop"`` / ``"torch"`` are returned as given; explicit
    ``"triton"`` is checked and raises when it cannot run.

    >>> select_backend(torch.device("cpu"))
    'torch'
    >>> select_backend(torch.device("cpu"), "loop")
    'loop'
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"masked_gae: backend={backend!r} is not one of {BACKENDS}; the advantages cannot be "
            "computed with an unknown implementation. Use 'auto' (fastest available), 'torch', "
            "'triton' (CUDA + Triton) or 'loop' (readable reference)."
        )
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda" and not torch.compiler.is_compiling() and triton_available():
            return "triton"
        return "torch"
    if backend == "triton":
        if device.type != "cuda":
            raise RuntimeError(
                f"masked_gae: backend='triton' needs CUDA tensors, but the rows are on {device}; "
                "the Triton kernel only runs on a GPU. Move the tensors to CUDA, or use "
                "backend='torch' (any device) or backend='auto'."
            )
        if not triton_available():
            raise RuntimeError(
                "masked_gae: backend='triton' was asked for but Triton cannot be used "
                f"({_TRITON_IMPORT_ERROR or 'no CUDA device is visible'}); the kernel cannot be "
                "compiled. Install triton (it ships with CUDA builds of torch), or use "
                "backend='torch' / backend='auto', which fall back to the torch path."
            )
    return backend


# ----------------------------------------------------------------------------------------------
# torch backend
# ----------------------------------------------------------------------------------------------


def _powers(g, exponents: Tensor) -> Tensor:
    """``g ** exponents`` in float64 (``0 ** 0 == 1``); ``g`` a float or a 0-d tensor."""
    if isinstance(g, Tensor):
        return torch.pow(g.to(torch.float64), exponents)
    return torch.pow(torch.full_like(exponents, float(g)), exponents)


@_constant_result
def _cuda_matmul_reduced() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32)


@_constant_result
def _cpu_matmul_reduced() -> bool:
    return torch.get_float32_matmul_precision() != "highest"


def _matmul_needs_float64(x: Tensor) -> bool:
    # reduced-precision float32 matmuls (TF32 on CUDA, bf16 passes on CPU) would cost ~1e-3
    # relative error; the blocked sum then runs in float64, which the tiny matrices make cheap.
    # (Under torch.compile the setting is read once, when the function is traced.)
    if x.dtype != torch.float32:
        return False
    return _cuda_matmul_reduced() if x.is_cuda else _cpu_matmul_reduced()


def discounted_reverse_cumsum(x: Tensor, g, block: int = _BLOCK, stop: Tensor | None = None) -> Tensor:
    """``out[:, k] = x[:, k] + g * out[:, k + 1]`` (0 past the end) for ``x`` of shape ``[N, L]``.

    Without ``stop`` that is ``sum_{j >= k} g**(j - k) * x[:, j]``. With ``stop`` (bool
    ``[N, L]``) the sum restarts after every stop: ``out[:, k] = x[:, k]`` plus
    ``g * out[:, k + 1]`` only where ``stop[:, k]`` is False, i.e. each sum ends at the
    first stop at or after ``k`` (the end of a trajectory in a collector row).

    Blocked two-level matrix product (recursive beyond ``block**2`` columns); non-negative
    powers of ``g`` only. ``g`` is a float or a 0-d tensor, ``0 <= g`` (``g <= 1`` keeps every
    power <= 1). Inside a block the stopped sum is the plain one minus the discounted sum
    after the stop, ``S_k - g**(s + 1 - k) * S_{s + 1}`` (both at most ``C`` terms, so no
    long-range cancellation); across blocks a block holding a stop passes nothing on.

    >>> discounted_reverse_cumsum(torch.tensor([[1.0, 2.0, 4.0]]), 0.5)  # 1+1+1, 2+2, 4
    tensor([[3., 4., 4.]])
    >>> discounted_reverse_cumsum(torch.tensor([[1.0, 2.0, 4.0]]), 0.5, stop=torch.tensor([[False, True, False]]))
    tensor([[2., 2., 4.]])
    """
    n, length = x.shape
    c = min(block, length)
    nb = -(-length // c)
    if nb * c != length:
        x = F.pad(x, (0, nb * c - length))
        stop = None if stop is None else F.pad(stop, (0, nb * c - length))
    work_dtype = torch.float64 if _matmul_needs_float64(x) else x.dtype
    decay_t, tail, cut_table = _decay_tables(g, c, work_dtype, x.device)
    xb = x.reshape(n, nb, c).to(work_dtype)
    local = torch.matmul(xb, decay_t)  # [N, nb, C]
    if stop is not None:
        return _stopped_blocks(local, stop.reshape(n, nb, c), g, block, cut_table)[:, :length].to(x.dtype)
    if nb > 1:
        g_block = g ** c  # decay from one block start to the next
        heads = local[:, :, 0]  # [N, nb]: each block discounted to its first slot
        starts = discounted_reverse_cumsum(heads, g_block, block)  # A at each block start
        after = F.pad(starts[:, 1:], (0, 1))  # A at the start of the following block
        local = torch.addcmul(local, after.unsqueeze(-1), tail)
    return local.reshape(n, nb * c)[:, :length].to(x.dtype)


def _stopped_blocks(local: Tensor, stop: Tensor, g, block: int, cut_table: Tensor) -> Tensor:
    """The stopped sums ``[N, nb * C]`` from the plain in-block sums ``local`` ``[N, nb, C]``.

    With ``s`` the first stop at or after slot ``k`` of its block (a reverse running minimum)::

        out_k = S_k - g^(s+1-k) * S_{s+1}          (a stop ahead; S_C = 0)
        out_k = S_k + g^(C-k)   * H_next           (no stop ahead: the next block's carry)

    one gather and one table look-up for both cases: a slot with no stop ahead gets the
    sentinel ``s = 2C + 1``, which indexes the carry column ``C + 1`` of ``[S | 0 | H_next]``
    and the ``+g^(C-k)`` half of ``cut_table`` (``-g^j`` at ``j <= C + 1``,
    ``g^(j-C-2)`` above). The carries ``H`` are the stopped sums of the block heads, one
    level up (a block holding a stop passes nothing on).
    """
    n, nb, c = local.shape
    ar = torch.arange(c, device=local.device, dtype=torch.int32)
    s = torch.where(stop, ar, 2 * c + 1).flip(-1).cummin(-1).values.flip(-1)
    column = (s + 1).clamp(max=c + 1).long()  # S_{s+1}, the zero column C, or the carry column C + 1
    factor = cut_table.index_select(0, (s + 1 - ar).reshape(-1)).view(s.shape)
    padded = F.pad(local, (0, 2))
    if nb > 1:
        heads = torch.addcmul(local[:, :, 0], factor[:, :, 0], padded.gather(-1, column[:, :, :1]).squeeze(-1))
        starts = discounted_reverse_cumsum(heads, g**c, block, s[:, :, 0] < c)  # H at each block start
        padded[:, :, c + 1] = F.pad(starts[:, 1:], (0, 1))  # the carry into each block
    return torch.addcmul(local, factor, padded.gather(-1, column)).reshape(n, nb * c)


_TABLES: dict = {}  # (g, C, dtype, device) -> tables, for Python-float decays only


def _decay_tables(g, c: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The constant tables of one block length: ``decay.T [C, C]`` with ``decay[i, j] = g^(j-i)``
    for ``j >= i`` (else 0), ``tail [C] = g^(C-i)`` (slot ``i`` to the next block start) and
    the ``[2C + 3]`` look-up table of :func:`_stopped_blocks`; computed in float64, then
    cast. Cached for Python-float ``g`` outside ``torch.compile`` (a 0-d tensor ``g`` is
    never read on the host)."""
    key = None
    if isinstance(g, (int, float)) and not torch.compiler.is_compiling():
        key = (float(g), c, dtype, device)
        if key in _TABLES:
            return _TABLES[key]
    ar = torch.arange(c, device=device, dtype=torch.float64)
    diff = ar[None, :] - ar[:, None]  # [C, C]: j - i
    decay = torch.where(diff >= 0, _powers(g, diff.clamp(min=0.0)), 0.0)
    tail = _powers(g, c - ar)
    j = torch.arange(2 * c + 3, device=device, dtype=torch.float64)
    cut_table = torch.where(j <= c + 1, -_powers(g, j.clamp(max=c + 1)), _powers(g, (j - c - 2).clamp(min=0.0)))
    tables = (decay.t().to(dtype), tail.to(dtype), cut_table.to(dtype))
    if key is not None:
        if len(_TABLES) >= 64:
            _TABLES.clear()
        _TABLES[key] = tables
    return tables


def gae_advantages_torch(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma,
    lmbda,
    bootstrap_value: Tensor | None,
    ends: Tensor | None = None,
    end_values: Tensor | None = None,
) -> Tensor:
    """Raw masked GAE advantages ``[N, R]`` by compaction + blocked discounted cumsum.

    See the module docstring for the algorithm (and for ``ends`` / ``end_values``, the
    trajectory ends of collector rows); host-sync free and shape-static.

    >>> r = torch.tensor([[1.0, 0.0, 2.0]])
    >>> v = torch.zeros(1, 3)
    >>> m = torch.tensor([[True, False, True]])
    >>> gae_advantages_torch(r, v, m, 0.5, 1.0, None)  # A_0 = 1 + 0.5 * 2 (slot 1 skipped)
    tensor([[2., 0., 2.]])
    """
    _exclusive_ends(bootstrap_value, ends, end_values)
    if mask is None:
        return _dense_advantages(rewards, values, gamma, lmbda, bootstrap_value, ends, end_values)
    n, r = rewards.shape
    dtype = rewards.dtype
    c = min(_BLOCK, r)
    length = -(-r // c) * c  # packed width L >= R, a whole number of blocks
    # packed row layout, L + 3 columns: [0] unused, [1 .. count] the valid tokens in order,
    # [count + 1 .. L + 1] zeros ("after the last slot"), [L + 2] dump for masked tokens
    slot = torch.cumsum(mask, dim=-1)  # [N, R] 1-based slot of each valid token
    dump = length + 2
    idx = torch.where(mask, slot, dump)
    packed_r = rewards.new_zeros(n, length + 3).scatter_(1, idx, rewards)
    packed_v = values.new_zeros(n, length + 3).scatter_(1, idx, values)
    if bootstrap_value is not None:
        # the last valid slot's delta gets + gamma * bootstrap; an empty row puts it in the
        # unused column 0
        packed_r.scatter_add_(1, slot[:, -1:], (bootstrap_value.reshape(n, 1) * gamma).to(dtype))
    # slots past the last valid one are 0 in both rows, so delta is 0 there and the last
    # valid slot sees V_next = 0
    own = packed_r[:, 1 : length + 1] - packed_v[:, 1 : length + 1]
    next_v = packed_v[:, 2 : length + 2]
    stop = None
    if ends is not None:  # a trajectory end sees its own end value instead of the next slot's value
        stop = torch.zeros(n, length + 3, dtype=torch.bool, device=mask.device).scatter_(1, idx, ends)
        stop.scatter_(1, slot[:, -1:], True)  # the last valid slot ends its trajectory (column 0 if none)
        stop = stop[:, 1 : length + 1]
        packed_e = values.new_zeros(n, length + 3).scatter_(1, idx, end_values.to(dtype))
        next_v = torch.where(stop, packed_e[:, 1 : length + 1], next_v)
    delta = _td_errors(own, next_v, gamma)
    adv_packed = discounted_reverse_cumsum(delta, gamma * lmbda, stop=stop)  # [N, L], slot k at column k - 1
    # back to the layout of idx (zero columns at 0, L + 1 and the dump L + 2), then unpack:
    # masked tokens read 0 from the dump column
    return F.pad(adv_packed, (1, 2)).gather(1, idx)


def _dense_advantages(rewards, values, gamma, lmbda, bootstrap_value, ends, end_values) -> Tensor:
    """``mask=None`` (every step valid): the packed rows are the rows themselves, so the TD errors
    are formed in place, with the same numbers as an all-True mask and without the packing."""
    dtype = rewards.dtype
    next_v = F.pad(values[:, 1:], (0, 1))  # V_{k+1}, 0 after the row's last step
    if bootstrap_value is not None:
        rewards = torch.cat([rewards[:, :-1], rewards[:, -1:] + (bootstrap_value.reshape(-1, 1) * gamma).to(dtype)], 1)
    own = rewards - values
    stop = None
    if ends is not None:
        stop = torch.cat([ends[:, :-1], torch.ones_like(ends[:, -1:])], 1)  # the row's last step ends it
        next_v = torch.where(stop, end_values.to(dtype), next_v)
    delta = _td_errors(own, next_v, gamma)
    # contiguous, as the packed path's gather output is: the whitening sums then add in the same order
    return discounted_reverse_cumsum(delta, gamma * lmbda, stop=stop).contiguous()


def _td_errors(own: Tensor, next_v: Tensor, gamma) -> Tensor:
    """``own + gamma * next_v`` (``own = r - V``), one fused op for a float or 0-d tensor ``gamma``."""
    if isinstance(gamma, Tensor):
        return torch.addcmul(own, next_v, gamma.to(own.dtype))
    return torch.add(own, next_v, alpha=gamma)


def _exclusive_ends(bootstrap_value, ends, end_values) -> None:
    # with ends, the last valid step of each row is an end too (the batch boundary), and its
    # bootstrap is its end value: a separate bootstrap_value would be counted twice
    if (ends is None) != (end_values is None):
        raise ValueError("ends and end_values go together: give both (collector rows) or neither")
    if ends is not None and bootstrap_value is not None:
        raise ValueError(
            "bootstrap_value and ends are exclusive: with ends, mark each row's last valid step as an end "
            "and put its bootstrap value in end_values"
        )


# ----------------------------------------------------------------------------------------------
# triton backend
# ----------------------------------------------------------------------------------------------


def gae_advantages_triton(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma,
    lmbda,
    bootstrap_value: Tensor | None,
    ends: Tensor | None = None,
    end_values: Tensor | None = None,
) -> Tensor:
    """Raw masked GAE advantages ``[N, R]`` from the Triton reverse-scan kernel (CUDA).

    Same contract as :func:`gae_advantages_torch`. The kernel has no backward: when autograd
    needs gradients through rewards / values / bootstrap this falls back to the torch path.
    """
    select_backend(rewards.device, "triton")  # clear error without CUDA / Triton
    _exclusive_ends(bootstrap_value, ends, end_values)
    if mask is None:
        mask = torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)
    inputs = (rewards, values, bootstrap_value, end_values, gamma, lmbda)
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in inputs)
    if needs_grad:
        return gae_advantages_torch(rewards, values, mask, gamma, lmbda, bootstrap_value, ends, end_values)
    from ppo_objectives._kernels.triton_gae import masked_gae_triton

    return masked_gae_triton(rewards, values, mask, gamma, lmbda, bootstrap_value, ends, end_values)

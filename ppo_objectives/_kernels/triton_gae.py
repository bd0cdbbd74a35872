"""Triton kernel for masked GAE on CUDA: one program per row, a chunked reverse linear scan.

Imported lazily by ``_kernels.gae.gae_advantages_triton`` only (this module imports ``triton``).

Shape letters: ``N`` rows, ``R`` tokens per row, ``BLOCK`` tokens per chunk of the scan.

The recursion over valid tokens (``next(k)`` = next valid token of the row)::

    A_k = r_k - V_k + gamma * V_next(k) + g * A_next(k),     g = gamma * lmbda

is rewritten with the carry ``C_j`` = "what the first valid token at or after ``j`` hands to
its predecessor", ``gamma * V_i + g * A_i`` for that token ``i`` (``gamma * bootstrap`` when
there is none)::

    C_j = m_j ? g * C_{j+1} + (gamma * V_j + g * (r_j - V_j)) : C_{j+1},   C_R = gamma * bootstrap
    A_k = m_k ? r_k - V_k + C_{k+1} : 0

Collector rows add trajectory ends (``e_j``, with end values ``E_j``: 0 for a termination,
the next value for a truncation): an end sees ``gamma * E_j`` instead of the carry, so::

    X_k = e_k ? gamma * E_k : C_{k+1},    A_k = m_k ? r_k - V_k + X_k : 0
    C_j = m_j ? (e_j ? 0 : g) * C_{j+1} + (gamma * V_j + g * (r_j - V_j) + (e_j ? g * gamma * E_j : 0)) : C_{j+1}

``C`` is a first-order linear recurrence ``C_j = a_j * C_{j+1} + b_j`` (``a = g`` or 1,
``b`` as above or 0), i.e. an associative scan over pairs ``(b, a)``. Each program walks its row
from the right in chunks of ``BLOCK`` tokens: it loads the chunk's inputs at ``j = k + 1``
in reversed order, scans them with ``tl.associative_scan`` (the first operand of the combine
function is the earlier element of the scan), adds the carry from the chunk to the right, and
writes ``A_k``. Masked positions are never loaded (``mask=`` on the loads), so garbage or NaN
there cannot leak. Arithmetic is in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _linear_combine(b_left, a_left, b_right, a_right):
    # compose x -> a_left * x + b_left (earlier in scan order) then x -> a_right * x + b_right
    return b_left * a_right + b_right, a_left * a_right


@triton.jit
def _load_end(e_ptr, ev_ptr, offsets, valid):
    # (is a trajectory end, its end value) at valid positions; nothing is loaded elsewhere
    end = (tl.load(e_ptr + offsets, mask=valid, other=0) != 0) & valid
    return end, tl.load(ev_ptr + offsets, mask=end, other=0.0)


@triton.jit
def _masked_gae_rows_kernel(
    r_ptr,
    v_ptr,
    m_ptr,
    boot_ptr,
    e_ptr,
    ev_ptr,
    gl_ptr,
    out_ptr,
    gamma_arg,
    lam_arg,
    R,
    HAS_BOOT: tl.constexpr,
    HAS_ENDS: tl.constexpr,
    GL_FROM_PTR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * R
    acc_ty = out_ptr.dtype.element_ty
    if GL_FROM_PTR:
        gamma = tl.load(gl_ptr).to(acc_ty)
        lmbda = tl.load(gl_ptr + 1).to(acc_ty)
    else:
        gamma = gamma_arg.to(acc_ty)
        lmbda = lam_arg.to(acc_ty)
    g = gamma * lmbda
    if HAS_BOOT:
        carry = gamma * tl.load(boot_ptr + row).to(acc_ty)
    else:
        carry = gamma * 0.0
    idx = tl.arange(0, BLOCK)
    n_chunks = tl.cdiv(R, BLOCK)
    for c in range(0, n_chunks):
        start = (n_chunks - 1 - c) * BLOCK
        k = start + BLOCK - 1 - idx  # positions of this chunk, right to left
        j = k + 1
        m_j = tl.load(m_ptr + base + j, mask=j < R, other=0) != 0
        r_j = tl.load(r_ptr + base + j, mask=m_j, other=0.0).to(acc_ty)
        v_j = tl.load(v_ptr + base + j, mask=m_j, other=0.0).to(acc_ty)
        own_j = gamma * v_j + g * (r_j - v_j)
        if HAS_ENDS:
            e_j, ev_j = _load_end(e_ptr, ev_ptr, base + j, m_j)
            a = tl.where(m_j, tl.where(e_j, 0.0, g), 1.0).to(acc_ty)
            b = tl.where(m_j, own_j + tl.where(e_j, g * gamma * ev_j.to(acc_ty), 0.0), 0.0).to(acc_ty)
        else:
            a = tl.where(m_j, g, 1.0).to(acc_ty)
            b = tl.where(m_j, own_j, 0.0).to(acc_ty)
        b_scan, a_scan = tl.associative_scan((b, a), 0, _linear_combine)
        c_next = b_scan + a_scan * carry  # C_{k+1}
        m_k = tl.load(m_ptr + base + k, mask=k < R, other=0) != 0
        r_k = tl.load(r_ptr + base + k, mask=m_k, other=0.0).to(acc_ty)
        v_k = tl.load(v_ptr + base + k, mask=m_k, other=0.0).to(acc_ty)
        if HAS_ENDS:
            e_k, ev_k = _load_end(e_ptr, ev_ptr, base + k, m_k)
            c_next = tl.where(e_k, gamma * ev_k.to(acc_ty), c_next)  # X_k
        adv = tl.where(m_k, r_k - v_k + c_next, 0.0)
        tl.store(out_ptr + base + k, adv.to(out_ptr.dtype.element_ty), mask=k < R)
        # the chunk to the left needs C_{start + 1}: the last element in scan order
        carry = tl.sum(tl.where(idx == BLOCK - 1, c_next, 0.0), axis=0)


def _launch_config(r: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of ``r`` tokens."""
    block = min(max(triton.next_power_of_2(r), 32), 1024)
    warps = 1 if block <= 64 else 2 if block <= 128 else 4 if block <= 512 else 8
    return block, warps


def masked_gae_triton(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma,
    lmbda,
    bootstrap_value: Tensor | None,
    ends: Tensor | None = None,
    end_values: Tensor | None = None,
) -> Tensor:
    """Raw masked GAE advantages ``[N, R]`` (contract of ``_kernels.gae.gae_advantages_torch``).

    ``gamma`` / ``lmbda`` as Python floats go to the kernel as arguments for float32 rows; 0-d
    tensors (or float64 rows, to keep float64 precision) go through a 2-element device buffer
    filled on the device, so no host synchronisation happens either way.
    """
    n, r = rewards.shape
    out = torch.empty_like(rewards)
    if n == 0 or r == 0:
        return out.zero_()
    rewards = rewards.contiguous()
    values = values.contiguous()
    mask = mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # same bytes; avoids int1 pointer quirks
    floats = isinstance(gamma, (int, float)) and isinstance(lmbda, (int, float))
    gl_from_ptr = not (floats and rewards.dtype == torch.float32)
    if gl_from_ptr:
        gl = torch.empty(2, dtype=rewards.dtype, device=rewards.device)
        gl[0] = gamma  # a fill kernel (float) or a device copy (0-d tensor): no sync
        gl[1] = lmbda
        gamma_arg, lam_arg = 0.0, 0.0
    else:
        gl = rewards  # unused pointer
        gamma_arg, lam_arg = float(gamma), float(lmbda)
    e, ev = mask, rewards  # unused pointers without ends
    if ends is not None:
        e = ends.contiguous().view(torch.uint8) if ends.dtype == torch.bool else ends.contiguous()
        ev = end_values.to(rewards.dtype).contiguous()
        # the last valid step ends its row's trajectory: the scan starts from its end value
        positions = torch.arange(r, device=rewards.device)
        last = torch.where(mask != 0, positions, -1).amax(-1, keepdim=True)
        bootstrap_value = torch.where(last >= 0, ev.gather(1, last.clamp(min=0)), 0.0).squeeze(-1)
    boot = rewards if bootstrap_value is None else bootstrap_value.to(rewards.dtype).contiguous()
    block, warps = _launch_config(r)
    _masked_gae_rows_kernel[(n,)](
        rewards,
        values,
        mask,
        boot,
        e,
        ev,
        gl,
        out,
        gamma_arg,
        lam_arg,
        r,
        HAS_BOOT=bootstrap_value is not None,
        HAS_ENDS=ends is not None,
        GL_FROM_PTR=gl_from_ptr,
        BLOCK=block,
        num_warps=warps,
    )
    return out

"""Fast masked GAE (torch blocked matrix product, Triton scan) against a naive float64 reference.

The references are the testing kit's (``ppo_objectives.testing``), written independently of
``functional.masked_gae_reference``: they walk each row's valid indices backwards with Python floats.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_objectives._kernels import gae as _gae_fast
from ppo_objectives._kernels.gae import (
    discounted_reverse_cumsum,
    gae_advantages_torch,
    gae_advantages_triton,
    select_backend,
)
from ppo_objectives.functional import masked_gae
from ppo_objectives.testing import MASK_KINDS as KIT_MASK_KINDS
from ppo_objectives.testing import (
    make_mask,
    reference_gae_collector,
    reference_gae_response,
)

# --------------------------------------------------------------------------- #
# References: the kit's loops, and the emulated Triton kernel
# --------------------------------------------------------------------------- #


def discounted_rcumsum_reference(x, g, stop=None):
    """``out[k] = x[k] + g * out[k + 1]``, restarted after each stop: the kit's GAE loops with zero values and
    lambda 1, a stop ending a trajectory."""
    if stop is None:
        return reference_gae_response(x, torch.zeros_like(x), None, g, 1.0)[0]
    return reference_gae_collector(x, torch.zeros_like(x), None, g, 1.0, done=stop)[0]


def make_flags(n, r, rate, gen, device):
    """done flags at ``rate``, half of them terminations, garbage-proof (flags at masked steps are
    random too), and next values (NaN where they must never be read is not possible: a truncated
    end reads them, so they are finite everywhere)."""
    done = torch.rand(n, r, generator=gen) < rate
    terminated = done & (torch.rand(n, r, generator=gen) < 0.5)
    next_values = torch.randn(n, r, generator=gen, dtype=torch.float64)
    return done.to(device), terminated.to(device), next_values.to(device)


def emulate_triton_kernel(rewards, values, mask, gamma, lmbda, bootstrap, block):
    """The Triton kernel's chunk / carry / shifted-load algebra, step by step in float64.

    Mirrors ``_triton_gae._masked_gae_rows_kernel`` (which cannot run without a GPU): chunks
    walked right to left, inputs read at ``j = k + 1`` in reversed order, a scan over
    ``(b, a)`` pairs with the same combine rule, the carry taken from the last scan element.
    """
    n, r = rewards.shape
    out = torch.zeros(n, r, dtype=torch.float64)
    g = gamma * lmbda
    for row in range(n):
        carry = gamma * (0.0 if bootstrap is None else float(bootstrap[row]))
        n_chunks = -(-r // block)
        for c in range(n_chunks):
            start = (n_chunks - 1 - c) * block
            ks = [start + block - 1 - i for i in range(block)]
            pairs = []
            for k in ks:
                j = k + 1
                if j < r and bool(mask[row, j]):
                    rj, vj = float(rewards[row, j]), float(values[row, j])
                    pairs.append((gamma * vj + g * (rj - vj), g))
                else:
                    pairs.append((0.0, 1.0))
            scanned, acc = [], None
            for b, a in pairs:  # inclusive scan with combine(left, right)
                acc = (b, a) if acc is None else (acc[0] * a + b, acc[1] * a)
                scanned.append(acc)
            c_next = [b + a * carry for b, a in scanned]
            for i, k in enumerate(ks):
                if k < r and bool(mask[row, k]):
                    out[row, k] = float(rewards[row, k]) - float(values[row, k]) + c_next[i]
            carry = c_next[block - 1]
    return out


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #

MASK_KINDS = tuple(k for k in KIT_MASK_KINDS if k != "mixed")  # the kit's kinds; "mixed" draws rows from these


def make_inputs(n, r, dtype, kind, gen, device):
    mask = make_mask(n, r, kind, generator=gen)
    rewards = torch.randn(n, r, generator=gen, dtype=torch.float64).to(dtype)
    values = torch.randn(n, r, generator=gen, dtype=torch.float64).to(dtype)
    boot = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    # garbage at masked positions must never leak
    rewards = rewards.masked_fill(~mask, float("nan"))
    values = values.masked_fill(~mask, float("inf"))
    return rewards.to(device), values.to(device), mask.to(device), boot.to(device)


def assert_close_to_reference(out, ref, dtype):
    """1e-5 relative in float32 (1e-11 in float64), with an absolute floor at the row scale."""
    rtol = 1e-5 if dtype == torch.float32 else 1e-11
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=rtol * scale)


FACTORS = [0.0, 0.5, 0.95, 1.0]
GAMMA_LAM_LONG = [(0.0, 0.0), (0.5, 0.5), (1.0, 0.95), (0.95, 1.0), (1.0, 1.0), (0.99, 0.95)]


# --------------------------------------------------------------------------- #
# torch backend equals the reference
# --------------------------------------------------------------------------- #


def check_grid_case(shape, gamma, lmbda, dtype, use_bootstrap, device):
    gen = torch.Generator().manual_seed(hash((shape, gamma, lmbda)) % 2**31)
    for kind in MASK_KINDS:
        r, v, m, boot = make_inputs(*shape, dtype, kind, gen, device)
        boot = boot if use_bootstrap else None
        out = gae_advantages_torch(r, v, m, gamma, lmbda, boot)
        ref = reference_gae_response(r, v, m, gamma, lmbda, bootstrap_value=boot)[0]
        assert out.dtype == dtype and out.shape == m.shape
        assert torch.isfinite(out).all(), kind
        assert (out[~m] == 0).all(), f"{kind}: masked positions must be exactly 0"
        assert_close_to_reference(out, ref, dtype)


# every gamma x lambda on short rows; on 1024-token rows (16 blocks of 64: the second level of the blocked sum)
# the pairs of GAMMA_LAM_LONG
GRID = [(s, g, lm) for s in [(1, 1), (3, 17)] for g in FACTORS for lm in FACTORS]
GRID += [((4, 1024), g, lm) for g, lm in GAMMA_LAM_LONG]


@pytest.mark.parametrize("use_bootstrap", [False, True], ids=["terminal", "bootstrap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape,gamma,lmbda", GRID, ids=[f"{s[0]}x{s[1]}-{g}-{lm}" for s, g, lm in GRID])
def test_torch_gae_matches_naive_reference_over_grid(shape, gamma, lmbda, dtype, use_bootstrap, device):
    check_grid_case(shape, gamma, lmbda, dtype, use_bootstrap, device)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_masked_gae_flattens_leading_dims_like_the_reference(backend, device):
    # shape (2, 3, 17): the batch dims are flattened to 6 rows of 17 and restored
    gen = torch.Generator().manual_seed(3)
    r, v, m, boot = make_inputs(6, 17, torch.float32, "holes", gen, device)
    r3, v3, m3, b3 = r.view(2, 3, 17), v.view(2, 3, 17), m.view(2, 3, 17), boot.view(2, 3)
    adv, ret = masked_gae(r3, v3, m3, 0.95, 0.9, average_gae=False, bootstrap_value=b3, backend=backend)
    ref, ref_ret = reference_gae_response(r3, v3, m3, 0.95, 0.9, bootstrap_value=b3)
    assert adv.shape == (2, 3, 17)
    assert_close_to_reference(adv, ref, torch.float32)
    assert_close_to_reference(ret, ref_ret, torch.float32)


def test_torch_gae_golden_case_with_hole_and_bootstrap():
    # row [r=1, hole, r=2] with V = [0.5, garbage, 1.0], gamma = 0.5, lmbda = 1, bootstrap 4
    # last valid:  delta_2 = 2 + 0.5 * 4 - 1.0 = 3           A_2 = 3
    # first valid: delta_0 = 1 + 0.5 * 1.0 - 0.5 = 1         A_0 = 1 + 0.5 * 3 = 2.5
    r = torch.tensor([[1.0, 7.0, 2.0]])
    v = torch.tensor([[0.5, float("nan"), 1.0]])
    m = torch.tensor([[True, False, True]])
    out = gae_advantages_torch(r, v, m, 0.5, 1.0, torch.tensor([4.0]))
    assert out.tolist() == [[2.5, 0.0, 3.0]]


def test_torch_gae_accepts_zero_dim_tensor_gamma_and_lam():
    gen = torch.Generator().manual_seed(1)
    r, v, m, boot = make_inputs(3, 70, torch.float32, "holes", gen, "cpu")
    out = gae_advantages_torch(r, v, m, torch.tensor(0.97), torch.tensor(0.9), boot)
    ref = reference_gae_response(r, v, m, 0.97, 0.9, bootstrap_value=boot)[0]
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("gamma,lmbda", [(0.999, 1.0), (1.0, 1.0), (0.9, 0.9)])
def test_torch_gae_long_rows_stay_accurate_in_float32(gamma, lmbda):
    # 5000 tokens: three levels of blocks (64 * 64 < 5000); decays like 0.81^4999 underflow to 0
    gen = torch.Generator().manual_seed(2)
    r, v, m, boot = make_inputs(2, 5000, torch.float32, "holes", gen, "cpu")
    out = gae_advantages_torch(r, v, m, gamma, lmbda, boot)
    assert torch.isfinite(out).all()
    ref = reference_gae_response(r, v, m, gamma, lmbda, bootstrap_value=boot)[0]
    assert_close_to_reference(out, ref, torch.float32)


def test_torch_gae_stays_accurate_under_reduced_float32_matmul_precision():
    # with TF32 / bf16 matmul passes allowed, the blocked sums switch to float64
    gen = torch.Generator().manual_seed(4)
    r, v, m, boot = make_inputs(3, 300, torch.float32, "right", gen, "cpu")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        out = gae_advantages_torch(r, v, m, 1.0, 1.0, boot)
    finally:
        torch.set_float32_matmul_precision(before)
    ref = reference_gae_response(r, v, m, 1.0, 1.0, bootstrap_value=boot)[0]
    assert_close_to_reference(out, ref, torch.float32)


def test_torch_gae_backpropagates_to_values():
    gen = torch.Generator().manual_seed(5)
    r, v, m, _ = make_inputs(2, 9, torch.float64, "holes", gen, "cpu")
    v = torch.where(m, v, 0.0).requires_grad_()
    r = torch.where(m, r, 0.0)
    assert torch.autograd.gradcheck(lambda vv: gae_advantages_torch(r, vv, m, 0.9, 0.8, None), (v,))


# lengths on and across block boundaries (64, 64 * 64); without stops, and with stops at three rates
RCUMSUM = [(n, g, None) for n in [1, 5, 63, 64, 65, 128, 4095, 4097] for g in [0.0, 0.3, 0.97, 1.0]]
RCUMSUM += [(n, g, rate) for n in [1, 5, 64, 65, 130, 4097] for g in [0.0, 0.5, 0.97, 1.0] for rate in [0.01, 0.3, 1.0]]


@pytest.mark.parametrize("length,g,rate", RCUMSUM, ids=[f"{n}-{g}-{'nostop' if r is None else f'stop{r}'}"
                                                        for n, g, r in RCUMSUM])  # fmt: skip
def test_discounted_reverse_cumsum_matches_loop(length, g, rate):
    if rate is None:
        gen = torch.Generator().manual_seed(length)
        x, stop = torch.randn(2, length, generator=gen, dtype=torch.float64), None
    else:
        gen = torch.Generator().manual_seed(length * 3 + int(rate * 10))
        x = torch.randn(3, length, generator=gen, dtype=torch.float64)
        stop = torch.rand(3, length, generator=gen) < rate
    ref = discounted_rcumsum_reference(x, g, stop)
    if stop is None:
        out = discounted_reverse_cumsum(x, g)
        torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-11 * max(1.0, float(ref.abs().max())))
    else:
        torch.testing.assert_close(discounted_reverse_cumsum(x, g, stop=stop), ref, rtol=1e-10, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 4),
    r=st.integers(1, 150),
    gamma=st.floats(0.0, 1.0),
    lmbda=st.floats(0.0, 1.0),
    p_valid=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    bootstrap=st.booleans(),
)
def test_torch_gae_equals_reference_and_ignores_garbage_property(n, r, gamma, lmbda, p_valid, seed, bootstrap):
    gen = torch.Generator().manual_seed(seed)
    m = torch.rand(n, r, generator=gen) < p_valid
    r_ = torch.randn(n, r, generator=gen, dtype=torch.float64)
    v_ = torch.randn(n, r, generator=gen, dtype=torch.float64)
    boot = torch.randn(n, generator=gen, dtype=torch.float64) if bootstrap else None
    clean = gae_advantages_torch(r_, v_, m, gamma, lmbda, boot)
    noisy = gae_advantages_torch(
        r_.masked_fill(~m, float("nan")), v_.masked_fill(~m, -float("inf")), m, gamma, lmbda, boot
    )
    assert torch.equal(clean, noisy)
    assert_close_to_reference(clean, reference_gae_response(r_, v_, m, gamma, lmbda, bootstrap_value=boot)[0],
                              torch.float64)


# --------------------------------------------------------------------------- #
# Collector rows: trajectory ends (done / terminated / next values), every backend
# --------------------------------------------------------------------------- #


def check_segment_case(shape, gamma, lmbda, dtype, rate, backend, device, seed):
    gen = torch.Generator().manual_seed(seed)
    for kind in MASK_KINDS:
        r, v, m, _ = make_inputs(*shape, dtype, kind, gen, device)
        done, term, nv = make_flags(*shape, rate, gen, device)
        adv, ret = masked_gae(
            r, v, m, gamma, lmbda, average_gae=False, done=done, terminated=term, next_values=nv.to(dtype), backend=backend
        )
        ref = reference_gae_collector(r, v, nv.to(dtype), gamma, lmbda, done=done, terminated=term, mask=m)[0]
        assert adv.dtype == dtype and adv.shape == m.shape
        assert (adv[~m] == 0).all() and (ret[~m] == 0).all(), kind
        assert_close_to_reference(adv, ref, dtype)
        assert_close_to_reference(ret, torch.where(m.cpu(), ref + v.cpu().double(), 0.0), dtype)


# 130 tokens: two blocks of 64 plus a partial one, so ends fall on and across block boundaries; every case in
# float32 and float64 on both backends. 5000 tokens: three levels of blocks, a block holding an end passes nothing
# on at every level; float32 on the torch backend.
SEGMENTS = [(s, g, lm, rate, dt, b, len(s) * 31 + s[-1]) for s in [(1, 1), (3, 130)]
            for g, lm in [(0.0, 0.0), (1.0, 1.0), (0.99, 0.95), (0.5, 1.0)] for rate in [0.0, 0.1, 1.0]
            for dt in [torch.float32, torch.float64] for b in ["loop", "torch"]]  # fmt: skip
SEGMENTS += [((2, 5000), g, lm, rate, torch.float32, "torch", int(rate * 1000))
             for g, lm, rate in [(1.0, 1.0, 0.001), (0.99, 0.95, 0.02), (1.0, 0.95, 0.3)]]  # fmt: skip


@pytest.mark.parametrize("shape,gamma,lmbda,rate,dtype,backend,seed", SEGMENTS,
                         ids=[f"{s[0]}x{s[1]}-{g}-{lm}-done{r}-{'f32' if dt == torch.float32 else 'f64'}-{b}"
                              for s, g, lm, r, dt, b, _ in SEGMENTS])  # fmt: skip
def test_collector_rows_match_the_naive_segment_reference(shape, gamma, lmbda, rate, dtype, backend, seed, device):
    check_segment_case(shape, gamma, lmbda, dtype, rate, backend, device, seed=seed)


def test_collector_row_golden_case():
    # one row, hole at 2: steps 0,1 terminate at 1; steps 3,4 are truncated at 4 (next value 10);
    # step 5 is cut by the row's end (next value 2). gamma = 0.5, lmbda = 1, rewards 1, values 0
    r = torch.ones(1, 6)
    v = torch.zeros(1, 6)
    m = torch.tensor([[True, True, False, True, True, True]])
    done = torch.tensor([[False, True, True, False, True, False]])  # the flag at the hole is never read
    term = torch.tensor([[False, True, False, False, False, False]])
    nv = torch.tensor([[0.0, 99.0, 99.0, 0.0, 10.0, 2.0]])
    adv, _ = masked_gae(r, v, m, 0.5, 1.0, average_gae=False, done=done, terminated=term, next_values=nv)
    # A_1 = 1 (terminated: 99 ignored), A_0 = 1 + 0.5 * A_1 = 1.5;  A_4 = 1 + 0.5 * 10 = 6,
    # A_3 = 1 + 0.5 * 6 = 4;  A_5 = 1 + 0.5 * 2 = 2
    assert adv.tolist() == [[1.5, 1.0, 0.0, 4.0, 6.0, 2.0]]


def test_collector_rows_without_next_values_bootstrap_zero_except_the_row_bootstrap():
    r = torch.ones(2, 4)
    v = torch.zeros(2, 4)
    m = torch.ones(2, 4, dtype=torch.bool)
    done = torch.tensor([[False, True, False, False], [False, False, False, True]])
    adv, _ = masked_gae(r, v, m, 1.0, 1.0, average_gae=False, done=done, bootstrap_value=torch.tensor([5.0, 5.0]))
    # row 0: the boundary cut takes the row bootstrap 5; row 1 ends done (terminal): 5 is not used
    assert adv.tolist() == [[2.0, 1.0, 7.0, 6.0], [4.0, 3.0, 2.0, 1.0]]


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_done_flags_at_masked_steps_and_garbage_next_values_are_never_read(backend):
    gen = torch.Generator().manual_seed(21)
    r, v, m, _ = make_inputs(4, 40, torch.float64, "holes", gen, "cpu")
    done, term, nv = make_flags(4, 40, 0.2, gen, "cpu")
    read = done & m | (m & (torch.cumsum(m, -1) == m.sum(-1, keepdim=True)))  # ends
    nv_clean = torch.where(read & ~term, nv, 0.0)
    clean = masked_gae(r, v, m, 0.9, 0.8, average_gae=False, done=done & m, terminated=term & m, next_values=nv_clean,
                       backend=backend)[0]  # fmt: skip
    noisy_nv = torch.where(read & ~term, nv, float("nan"))
    noisy = masked_gae(r, v, m, 0.9, 0.8, average_gae=False, done=done | ~m, terminated=term, next_values=noisy_nv,
                       backend=backend)[0]  # fmt: skip
    torch.testing.assert_close(noisy, clean, rtol=0, atol=0)


def test_no_ends_is_the_response_layout_exactly():
    # all-False flags and the row bootstrap as next value of the last valid step: same numbers
    gen = torch.Generator().manual_seed(22)
    r, v, m, boot = make_inputs(5, 150, torch.float64, "holes", gen, "cpu")
    nv = boot[:, None].expand(5, 150).contiguous()
    want = masked_gae(r, v, m, 0.99, 0.95, average_gae=True, bootstrap_value=boot)[0]
    got = masked_gae(r, v, m, 0.99, 0.95, average_gae=True, done=torch.zeros_like(m), next_values=nv)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


NO_MASK_CASES = [(b, s) for b in ("loop", "torch") for s in ((3, 1), (4, 17), (2, 130))] + [("torch", (2, 4100))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("backend,shape", NO_MASK_CASES, ids=[f"{b}-{s[0]}x{s[1]}" for b, s in NO_MASK_CASES])
def test_no_mask_gives_the_numbers_of_an_all_true_mask_bit_for_bit(backend, shape, dtype):
    # mask=None skips the packing of the rows; the TD errors and sums are the same operations
    gen = torch.Generator().manual_seed(shape[-1])
    r, v, _, boot = make_inputs(*shape, dtype, "all_valid", gen, "cpu")
    done, term, nv = make_flags(*shape, 0.05, gen, "cpu")
    ones = torch.ones(shape, dtype=torch.bool)
    cases = [{}, dict(bootstrap_value=boot), dict(done=done, terminated=term, next_values=nv.to(dtype)),
             dict(done=done), dict(next_values=nv.to(dtype))]  # fmt: skip
    for kwargs in cases:
        for normalize in (True, False):
            got = masked_gae(r, v, None, 0.99, 0.95, average_gae=normalize, backend=backend, **kwargs)
            want = masked_gae(r, v, ones, 0.99, 0.95, average_gae=normalize, backend=backend, **kwargs)
            for a, b in zip(got, want):
                assert torch.equal(a, b), (sorted(kwargs), normalize)


def test_torch_gae_with_ends_backpropagates_to_values_and_next_values():
    gen = torch.Generator().manual_seed(23)
    r, v, m, _ = make_inputs(2, 9, torch.float64, "holes", gen, "cpu")
    done, term, nv = make_flags(2, 9, 0.3, gen, "cpu")
    v = torch.where(m, v, 0.0).requires_grad_()
    nv = nv.requires_grad_()
    r = torch.where(m, r, 0.0)

    def f(vv, nn):
        return masked_gae(r, vv, m, 0.9, 0.8, average_gae=False, done=done, terminated=term, next_values=nn,
                          backend="torch")[0]  # fmt: skip

    assert torch.autograd.gradcheck(f, (v, nv))


def test_kernel_rejects_bootstrap_together_with_ends():
    m = torch.ones(1, 3, dtype=torch.bool)
    z = torch.zeros(1, 3)
    with pytest.raises(ValueError, match=r"bootstrap_value and ends are exclusive"):
        gae_advantages_torch(z, z, m, 1.0, 1.0, torch.zeros(1), m, z)
    with pytest.raises(ValueError, match=r"ends and end_values go together"):
        gae_advantages_torch(z, z, m, 1.0, 1.0, None, m, None)


_INTERPRETED_KERNEL = """
import torch
from ppo_objectives import functional as F
from ppo_objectives._kernels.triton_gae import masked_gae_triton
from ppo_objectives.testing import reference_gae_collector, reference_gae_response
import tests.kernels.test_gae_fast as t
gen = torch.Generator().manual_seed(0)
worst = 0.0
cases = [((3, 1), kind) for kind in t.MASK_KINDS] + [((3, 17), kind) for kind in t.MASK_KINDS]
cases += [((2, 200), "holes"), ((1, 1100), "holes")]  # 1100 > 1024: two chunks, a carry between them
for shape, kind in cases:
    r, v, m, boot = t.make_inputs(*shape, torch.float32, kind, gen, "cpu")
    done, term, nv = t.make_flags(*shape, 0.05, gen, "cpu")
    for gamma, lmbda in [(1.0, 1.0), (0.9, 0.5)]:
        g, l = torch.tensor(gamma), torch.tensor(lmbda)  # the interpreter takes the device-buffer path
        rr, vv, mm, g_, l_, _, ends, ev, _ = F._gae_inputs(r, v, m, g, l, None, done, term, nv.float())
        seg = masked_gae_triton(rr, vv, mm, g_, l_, None, ends, ev)
        want = reference_gae_collector(r, v, nv.float(), gamma, lmbda, done=done, terminated=term, mask=m)[0]
        t.assert_close_to_reference(seg, want, torch.float32)
        for b in (None, boot):
            out = masked_gae_triton(r, v, m, g, l, b)
            want = reference_gae_response(r, v, m, gamma, lmbda, bootstrap_value=b)[0]
            t.assert_close_to_reference(out, want, torch.float32)
        worst = max(worst, float((seg.double() - want).abs().max()))
print("ok", worst)
"""


@pytest.mark.slow  # about 10 s: the interpreter runs the kernel program by program in numpy
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package (interpreter mode)")
def test_triton_kernel_runs_under_the_interpreter_for_both_layouts():
    # TRITON_INTERPRET=1 executes the real kernel source on CPU tensors, so the kernel is checked
    # on machines without a GPU; it must be set before triton is imported, hence the subprocess
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED_KERNEL], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok")


# importing inductor on torch 2.13 trips torch's own torch.jit.script_method deprecation warning
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.slow  # 10-25 s of inductor compilation on 2 cores
def test_masked_gae_compiles_with_fullgraph_and_matches_reference():
    # the whole public function: validation, dispatch ("auto" -> torch), kernel, whitening
    gen = torch.Generator().manual_seed(6)
    r, v, m, boot = make_inputs(3, 17, torch.float32, "holes", gen, "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda r, v, m, b: masked_gae(r, v, m, 0.95, 0.9, average_gae=False, bootstrap_value=b),
        fullgraph=True,
        dynamic=False,
    )
    adv, ret = compiled(r, v, m, boot)
    ref = reference_gae_response(r, v, m, 0.95, 0.9, bootstrap_value=boot)[0]
    assert_close_to_reference(adv, ref, torch.float32)
    assert_close_to_reference(ret, torch.where(m, ref + v.double(), 0.0), torch.float32)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- #
# Triton algorithm (emulated) and backend selection, on any machine
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("block", [1, 4, 32])
@pytest.mark.parametrize("r", [1, 3, 17, 33])
def test_triton_kernel_algebra_matches_reference_when_emulated(r, block):
    gen = torch.Generator().manual_seed(r * 7 + block)
    for kind in MASK_KINDS:
        rw, v, m, boot = make_inputs(3, r, torch.float64, kind, gen, "cpu")
        for b in (None, boot):
            out = emulate_triton_kernel(rw, v, m, 0.9, 0.8, b, block)
            ref = reference_gae_response(rw, v, m, 0.9, 0.8, bootstrap_value=b)[0]
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_select_backend_auto_is_torch_on_cpu():
    assert select_backend(torch.device("cpu"), "auto") == "torch"


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_select_backend_returns_explicit_choices(backend):
    assert select_backend(torch.device("cpu"), backend) == backend
    assert select_backend(torch.device("cuda"), backend) == backend


def test_select_backend_auto_picks_triton_on_cuda_when_available(monkeypatch):
    monkeypatch.setattr(_gae_fast, "triton_available", lambda: True)
    assert select_backend(torch.device("cuda"), "auto") == "triton"
    assert select_backend(torch.device("cuda", 0), "triton") == "triton"
    assert select_backend(torch.device("cpu"), "auto") == "torch"


def test_select_backend_auto_falls_back_to_torch_without_triton(monkeypatch):
    monkeypatch.setattr(_gae_fast, "triton_available", lambda: False)
    assert select_backend(torch.device("cuda"), "auto") == "torch"


def test_select_backend_auto_leaves_compiled_code_to_inductor(monkeypatch):
    monkeypatch.setattr(_gae_fast, "triton_available", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert select_backend(torch.device("cuda"), "auto") == "torch"


def test_select_backend_rejects_unknown_name():
    with pytest.raises(ValueError, match=r"masked_gae: backend='cuda' is not one of \('auto', 'loop', 'torch', 'triton'\); "
                                         r"the advantages cannot be computed with an unknown implementation"):
        select_backend(torch.device("cpu"), "cuda")


def test_select_backend_triton_on_cpu_raises_clear_error():
    with pytest.raises(RuntimeError, match=r"backend='triton' needs CUDA tensors, but the rows are on cpu"):
        select_backend(torch.device("cpu"), "triton")


def test_select_backend_triton_without_triton_raises_clear_error(monkeypatch):
    monkeypatch.setattr(_gae_fast, "triton_available", lambda: False)
    monkeypatch.setattr(_gae_fast, "_TRITON_IMPORT_ERROR", "No module named 'triton'")
    with pytest.raises(RuntimeError, match=r"Triton cannot be used \(No module named 'triton'\).*backend='torch'"):
        select_backend(torch.device("cuda"), "triton")


def test_masked_gae_with_triton_backend_on_cpu_raises():
    m = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        masked_gae(torch.zeros(1, 3), torch.zeros(1, 3), m, 1.0, 1.0, backend="triton")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        gae_advantages_triton(torch.zeros(1, 3), torch.zeros(1, 3), m, 1.0, 1.0, None)


def test_triton_probe_never_raises_and_reports_why():
    available = _gae_fast._find_triton()
    assert isinstance(available, bool)
    if not available:
        assert "triton" in _gae_fast._TRITON_IMPORT_ERROR.lower() or _gae_fast._TRITON_IMPORT_ERROR
    assert _gae_fast.triton_available() == (torch.cuda.is_available() and available)


def test_triton_entry_falls_back_to_torch_when_gradients_are_needed(monkeypatch):
    # the kernel has no backward; with requires_grad inputs the torch path (with autograd) runs
    monkeypatch.setattr(_gae_fast, "select_backend", lambda device, backend: backend)
    gen = torch.Generator().manual_seed(7)
    r, v, m, _ = make_inputs(2, 9, torch.float32, "holes", gen, "cpu")
    v = torch.where(m, v, 0.0).requires_grad_()
    out = gae_advantages_triton(r, v, m, 0.9, 0.8, None)
    assert out.grad_fn is not None
    assert_close_to_reference(out.detach(), reference_gae_response(r, v.detach(), m, 0.9, 0.8)[0], torch.float32)


# --------------------------------------------------------------------------- #
# CUDA: Triton kernel equal to the reference, no host synchronisation
# --------------------------------------------------------------------------- #

needs_triton = pytest.mark.skipif(not _gae_fast.triton_available(), reason="needs CUDA and Triton")


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("tensor_gamma", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (4, 1024), (2, 3000)], ids=lambda s: "x".join(map(str, s)))
def test_triton_gae_matches_naive_reference_on_cuda(shape, dtype, tensor_gamma):
    gen = torch.Generator().manual_seed(11)
    for gamma, lmbda in [(0.0, 0.0), (1.0, 1.0), (0.99, 0.95), (0.5, 0.5)]:
        for kind in MASK_KINDS:
            r, v, m, boot = make_inputs(*shape, dtype, kind, gen, "cuda")
            g = torch.tensor(gamma, device="cuda", dtype=dtype) if tensor_gamma else gamma
            lm = torch.tensor(lmbda, device="cuda", dtype=dtype) if tensor_gamma else lmbda
            for b in (None, boot):
                out = gae_advantages_triton(r, v, m, g, lm, b)
                ref = reference_gae_response(r, v, m, gamma, lmbda, bootstrap_value=b)[0]
                assert (out[~m] == 0).all()
                assert_close_to_reference(out, ref, dtype)


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (4, 1024), (2, 3000)], ids=lambda s: "x".join(map(str, s)))
def test_triton_gae_collector_rows_match_the_segment_reference_on_cuda(shape, dtype):
    for gamma, lmbda in [(1.0, 1.0), (0.99, 0.95), (0.0, 0.5)]:
        for rate in (0.02, 0.5):
            check_segment_case(shape, gamma, lmbda, dtype, rate, "triton", "cuda", seed=shape[-1] + int(rate * 100))


@pytest.mark.cuda
@needs_triton
def test_masked_gae_auto_uses_triton_on_cuda_and_matches_torch():
    gen = torch.Generator().manual_seed(12)
    r, v, m, boot = make_inputs(8, 513, torch.float32, "holes", gen, "cuda")
    assert select_backend(r.device, "auto") == "triton"
    a_auto, ret_auto = masked_gae(r, v, m, 0.99, 0.95, bootstrap_value=boot)
    a_torch, ret_torch = masked_gae(r, v, m, 0.99, 0.95, bootstrap_value=boot, backend="torch")
    torch.testing.assert_close(a_auto, a_torch, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret_auto, ret_torch, rtol=1e-5, atol=1e-5)


def _masked_gae_auto(r, v, m, gamma, lmbda, boot):
    return masked_gae(r, v, m, gamma, lmbda, bootstrap_value=boot)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "triton", "masked_gae"])
def test_fast_gae_kernels_do_not_synchronise_with_the_host(backend):
    if backend == "triton" and not _gae_fast.triton_available():
        pytest.skip("needs Triton")
    kernel = {"torch": gae_advantages_torch, "triton": gae_advantages_triton, "masked_gae": _masked_gae_auto}[backend]
    gen = torch.Generator().manual_seed(13)
    r, v, m, boot = make_inputs(4, 300, torch.float32, "holes", gen, "cuda")
    g = torch.tensor(0.99, device="cuda")
    kernel(r, v, m, g, 0.95, boot)  # warm-up (Triton compiles, allocator caches)
    kernel(r, v, m, 0.99, 0.95, boot)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    done, term, nv = make_flags(4, 300, 0.05, gen, "cuda")
    nv = nv.float()
    if backend == "masked_gae":  # the collector layout through the public function
        masked_gae(r, v, m, 0.99, 0.95, done=done, terminated=term, next_values=nv)
    try:
        kernel(r, v, m, g, 0.95, boot)
        kernel(r, v, m, 0.99, 0.95, None)
        if backend == "masked_gae":
            masked_gae(r, v, m, 0.99, 0.95, done=done, terminated=term, next_values=nv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = kernel(r, v, m, 0.99, 0.95, boot)
    assert math.isfinite(float((out[0] if isinstance(out, tuple) else out).sum()))

"""Tests of the functional core against the kit's references, MiniMind's formulas, golden cases and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ppo_objectives.functional as F
from ppo_objectives.functional import (
    aggregate_loss,
    approx_kl,
    clipped_value_loss,
    explained_variance,
    kl_estimate,
    loss_normalizer,
    masked_gae,
    masked_gae_reference,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    reference_kl_penalty,
    resolve_done_flags,
    response_log_probs,
    response_logp_positions,
    value_checks,
)
from ppo_objectives.testing import (
    MASK_KINDS,
    make_mask,
    reference_gae_response,
    reference_kl,
    reference_ppo_policy_loss,
    reference_response_log_probs,
)
from ppo_objectives.testing.references import whiten

# --------------------------------------------------------------------------- #
# References: the testing kit's loops (ppo_objectives.testing), and MiniMind's GAE for one alignment test.
# --------------------------------------------------------------------------- #


def minimind_gae(token_rewards, values, mask, gamma, lmbda):
    """MiniMind's PPO-stage arithmetic, transcribed: values zeroed at padding, plain loop, masked whitening."""
    old_resp_values = values * mask
    gen_len = values.size(1)
    lastgaelam = torch.zeros(values.size(0), dtype=values.dtype)
    advs_rev = []
    for t in reversed(range(gen_len)):
        nv = old_resp_values[:, t + 1] if t < gen_len - 1 else 0.0
        delta = token_rewards[:, t] + gamma * nv - old_resp_values[:, t]
        lastgaelam = delta + gamma * lmbda * lastgaelam
        advs_rev.append(lastgaelam)
    advantages = torch.stack(advs_rev[::-1], dim=1)
    returns = advantages + old_resp_values
    adv_mean = (advantages * mask).sum() / mask.sum().clamp(min=1)
    adv_var = ((advantages - adv_mean) ** 2 * mask).sum() / mask.sum().clamp(min=1)
    advantages = (advantages - adv_mean) * torch.rsqrt(adv_var + 1e-8) * mask
    return advantages, returns


def nd_mask(kind, shape, gen):
    """The kit's mask of ``kind`` over the rows of ``shape`` (leading dims flattened), in ``shape``."""
    return make_mask(math.prod(shape[:-1]), shape[-1], kind, generator=gen).reshape(shape)


SHAPES = [(1, 1), (3, 17), (2, 3, 17)]
MASKS = [k for k in MASK_KINDS if k != "mixed"]  # "mixed" draws each row from these


# --------------------------------------------------------------------------- #
# Positions and log-probs
# --------------------------------------------------------------------------- #


def test_response_logp_positions_match_prompt_offsets(device):
    pos = response_logp_positions(torch.tensor([4, 2, 1], device=device), 3)
    assert pos.device.type == device.type
    assert pos.dtype == torch.int64
    # row b: prompt_lens[b] - 1 + j
    assert pos.cpu().tolist() == [[3, 4, 5], [1, 2, 3], [0, 1, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_response_log_probs_equal_naive_gather(device, dtype):
    g = torch.Generator().manual_seed(1)
    B, T, V, R = 3, 9, 11, 4
    logits = torch.randn(B, T, V, generator=g).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    pl = torch.tensor([1, 5, 3])
    want, want_ent = reference_response_log_probs(logits, ids, pl, R, return_entropy=True)
    got, ent = response_log_probs(logits.to(device), ids.to(device), pl.to(device), R, return_entropy=True)
    want_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # float32 or better
    assert got.dtype == want_dtype and ent.dtype == want_dtype
    tol = 1e-5
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(ent.cpu().double(), want_ent, atol=tol, rtol=tol)


def test_response_log_probs_equal_minimind_formula():
    g = torch.Generator().manual_seed(2)
    B, T, V, R = 2, 8, 7, 3
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    pl = torch.tensor([2, 5])
    labels = ids[:, 1:]
    logp_pos = pl.unsqueeze(1) - 1 + torch.arange(R).unsqueeze(0)
    minimind = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, labels.unsqueeze(-1)).squeeze(-1).gather(1, logp_pos)
    torch.testing.assert_close(response_log_probs(logits, ids, pl, R), minimind)


def test_response_log_probs_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 4, (2, 5), generator=g)
    pl = torch.tensor([1, 2])

    def f(x):
        lp, ent = response_log_probs(x, ids, pl, 3, return_entropy=True)
        return lp, ent

    assert torch.autograd.gradcheck(f, (logits,))


# --------------------------------------------------------------------------- #
# Masked statistics
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASKS)
def test_masked_stats_equal_naive_over_grid(shape, kind, device):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    m = nd_mask(kind, shape, g)
    garbage = torch.where(m, x, torch.tensor(float("nan"), dtype=torch.float64))
    vals = x[m].tolist()
    n = len(vals)
    mean = sum(vals) / n if n else 0.0
    var = sum((a - mean) ** 2 for a in vals) / n if n else 0.0
    uvar = sum((a - mean) ** 2 for a in vals) / (n - 1) if n > 1 else 0.0
    gd, md = garbage.to(device), m.to(device)
    assert masked_sum(gd, md).item() == pytest.approx(sum(vals))
    assert masked_mean(gd, md).item() == pytest.approx(mean)
    assert masked_var(gd, md).item() == pytest.approx(var)
    assert masked_var(gd, md, unbiased=True).item() == pytest.approx(uvar)
    w = masked_whiten(gd, md).cpu()
    torch.testing.assert_close(w, whiten(x, m))
    assert torch.isfinite(w).all()


def test_masked_mean_float_and_int_masks_equal_bool():
    x = torch.tensor([[1.0, 2.0, 4.0]])
    b = torch.tensor([[True, False, True]])
    assert masked_mean(x, b) == masked_mean(x, b.float()) == masked_mean(x, b.long())


def test_masked_mean_per_row_with_empty_row_gives_zero():
    x = torch.tensor([[1.0, 3.0], [float("nan"), float("nan")]])
    m = torch.tensor([[1, 1], [0, 0]])
    assert masked_mean(x, m, dim=-1).tolist() == [2.0, 0.0]


def test_masked_whiten_without_mean_shift_keeps_mean():
    x = torch.tensor([1.0, 3.0, 5.0])
    m = torch.ones(3, dtype=torch.bool)
    w = masked_whiten(x, m, shift_mean=False)
    # std = sqrt(8/3); (x - 3)/std + 3
    assert masked_mean(w, m).item() == pytest.approx(3.0)


def test_masked_whiten_keeps_half_dtype():
    x = torch.randn(4, 5).bfloat16()
    m = torch.ones(4, 5, dtype=torch.bool)
    assert masked_whiten(x, m).dtype == torch.bfloat16


def test_explained_variance_of_half_correct_critic():
    r = torch.tensor([0.0, 2.0, 0.0, 2.0])
    v = torch.tensor([0.0, 1.0, 0.0, 1.0])
    m = torch.ones(4, dtype=torch.bool)
    # var(r) = 1, var(r - v) = var([0,1,0,1]) = 0.25  ->  1 - 0.25 = 0.75
    assert explained_variance(v, r, m).item() == pytest.approx(0.75)
    assert explained_variance(v, r, torch.zeros(4, dtype=torch.bool)).item() == 0.0


def test_explained_variance_of_returns_equal_up_to_rounding_is_zero():
    # a first iteration that no answer solves: returns are 0 plus KL terms at float32 rounding; the ratio of the
    # two variances was -3e9 there, a number that says nothing about the critic
    m = torch.ones(6, dtype=torch.bool)
    r = torch.tensor([0.0, 1e-9, -2e-9, 0.0, 3e-9, 0.0])
    v = torch.tensor([0.01, -0.02, 0.015, 0.0, 0.01, -0.01])
    assert explained_variance(v, r, m).item() == 0.0
    # a small spread that is real is kept: returns near 1 with one failure, a critic that misses it
    r = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.97])
    v = torch.tensor([0.9, 0.95, 0.9, 0.95, 0.9, 0.95])
    ev = explained_variance(v, r, m).item()
    res = r - v
    assert ev == pytest.approx(1 - res.var(unbiased=False).item() / r.var(unbiased=False).item(), rel=1e-4)
    assert ev < 0.0


def test_value_checks_context_skips_mask_value_check_and_restores():
    x, bad = torch.ones(2), torch.tensor([0.5, 1.0])
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        masked_mean(x, bad)
    with value_checks(False):
        masked_mean(x, bad)  # not checked: the caller vouches for the data
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        masked_mean(x, bad)


# --------------------------------------------------------------------------- #
# GAE
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("gamma,lmbda", [(1.0, 0.95), (0.9, 0.5), (0.0, 0.3), (1.0, 1.0), (0.7, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fn", [masked_gae, masked_gae_reference], ids=["fast", "loop"])
def test_masked_gae_equals_naive_reference_over_grid(fn, shape, kind, gamma, lmbda, dtype, device):
    # whitened and terminal (the default), then raw and bootstrapped: both against the kit's loop
    g = torch.Generator().manual_seed(hash((shape, kind)) % 1000)
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    m = nd_mask(kind, shape, g)
    boot = torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    rd = torch.where(m, r, float("nan")).to(dtype).to(device)
    vd = torch.where(m, v, float("inf")).to(dtype).to(device)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for b, normalize in ((None, True), (boot, False)):
        want_adv, want_ret = reference_gae_response(r, v, m, gamma, lmbda, bootstrap_value=b, average_gae=normalize)
        bd = None if b is None else b.to(dtype).to(device)
        adv, ret = fn(rd, vd, m.to(device), gamma, lmbda, average_gae=normalize, bootstrap_value=bd)
        assert adv.shape == shape and adv.dtype == dtype
        torch.testing.assert_close(adv.cpu().double(), want_adv, atol=tol, rtol=tol)
        torch.testing.assert_close(ret.cpu().double(), want_ret, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["all_valid", "right", "empty_rows"])
def test_masked_gae_equals_minimind_loop_with_right_padding(kind):
    # the one test of MiniMind's transcribed loop: the package and the kit's reference both equal it
    g = torch.Generator().manual_seed(5)
    B, R = 6, 13
    m = make_mask(B, R, kind, generator=g).double()
    r = torch.randn(B, R, generator=g, dtype=torch.float64) * m
    v = torch.randn(B, R, generator=g, dtype=torch.float64) * m
    want_adv, want_ret = minimind_gae(r, v, m, 1.0, 0.95)
    for name, (adv, ret) in (("package", masked_gae(r, v, m, 1.0, 0.95)),
                             ("kit", reference_gae_response(r, v, m, 1.0, 0.95, average_gae=True))):  # fmt: skip
        torch.testing.assert_close(adv, want_adv, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(ret * m, want_ret * m, rtol=1e-12, atol=1e-12, msg=name)


def test_masked_gae_bootstrap_value_continues_truncated_rows(device):
    # one token, reward 1, value 0.5, bootstrap 2, gamma 0.5: delta = 1 + 0.5*2 - 0.5 = 1.5
    r = torch.tensor([[1.0, 0.0]], device=device)
    v = torch.tensor([[0.5, 9.0]], device=device)
    m = torch.tensor([[True, False]], device=device)
    adv, ret = masked_gae(r, v, m, 0.5, 1.0, average_gae=False, bootstrap_value=torch.tensor([2.0], device=device))
    assert adv.cpu().tolist() == [[1.5, 0.0]]
    assert ret.cpu().tolist() == [[2.0, 0.0]]


def test_masked_gae_golden_case_with_hole():
    # valid tokens at t = 0, 2 (t = 1 is a hole, e.g. a tool token); gamma = 1, lmbda = 0.5
    # t=2: delta = 1 + 0 - 0.5 = 0.5, A = 0.5
    # t=0: next valid value is V_2 = 0.5 -> delta = 0 + 0.5 - 0.25 = 0.25, A = 0.25 + 0.5 * 0.5 = 0.5
    r = torch.tensor([[0.0, 123.0, 1.0]])
    v = torch.tensor([[0.25, float("nan"), 0.5]])
    m = torch.tensor([[1, 0, 1]])
    adv, ret = masked_gae(r, v, m, 1.0, 0.5, average_gae=False)
    assert adv.tolist() == [[0.5, 0.0, 0.5]]
    assert ret.tolist() == [[0.75, 0.0, 1.0]]


def test_masked_gae_lam_zero_gives_td_error():
    g = torch.Generator().manual_seed(7)
    r, v = torch.randn(3, 6, generator=g).double(), torch.randn(3, 6, generator=g).double()
    m = torch.ones(3, 6, dtype=torch.bool)
    adv, _ = masked_gae(r, v, m, 0.9, 0.0, average_gae=False)
    nv = torch.cat([v[:, 1:], torch.zeros(3, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(adv, r + 0.9 * nv - v)


def test_masked_gae_gamma_lam_one_gives_reward_to_go_minus_value():
    g = torch.Generator().manual_seed(8)
    r, v = torch.randn(3, 6, generator=g).double(), torch.randn(3, 6, generator=g).double()
    m = torch.ones(3, 6, dtype=torch.bool)
    adv, ret = masked_gae(r, v, m, 1.0, 1.0, average_gae=False)
    rtg = r.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, rtg - v)
    torch.testing.assert_close(ret, rtg)


def test_masked_gae_accepts_tensor_hyperparameters():
    r, v, m = torch.randn(2, 5), torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool)
    a1, _ = masked_gae(r, v, m, torch.tensor(0.9), torch.tensor(0.8))
    a2, _ = masked_gae(r, v, m, 0.9, 0.8)
    torch.testing.assert_close(a1, a2)


def test_masked_gae_empty_mask_gives_zeros():
    adv, ret = masked_gae(torch.randn(2, 4), torch.randn(2, 4), torch.zeros(2, 4), 1.0, 0.95)
    assert (adv == 0).all() and (ret == 0).all()


def test_masked_gae_compiles_fullgraph():
    fn = torch.compile(lambda r, v, m: masked_gae(r, v, m, 0.99, 0.95), fullgraph=True, backend="eager")
    r, v = torch.randn(3, 7), torch.randn(3, 7)
    m = torch.rand(3, 7) > 0.3
    got = fn(r, v, m)
    want = masked_gae_reference(r, v, m, 0.99, 0.95)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


# --------------------------------------------------------------------------- #
# Loss aggregation
# --------------------------------------------------------------------------- #


def naive_aggregate(L, m, mode):
    rows = [[(float(L[b, t]), bool(m[b, t])) for t in range(L.shape[1])] for b in range(L.shape[0])]
    vals = [x for row in rows for x, ok in row if ok]
    if mode == "token-mean":
        return sum(vals) / len(vals) if vals else 0.0
    if mode == "seq-mean-token-sum-norm":
        return sum(vals) / (L.shape[0] * L.shape[1])
    if mode == "token-sum":
        return sum(vals)
    if mode == "token-sum-norm":
        return sum(vals) / L.shape[1]
    seqs = []
    for row in rows:
        xs = [x for x, ok in row if ok]
        if xs:
            seqs.append(sum(xs) / len(xs) if mode == "seq-mean-token-mean" else sum(xs))
    return sum(seqs) / len(seqs) if seqs else 0.0


@pytest.mark.parametrize("mode", F.AGGREGATIONS)
@pytest.mark.parametrize("kind", MASKS)
def test_aggregate_loss_equals_naive(mode, kind, device):
    g = torch.Generator().manual_seed(9)
    L = torch.randn(5, 8, generator=g, dtype=torch.float64)
    m = make_mask(5, 8, kind, generator=g)
    got = aggregate_loss(torch.where(m, L, float("nan")).to(device), m.to(device), mode)
    assert got.item() == pytest.approx(naive_aggregate(L, m, mode))


@pytest.mark.parametrize("mode", F.AGGREGATIONS)
def test_aggregate_loss_is_numerator_over_loss_normalizer(mode):
    g = torch.Generator().manual_seed(17)
    L = torch.randn(4, 6, generator=g, dtype=torch.float64)
    m = torch.rand(4, 6, generator=g) > 0.5
    n = loss_normalizer(m, mode)
    torch.testing.assert_close(aggregate_loss(L, m, mode, normalizer=2 * n) * 2, aggregate_loss(L, m, mode))


@pytest.mark.parametrize("mode", F.AGGREGATIONS)
@pytest.mark.parametrize("kind", ["right", "holes"])
def test_gradient_of_one_step_is_the_same_over_1_2_or_4_micro_batches(mode, kind):
    # gradient accumulation: each micro-batch's loss divided by the whole step's normalizer
    g = torch.Generator().manual_seed(21)
    B, R = 8, 7
    m = make_mask(B, R, kind, generator=g)
    m[0, 0] = True
    x = torch.randn(B, R, generator=g, dtype=torch.float64)
    w = torch.randn(R, generator=g, dtype=torch.float64, requires_grad=True)

    def per_token(rows):
        return torch.tanh(x[rows] * w) ** 2  # any differentiable per-token loss of the parameters w

    (whole,) = torch.autograd.grad(aggregate_loss(per_token(slice(None)), m, mode), w)
    norm = loss_normalizer(m, mode)
    for parts in (1, 2, 4):
        total = torch.zeros_like(w)
        for rows in torch.arange(B).chunk(parts):
            (grad,) = torch.autograd.grad(aggregate_loss(per_token(rows), m[rows], mode, normalizer=norm), w)
            total += grad
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)


def test_aggregate_loss_flattens_leading_dims():
    g = torch.Generator().manual_seed(10)
    L = torch.randn(2, 3, 4, generator=g)
    m = torch.rand(2, 3, 4, generator=g) > 0.5
    for mode in F.AGGREGATIONS:
        torch.testing.assert_close(aggregate_loss(L, m, mode), aggregate_loss(L.reshape(6, 4), m.reshape(6, 4), mode))


# --------------------------------------------------------------------------- #
# Policy loss
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("eps_hi,dual", [(None, None), (0.28, None), (None, 3.0), (0.3, 2.0)])
def test_ppo_policy_loss_equals_naive(kind, eps_hi, dual, device):
    g = torch.Generator().manual_seed(11)
    # both log-probs shifted by -3 (<= 0, as log-probs are); the ratios exp(new - old) are unchanged
    new = torch.randn(4, 9, generator=g, dtype=torch.float64) * 0.5 - 3.0
    old = torch.randn(4, 9, generator=g, dtype=torch.float64) * 0.5 - 3.0
    adv = torch.randn(4, 9, generator=g, dtype=torch.float64)
    m = make_mask(4, 9, kind, generator=g)
    nan = float("nan")
    got = ppo_policy_loss(
        torch.where(m, new, nan).to(device), torch.where(m, old, nan).to(device), torch.where(m, adv, nan).to(device),
        m.to(device), 0.2 if eps_hi is None else (0.2, eps_hi), dual_clip=dual,
    )
    want = reference_ppo_policy_loss(new, old, adv, m, 0.2 if eps_hi is None else (0.2, eps_hi), dual_clip=dual)
    assert got.item() == pytest.approx(want.item())


def test_ppo_policy_loss_equals_minimind_formula():
    g = torch.Generator().manual_seed(12)
    new, old, adv = (torch.randn(3, 7, generator=g) * 0.4 for _ in range(3))
    new, old = new - 3.0, old - 3.0  # log-probs are <= 0; the shift leaves new - old (ratios, KL) unchanged
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    ratio = torch.exp(new - old)
    want = (torch.max(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)) * mask).sum() / mask.sum().clamp(min=1)
    clipfrac = (((ratio - 1.0).abs() > 0.2).float() * mask).sum() / mask.sum().clamp(min=1)
    akl = (0.5 * (new - old) ** 2 * mask).sum() / mask.sum().clamp(min=1)
    loss, stats = ppo_policy_loss(new, old, adv, mask, 0.2, return_stats=True)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(reference_ppo_policy_loss(new, old, adv, mask, 0.2).float(), want)  # the kit's too
    torch.testing.assert_close(stats["clip_fraction"], clipfrac)
    torch.testing.assert_close(stats["kl_approx"], akl)
    torch.testing.assert_close(approx_kl(new, old, mask), akl)


def test_policy_loss_clipped_for_high_ratio_has_zero_gradient():
    # ratio = e^0.5 = 1.65 > 1.2 with A > 0: the clipped branch is taken and the gradient vanishes
    new = torch.tensor([[-2.5]], requires_grad=True)  # log-probs -2.5 over -3: log ratio 0.5
    loss = ppo_policy_loss(new, torch.full((1, 1), -3.0), torch.ones(1, 1), torch.ones(1, 1), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert new.grad.item() == 0.0


def test_policy_loss_dual_clip_caps_negative_advantage_loss():
    # ratio = e^2 = 7.39, A = -1: ordinary clip gives max(7.39, 1.2) = 7.39; dual clip caps at 3
    new, old = torch.tensor([[-1.0]]), torch.full((1, 1), -3.0)  # log-probs -1 over -3: log ratio 2
    loss = ppo_policy_loss(new, old, -torch.ones(1, 1), torch.ones(1, 1), 0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    _, stats = ppo_policy_loss(new, old, -torch.ones(1, 1), torch.ones(1, 1), 0.2, dual_clip=3.0, return_stats=True)
    assert stats["dual_clip_fraction"].item() == 1.0


def test_policy_loss_stats_ratio_and_ess():
    new = torch.log(torch.tensor([[1.0, 3.0, 7.0]])) - 3.0  # log-probs over old ones of -3: ratios 1, 3, 7
    m = torch.tensor([[1, 1, 0]])
    _, s = ppo_policy_loss(new, torch.full((1, 3), -3.0), torch.ones(1, 3), m, 0.2, return_stats=True)
    # valid ratios 1 and 3: mean 2, max 3, ess = (1+3)^2 / (2 * (1+9)) = 0.8
    assert s["mean_ratio"].item() == pytest.approx(2.0)
    assert s["max_ratio"].item() == pytest.approx(3.0)
    assert s["ESS"].item() == pytest.approx(0.8)
    assert all(not v.requires_grad for v in s.values())


def test_policy_loss_stats_empty_mask_are_zero():
    _, s = ppo_policy_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3), 0.2, return_stats=True)
    assert all(v.item() == 0.0 for v in s.values())


@settings(max_examples=40, deadline=None)
@given(
    lr=st.lists(st.floats(-0.18, 0.18), min_size=1, max_size=8),
    adv=st.lists(st.floats(-5, 5), min_size=8, max_size=8),
)
def test_policy_loss_inside_trust_region_equals_unclipped(lr, adv):
    n = len(lr)
    log_ratio = torch.tensor([lr], dtype=torch.float64)
    # |log r| <= 0.18 keeps r in [0.835, 1.197], inside [0.8, 1.2]
    A = torch.tensor([adv[:n]], dtype=torch.float64)
    m = torch.ones(1, n, dtype=torch.bool)
    # log-probs log_ratio - 3 over old ones of -3 (both <= 0): the ratio is exp(log_ratio)
    loss = ppo_policy_loss(log_ratio - 3.0, torch.full_like(log_ratio, -3.0), A, m, 0.2)
    torch.testing.assert_close(loss, (-A * log_ratio.exp()).mean())


# --------------------------------------------------------------------------- #
# KL
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("est", F.KL_ESTIMATORS)
def test_kl_estimate_equals_closed_forms(est, device):
    lp = torch.tensor([-0.1, -2.0, -0.7], dtype=torch.float64)
    ref = torch.tensor([-0.3, -1.0, -0.7], dtype=torch.float64)
    got = kl_estimate(lp.to(device), ref.to(device), est).cpu().tolist()
    assert got == pytest.approx(reference_kl(lp, ref, est).tolist())


def test_kl_k3_plus_has_k2_gradient_and_k3_value():
    lp = torch.tensor([-0.2, -1.5], requires_grad=True)
    ref = torch.tensor([-1.0, -0.5])
    kl_estimate(lp, ref, "k3+").sum().backward()
    g_plus = lp.grad.clone()
    lp.grad = None
    kl_estimate(lp, ref, "k2").sum().backward()
    torch.testing.assert_close(g_plus, lp.grad)
    torch.testing.assert_close(kl_estimate(lp, ref, "k3+"), kl_estimate(lp, ref, "k3"))


def test_kl_estimate_clamp_bounds_values():
    lp, ref = torch.tensor([-30.0, -30.0]), torch.tensor([0.0, -60.0])  # log-probs <= 0; ref - lp = [30, -30]
    out = kl_estimate(lp, ref, "k3", clamp=10.0)
    assert out.tolist() == [10.0, 10.0]
    assert kl_estimate(lp, ref, "k1", clamp=10.0).tolist() == [-10.0, 10.0]


def test_reference_kl_penalty_equals_minimind_formula():
    g = torch.Generator().manual_seed(13)
    pol, ref = torch.randn(3, 5, generator=g) * 0.5 - 1, torch.randn(3, 5, generator=g) * 0.5 - 1
    mask = (torch.rand(3, 5, generator=g) > 0.4).float()
    d = ref - pol
    want = ((torch.exp(d) - d - 1.0) * mask).sum() / mask.sum().clamp(min=1)
    torch.testing.assert_close(reference_kl_penalty(pol, ref, mask), want)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-20, 0), st.floats(-20, 0)), min_size=1, max_size=10))
def test_k3_is_never_negative(pairs):
    lp = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    ref = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    assert (kl_estimate(lp, ref, "k3") >= 0).all()
    assert reference_kl_penalty(lp, ref, torch.ones_like(lp, dtype=torch.bool)) >= 0


# --------------------------------------------------------------------------- #
# Value loss
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", MASKS)
def test_clipped_value_loss_equals_minimind_formula(kind, device):
    g = torch.Generator().manual_seed(14)
    V, Vo, R = (torch.randn(4, 6, generator=g) for _ in range(3))
    m = make_mask(4, 6, kind, generator=g).float()
    want = 0.5 * (torch.max((V - R) ** 2, (torch.clamp(V, Vo - 0.2, Vo + 0.2) - R) ** 2) * m).sum() / m.sum().clamp(min=1)
    nan = float("nan")
    got = clipped_value_loss(*(torch.where(m.bool(), x, nan).to(device) for x in (V, Vo, R)), m.to(device), 0.2)
    torch.testing.assert_close(got.cpu(), want)


def test_value_clip_fraction_counts_clipped_branch():
    # token 0: V moved 1.0 away from V_old toward nowhere useful -> clipped branch larger
    V, Vo, R = torch.tensor([[1.0, 0.1]]), torch.zeros(1, 2), torch.tensor([[-1.0, 0.1]])
    _, s = clipped_value_loss(V, Vo, R, torch.ones(1, 2), 0.2, return_stats=True)
    # token 0: (1+1)^2 = 4 vs (0.2+1)^2 = 1.44 -> unclipped larger; token 1: 0 vs 0 -> not clipped
    assert s["value_clip_fraction"].item() == 0.0
    V2 = torch.tensor([[-2.0, 0.0]])
    R2 = torch.tensor([[-1.0, 0.0]])
    _, s2 = clipped_value_loss(V2, Vo, R2, torch.ones(1, 2), 0.2, return_stats=True)
    # token 0: (-2+1)^2 = 1 vs (-0.2+1)^2 = 0.64 -> unclipped larger again
    assert s2["value_clip_fraction"].item() == 0.0
    V3 = torch.tensor([[0.5, 0.0]])
    R3 = torch.tensor([[0.6, 0.0]])
    _, s3 = clipped_value_loss(V3, Vo, R3, torch.ones(1, 2), 0.2, return_stats=True)
    # token 0: (0.5-0.6)^2 = 0.01 vs (0.2-0.6)^2 = 0.16 -> clipped branch larger; 1 of 2 tokens
    assert s3["value_clip_fraction"].item() == 0.5


# --------------------------------------------------------------------------- #
# Properties: masked garbage, gradients, gradcheck
# --------------------------------------------------------------------------- #


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    garbage=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -7.0]),
)
def test_garbage_at_masked_positions_changes_nothing(seed, garbage):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 8)
    xs = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4)]
    m = torch.rand(shape, generator=g) > 0.4
    dirty = [torch.where(m, x, garbage) for x in xs]

    def everything(a, b, c, d):
        adv, ret = masked_gae(a, b, m, 0.99, 0.9)
        return [
            adv, ret,
            ppo_policy_loss(a * 0.1 - 3, b * 0.1 - 3, c, m, 0.2, dual_clip=3.0),  # log-probs <= 0
            reference_kl_penalty(a * 0.1 - 1, b * 0.1 - 1, m),
            clipped_value_loss(a, b, c, m, 0.2),
            masked_whiten(d, m),
            explained_variance(a, b, m),
            *[aggregate_loss(d, m, mode) for mode in F.AGGREGATIONS],
        ]

    for clean_out, dirty_out in zip(everything(*xs), everything(*dirty)):
        torch.testing.assert_close(clean_out, dirty_out)
        assert torch.isfinite(dirty_out).all()


def test_gradients_are_zero_at_masked_positions():
    g = torch.Generator().manual_seed(15)
    new = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    vals = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    old, adv, ref, ret = (torch.randn(3, 6, generator=g, dtype=torch.float64) for _ in range(4))
    m = torch.rand(3, 6, generator=g) > 0.5
    # log-probs shifted by -3 to be <= 0: ratios, KL and the gradients with respect to new are unchanged
    total = (
        ppo_policy_loss(new - 3, old - 3, adv, m, 0.2) + reference_kl_penalty(new - 3, ref - 3, m, estimator="k3+")
        + clipped_value_loss(vals, old, ret, m, 0.2)
    )
    total.backward()
    assert (new.grad[~m] == 0).all() and (vals.grad[~m] == 0).all()
    assert new.grad[m].abs().sum() > 0


def test_losses_pass_gradcheck_float64():
    g = torch.Generator().manual_seed(16)
    # log-probs (new, old, ref) shifted by -3 to be <= 0: their differences are unchanged
    new = (torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.1 - 3.0).requires_grad_()
    vals = torch.randn(2, 4, generator=g, dtype=torch.float64).requires_grad_()
    old = torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.1 - 3.0
    adv, ret, ref = (torch.randn(2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ref = ref - 3.0
    m = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)
    for mode in F.AGGREGATIONS:
        assert torch.autograd.gradcheck(lambda x: ppo_policy_loss(x, old, adv, m, 0.5, aggregation=mode), (new,))
        assert torch.autograd.gradcheck(lambda x: reference_kl_penalty(x, ref, m, aggregation=mode), (new,))
        assert torch.autograd.gradcheck(lambda x: clipped_value_loss(x, x.detach() + 0.05, ret, m, 1.0, aggregation=mode), (vals,))


def test_half_precision_inputs_compute_in_float32():
    new = (torch.randn(2, 5) - 4).clamp(max=0).bfloat16()  # log-probs are <= 0
    old = (torch.randn(2, 5) - 4).clamp(max=0).bfloat16()
    adv = torch.randn(2, 5).bfloat16()
    m = torch.ones(2, 5, dtype=torch.bool)
    assert ppo_policy_loss(new, old, adv, m, 0.2).dtype == torch.float32
    assert reference_kl_penalty(new, old, m).dtype == torch.float32
    assert clipped_value_loss(new, old, adv, m, 0.2).dtype == torch.float32
    adv_out, ret_out = masked_gae(new, old, m, 1.0, 0.95)
    assert adv_out.dtype == torch.bfloat16  # the input dtype of values, computed in float32


# --------------------------------------------------------------------------- #
# Bad input: every check, with the message it must give
# --------------------------------------------------------------------------- #

x3 = torch.zeros(2, 3)
m3 = torch.ones(2, 3, dtype=torch.bool)

BAD = [
    ("shape mismatch", lambda: ppo_policy_loss(x3, torch.zeros(2, 4), x3, m3, 0.2), ValueError, r"sample_log_prob has shape \(2, 4\) but log_prob has shape \(2, 3\); per-token tensors must have identical shapes \(nothing is broadcast, since broadcasting here would silently mix tokens of different sequences\)"),
    ("broadcastable shape", lambda: masked_gae(x3, torch.zeros(1, 3), m3, 1.0, 0.95), ValueError, r"values has shape \(1, 3\)"),
    ("mask shape", lambda: masked_mean(x3, torch.ones(3, dtype=torch.bool)), ValueError, r"mask has shape \(3,\).*no broadcasting"),
    ("non-float values", lambda: masked_gae(x3, torch.zeros(2, 3, dtype=torch.long), m3, 1.0, 0.9), TypeError, r"values must be a floating-point tensor"),
    ("not a tensor", lambda: masked_mean([1.0], m3), TypeError, r"x must be a torch\.Tensor, got list"),
    ("non-binary mask", lambda: masked_whiten(x3, torch.full((2, 3), 0.5)), ValueError, r"mask must hold only 0 and 1 \(True = token takes part\), found values such as \[0\.5, 0\.5, 0\.5\]; pass a bool mask, e\.g\. mask > 0\.5"),
    ("complex mask", lambda: masked_mean(x3, torch.ones(2, 3, dtype=torch.complex64)), TypeError, r"mask must be bool or real with values in \{0, 1\}, got dtype torch\.complex64"),
    ("gamma > 1", lambda: masked_gae(x3, x3, m3, 1.5, 0.9), ValueError, r"gamma=1.5 is outside \[0, 1\]"),
    ("lmbda < 0", lambda: masked_gae_reference(x3, x3, m3, 0.9, -0.1), ValueError, r"lmbda=-0.1 is outside \[0, 1\]"),
    ("gamma tensor out of range", lambda: masked_gae(x3, x3, m3, torch.tensor(2.0), 0.9), ValueError, r"gamma=2.0"),
    ("gamma wrong type", lambda: masked_gae(x3, x3, m3, "0.9", 0.9), TypeError, r"gamma must be a float in \[0, 1\], got str"),
    ("bootstrap shape", lambda: masked_gae(x3, x3, m3, 1.0, 0.9, bootstrap_value=torch.zeros(3)), ValueError, r"bootstrap_value has shape \(3,\).*\[\*B\] = \(2,\)"),
    ("backend", lambda: masked_gae(x3, x3, m3, 1.0, 0.9, backend="cuda"), ValueError, r"backend='cuda' is not one of \('auto', 'loop', 'torch', 'triton'\)"),
    ("scalar rewards", lambda: masked_gae(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(True), 1.0, 0.9), ValueError, r"token_rewards must have a time axis: shape \[\*B, R\], got a scalar"),
    ("clip_epsilon <= 0", lambda: ppo_policy_loss(x3, x3, x3, m3, 0.0), ValueError, r"clip_epsilon=0\.0 must be a finite number > 0\.0"),
    ("clip_epsilon high <= 0", lambda: ppo_policy_loss(x3, x3, x3, m3, (0.2, -1.0)), ValueError, r"clip_epsilon \(high\)=-1\.0 must be a finite number > 0\.0"),
    ("dual clip <= 1", lambda: ppo_policy_loss(x3, x3, x3, m3, 0.2, dual_clip=0.5), ValueError, r"dual_clip=0.5.*must exceed 1"),
    ("clip wrong type", lambda: ppo_policy_loss(x3, x3, x3, m3, None), TypeError, r"clip_epsilon must be a positive float, got NoneType"),
    ("clip_value", lambda: clipped_value_loss(x3, x3, x3, m3, -0.2), ValueError, r"clip_value=-0\.2 must be a finite number > 0\.0"),
    ("agg mode", lambda: aggregate_loss(x3, m3, "mean"), ValueError, r"aggregation='mean' is not one of \('token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm', 'token-sum', 'token-sum-norm'\)"),
    ("agg scalar", lambda: aggregate_loss(torch.tensor(1.0), torch.tensor(True)), ValueError, r"token axis"),
    ("kl estimator", lambda: kl_estimate(x3, x3, "k4"), ValueError, r"estimator='k4' is not one of \('k1', 'k2', 'k3', 'k3\+'\)"),
    ("kl clamp", lambda: kl_estimate(x3, x3, "k3", clamp=0.0), ValueError, r"clamp=0.0"),
    ("kl shape", lambda: reference_kl_penalty(x3, torch.zeros(3, 2), m3), ValueError, r"ref_log_prob has shape \(3, 2\)"),
    ("whiten eps", lambda: masked_whiten(x3, m3, eps=0.0), ValueError, r"eps=0.0"),
    ("prompt_lens 2-D", lambda: response_logp_positions(torch.ones(2, 2, dtype=torch.long), 3), ValueError, r"prompt_lens must be 1-D \[B\], got shape \(2, 2\)"),
    ("prompt_lens float", lambda: response_logp_positions(torch.ones(2), 3), TypeError, r"prompt_lens must be an integer tensor, got dtype torch\.float32; use \.long\(\)"),
    ("response_len 0", lambda: response_logp_positions(torch.ones(2, dtype=torch.long), 0), ValueError, r"response_len=0 must be >= 1: there is no response token to score"),
    ("response_len float", lambda: response_logp_positions(torch.ones(2, dtype=torch.long), 2.0), TypeError, r"response_len must be an int, got float"),
    ("response_len bool", lambda: response_logp_positions(torch.ones(2, dtype=torch.long), True), TypeError, r"response_len must be an int, got bool"),
    ("prompt_lens 0", lambda: response_logp_positions(torch.tensor([0, 2]), 2), ValueError, r"prompt_lens must be >= 1 \(the first response token needs a token before it\), got min 0"),
    ("positions past T", lambda: response_log_probs(torch.zeros(1, 4, 5), torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]), 2), ValueError, r"positions outside the sequence: prompt_lens up to 3 with response_len=2 needs T >= 5, but logits/input_ids have T=4; pad the sequences or shorten response_len"),
    ("logits 2-D", lambda: response_log_probs(torch.zeros(4, 5), torch.zeros(1, 4, dtype=torch.long), torch.tensor([1]), 2), ValueError, r"logits must be \[B, T, V\], got shape \(4, 5\)"),
    ("ids shape", lambda: response_log_probs(torch.zeros(1, 4, 5), torch.zeros(1, 5, dtype=torch.long), torch.tensor([1]), 2), ValueError, r"input_ids has shape \(1, 5\)"),
    ("ids float", lambda: response_log_probs(torch.zeros(1, 4, 5), torch.zeros(1, 4), torch.tensor([1]), 2), TypeError, r"input_ids must be an integer tensor, got dtype torch\.float32"),
    ("prompt_lens batch", lambda: response_log_probs(torch.zeros(1, 4, 5), torch.zeros(1, 4, dtype=torch.long), torch.tensor([1, 1]), 2), ValueError, r"prompt_lens has shape \(2,\), expected \[B\] = \[1\]"),
    ("chunk size", lambda: response_log_probs(torch.zeros(1, 4, 5), torch.zeros(1, 4, dtype=torch.long), torch.tensor([1]), 2, chunk_size=0), ValueError, r"chunk_size=0 must be an int >= 1 or None \(rows per chunk\)"),
    ("explained variance shapes", lambda: explained_variance(x3, torch.zeros(3, 2), m3), ValueError, r"returns has shape \(3, 2\) but values has shape \(2, 3\)"),
    ("normalizer tensor shape", lambda: aggregate_loss(x3, m3, normalizer=torch.ones(2)), TypeError, r"normalizer must be a positive float or a one-element float tensor, got torch\.float32 \(2,\)"),
    ("normalizer int tensor", lambda: aggregate_loss(x3, m3, normalizer=torch.tensor(2)), TypeError, r"normalizer must be a positive float or a one-element float tensor, got torch\.int64 \(\)"),
    ("normalizer <= 0", lambda: ppo_policy_loss(x3, x3, x3, m3, 0.2, normalizer=0.0), ValueError, r"normalizer=0\.0 must be a finite number > 0\.0"),
    ("normalizer mode", lambda: loss_normalizer(m3, "sum"), ValueError, r"aggregation='sum'"),
    ("normalizer scalar mask", lambda: loss_normalizer(torch.tensor(True)), ValueError, r"token axis"),
    ("process_group with dim", lambda: masked_mean(x3, m3, dim=-1, process_group=object()), ValueError, r"masked_mean: process_group needs dim=None \(a global mean over every rank's tokens\)"),
    ("approx kl shapes", lambda: approx_kl(x3, torch.zeros(3), m3), ValueError, r"sample_log_prob has shape \(3,\)"),
    ("done shape", lambda: masked_gae(x3, x3, m3, 1.0, 0.9, done=torch.zeros(2, 1, dtype=torch.bool)), ValueError, r"done has shape \(2, 1\) but token_rewards has shape \(2, 3\)"),
    ("done non-binary", lambda: masked_gae(x3, x3, m3, 1.0, 0.9, done=torch.full((2, 3), 2.0)), ValueError, r"done must hold only 0 and 1 \(True = the trajectory ends at this step\)"),
    ("terminated not a tensor", lambda: masked_gae(x3, x3, m3, 1.0, 0.9, terminated=[True]), TypeError, r"terminated must be a torch.Tensor"),
    ("next_values shape", lambda: masked_gae(x3, x3, m3, 1.0, 0.9, next_values=torch.zeros(2)), ValueError, r"next_values has shape \(2,\)"),
    ("next_values int", lambda: masked_gae_reference(x3, x3, m3, 1.0, 0.9, next_values=torch.zeros(2, 3, dtype=torch.long)), TypeError, r"next_values must be a floating-point tensor"),
    ("bootstrap and next_values", lambda: masked_gae(x3, x3, m3, 1.0, 0.9, bootstrap_value=torch.zeros(2), next_values=x3), ValueError, r"bootstrap_value and next_values are exclusive"),
    ("done flags on meta", lambda: masked_gae(x3, x3, m3, 1.0, 0.9, done=torch.zeros(2, 3, dtype=torch.bool, device="meta")), ValueError, r"all tensors must be on one device.*done on meta"),
    ("resolve nothing", lambda: resolve_done_flags(None, None, None), ValueError, r"needs at least one of done, terminated, truncated"),
]


@pytest.mark.parametrize("call,exc,pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_clear_error(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mixed_devices_raise():
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        masked_mean(torch.zeros(3, device="cuda"), torch.ones(3, dtype=torch.bool))


def test_mixed_devices_raise_on_meta():
    # 'meta' stands in for a second device on a CPU-only machine
    with pytest.raises(ValueError, match=r"all tensors must be on one device, got x on cpu, mask on meta; move them with "
                                         r"\.to\(device\)$"):
        masked_sum(torch.zeros(3), torch.ones(3, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0), (2, 0, 3)])
def test_empty_batches_and_empty_responses_give_zeros(shape):
    x = torch.randn(shape)
    m = torch.ones(shape, dtype=torch.bool)
    for fn in (masked_gae, masked_gae_reference):
        adv, ret = fn(x, x, m, 1.0, 0.95)
        assert adv.shape == shape and ret.shape == shape
    loss, stats = ppo_policy_loss(x, x, x, m, 0.2, return_stats=True)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in stats.values())
    assert reference_kl_penalty(x, x, m).item() == 0.0
    assert clipped_value_loss(x, x, x, m, 0.2).item() == 0.0
    assert masked_whiten(x, m).shape == shape
    for mode in F.AGGREGATIONS:
        assert aggregate_loss(x, m, mode).item() == 0.0


def test_device_mismatch_is_reported_before_mask_values_are_read():
    # a float mask on another device must give the device error, not a failed value check
    with pytest.raises(ValueError, match=r"all tensors must be on one device.*mask on meta"):
        ppo_policy_loss(x3, x3, x3, torch.ones(2, 3, device="meta"), 0.2)


@pytest.mark.parametrize("done", [None, False, True])
@pytest.mark.parametrize("terminated", [None, False, True])
@pytest.mark.parametrize("truncated", [None, False, True])
def test_resolve_done_flags_follows_torchrl_and_agrees_for_bools_and_tensors(done, terminated, truncated):
    given = (done, terminated, truncated)
    if all(f is None for f in given):
        pytest.skip("no flag at all is an error (see the bad inputs)")
    d, te, tr = resolve_done_flags(*given)
    # what was given stays as given
    for got, want in zip((d, te, tr), given):
        assert want is None or got == want
    if done is None:
        assert d == (bool(terminated) or bool(truncated))
    if terminated is None:
        assert te == (d and not bool(truncated))
    if truncated is None:
        assert tr == (d and not te)
    as_tensor = [None if f is None else torch.tensor([f]) for f in given]
    assert [bool(x) for x in resolve_done_flags(*as_tensor)] == [d, te, tr]

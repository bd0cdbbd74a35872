"""The in-reward KL penalty of the functional core and KLPenaltyTransform's keys.

``kl_penalized_rewards`` is checked against a naive per-row loop written here;
``KLPenaltyTransform`` must give exactly the functional numbers.
"""

import math

import pytest
import torch
from tensordict import TensorDict

from ppo_objectives import functional as F
from ppo_objectives.testing import make_mask
from ppo_objectives.transforms import AdaptiveKLController, KLPenaltyTransform


def _naive_penalized(rewards, logps, refs, mask, beta):
    """One row at a time, one token at a time: k1 penalty, score on the last valid token."""
    out = torch.zeros_like(logps)
    for b in range(logps.shape[0]):
        valid = [t for t in range(logps.shape[1]) if mask[b, t]]
        for t in valid:
            kl = float(logps[b, t]) - float(refs[b, t])
            r = float(rewards[b, t]) if rewards.dim() == 2 else (float(rewards[b]) if t == valid[-1] else 0.0)
            out[b, t] = r - beta * kl
    return out


def _batch(seed=0, B=5, R=7):
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(B, R, "holes", generator=g)  # every row has a valid token
    logps = -torch.rand(B, R, generator=g) * 3
    refs = -torch.rand(B, R, generator=g) * 3
    return logps, refs, mask, g


def test_last_valid_index_with_holes_empty_rows_and_zero_length():
    m = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]])
    assert F.last_valid_index(m).tolist() == [1, 3, -1]
    assert F.last_valid_index(torch.zeros(2, 3, 0, dtype=torch.bool)).tolist() == [[-1, -1, -1], [-1, -1, -1]]
    assert F.last_valid_index(m.reshape(1, 3, 4).bool()).tolist() == [[1, 3, -1]]


def test_last_valid_index_refuses_a_scalar_and_non_binary_masks():
    with pytest.raises(ValueError, match=r"mask must be \[\*B, R\], got a scalar"):
        F.last_valid_index(torch.tensor(True))
    with pytest.raises(ValueError, match=r"\bmask\b"):
        F.last_valid_index(torch.tensor([[0.5, 1.0]]))


def test_masked_kl_estimate_ignores_nan_at_masked_positions_and_writes_plus_zero():
    logps, refs, mask, _ = _batch()
    dirty_l = torch.where(mask, logps, torch.nan)
    dirty_r = torch.where(mask, refs, torch.inf)
    for est in F.KL_ESTIMATORS:
        kl = F.masked_kl_estimate(dirty_l, dirty_r, mask, est)
        expect = torch.where(mask, F.kl_estimate(logps, refs, est), torch.zeros(()))
        torch.testing.assert_close(kl, expect, rtol=0, atol=0)
        assert not torch.signbit(kl[~mask]).any()  # +0.0, never -0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("per_token", [True, False])
def test_kl_penalized_rewards_equal_a_naive_loop(seed, per_token):
    logps, refs, mask, g = _batch(seed)
    rewards = torch.randn(mask.shape if per_token else mask.shape[:1], generator=g)
    got, kl = F.kl_penalized_rewards(rewards, logps, refs, mask, 0.1)
    torch.testing.assert_close(got, _naive_penalized(rewards, logps, refs, mask, 0.1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl, torch.where(mask, logps - refs, torch.zeros(())))


def test_sequence_score_lands_on_the_last_valid_token_not_after_a_hole():
    # row: valid, hole, valid, padding -> the score goes to position 2 (the last valid), not 3
    mask = torch.tensor([[True, False, True, False]])
    same = torch.full((1, 4), -1.0)
    got, _ = F.kl_penalized_rewards(torch.tensor([2.5]), same, same, mask, 0.3)
    assert got.tolist() == [[0.0, 0.0, 2.5, 0.0]]


def test_kl_penalized_rewards_garbage_at_masked_positions_changes_nothing():
    logps, refs, mask, g = _batch(3)
    rewards = torch.randn(mask.shape, generator=g)
    clean, _ = F.kl_penalized_rewards(rewards, logps, refs, mask, 0.2)
    nan = lambda x: torch.where(mask, x, torch.nan)  # noqa: E731
    dirty, kl = F.kl_penalized_rewards(nan(rewards), nan(logps), nan(refs), mask, 0.2)
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)
    assert torch.isfinite(kl).all()


def test_kl_penalized_rewards_refuses_broadcast_shapes_and_dropped_scores():
    logps, refs, mask, _ = _batch()
    with pytest.raises(ValueError, match=r"rewards has shape \(5, 1\).*per-token reward \(5, 7\) or one score per sequence \(5,\)"):
        F.kl_penalized_rewards(torch.zeros(5, 1), logps, refs, mask, 0.1)
    mask[2] = False
    with pytest.raises(ValueError, match=r"rows \[2\] have no valid token .* sequence score would be dropped"):
        F.kl_penalized_rewards(torch.zeros(5), logps, refs, mask, 0.1)
    with F.value_checks(False):  # the caller vouches for the rows: the score of row 2 is dropped
        got, _ = F.kl_penalized_rewards(torch.ones(5), logps, refs, mask, 0.1)
    assert got[2].abs().sum() == 0
    with pytest.raises(TypeError, match="rewards must be a floating-point tensor"):
        F.kl_penalized_rewards(torch.zeros(5, 7, dtype=torch.long), logps, refs, mask, 0.1)


def test_transform_gives_the_functional_numbers():
    logps, refs, mask, g = _batch(4)
    score = torch.randn(5, 1, generator=g)
    td = TensorDict({"sample_log_prob": logps, "ref_log_prob": refs, "mask": mask, ("next", "reward"): score}, [5])
    out = KLPenaltyTransform(coeff=0.07, estimator="k3")(td)
    expect, kl = F.kl_penalized_rewards(score.squeeze(-1), logps, refs, mask, torch.tensor(0.07), estimator="k3")
    torch.testing.assert_close(out["next", "reward"], expect.unsqueeze(-1), rtol=0, atol=0)
    torch.testing.assert_close(out["kl_penalty"], kl, rtol=0, atol=0)


def test_adaptive_kl_coeff_rule_and_the_controller_agree():
    beta = torch.tensor(0.2)
    # e = clip(12 / 6 - 1, +-0.2) = 0.2 -> 0.2 * (1 + 0.2 * 10 / 100) = 0.204
    assert F.adaptive_kl_coeff(beta, 12.0, 6.0, 100, 10).item() == pytest.approx(0.204)
    assert F.adaptive_kl_coeff(beta, math.nan, 6.0, 100, 10).item() == pytest.approx(0.2)  # NaN: unchanged
    assert beta.item() == pytest.approx(0.2)  # not modified in place
    ctl = AdaptiveKLController(0.2, 6.0, 100)
    for kl in (12.0, 3.0, 6.5):
        expect = F.adaptive_kl_coeff(ctl.coeff.clone(), kl, 6.0, 100, 10)
        assert ctl.update(kl, 10).item() == expect.item()
    with pytest.raises(ValueError, match=r"n_steps=600 with horizon=100.*use a horizon larger than clip \* n_steps"):
        F.adaptive_kl_coeff(beta, 1.0, 6.0, 100, 600)


def test_transform_keys_are_set_with_set_keys_and_the_old_keywords():
    logps, refs, mask, g = _batch(5)
    reward = torch.randn(5, 7, generator=g)
    renamed = TensorDict({"old_lp": logps, "ref": refs, "m": mask, ("next", "score"): reward.clone()}, [5])
    t = KLPenaltyTransform(coeff=0.1).set_keys(log_prob="old_lp", ref_log_prob="ref", mask="m", reward="score", kl="kl")
    assert t.in_keys == ["old_lp", "ref", "m", ("next", "score")] and t.out_keys == ["kl", "ref", ("next", "score")]
    got = t(renamed)
    legacy = KLPenaltyTransform(coeff=0.1, log_prob_key="old_lp", ref_log_prob_key="ref", mask_key="m",
                                reward_key="score", kl_key="kl")  # fmt: skip
    assert legacy.tensor_keys == t.tensor_keys and legacy.kl_key == "kl"
    default = TensorDict({"sample_log_prob": logps, "ref_log_prob": refs, "mask": mask, ("next", "reward"): reward}, [5])
    torch.testing.assert_close(got["next", "score"], KLPenaltyTransform(coeff=0.1)(default)["next", "reward"])


def test_transform_key_errors_name_the_accepted_fields():
    with pytest.raises(KeyError, match=r"'logprob' is not one of \['kl', 'log_prob', 'mask', 'ref_log_prob'"):
        KLPenaltyTransform().set_keys(logprob="x")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'score_key' \(key keywords: log_prob_key"):
        KLPenaltyTransform(score_key="x")
    with pytest.raises(TypeError, match=r"set_keys: mask=3 must be a str or a tuple of str"):
        KLPenaltyTransform().set_keys(mask=3)


def test_policy_loss_statistics_use_torchrl_names():
    _, s = F.ppo_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.2,
                             return_stats=True)  # fmt: skip
    assert {"kl_approx", "kl_approx_token_max", "mean_ratio", "max_ratio", "ESS"} <= set(s)
    assert type(s) is dict and not {"approx_kl", "ratio_max", "ess"} & set(s)


# --------------------------------------------------------------------------- KL estimator gradients


def _written_formula(logp, ref, estimator, clamp, old=None, score_grad=False):
    """Each estimator as its docstring writes it, in plain autograd ops."""
    if score_grad:  # the value of the estimate, the gradient w * log(pi / pi_ref) * grad log pi
        value = _written_formula(logp, ref, estimator, clamp, old).detach()
        w = 1.0 if old is None else torch.exp(logp - old).detach()
        return value + (logp - logp.detach()) * (w * (logp - ref)).detach()
    d = ref - logp
    k1, k2, k3 = -d, 0.5 * d**2, torch.exp(d) - d - 1
    if estimator == "k3+":
        value = k3 if clamp is None else torch.clamp(k3, -clamp, clamp)
        kl = k2 + (value - k2).detach()
    else:
        kl = {"k1": k1, "k2": k2, "k3": k3}[estimator]
        kl = kl if clamp is None else torch.clamp(kl, -clamp, clamp)
    return kl if old is None else torch.exp(logp - old) * kl  # importance weight pi / pi_old


@pytest.mark.parametrize("score_grad", [False, True], ids=["own-grad", "score-grad"])
@pytest.mark.parametrize("weighted", [False, True], ids=["on-policy", "importance-weighted"])
@pytest.mark.parametrize("clamp", [None, 10.0, 0.5])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3+"])
def test_every_kl_estimator_has_the_gradient_of_its_written_formula(estimator, clamp, weighted, score_grad):
    g = torch.Generator().manual_seed(0)
    # log-probs in [-6, -3]: every log-prob (old ones near logp included) stays <= 0
    logp = (-3 - 3 * torch.rand(4, 6, generator=g, dtype=torch.float64)).requires_grad_()
    ref = -3 - 3 * torch.rand(4, 6, generator=g, dtype=torch.float64)
    old = (logp.detach() + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)) if weighted else None
    ref[0, 0], logp.data[0, 0] = 0.0, -3.0  # ref - logp = 3, k3 = e^3 - 4 = 16.1: past a clamp of 10
    got = F.kl_estimate(logp, ref, estimator, clamp=clamp, sample_log_prob=old, score_grad=score_grad)
    (grad_got,) = torch.autograd.grad(got.sum(), logp)
    lp2 = logp.detach().clone().requires_grad_()
    want = _written_formula(lp2, ref, estimator, clamp, old, score_grad)
    (grad_want,) = torch.autograd.grad(want.sum(), lp2)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("clamp", [None, 10.0, 0.5])
def test_k3_plus_takes_k3s_value_and_keeps_k2s_gradient_past_the_clamp(clamp):
    # log-probs <= 0; only ref - logp = [3, -0.5, 0.1] matters
    logp = torch.tensor([-3.0, -4.0, -3.2], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0, -4.5, -3.1], dtype=torch.float64)
    value = F.kl_estimate(logp, ref, "k3+", clamp=clamp)
    torch.testing.assert_close(value, F.kl_estimate(logp, ref, "k3", clamp=clamp).detach())  # the base value
    (grad,) = torch.autograd.grad(value.sum(), logp)
    torch.testing.assert_close(grad, -(ref - logp.detach()))  # d/dlogp of (ref - logp)^2 / 2, clamp or not
    if clamp == 10.0:
        assert value[0].item() == 10.0 and grad[0].item() == -3.0  # logp=-3, ref=0: value 10, gradient -3


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_importance_weighted_kl_is_unbiased_off_policy_in_value_and_gradient(estimator):
    # exact expectations over a 6-token vocabulary: tokens drawn from pi_old, estimate of KL(pi || pi_ref)
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(theta, -1)
    ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    old = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    kl_exact = (logp.exp() * (logp - ref)).sum()
    estimate = (old.exp() * F.kl_estimate(logp, ref, estimator, sample_log_prob=old)).sum()  # E_{pi_old}[w * k]
    torch.testing.assert_close(estimate, kl_exact, rtol=1e-12, atol=1e-12)
    if estimator == "k3":  # and its gradient is the KL's gradient
        (g_est,) = torch.autograd.grad(estimate, theta, retain_graph=True)
        (g_exact,) = torch.autograd.grad(kl_exact, theta)
        torch.testing.assert_close(g_est, g_exact, rtol=1e-12, atol=1e-12)
    # without the weight the same sum estimates a different quantity
    biased = (old.exp() * F.kl_estimate(logp, ref, estimator)).sum()
    assert abs((biased - kl_exact).item()) > 1e-3


def test_token_ppo_loss_importance_weights_its_reference_kl_on_request():
    from ppo_objectives import TokenPPOLoss
    from ppo_objectives import testing as kit

    td = kit.response_batch(batch_size=4, response_len=5, mask="holes", with_advantage=True, seed=1)
    actor, critic = kit.tiny_actor_critic()
    plain = TokenPPOLoss(actor, critic, kl_to_ref_coeff=1.0)(td.clone())
    weighted = TokenPPOLoss(actor, critic, kl_to_ref_coeff=1.0, kl_importance_weighted=True)(td.clone())
    new = actor(td.clone())["log_prob"]
    want = F.reference_kl_penalty(new, td["ref_log_prob"], td["mask"], sample_log_prob=td["sample_log_prob"])
    torch.testing.assert_close(weighted["kl_ref"], want.detach())
    assert not torch.allclose(weighted["kl_ref"], plain["kl_ref"])


@pytest.mark.parametrize("weighted", [False, True], ids=["on-policy", "importance-weighted"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3+"])
def test_score_function_gradient_is_the_kls_gradient_for_every_estimator(estimator, weighted):
    # exact expectations over a 6-token vocabulary; the value stays the estimator's
    g = torch.Generator().manual_seed(4)
    theta = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(theta, -1)
    ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    sample = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1) if weighted else logp.detach()
    old = sample if weighted else None
    est = F.kl_estimate(logp, ref, estimator, sample_log_prob=old, score_grad=True)
    torch.testing.assert_close(est.detach(), F.kl_estimate(logp, ref, estimator, sample_log_prob=old).detach())
    (grad,) = torch.autograd.grad((sample.exp() * est).sum(), theta, retain_graph=True)
    (want,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)

"""Critic-free advantages (ppo_objectives.value.critic_free): GRPO, Dr. GRPO, RLOO, REINFORCE++.

Each estimator is checked against a naive loop (Python floats, per group, per row; REINFORCE++'s
discounted sums are the testing kit's GAE loop), against the formula of verl / TRL / OpenRLHF
transcribed here, for masked-garbage invariance, empty rows, groups of one, its error paths, and end
to end through ``TokenPPOLoss(actor, None)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from ppo_objectives import MaskedGAE, TokenPPOLoss
from ppo_objectives import functional as F
from ppo_objectives.testing import (
    assert_mask_invariant,
    make_mask,
    reference_gae_response,
    response_batch,
    tiny_actor_critic,
)
from ppo_objectives.value import critic_free as CF

GROUPS = [5, 5, 5, -2, -2, 40, 7, 7, 7, 7]  # sizes 3, 2, 1, 4; ids neither sorted nor contiguous


def _inputs(mask_kind: str = "mixed", seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B, R = len(GROUPS), 6
    m = make_mask(B, R, mask_kind, generator=g)
    scores = torch.randn(B, generator=g, dtype=torch.float64).to(dtype)
    scores = torch.where(m.any(-1), scores, torch.zeros((), dtype=dtype))  # an empty row has no response
    return scores, torch.tensor(GROUPS), m


def _members(group: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, k in enumerate(group):
        out.setdefault(k, []).append(i)
    return out


def _naive_group(scores, group, mask, kind: str, eps: float = 1e-6) -> torch.Tensor:
    """Per group, per row, in Python floats: the row advantage on each of its valid tokens."""
    s, gr, m = scores.tolist(), group.tolist(), mask.tolist()
    per_row = [0.0] * len(s)
    for rows in _members(gr).values():
        n = len(rows)
        mean = sum(s[i] for i in rows) / n
        std = math.sqrt(sum((s[i] - mean) ** 2 for i in rows) / (n - 1)) if n > 1 else 0.0
        for i in rows:
            if kind == "grpo":
                per_row[i] = (s[i] - mean) / (std + eps)
            elif kind == "dr_grpo":
                per_row[i] = s[i] - mean
            else:  # rloo: minus the mean of the others
                per_row[i] = s[i] - sum(s[j] for j in rows if j != i) / (n - 1) if n > 1 else 0.0
    out = [[per_row[b] if m[b][t] else 0.0 for t in range(len(m[b]))] for b in range(len(m))]
    return torch.tensor(out, dtype=torch.float64)


def _naive_reinforce_pp(r, mask, gamma, *, scores=None, group=None, whiten=True) -> torch.Tensor:
    """Per row: the group's mean score taken off the last valid token's reward, then the reverse discounted sum
    over the valid tokens only (the kit's GAE loop with zero values and lambda 1), whitened over every valid
    token."""
    r = r.double().clone()
    if scores is not None:
        s, m = scores.tolist(), mask.tolist()
        for rows in _members(group.tolist()).values():
            for i in rows:
                valid = [t for t in range(len(m[i])) if m[i][t]]
                if valid:
                    r[i, valid[-1]] -= sum(s[j] for j in rows) / len(rows)
    return reference_gae_response(r, torch.zeros_like(r), mask, gamma, 1.0, average_gae=whiten)[0]


# --------------------------------------------------------------------------- #
# Against the naive loops
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("mask_kind", ["mixed", "holes", "left", "empty_rows"])
@pytest.mark.parametrize("kind", CF.GROUP_KINDS)
def test_group_advantages_match_naive_loop(kind, mask_kind):
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        scores, group, m = _inputs(mask_kind, dtype=dtype)
        fn = {"grpo": CF.grpo_advantages, "dr_grpo": CF.dr_grpo_advantages, "rloo": CF.rloo_advantages}[kind]
        out = fn(scores, group, m)
        assert out.dtype == dtype and out.shape == m.shape
        torch.testing.assert_close(out.double(), _naive_group(scores.double(), group, m, kind), atol=tol, rtol=tol)
        assert bool((out[~m] == 0).all())


@pytest.mark.parametrize("mask_kind", ["mixed", "holes", "right"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_naive_loop(mask_kind, gamma, baseline):
    scores, group, m = _inputs(mask_kind, seed=3)
    r = torch.randn(m.shape, generator=torch.Generator().manual_seed(1)).masked_fill(~m, float("nan"))
    kw = dict(scores=scores, group=group) if baseline else {}
    for whiten in (False, True):
        out = CF.reinforce_plus_plus_advantages(r, m, gamma=gamma, whiten=whiten, **kw)
        ref = _naive_reinforce_pp(r.double(), m, gamma, whiten=whiten, **kw)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        assert bool((out[~m] == 0).all()) and bool(torch.isfinite(out).all())


def test_reinforce_pp_holes_are_skipped_not_ends():
    r = torch.tensor([[1.0, 123.0, 2.0, 0.0]])
    m = torch.tensor([[True, False, True, True]])
    out = CF.reinforce_plus_plus_advantages(r, m, gamma=0.5, whiten=False)
    assert out.tolist() == [[1.0 + 0.5 * 2.0, 0.0, 2.0, 0.0]]  # one discount step across the hole


# --------------------------------------------------------------------------- #
# Against the formulas of verl, TRL and OpenRLHF (transcribed here)
# --------------------------------------------------------------------------- #


def test_grpo_matches_verl_formula():
    # verl compute_grpo_outcome_advantage: per prompt index, mean and torch.std (unbiased) of the scores,
    # (score - mean) / (std + 1e-6), times the response mask; groups of one get mean 0 and std 1.
    scores, group, m = _inputs("right", seed=5)
    ref = torch.empty_like(scores)
    for k in set(group.tolist()):
        idx = group == k
        s = scores[idx]
        mean, std = (s.mean(), s.std()) if s.numel() > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        ref[idx] = (s - mean) / (std + 1e-6)
    ref = ref.unsqueeze(-1) * m
    out = CF.grpo_advantages(scores, group, m)
    single = (group == 40).unsqueeze(-1).expand_as(m)
    torch.testing.assert_close(out[~single], ref[~single], atol=1e-6, rtol=1e-6)
    assert bool((out[single] == 0).all())  # ours: a lone response has nothing to be compared with


def test_grpo_and_rloo_match_trl_formulas():
    # TRL: rewards laid out prompt-major in groups of G; GRPO: (r - mean) / (std + 1e-4) per group with
    # view(-1, G).std(dim=1); RLOO: r - (group sum - r) / (G - 1).
    G, P = 4, 3
    r = torch.randn(P * G, generator=torch.Generator().manual_seed(2))
    group = torch.arange(P).repeat_interleave(G)
    m = torch.ones(P * G, 2, dtype=torch.bool)
    grouped = r.view(-1, G)
    mean, std = grouped.mean(1).repeat_interleave(G), grouped.std(1).repeat_interleave(G)
    torch.testing.assert_close(CF.grpo_advantages(r, group, m, eps=1e-4)[:, 0], (r - mean) / (std + 1e-4))
    torch.testing.assert_close(CF.dr_grpo_advantages(r, group, m)[:, 1], r - mean)
    rloo = r - (grouped.sum(1).repeat_interleave(G) - r) / (G - 1)
    torch.testing.assert_close(CF.rloo_advantages(r, group, m)[:, 0], rloo)


def test_reinforce_pp_matches_openrlhf_formula():
    # OpenRLHF REINFORCE++: right-padded rewards (0 after the response), returns by the reverse
    # cumulative sum returns_t = r_t + gamma * returns_{t+1}, then whitened over the action mask
    # ((x - mean) * rsqrt(var + 1e-8), biased variance).
    scores, group, m = _inputs("right", seed=7)
    r = torch.randn(m.shape, generator=torch.Generator().manual_seed(4)) * m
    gamma, ret, acc = 0.95, torch.zeros_like(r), torch.zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        acc = r[:, t] + gamma * acc
        ret[:, t] = acc
    mean = ret[m].mean()
    var = ((ret - mean) ** 2)[m].mean()
    ref = (ret - mean) * torch.rsqrt(var + 1e-8) * m
    torch.testing.assert_close(CF.reinforce_plus_plus_advantages(r, m, gamma=gamma), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Masked garbage, empty rows, groups of one
# --------------------------------------------------------------------------- #


def _batch(mask_kind: str = "mixed", seed: int = 0):
    td = response_batch(batch_size=len(GROUPS), response_len=5, mask=mask_kind, with_values=False, seed=seed)
    td.set("group", torch.tensor(GROUPS))
    return td


@pytest.mark.parametrize("mask_kind", ["holes", "empty_rows", "mixed"])
@pytest.mark.parametrize(
    "estimator",
    [CF.GroupAdvantage("grpo"), CF.GroupAdvantage("dr_grpo"), CF.GroupAdvantage("rloo"),
     CF.ReinforcePlusPlus(), CF.ReinforcePlusPlus(gamma=0.9, baseline=True)],  # fmt: skip
    ids=["grpo", "dr_grpo", "rloo", "rpp", "rpp_baseline"],
)
def test_mask_invariant(estimator, mask_kind):
    assert_mask_invariant(estimator, _batch(mask_kind))


def test_empty_rows_and_empty_batches():
    scores, group = torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([0, 0, 0])
    m = torch.tensor([[True, True], [False, False], [True, False]])
    out = CF.grpo_advantages(scores, group, m)  # the empty row's NaN score is never read (counts as 0)
    assert bool(torch.isfinite(out).all()) and out[1].tolist() == [0.0, 0.0]
    for fn in (CF.grpo_advantages, CF.dr_grpo_advantages, CF.rloo_advantages):
        assert fn(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 4, dtype=torch.bool)).shape == (0, 4)
        assert fn(torch.ones(2), torch.tensor([0, 0]), torch.zeros(2, 0, dtype=torch.bool)).shape == (2, 0)
        assert fn(torch.ones(2), torch.tensor([0, 1]), torch.zeros(2, 3, dtype=torch.bool)).abs().sum() == 0
    r = torch.full((2, 3), float("nan"))
    assert CF.reinforce_plus_plus_advantages(r, torch.zeros(2, 3, dtype=torch.bool)).abs().sum() == 0


def test_group_of_one_gives_zero_not_nan():
    scores, group, m = torch.tensor([4.0, 1.0, 1.0]), torch.tensor([0, 1, 1]), torch.ones(3, 2, dtype=torch.bool)
    for fn in (CF.grpo_advantages, CF.dr_grpo_advantages, CF.rloo_advantages):
        out = fn(scores, group, m)
        assert out.tolist() == [[0.0, 0.0]] * 3  # a lone response, then a group of equal scores


def test_half_precision_computes_in_float32():
    scores, group, m = _inputs("mixed")
    out = CF.grpo_advantages(scores.half(), group, m)
    assert out.dtype == torch.float16
    ref = CF.grpo_advantages(scores.half().float(), group, m)
    torch.testing.assert_close(out.float(), ref, atol=1e-3, rtol=1e-3)


# --------------------------------------------------------------------------- #
# TorchRL estimators and the loss without a critic
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", CF.GROUP_KINDS)
def test_group_estimator_writes_advantage_and_value_target(kind):
    td = _batch()
    out = CF.GroupAdvantage(kind)(td.clone())
    ref = _naive_group(td["score"].double(), td["group"], td["mask"], kind)
    torch.testing.assert_close(out["advantage"].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out["value_target"], out["advantage"])
    torch.testing.assert_close(CF.GroupAdvantage(kind).value_estimate(td), out["advantage"])


def test_set_keys_renames_entries():
    td = _batch().rename_key_("score", "outcome").rename_key_("group", "prompt_id")
    est = CF.GroupAdvantage("grpo")
    est.set_keys(score="outcome", group="prompt_id", advantage="adv")
    assert est.in_keys[:2] == ["outcome", "prompt_id"]
    out = est(td)
    torch.testing.assert_close(out["adv"], CF.grpo_advantages(td["outcome"], td["prompt_id"], td["mask"]))
    rpp = CF.ReinforcePlusPlus(baseline=True)
    rpp.set_keys(reward="token_reward", score="outcome", group="prompt_id")
    td.set(("next", "token_reward"), td["next", "reward"])
    kw = dict(scores=td["outcome"], group=td["prompt_id"])
    ref = CF.reinforce_plus_plus_advantages(td["next", "reward"], td["mask"], **kw)
    torch.testing.assert_close(rpp(td)["advantage"], ref)


@pytest.mark.parametrize(
    "estimator, mode",
    [(CF.GroupAdvantage("grpo"), "token-mean"), (CF.GroupAdvantage("dr_grpo"), "seq-mean-token-sum-norm"),
     (CF.GroupAdvantage("rloo"), "token-mean"), (CF.ReinforcePlusPlus(baseline=True), "token-mean")],  # fmt: skip
    ids=["grpo", "dr_grpo", "rloo", "rpp_baseline"],
)
def test_token_ppo_loss_trains_without_critic(estimator, mode):
    actor, _ = tiny_actor_critic()
    td = estimator(_batch("holes", seed=1))
    loss = TokenPPOLoss(actor, None, aggregation=mode)
    out = loss(td)
    assert "loss_critic" not in out.keys()
    total = sum(v for k, v in out.items() if k.startswith("loss_"))
    assert bool(torch.isfinite(total))
    total.backward()
    grads = [p.grad for p in actor.parameters() if p.grad is not None]
    assert grads and any(bool(g.abs().sum() > 0) for g in grads)
    # on-policy (ratio 1, nothing clipped) the objective is minus the aggregated advantages
    with torch.no_grad():
        td.set("sample_log_prob", actor(td.clone())["log_prob"])
        expected = F.aggregate_loss(-td["advantage"], td["mask"], mode)
    torch.testing.assert_close(loss(td)["loss_objective"].detach(), expected, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Error paths
# --------------------------------------------------------------------------- #


def test_errors():
    td = _batch()
    with pytest.raises(KeyError, match="'group'"):
        CF.GroupAdvantage("grpo")(td.exclude("group"))
    with pytest.raises(KeyError, match="'group'"):
        CF.ReinforcePlusPlus(baseline=True)(td.exclude("group"))
    with pytest.raises(ValueError, match=r"group has shape \(3,\) but scores has shape \(10,\)"):
        CF.grpo_advantages(td["score"], torch.tensor([0, 0, 1]), td["mask"])
    with pytest.raises(ValueError, match="kind='ppo' is not one of"):
        CF.GroupAdvantage("ppo")
    with pytest.raises(ValueError, match="scale='var' is not one of"):
        CF.grpo_advantages(td["score"], td["group"], td["mask"], scale="var")
    with pytest.raises(TypeError, match="group must be an integer tensor"):
        CF.rloo_advantages(td["score"], td["group"].float(), td["mask"])
    with pytest.raises(ValueError, match=r"expected one score per row"):
        CF.rloo_advantages(td["score"][:3], td["group"][:3], td["mask"])
    with pytest.raises(ValueError, match="needs both scores= and group="):
        CF.reinforce_plus_plus_advantages(td["next", "reward"], td["mask"], scores=td["score"])
    with pytest.raises(ValueError, match="gamma"):
        CF.ReinforcePlusPlus(gamma=1.5)


def test_constant_inputs_give_zero():
    td = TensorDict(
        {"score": torch.ones(4), "group": torch.tensor([0, 0, 1, 1]), "mask": torch.ones(4, 3, dtype=torch.bool)}, [4]
    )
    for kind in CF.GROUP_KINDS:
        assert CF.GroupAdvantage(kind)(td.clone())["advantage"].abs().sum() == 0


# --------------------------------------------------------------------------- #
# Non-finite inputs stop here, as at MaskedGAE
# --------------------------------------------------------------------------- #

_METHODS = {"grpo": "GRPO", "dr_grpo": r"Dr\. GRPO", "rloo": "RLOO"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", CF.GROUP_KINDS)
def test_group_estimator_refuses_a_non_finite_score_naming_the_row(kind, bad):
    td = _batch("right")
    td["score"][3] = bad  # row 3 has valid tokens under a right-padded mask
    match = (rf"{_METHODS[kind]}: scores holds {bad} at the row \(3,\), a response with valid tokens, so the "
             r"advantages would be NaN/inf; fix the reward function for that response, or drop the response")
    with pytest.raises(ValueError, match=match):
        CF.GroupAdvantage(kind)(td)
    fn = {"grpo": CF.grpo_advantages, "dr_grpo": CF.dr_grpo_advantages, "rloo": CF.rloo_advantages}[kind]
    with pytest.raises(ValueError, match=match):
        fn(td["score"], td["group"], td["mask"])


@pytest.mark.parametrize("baseline", [False, True], ids=["rpp", "rpp_baseline"])
@pytest.mark.parametrize("whiten", [True, False])
def test_reinforce_pp_refuses_a_non_finite_reward_naming_the_position(baseline, whiten):
    td = _batch("right")
    td["next", "reward"][2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"REINFORCE\+\+: token_rewards holds nan at the valid position \(2, 1\), so "
                                         r"the advantages would be NaN/inf; fix the reward function .* or mask the "
                                         r"token out \(mask False"):
        CF.ReinforcePlusPlus(baseline=baseline, whiten=whiten)(td)


def test_reinforce_pp_baseline_refuses_a_non_finite_score_naming_the_row():
    td = _batch("right")
    td["score"][0] = float("inf")
    with pytest.raises(ValueError, match=r"REINFORCE\+\+: scores holds inf at the row \(0,\), a response with valid "
                                         r"tokens, so the advantages would be NaN/inf"):
        CF.ReinforcePlusPlus(baseline=True)(td)


def test_overflow_of_finite_inputs_is_refused_as_an_overflow():
    r, m = torch.full((2, 3), 3e38), torch.ones(2, 3, dtype=torch.bool)  # returns of 9e38 overflow float32
    with pytest.raises(ValueError, match=r"REINFORCE\+\+: the advantages are not finite although the rewards at the "
                                         r"valid tokens are finite \(an overflow of very large rewards\); "
                                         r"rescale them"):
        CF.reinforce_plus_plus_advantages(r, m, whiten=False)
    scores, group = torch.tensor([3e38, 3e38, -3e38]), torch.tensor([0, 0, 0])  # their sum overflows
    with pytest.raises(ValueError, match=r"RLOO: the advantages are not finite although the scores of the rows with "
                                         r"valid tokens are finite \(an overflow of very large scores\)"):
        CF.rloo_advantages(scores, group, torch.ones(3, 2, dtype=torch.bool))


def test_non_finite_inputs_off_the_mask_are_never_read():
    td = _batch("right")
    td["mask"][4] = False  # row 4 becomes empty: its score is never read
    td["score"][4] = float("nan")
    td["next", "reward"][~td["mask"]] = float("inf")
    for estimator in (CF.GroupAdvantage("grpo"), CF.GroupAdvantage("rloo"), CF.ReinforcePlusPlus(baseline=True)):
        assert bool(torch.isfinite(estimator(td.clone())["advantage"]).all())


def test_value_checks_off_lets_non_finite_advantages_through():
    td = _batch("right")
    td["score"][1] = float("nan")
    with F.value_checks(False):
        out = CF.GroupAdvantage("grpo")(td)["advantage"]
    assert bool(torch.isnan(out[1][td["mask"][1]]).all())


# --------------------------------------------------------------------------- #
# A loss with a critic refuses critic-free advantages
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "estimator", [CF.GroupAdvantage("grpo"), CF.ReinforcePlusPlus()], ids=["grpo", "rpp"]
)
def test_estimator_marks_its_batch_critic_free(estimator):
    td = estimator(_batch())
    assert td["critic_free"].dtype == torch.bool and td["critic_free"].shape == td.batch_size
    assert bool(td["critic_free"].all())
    assert "critic_free" in estimator.out_keys


@pytest.mark.parametrize(
    "estimator", [CF.GroupAdvantage("grpo"), CF.ReinforcePlusPlus()], ids=["grpo", "rpp"]
)
def test_loss_with_a_critic_refuses_critic_free_advantages(estimator):
    actor, critic = tiny_actor_critic()
    td = estimator(_batch("holes", seed=1))
    with pytest.raises(ValueError, match=r"TokenPPOLoss: the batch's advantages come from a critic-free estimator "
                                         r"\(its 'critic_free' entry is set and 'value_target' is a copy of "
                                         r"'advantage'\), but this loss has a critic network: it would regress the "
                                         r"critic onto advantages; build the loss without one, "
                                         r"TokenPPOLoss\(actor, None, \.\.\.\)"):
        TokenPPOLoss(actor, critic)(td)
    with pytest.raises(ValueError, match="critic-free estimator"):
        TokenPPOLoss(actor, critic)(td[:4])  # a minibatch keeps the marker


def test_loss_with_a_critic_accepts_a_marked_batch_whose_advantages_were_recomputed():
    actor, critic = tiny_actor_critic()
    td = response_batch(batch_size=len(GROUPS), response_len=5, mask="holes", seed=1)  # with the critic's values
    td = CF.GroupAdvantage("grpo")(td.set("group", torch.tensor(GROUPS)))
    td = MaskedGAE()(td)  # the critic's GAE overwrites advantage and value_target
    assert "critic_free" in td.keys()
    out = TokenPPOLoss(actor, critic)(td)
    assert bool(torch.isfinite(out["loss_critic"]))

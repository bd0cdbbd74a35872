"""Rollout correction (training / inference mismatch): rollout_correction_weights, ppo_policy_loss(weights=)
and TokenPPOLoss(rollout_correction=), each checked against a plain Python-float loop written here."""

import math

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from ppo_objectives import functional as F
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.testing import make_mask, reference_ppo_policy_loss

MODES = F.ROLLOUT_CORRECTION_MODES


# --------------------------------------------------------------------------- #
# Naive references (Python floats, one token at a time)
# --------------------------------------------------------------------------- #


def naive_weights(old, roll, mask, mode, high=2.0, low=None):
    """(weights, clipped, rejected) as nested lists, straight from the written formulas."""
    if low is None and mode in ("icepop", "geo-mask"):
        low = 1.0 / high
    weights, clipped, rejected = [], [], []
    for o_row, r_row, m_row in zip(old.tolist(), roll.tolist(), mask.tolist()):
        logs = [o - r for o, r, v in zip(o_row, r_row, m_row) if v]
        s = math.exp(sum(logs))  # the product of the ratios
        g = math.exp(sum(logs) / len(logs)) if logs else 1.0  # their geometric mean
        w_row, c_row, x_row = [], [], []
        for o, r, v in zip(o_row, r_row, m_row):
            if not v:
                w_row.append(0.0), c_row.append(False), x_row.append(False)
                continue
            w = math.exp(o - r)
            inside = lambda x: x <= high and (low is None or x >= low)  # noqa: E731
            if mode == "token-tis":
                out, clip, rej = min(w, high), w > high, False
            elif mode in ("token-mis", "icepop"):
                out, clip, rej = (w if inside(w) else 0.0), False, not inside(w)
            elif mode == "seq-tis":
                out, clip, rej = min(s, high), s > high, False
            elif mode == "seq-mis":
                out, clip, rej = (s if inside(s) else 0.0), False, not inside(s)
            else:  # geo-mask
                out, clip, rej = (1.0 if inside(g) else 0.0), False, not inside(g)
            w_row.append(out), c_row.append(clip), x_row.append(rej)
        weights.append(w_row), clipped.append(c_row), rejected.append(x_row)
    return weights, clipped, rejected


def naive_stats(weights, clipped, rejected, mask):
    valid = [(w, c, x) for wr, cr, xr, mr in zip(weights, clipped, rejected, mask.tolist())
             for w, c, x, v in zip(wr, cr, xr, mr) if v]  # fmt: skip
    rows = [i for i, mr in enumerate(mask.tolist()) if any(mr)]
    n = len(valid)
    sw, sw2 = sum(w for w, _, _ in valid), sum(w * w for w, _, _ in valid)
    return {
        "clip_fraction": sum(c for _, c, _ in valid) / max(n, 1),
        "mask_fraction": sum(x for _, _, x in valid) / max(n, 1),
        "seq_clip_fraction": sum(any(clipped[i]) for i in rows) / max(len(rows), 1),
        "seq_mask_fraction": sum(any(rejected[i]) for i in rows) / max(len(rows), 1),
        "ESS": sw * sw / (n * sw2) if sw2 > 0 else 0.0,
        "mean_weight": sw / max(n, 1),
        "max_weight": max([w for w, _, _ in valid] + [0.0]),
    }


def batch(B=5, R=7, seed=0, scale=0.6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    # centred on -3 so that the log-probs stay <= 0; only the differences old - roll (the ratios) matter
    old = (-3.0 + scale * torch.randn(B, R, generator=g)).to(dtype)
    roll = (-3.0 + scale * torch.randn(B, R, generator=g)).to(dtype)
    mask = make_mask(B, R, "empty_rows", generator=g)  # right padding, some rows empty
    return old, roll, mask


# --------------------------------------------------------------------------- #
# rollout_correction_weights
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("high", "low"), [(2.0, None), (1.5, 0.7), (5.0, 0.5)])
def test_weights_and_stats_match_the_naive_loop(mode, high, low):
    if low is not None and mode.endswith("tis"):
        low = None
    for seed in range(3):
        old, roll, mask = batch(seed=seed, scale=0.3 if mode.startswith("seq") else 0.6)
        w, stats = F.rollout_correction_weights(
            old, roll, mask, mode, threshold_high=high, threshold_low=low, return_stats=True
        )
        ref_w, ref_c, ref_x = naive_weights(old, roll, mask, mode, high, low)
        assert w.dtype == torch.float64
        torch.testing.assert_close(w, torch.tensor(ref_w, dtype=torch.float64), rtol=1e-12, atol=0)
        for name, value in naive_stats(ref_w, ref_c, ref_x, mask).items():
            assert float(stats[name]) == pytest.approx(value, rel=1e-12, abs=1e-15), name
        assert not w.requires_grad


def test_each_mode_on_a_hand_computed_row():
    # log-probs <= 0 with old - roll = log(ratio) exactly (one of the two is 0 at each token)
    log_ratio = torch.log(torch.tensor([[0.5, 1.0, 3.0, 9.0]]))
    old, roll = log_ratio.clamp(max=0.0), -log_ratio.clamp(min=0.0)
    m = torch.tensor([[True, True, True, False]])  # ratios 0.5, 1, 3 (9 masked)
    expect = {
        "token-tis": [0.5, 1.0, 2.0, 0.0],
        "token-mis": [0.5, 1.0, 0.0, 0.0],
        "icepop": [0.5, 1.0, 0.0, 0.0],  # 0.5 = 1 / 2 is inside: the bounds are inclusive
        "seq-tis": [1.5, 1.5, 1.5, 0.0],  # product 1.5 <= 2
        "seq-mis": [1.5, 1.5, 1.5, 0.0],
        "geo-mask": [1.0, 1.0, 1.0, 0.0],  # 1.5 ** (1 / 3) in [0.5, 2]: kept, not reweighted
    }
    for mode, ref in expect.items():
        torch.testing.assert_close(F.rollout_correction_weights(old, roll, m, mode), torch.tensor([ref]))
    # product 1.5 > 1.2: truncated / rejected as a whole
    torch.testing.assert_close(F.rollout_correction_weights(old, roll, m, "seq-tis", threshold_high=1.2),
                               torch.tensor([[1.2, 1.2, 1.2, 0.0]]))  # fmt: skip
    assert F.rollout_correction_weights(old, roll, m, "seq-mis", threshold_high=1.2).abs().sum() == 0
    # icepop masks the low tail by default, token-mis only when asked
    low = F.rollout_correction_weights(old, roll, m, "icepop", threshold_high=4.0)  # c = 0.25
    torch.testing.assert_close(low, torch.tensor([[0.5, 1.0, 3.0, 0.0]]))
    both = F.rollout_correction_weights(old, roll, m, "token-mis", threshold_high=4.0, threshold_low=0.6)
    torch.testing.assert_close(both, F.rollout_correction_weights(old, roll, m, "icepop", threshold_high=4.0,
                                                                  threshold_low=0.6))  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_masked_garbage_is_never_read(mode):
    old, roll, mask = batch(dtype=torch.float32)
    clean = F.rollout_correction_weights(old, roll, mask, mode, return_stats=True)
    bad_old = torch.where(mask, old, torch.tensor(float("nan")))
    bad_roll = torch.where(mask, roll, torch.tensor(float("-inf")))
    dirty = F.rollout_correction_weights(bad_old, bad_roll, mask, mode, return_stats=True)
    assert torch.equal(clean[0], dirty[0])
    assert torch.equal(dirty[0][~mask], torch.zeros_like(dirty[0][~mask]))
    assert all(torch.equal(clean[1][k], dirty[1][k]) for k in clean[1])
    assert all(torch.isfinite(v) for v in dirty[1].values())


@pytest.mark.parametrize("mode", MODES)
def test_empty_rows_and_empty_masks(mode):
    old, roll, mask = batch()
    assert torch.equal(F.rollout_correction_weights(old, roll, mask, mode)[1], torch.zeros(7, dtype=torch.float64))
    w, stats = F.rollout_correction_weights(old, roll, torch.zeros_like(mask), mode, return_stats=True)
    assert torch.equal(w, torch.zeros_like(w))
    assert all(float(v) == 0.0 for v in stats.values())
    w, stats = F.rollout_correction_weights(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0), mode,
                                            return_stats=True)  # fmt: skip
    assert w.shape == (3, 0) and all(float(v) == 0.0 for v in stats.values())


def test_half_precision_computes_in_float32_and_leading_dims():
    old, roll, mask = batch(dtype=torch.float32)
    w32 = F.rollout_correction_weights(old, roll, mask, "seq-tis")
    w16 = F.rollout_correction_weights(old.bfloat16(), roll.bfloat16(), mask, "seq-tis")
    assert w16.dtype == torch.float32
    ref = F.rollout_correction_weights(old.bfloat16().float(), roll.bfloat16().float(), mask, "seq-tis")
    assert torch.equal(w16, ref)
    w3 = F.rollout_correction_weights(old.reshape(1, 5, 7), roll.reshape(1, 5, 7), mask.reshape(1, 5, 7), "seq-tis")
    assert torch.equal(w3.reshape(5, 7), w32)


def test_ess_is_one_for_equal_weights_and_drops_with_spread():
    m = torch.ones(1, 4, dtype=torch.bool)
    _, s = F.rollout_correction_weights(torch.full((1, 4), -1.0), torch.full((1, 4), -1.2), m, return_stats=True)
    assert float(s["ESS"]) == pytest.approx(1.0)
    old = torch.log(torch.tensor([[0.1, 1.0, 1.0, 1.9]])) - 3.0  # ratios 0.1, 1, 1, 1.9 over rollout log-probs -3
    _, s = F.rollout_correction_weights(old, torch.full((1, 4), -3.0), m, return_stats=True)
    assert 0.0 < float(s["ESS"]) < 1.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(mode="tis"), ValueError, "mode='tis' is not one of"),
        (dict(threshold_high=0.5), ValueError, "threshold_high=0.5 must be >= 1"),
        (dict(threshold_high=float("inf")), ValueError, "threshold_high=inf must be a finite number"),
        (dict(threshold_high="2"), TypeError, "threshold_high must be a positive float"),
        (dict(mode="token-tis", threshold_low=0.5), ValueError, "threshold_low=0.5 is not used by mode='token-tis'"),
        (dict(mode="seq-tis", threshold_low=0.5), ValueError, "is not used by mode='seq-tis'"),
        (dict(mode="icepop", threshold_low=2.0), ValueError, "threshold_low=2.0 must be <= 1"),
        (dict(mode="token-mis", threshold_low=-1.0), ValueError, "threshold_low=-1.0 must be a finite number > 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    old, roll, mask = batch()
    with pytest.raises(error, match=match):
        F.rollout_correction_weights(old, roll, mask, **kwargs)


def test_bad_shapes_and_dtypes_are_refused():
    old, roll, mask = batch()
    with pytest.raises(ValueError, match=r"rollout_log_prob has shape \(5, 6\)"):
        F.rollout_correction_weights(old, roll[:, :6], mask)
    with pytest.raises(ValueError, match="mask"):
        F.rollout_correction_weights(old, roll, mask[:, :6])
    with pytest.raises(TypeError, match="rollout_log_prob must be a floating-point tensor"):
        F.rollout_correction_weights(old, roll.long(), mask)


# --------------------------------------------------------------------------- #
# ppo_policy_loss(weights=)
# --------------------------------------------------------------------------- #


def test_policy_loss_weights_multiply_the_surrogate():
    old, roll, mask = batch()
    g = torch.Generator().manual_seed(3)
    new = (old + 0.3 * torch.randn(old.shape, generator=g, dtype=old.dtype)).requires_grad_()
    adv = torch.randn(old.shape, generator=g, dtype=old.dtype)
    w = F.rollout_correction_weights(old, roll, mask, "token-tis")
    loss = F.ppo_policy_loss(new, old, adv, mask, 0.2, weights=w)
    assert float(loss.detach()) == pytest.approx(float(reference_ppo_policy_loss(new, old, adv, mask, 0.2, weights=w)),
                                                 rel=1e-12)
    plain = F.ppo_policy_loss(new, old, adv, mask, 0.2)
    assert torch.equal(F.ppo_policy_loss(new, old, adv, mask, 0.2, weights=None), plain)
    assert torch.equal(F.ppo_policy_loss(new, old, adv, mask, 0.2, weights=torch.ones_like(w)), plain)
    # detached weights, never read at masked positions; the statistics stay those of the ratios
    wg = torch.where(mask, w, torch.tensor(float("nan"), dtype=w.dtype)).requires_grad_()
    loss2, stats = F.ppo_policy_loss(new, old, adv, mask, 0.2, weights=wg, return_stats=True)
    assert torch.equal(loss2, loss)
    loss2.backward()
    assert wg.grad is None and torch.isfinite(new.grad).all()
    assert torch.equal(stats["ESS"], F.ppo_policy_loss(new, old, adv, mask, 0.2, return_stats=True)[1]["ESS"])


def test_policy_loss_weights_errors():
    old, _, mask = batch()
    with pytest.raises(ValueError, match=r"weights has shape \(5, 6\) but log_prob has shape \(5, 7\)"):
        F.ppo_policy_loss(old, old, old, mask, 0.2, weights=old[:, :6])
    with pytest.raises(TypeError, match="weights must be a floating-point tensor"):
        F.ppo_policy_loss(old, old, old, mask, 0.2, weights=mask)


# --------------------------------------------------------------------------- #
# TokenPPOLoss(rollout_correction=)
# --------------------------------------------------------------------------- #


class _Policy(nn.Module):
    def __init__(self, vocab=9):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, vocab)

    def forward(self, tokens):
        return torch.log_softmax(self.emb(tokens), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def loss_batch(B=4, R=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    actor = TensorDictModule(_Policy(), in_keys=["tokens"], out_keys=["log_prob"])
    tokens = torch.randint(9, (B, R), generator=g)
    with torch.no_grad():
        logp = actor.module(tokens)
    mask = torch.arange(R) < torch.randint(1, R + 1, (B,), generator=g)[:, None]
    td = TensorDict(
        {
            "tokens": tokens,
            "mask": mask,
            "sample_log_prob": logp + 0.2 * torch.randn(B, R, generator=g),
            "rollout_log_prob": logp + 0.6 * torch.randn(B, R, generator=g),
            "advantage": torch.randn(B, R, generator=g),
        },
        [B],
    )
    return actor, td


@pytest.mark.parametrize("mode", ["token-tis", "seq-mis", "icepop"])
def test_loss_module_weights_the_objective(mode):
    actor, td = loss_batch()
    loss = TokenPPOLoss(actor, kl_to_ref_coeff=0.0, rollout_correction=mode, rollout_threshold_high=1.5)
    out = loss(td)
    w, stats = F.rollout_correction_weights(td["sample_log_prob"], td["rollout_log_prob"], td["mask"], mode,
                                            threshold_high=1.5, return_stats=True)  # fmt: skip
    new = actor.module(td["tokens"]).detach()
    ref = reference_ppo_policy_loss(new, td["sample_log_prob"], td["advantage"], td["mask"], 0.2, weights=w)
    assert float(out["loss_objective"].detach()) == pytest.approx(float(ref), rel=1e-5)
    plain = TokenPPOLoss(actor, kl_to_ref_coeff=0.0)(td)
    assert not torch.equal(out["loss_objective"], plain["loss_objective"])
    for name, value in stats.items():
        assert torch.equal(out[f"rollout_{name}"], value)
    assert {"rollout_clip_fraction", "rollout_mask_fraction", "rollout_ESS"} <= set(out.keys())
    assert "rollout_log_prob" in loss.in_keys


def test_loss_module_default_is_unchanged():
    actor, td = loss_batch()
    on = TokenPPOLoss(actor, kl_to_ref_coeff=0.0, rollout_correction="token-tis")
    off = TokenPPOLoss(actor, kl_to_ref_coeff=0.0)
    assert "rollout_log_prob" not in off.in_keys and off.rollout_correction is None
    with_key, without_key = off(td), off(td.exclude("rollout_log_prob"))
    assert set(with_key.keys()) == set(without_key.keys())
    assert not any(k.startswith("rollout_") for k in with_key.keys())
    for k in with_key.keys():
        assert torch.equal(with_key[k], without_key[k]), k
    # no mismatch (rollout == old): every weight is 1 and the loss is bit-identical
    same = td.set("rollout_log_prob", td["sample_log_prob"].clone())
    assert torch.equal(on(same)["loss_objective"], off(same)["loss_objective"])


def test_loss_module_missing_key_and_renamed_key():
    actor, td = loss_batch()
    loss = TokenPPOLoss(actor, kl_to_ref_coeff=0.0, rollout_correction="seq-tis")
    with pytest.raises(KeyError, match=r"no 'rollout_log_prob' \(rollout log-probs\); needed because "
                                       r"rollout_correction is set.*set_keys\(rollout_log_prob="):  # fmt: skip
        loss(td.exclude("rollout_log_prob"))
    loss.set_keys(rollout_log_prob="vllm_log_prob")
    assert "vllm_log_prob" in loss.in_keys and "rollout_log_prob" not in loss.in_keys
    renamed = td.rename_key_("rollout_log_prob", "vllm_log_prob")
    assert torch.isfinite(loss(renamed)["rollout_ESS"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(rollout_correction="vllm"), "mode='vllm' is not one of"),
        (dict(rollout_correction="token-mis", rollout_threshold_high=0.9), "threshold_high=0.9 must be >= 1"),
        (dict(rollout_correction="seq-tis", rollout_threshold_low=0.5), "is not used by mode='seq-tis'"),
    ],
)
def test_loss_module_bad_hyperparameters(kwargs, match):
    actor, _ = loss_batch()
    with pytest.raises(ValueError, match=match):
        TokenPPOLoss(actor, kl_to_ref_coeff=0.0, **kwargs)

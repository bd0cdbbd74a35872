"""``MaskedGAE(holes="cut")``: TorchRL's semantics for its ``valid`` key, checked against TorchRL's own GAE.

A hole inside a row *cuts* the trajectory there under TorchRL's semantics (the valid step before
it bootstraps from its own next value) where this package *skips* it (``holes="skip"``, the
default: the next valid step's value is the next value). Both are tested here on the same
collector rows with holes; with a torchrl whose ``GAE`` has the ``valid`` key (the nightly of
2026-10 and later) the cut semantics equal ``torchrl.objectives.value.GAE`` number for number.
"""

import dataclasses

import pytest
import torch
from torchrl.objectives.value import GAE

from ppo_objectives import testing as T
from ppo_objectives.value.gae import MaskedGAE

TORCHRL_HAS_VALID = "valid" in {f.name for f in dataclasses.fields(GAE._AcceptedKeys)}
GAMMA, LMBDA = 0.97, 0.9


def _holey(seed: int):
    """Collector rows ``[4, 12]`` with a ``my_valid`` entry holding holes inside the rows (the first step valid);
    NaN at every invalid step of the values and rewards, flags only at valid steps."""
    td = T.collector_batch(4, 12, seed=seed)
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(4, 12, 1, generator=g) > 0.35
    valid[:, 0] = True
    out = td.clone()
    for key in ("state_value", ("next", "state_value"), ("next", "reward")):
        out.set(key, torch.where(valid, out.get(key), float("nan")))
    for key in (("next", "done"), ("next", "terminated"), ("next", "truncated")):
        out.set(key, out.get(key) & valid)
    out.set("my_valid", valid)
    return out, valid.squeeze(-1)


def _segments(valid_row: torch.Tensor) -> list[tuple[int, int]]:
    """The maximal runs ``[a, b)`` of valid steps of one row."""
    runs, start = [], None
    for t, ok in enumerate([*valid_row.tolist(), False]):
        if ok and start is None:
            start = t
        elif not ok and start is not None:
            runs.append((start, t))
            start = None
    return runs


def _cut_gae(holes: str, average_gae: bool) -> MaskedGAE:
    gae = MaskedGAE(GAMMA, LMBDA, holes=holes, average_gae=average_gae)
    gae.set_keys(valid="my_valid")
    return gae


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cut_holes_equal_torchrls_gae_on_each_valid_run(seed):
    # TorchRL's GAE on one run of valid steps alone: the run's last step bootstraps from its next value
    td, valid = _holey(seed)
    out = _cut_gae("cut", False)(td.clone())
    adv, target = out["advantage"].squeeze(-1), out["value_target"].squeeze(-1)
    clean = T.collector_batch(4, 12, seed=seed)
    for i in range(4):
        for a, b in _segments(valid[i]):
            run = clean[i : i + 1, a:b].clone()
            for key in (("next", "done"), ("next", "terminated"), ("next", "truncated")):
                run.set(key, td.get(key)[i : i + 1, a:b])
            want = GAE(gamma=GAMMA, lmbda=LMBDA, value_network=None)(run)
            torch.testing.assert_close(adv[i, a:b], want["advantage"].reshape(b - a))
            torch.testing.assert_close(target[i, a:b], want["value_target"].reshape(b - a))
    assert (adv[~valid] == 0).all() and (target[~valid] == 0).all()


def test_cut_holes_standardise_with_the_unbiased_std_over_the_valid_steps():
    td, valid = _holey(3)
    raw = _cut_gae("cut", False)(td.clone())["advantage"].squeeze(-1)
    got = _cut_gae("cut", True)(td.clone())["advantage"].squeeze(-1)
    x = raw[valid].double()
    want = torch.zeros_like(raw)
    want[valid] = ((x - x.mean()) / x.std(unbiased=True).clamp_min(1e-4)).float()
    torch.testing.assert_close(got, want)


def test_skip_and_cut_differ_on_holes_and_agree_without_them():
    td, _ = _holey(4)
    skip, cut = _cut_gae("skip", False)(td.clone()), _cut_gae("cut", False)(td.clone())
    assert not torch.allclose(skip["advantage"], cut["advantage"])
    full = T.collector_batch(4, 12, seed=4)
    full.set("my_valid", torch.ones(4, 12, 1, dtype=torch.bool))
    torch.testing.assert_close(_cut_gae("skip", False)(full.clone())["advantage"],
                               _cut_gae("cut", False)(full.clone())["advantage"])  # fmt: skip


@pytest.mark.skipif(not TORCHRL_HAS_VALID, reason="the installed torchrl's GAE has no valid key (it came after 0.14.1)")
@pytest.mark.parametrize("average_gae", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_cut_holes_equal_torchrls_gae_with_its_valid_key(seed, average_gae):
    td, valid = _holey(seed)
    theirs = GAE(gamma=GAMMA, lmbda=LMBDA, value_network=None, average_gae=average_gae)
    theirs.set_keys(valid="my_valid")
    want = theirs(td.clone())
    got = _cut_gae("cut", average_gae)(td.clone())
    for key in ("advantage", "value_target"):
        torch.testing.assert_close(got[key][valid], want[key][valid], atol=1e-5, rtol=1e-5)
        assert (got[key][~valid] == 0).all()


def test_holes_is_checked_at_construction():
    with pytest.raises(ValueError, match=r"MaskedGAE: holes='drop' is not one of \('skip', 'cut'\)"):
        MaskedGAE(holes="drop")
    with pytest.raises(ValueError, match=r"holes='cut' \(TorchRL's semantics\) takes one lambda: drop policy_lmbda"):
        MaskedGAE(holes="cut", policy_lmbda=0.5)

"""Turn-level GAE (``functional.turn_gae``, ``MaskedGAE(level="turn")``) against an independent loop over turns."""

import pytest
import torch
from tensordict import TensorDict

from ppo_objectives import functional as F
from ppo_objectives.testing import response_batch
from ppo_objectives.value.gae import MaskedGAE


def _turns_loop(r, v, m, gamma, lmbda):
    """Per row: find the runs of valid tokens, then GAE over them in plain Python (raw advantages, returns)."""
    adv, ret = torch.zeros_like(r), torch.zeros_like(r)
    for b in range(r.shape[0]):
        turns, cur = [], []
        for t in range(r.shape[1]):
            if m[b, t]:
                cur.append(t)
            elif cur:
                turns.append(cur)
                cur = []
        if cur:
            turns.append(cur)
        next_v, next_a = 0.0, 0.0
        for toks in reversed(turns):
            reward = sum(float(r[b, t]) for t in toks)
            value = float(v[b, toks[0]])
            a = reward + gamma * next_v - value + gamma * lmbda * next_a
            for t in toks:
                adv[b, t], ret[b, t] = a, a + value
            next_v, next_a = value, a
    return adv, ret


def _holed(seed, B=6, R=12):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, R, generator=g) > 0.35  # several runs per row, holes between them
    m[0] = False  # a row with no valid token
    m[1] = True  # a row that is one turn
    r = torch.randn(B, R, generator=g).masked_fill(~m, float("nan"))  # never read at holes
    v = torch.randn(B, R, generator=g).masked_fill(~m, float("inf"))
    return r, v, m


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("gamma", "lmbda"), [(1.0, 1.0), (0.9, 0.8), (1.0, 0.0)])
def test_turn_gae_equals_an_independent_loop_over_turns(seed, gamma, lmbda):
    r, v, m = _holed(seed)
    adv, ret = F.turn_gae(r, v, m, gamma, lmbda, average_gae=False)
    ref_adv, ref_ret = _turns_loop(torch.nan_to_num(r), torch.nan_to_num(v), m, gamma, lmbda)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


def test_whitening_is_over_the_valid_tokens_as_token_level_gae_does():
    r, v, m = _holed(3)
    raw, _ = F.turn_gae(r, v, m, 0.95, 0.9, average_gae=False)
    white, _ = F.turn_gae(r, v, m, 0.95, 0.9, average_gae=True)
    torch.testing.assert_close(white, F.masked_whiten(raw, m).masked_fill(~m, 0.0))


def test_one_turn_rows_get_the_return_minus_the_first_value_on_every_token():
    batch = response_batch(4, 7, seed=0)
    m, r, v = batch["mask"], batch["next", "reward"], batch["state_value"]
    runs = (m & ~torch.nn.functional.pad(m[:, :-1], (1, 0), value=False)).sum(-1)
    assert (runs <= 1).all()  # the kit's rows are one contiguous response each
    adv, ret = F.turn_gae(r, v, m, 1.0, 1.0, average_gae=False)
    first = m.float().argmax(-1)
    expected = (r * m).sum(-1) - v.gather(1, first[:, None]).squeeze(1)
    for b in range(4):
        if m[b].any():
            torch.testing.assert_close(adv[b][m[b]], expected[b].expand(int(m[b].sum())))


def test_masked_gae_module_at_turn_level_writes_the_functional_numbers_and_decouples_lambda():
    r, v, m = _holed(4)
    td = TensorDict({"next": {"reward": r}, "state_value": v, "mask": m}, batch_size=r.shape)
    out = MaskedGAE(gamma=1.0, lmbda=1.0, policy_lmbda=0.5, level="turn")(td)
    _, target = F.turn_gae(r, v, m, 1.0, 1.0, average_gae=False)
    adv, _ = F.turn_gae(r, v, m, 1.0, 0.5, average_gae=False)
    torch.testing.assert_close(out["value_target"], target)
    torch.testing.assert_close(out["advantage"], adv)


def test_turn_level_differs_from_token_level_on_holed_rows():
    r, v, m = _holed(5)
    tok, _ = F.masked_gae(r, v, m, 1.0, 0.9, average_gae=False)
    turn, _ = F.turn_gae(r, v, m, 1.0, 0.9, average_gae=False)
    assert not torch.allclose(tok, turn)


def test_bad_levels_and_combinations_are_refused():
    with pytest.raises(ValueError, match="level='turns' is not one of"):
        MaskedGAE(level="turns")
    with pytest.raises(ValueError, match="level='turn' runs over the turns .* drop holes='cut' / length_alpha"):
        MaskedGAE(level="turn", holes="cut")
    with pytest.raises(ValueError, match="level='turn' runs over the turns"):
        MaskedGAE(level="turn", length_alpha=0.5)
    td = TensorDict({"next": {"reward": torch.zeros(2, 3), "done": torch.zeros(2, 3, dtype=torch.bool),
                              "state_value": torch.zeros(2, 3)},
                     "state_value": torch.zeros(2, 3)}, batch_size=[2, 3])  # fmt: skip
    with pytest.raises(ValueError, match="level='turn' takes the response form"):
        MaskedGAE(level="turn")(td)
    with pytest.raises(ValueError, match="turn_gae needs mask"):
        F.turn_gae(torch.zeros(1, 2), torch.zeros(1, 2), None, 1.0, 1.0)

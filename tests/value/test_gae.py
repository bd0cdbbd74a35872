"""MaskedGAE: the TorchRL value-estimator layer over functional.masked_gae.

References used here are independent of the module: the testing kit's loop
(`ppo_objectives.testing.reference_gae_collector`), the functional core, and torchrl.objectives.value.GAE.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.objectives.value import GAE

from ppo_objectives import functional as F
from ppo_objectives.testing import make_mask, reference_gae_collector
from ppo_objectives.value.gae import MaskedGAE


def collector_batch(N=3, T=10, seed=0, p_done=0.25, device="cpu", trailing=True):
    """Consistent collector data: ("next", "state_value")[t] == state_value[t+1] inside trajectories."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(N, T, generator=g)
    done = torch.rand(N, T, generator=g) < p_done
    term = done & (torch.rand(N, T, generator=g) < 0.5)
    trunc = done & ~term
    nv = torch.cat([v[:, 1:], torch.randn(N, 1, generator=g)], 1)
    nv = torch.where(done, torch.randn(N, T, generator=g), nv)  # value of the real final obs
    r = torch.randn(N, T, generator=g)
    u = (lambda x: x.unsqueeze(-1)) if trailing else (lambda x: x)
    td = TensorDict(
        {
            "state_value": u(v),
            ("next", "state_value"): u(nv),
            ("next", "reward"): u(r),
            ("next", "done"): u(done),
            ("next", "terminated"): u(term),
            ("next", "truncated"): u(trunc),
        },
        [N, T],
        device=device,
    )
    return td


def llm_batch(B=4, R=7, seed=0, device="cpu", trailing=False):
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(B, R, "right", generator=g)
    lengths = mask.sum(-1)
    r = torch.zeros(B, R)
    r[torch.arange(B), lengths - 1] = torch.randn(B, generator=g)
    r = r + 0.1 * torch.randn(B, R, generator=g)  # dense shaping on top
    v = torch.randn(B, R, generator=g)
    u = (lambda x: x.unsqueeze(-1)) if trailing else (lambda x: x)
    return TensorDict({"state_value": u(v), ("next", "reward"): u(r), "mask": u(mask)}, [B, R], device=device)


# --------------------------------------------------------------------------- golden cases


def test_llm_layout_golden_case_skips_padding_and_ends_terminal():
    # row: V = [1, 0.5, pad], r = [0, 2, pad], gamma = 0.5, lambda = 1
    # t=1: delta = 2 + 0.5 * 0 - 0.5 = 1.5              (next value after the last valid token is 0)
    # t=0: delta = 0 + 0.5 * 0.5 - 1 = -0.75; A = -0.75 + 0.5 * 1 * 1.5 = 0
    td = TensorDict(
        {
            "state_value": torch.tensor([[1.0, 0.5, float("nan")]]),
            ("next", "reward"): torch.tensor([[0.0, 2.0, float("nan")]]),
            "mask": torch.tensor([[1.0, 1.0, 0.0]]),
        },
        [1, 3],
    )
    out = MaskedGAE(gamma=0.5, lmbda=1.0)(td)
    torch.testing.assert_close(out["advantage"], torch.tensor([[0.0, 1.5, 0.0]]))
    torch.testing.assert_close(out["value_target"], torch.tensor([[1.0, 2.0, 0.0]]))


def test_collector_layout_golden_case_restarts_at_done_and_bootstraps_truncation():
    # gamma = lambda = 1, V = 0 everywhere, r = 1 per step, row = [a a | b b | c]
    #   a: terminated at t=1 -> A = [2, 1]
    #   b: truncated at t=3, next value 10 -> A = [12, 11]
    #   c: cut by the batch boundary, next value 5 -> A = [6]
    td = TensorDict(
        {
            "state_value": torch.zeros(1, 5),
            ("next", "state_value"): torch.tensor([[0.0, 0.0, 0.0, 10.0, 5.0]]),
            ("next", "reward"): torch.ones(1, 5),
            ("next", "done"): torch.tensor([[False, True, False, True, False]]),
            ("next", "terminated"): torch.tensor([[False, True, False, False, False]]),
        },
        [1, 5],
    )
    out = MaskedGAE(1.0, 1.0)(td)
    torch.testing.assert_close(out["advantage"], torch.tensor([[2.0, 1.0, 12.0, 11.0, 6.0]]))


# --------------------------------------------------------------------------- equal to references


@pytest.mark.parametrize("average_gae", [False, True])
@pytest.mark.parametrize("trailing", [False, True])
def test_llm_layout_equals_functional_masked_gae(device, average_gae, trailing):
    td = llm_batch(device=device, trailing=trailing)
    out = MaskedGAE(0.97, 0.9, average_gae=average_gae)(td.clone())
    sq = (lambda x: x.squeeze(-1)) if trailing else (lambda x: x)
    adv, ret = F.masked_gae(
        sq(td["next", "reward"]), sq(td["state_value"]), sq(td["mask"]), 0.97, 0.9, average_gae=average_gae
    )
    assert out["advantage"].shape == td["state_value"].shape  # written in the layout it read
    torch.testing.assert_close(sq(out["advantage"]), adv)
    torch.testing.assert_close(sq(out["value_target"]), ret)


@pytest.mark.parametrize("gamma,lmbda", [(0.99, 0.95), (1.0, 1.0), (0.5, 0.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_collector_layout_equals_torchrl_gae_on_unmasked_data(device, gamma, lmbda, seed):
    td = collector_batch(seed=seed, device=device)
    ours = MaskedGAE(gamma, lmbda)(td.clone())
    ref = GAE(gamma=gamma, lmbda=lmbda, value_network=None)(td.clone())
    torch.testing.assert_close(ours["advantage"], ref["advantage"])
    torch.testing.assert_close(ours["value_target"], ref["value_target"])


def test_collector_layout_whitening_equals_torchrl_up_to_variance_convention():
    td = collector_batch(N=4, T=16, seed=3)
    ours = MaskedGAE(0.9, 0.9, average_gae=True)(td.clone())["advantage"]
    ref = GAE(gamma=0.9, lmbda=0.9, value_network=None, average_gae=False)(td.clone())["advantage"]
    # ours: biased variance (MiniMind); TorchRL: unbiased std -> compare to a masked biased whitening
    expected = (ref - ref.mean()) / ref.var(unbiased=False).add(1e-8).sqrt()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 3), t=st.integers(1, 9), seed=st.integers(0, 10_000),
    gamma=st.floats(0.0, 1.0), lmbda=st.floats(0.0, 1.0), p_done=st.floats(0.0, 0.6), p_mask=st.floats(0.0, 1.0),
)  # fmt: skip
def test_collector_layout_property_equals_naive_loop(n, t, seed, gamma, lmbda, p_done, p_mask):
    td = collector_batch(N=n, T=t, seed=seed, p_done=p_done, trailing=False).to(torch.float64)
    mask = torch.rand(n, t, generator=torch.Generator().manual_seed(seed)) < p_mask
    td["mask"] = mask
    out = MaskedGAE(gamma, lmbda)(td.clone())
    adv, ret = reference_gae_collector(td["next", "reward"], td["state_value"], td["next", "state_value"], gamma, lmbda,
                                       done=td["next", "done"], terminated=td["next", "terminated"], mask=mask)
    torch.testing.assert_close(out["advantage"], adv)
    torch.testing.assert_close(out["value_target"], ret)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("collector", [False, True])
def test_low_and_high_precision_inputs_keep_their_dtype(dtype, collector):
    td = collector_batch(seed=2) if collector else llm_batch(seed=2)
    low = td.apply(lambda x: x.to(dtype) if x.is_floating_point() else x)
    out = MaskedGAE(0.99, 0.95, average_gae=True)(low.clone())
    ref = MaskedGAE(0.99, 0.95, average_gae=True)(low.apply(lambda x: x.double() if x.is_floating_point() else x))
    assert out["advantage"].dtype == dtype and out["value_target"].dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-2  # computed in float32, rounded once at the end
    torch.testing.assert_close(out["advantage"].double(), ref["advantage"], rtol=tol, atol=tol)


def test_collector_layout_with_one_trajectory_per_row_equals_the_response_layout():
    # One trajectory per row, truncated (bootstrapped) or terminated at its last valid token:
    # the same numbers through the done-flag path and through bootstrap_value.
    td = llm_batch(B=5, R=6, seed=4)
    r, v, m = td["next", "reward"], td["state_value"], td["mask"]
    boot = torch.tensor([0.0, 1.5, 0.0, -2.0, 0.3])
    col = td.clone()
    col["next", "done"] = torch.zeros_like(m)
    col["next", "terminated"] = (boot == 0).unsqueeze(-1).expand_as(m).clone()
    col["next", "state_value"] = boot.unsqueeze(-1).expand_as(v).clone()
    out = MaskedGAE(0.9, 0.7)(col)
    adv_f, ret_f = F.masked_gae(r, v, m, 0.9, 0.7, average_gae=False, bootstrap_value=boot)
    torch.testing.assert_close(out["advantage"], adv_f)
    torch.testing.assert_close(out["value_target"], ret_f)


def test_flags_default_like_torchrl_when_only_done_or_terminated_is_given():
    td = collector_batch(seed=5, trailing=False)
    # only ("next", "done"): terminated = done, as in TorchRL
    only_done = td.clone().exclude(("next", "terminated"), ("next", "truncated"))
    ref = GAE(gamma=0.9, lmbda=0.9, value_network=None)(only_done.clone())["advantage"]
    torch.testing.assert_close(MaskedGAE(0.9, 0.9)(only_done)["advantage"], ref)
    # only ("next", "terminated"): done = terminated, former truncations are continuations
    only_term = td.clone().exclude(("next", "done"), ("next", "truncated"))
    adv, _ = reference_gae_collector(td["next", "reward"], td["state_value"], td["next", "state_value"], 0.9, 0.9,
                                     terminated=td["next", "terminated"])
    torch.testing.assert_close(MaskedGAE(0.9, 0.9)(only_term)["advantage"], adv.float())


# --------------------------------------------------------------------------- masked positions


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), collector=st.booleans())
def test_garbage_at_masked_positions_changes_nothing(seed, collector):
    td = collector_batch(N=2, T=7, seed=seed, trailing=False) if collector else llm_batch(B=3, R=5, seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(td.batch_size, generator=g) < 0.6
    td["mask"] = mask
    clean = MaskedGAE(0.95, 0.9, average_gae=True)(td.clone())
    dirty = td.clone()
    for key in [("next", "reward"), "state_value"] + ([("next", "state_value")] if collector else []):
        dirty[key] = torch.where(mask, dirty[key], torch.tensor(float("nan")))
    if collector:
        dirty["next", "done"] = torch.where(mask, dirty["next", "done"], True)  # flags there are ignored too
    dirty = MaskedGAE(0.95, 0.9, average_gae=True)(dirty)
    for key in ("advantage", "value_target"):
        torch.testing.assert_close(dirty[key], clean[key])
        assert (dirty[key][~mask] == 0).all()


def test_empty_mask_gives_zeros_not_nan():
    td = llm_batch()
    td["mask"] = torch.zeros_like(td["mask"])
    out = MaskedGAE(1.0, 0.95, average_gae=True)(td)
    assert (out["advantage"] == 0).all() and (out["value_target"] == 0).all()


# --------------------------------------------------------------------------- keys, dispatch, networks


ALL_KEYS = ["advantage", "value_target", "value", "reward", "done", "terminated", "truncated", "mask"]


@pytest.mark.parametrize("field", ALL_KEYS + ["steps_to_next_obs", "sample_log_prob"])
def test_set_keys_round_trips_every_field(field):
    gae = MaskedGAE(0.9, 0.9)
    gae.set_keys(**{field: ("custom", field)})
    assert getattr(gae.tensor_keys, field) == ("custom", field)
    gae.set_keys(**{field: "plain"})
    assert getattr(gae.tensor_keys, field) == "plain"


def test_renamed_keys_are_read_and_written():
    td = collector_batch(seed=1, trailing=False)
    renamed = TensorDict(
        {
            "v": td["state_value"],
            ("next", "v"): td["next", "state_value"],
            ("next", "r"): td["next", "reward"],
            ("next", "d"): td["next", "done"],
            ("next", "term"): td["next", "terminated"],
            ("next", "trunc"): td["next", "truncated"],
            "valid": torch.ones(td.batch_size, dtype=torch.bool),
        },
        td.batch_size,
    )
    gae = MaskedGAE(0.9, 0.8)
    gae.set_keys(
        value="v", reward="r", done="d", terminated="term", truncated="trunc", mask="valid",
        advantage=("out", "adv"), value_target=("out", "ret"),
    )  # fmt: skip
    out = gae(renamed)
    ref = MaskedGAE(0.9, 0.8)(td)
    torch.testing.assert_close(out["out", "adv"], ref["advantage"])
    torch.testing.assert_close(out["out", "ret"], ref["value_target"])


def test_set_keys_rejects_unknown_field():
    with pytest.raises(KeyError, match="not an accepted tensordict key"):
        MaskedGAE(0.9, 0.9).set_keys(values="x")


def test_kwargs_dispatch_returns_advantage_and_value_target():
    td = llm_batch()
    adv, ret = MaskedGAE(1.0, 0.95)(next_reward=td["next", "reward"], state_value=td["state_value"], mask=td["mask"])
    ref = MaskedGAE(1.0, 0.95)(td.clone())
    torch.testing.assert_close(adv, ref["advantage"])
    torch.testing.assert_close(ret, ref["value_target"])


class TokenCritic(nn.Module):
    """A tiny pure-torch critic: embedding + linear over tokens -> [B, R] values."""

    def __init__(self, vocab=11, dim=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, tokens):
        return self.head(self.emb(tokens)).squeeze(-1)


def test_value_network_fills_missing_values_and_is_not_trained():
    torch.manual_seed(0)
    critic = TensorDictModule(TokenCritic(), in_keys=["tokens"], out_keys=["state_value"])
    td = llm_batch(B=3, R=5).exclude("state_value")
    td["tokens"] = torch.randint(11, (3, 5))
    out = MaskedGAE(1.0, 0.95, value_network=critic)(td.clone())
    with torch.no_grad():
        v = critic(td.clone())["state_value"]
    torch.testing.assert_close(out["state_value"], v)
    ref = F.masked_gae(td["next", "reward"], v, td["mask"], 1.0, 0.95, average_gae=False)
    torch.testing.assert_close(out["advantage"], ref[0])
    assert not out["advantage"].requires_grad  # differentiable=False


def test_value_network_computes_bootstrap_values_in_collector_layout():
    torch.manual_seed(0)
    critic = TensorDictModule(TokenCritic(), in_keys=["tokens"], out_keys=["state_value"])
    tokens = torch.randint(11, (2, 7))
    td = collector_batch(N=2, T=6, trailing=False).exclude("state_value", ("next", "state_value"))
    td["tokens"], td["next", "tokens"] = tokens[:, :-1], tokens[:, 1:]
    ours = MaskedGAE(0.9, 0.9, value_network=critic)(td.clone())
    ref = GAE(gamma=0.9, lmbda=0.9, value_network=critic)(td.clone())
    torch.testing.assert_close(ours["advantage"], ref["advantage"])


def test_set_keys_value_must_be_written_by_the_value_network():
    critic = TensorDictModule(TokenCritic(), in_keys=["tokens"], out_keys=["state_value"])
    with pytest.raises(KeyError, match="not found in value network out_keys"):
        MaskedGAE(0.9, 0.9, value_network=critic).set_keys(value="other")


def test_value_estimate_returns_targets_without_writing():
    td = llm_batch()
    before = set(td.keys(True))
    target = MaskedGAE(1.0, 0.9).value_estimate(td)
    assert set(td.keys(True)) == before
    torch.testing.assert_close(target, MaskedGAE(1.0, 0.9)(td.clone())["value_target"])


def test_value_estimate_uses_an_explicit_next_value():
    td = collector_batch(seed=7)
    next_value = td["next", "state_value"]
    target = MaskedGAE(0.9, 0.9).value_estimate(td.exclude(("next", "state_value")), next_value=next_value)
    torch.testing.assert_close(target, MaskedGAE(0.9, 0.9)(td)["value_target"])


def test_only_output_keys_are_added():
    td = llm_batch()
    before = {k: v.clone() for k, v in td.items(True, True)}
    out = MaskedGAE(1.0, 0.9)(td)
    assert set(out.keys(True, True)) == set(before) | {"advantage", "value_target"}
    for k, v in before.items():
        assert torch.equal(out[k], v)


def test_hyperparameters_are_buffers_in_state_dict():
    gae = MaskedGAE(0.9, 0.8)
    sd = gae.state_dict()
    assert set(sd) == {"gamma", "lmbda"}
    other = MaskedGAE(0.1, 0.1)
    other.load_state_dict(sd)
    assert float(other.gamma) == pytest.approx(0.9) and float(other.lmbda) == pytest.approx(0.8)


# --------------------------------------------------------------------------- errors


def test_error_per_sequence_value_against_per_token_reward():
    td = TensorDict({"state_value": torch.zeros(2, 4), ("next", "reward"): torch.zeros(2, 4)}, [2, 4])
    bad = TensorDict({"state_value": torch.zeros(2, 4), ("next", "reward"): torch.zeros(2, 4, 3)}, [2, 4])
    MaskedGAE(1.0, 1.0)(td)
    with pytest.raises(ValueError, match=r"reward .* has shape \(2, 4, 3\) .* expected \(2, 4\) or .* \(2, 4, 1\)"):
        MaskedGAE(1.0, 1.0)(bad)


def test_error_mask_of_wrong_shape():
    td = llm_batch(B=2, R=3)
    td = TensorDict({**td.to_dict(), "mask": torch.ones(2, 3, 2, dtype=torch.bool)}, [2, 3])
    with pytest.raises(ValueError, match=r"mask 'mask' has shape \(2, 3, 2\)"):
        MaskedGAE(1.0, 1.0)(td)


def test_error_mask_with_values_other_than_0_and_1():
    td = llm_batch(B=2, R=3)
    td["mask"] = torch.full((2, 3), 0.5)
    with pytest.raises(ValueError, match=r"\bmask\b"):
        MaskedGAE(1.0, 1.0)(td)


def test_error_missing_reward():
    with pytest.raises(KeyError, match=r"MaskedGAE: the TensorDict has no \('next', 'reward'\) \(the per-step reward\); the environment"):
        MaskedGAE(1.0, 1.0)(TensorDict({"state_value": torch.zeros(1, 2)}, [1, 2]))


def test_error_missing_values_without_value_network():
    with pytest.raises(KeyError, match=r"no 'state_value' \(the critic's values\); no value_network was given"):
        MaskedGAE(1.0, 1.0)(TensorDict({("next", "reward"): torch.zeros(1, 2)}, [1, 2]))


def test_error_collector_layout_without_next_values():
    td = collector_batch().exclude(("next", "state_value"))
    with pytest.raises(KeyError, match=r"no \('next', 'state_value'\) \(the next values\); done flags are present"):
        MaskedGAE(1.0, 1.0)(td)


def test_error_multi_step_returns():
    td = llm_batch()
    td["steps_to_next_obs"] = torch.ones(td.batch_size)
    with pytest.raises(NotImplementedError, match="multi-step returns are not supported"):
        MaskedGAE(1.0, 1.0)(td)


def test_error_tensordict_without_time_dimension():
    td = TensorDict({"state_value": torch.zeros(3), ("next", "reward"): torch.zeros(3)}, [])
    with pytest.raises(ValueError, match=r"MaskedGAE needs a TensorDict with a time dimension, got batch_size=\(\); use "
                                         r"batch_size \[\*B, T\]"):
        MaskedGAE(1.0, 1.0)(td)


@pytest.mark.parametrize("name,kwargs", [("gamma", dict(gamma=1.5, lmbda=0.9)), ("lmbda", dict(gamma=0.9, lmbda=-0.1))])
def test_error_discount_outside_unit_interval(name, kwargs):
    with pytest.raises(ValueError, match=rf"{name}=.* is outside \[0, 1\]"):
        MaskedGAE(**kwargs)


# --------------------------------------------------------------------------- compile


# importing inductor on torch 2.13 trips torch's own torch.jit.script_method deprecation warning
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.slow  # inductor compilation on 2 cores
def test_collector_layout_gae_compiles_fullgraph():
    # masked_gae with done flags (validation, segment ends, torch fast path) in one graph
    td = collector_batch(N=2, T=6, trailing=False)
    args = (td["next", "reward"], td["state_value"], torch.rand(2, 6) < 0.8, td["next", "done"],
            td["next", "terminated"], td["next", "state_value"])  # fmt: skip

    def gae(r, v, m, d, t, nv):
        return F.masked_gae(r, v, m, 0.9, 0.8, average_gae=True, done=d, terminated=t, next_values=nv)

    torch._dynamo.reset()
    compiled = torch.compile(gae, fullgraph=True, dynamic=False)
    for a, b in zip(compiled(*args), F.masked_gae_reference(*args[:3], 0.9, 0.8, done=args[3], terminated=args[4],
                                                             next_values=args[5])):  # fmt: skip
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_usable_as_the_value_estimator_of_torchrls_clip_ppo_loss():
    from tensordict.nn import NormalParamExtractor
    from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import ClipPPOLoss

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True,
    )  # fmt: skip
    critic = ValueOperator(nn.Linear(3, 1), in_keys=["observation"])
    obs = torch.randn(2, 6, 3)
    done = torch.zeros(2, 5, 1, dtype=torch.bool)
    done[0, 2] = True
    td = TensorDict(
        {
            "observation": obs[:, :-1], ("next", "observation"): obs[:, 1:], "action": torch.rand(2, 5, 1) * 0.5,
            ("next", "reward"): torch.randn(2, 5, 1), ("next", "done"): done, ("next", "terminated"): done,
        },
        [2, 5],
    )  # fmt: skip
    with torch.no_grad():
        actor(td)
    loss = ClipPPOLoss(actor, critic)
    loss.make_value_estimator(MaskedGAE(0.9, 0.8, value_network=critic))
    ours = loss.value_estimator(td.clone(), params=loss.critic_network_params.detach())["advantage"]
    ref = GAE(gamma=0.9, lmbda=0.8, value_network=critic)(td.clone())["advantage"]
    torch.testing.assert_close(ours, ref)
    out = loss(td.clone())
    assert torch.isfinite(out["loss_objective"]) and torch.isfinite(out["loss_critic"])


# --------------------------------------------------------------------------- TorchRL's `valid` contract


def _right_padded(td, seed=0):
    """``td`` with a TorchRL ``valid`` entry (right padding, random lengths >= 1) and garbage after it."""
    N, T = td.batch_size
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    valid = (torch.arange(T) < lengths[:, None]).unsqueeze(-1)
    out = td.clone()
    for key in ("state_value", ("next", "state_value"), ("next", "reward")):
        out.set(key, torch.where(valid, out.get(key), float("nan")))
    out.set("valid", valid)
    return out, lengths


@pytest.mark.parametrize("trailing", [True, False])
def test_valid_key_gives_torchrls_gae_on_each_rows_valid_prefix(trailing):
    # the documented contract of TorchRL's `valid` key: the recursion stops at the valid-to-padding
    # boundary, padded steps are 0, the last valid step bootstraps from its own next value unless
    # terminated; TorchRL's GAE on each row's prefix alone computes exactly that
    td, lengths = _right_padded(collector_batch(N=4, T=12, seed=7, trailing=True), seed=1)
    if not trailing:
        td = td.apply(lambda x: x.squeeze(-1))
    out = MaskedGAE(0.97, 0.9)(td.clone())["advantage"].reshape(4, 12)
    for i, n in enumerate(lengths.tolist()):
        row = collector_batch(N=4, T=12, seed=7, trailing=True)[i : i + 1, :n]
        want = GAE(gamma=0.97, lmbda=0.9, value_network=None)(row)["advantage"].reshape(n)
        torch.testing.assert_close(out[i, :n], want)
        assert (out[i, n:] == 0).all()


def test_valid_key_whitens_over_the_valid_steps_only():
    td, lengths = _right_padded(collector_batch(N=3, T=9, seed=8), seed=2)
    raw = MaskedGAE(0.99, 0.95)(td.clone())["advantage"]
    white = MaskedGAE(0.99, 0.95, average_gae=True)(td.clone())["advantage"]
    valid = td["valid"]
    torch.testing.assert_close(white, F.masked_whiten(raw, valid))
    assert (white[~valid] == 0).all()


def test_mask_precedes_valid_which_precedes_the_collector_mask_and_set_keys_renames_them():
    td, _ = _right_padded(collector_batch(N=3, T=8, seed=9), seed=3)
    by_valid = MaskedGAE(1.0, 0.95)(td.clone())["advantage"]
    as_collector = td.clone().exclude("valid")
    as_collector.set(("collector", "mask"), td["valid"])
    torch.testing.assert_close(MaskedGAE(1.0, 0.95)(as_collector)["advantage"], by_valid)
    renamed = td.clone().rename_key_("valid", "my_valid")
    gae = MaskedGAE(1.0, 0.95)
    gae.set_keys(valid="my_valid")
    torch.testing.assert_close(gae(renamed)["advantage"], by_valid)
    full = collector_batch(N=3, T=8, seed=9)
    with_mask = full.clone()
    with_mask.set("mask", torch.ones_like(td["valid"]))  # an explicit mask wins over `valid`
    with_mask.set("valid", torch.zeros_like(td["valid"]))
    want = MaskedGAE(1.0, 0.95)(full.clone())["advantage"]
    torch.testing.assert_close(MaskedGAE(1.0, 0.95)(with_mask)["advantage"], want)
    assert "valid" in MaskedGAE(1.0, 0.95).in_keys and ("collector", "mask") in MaskedGAE(1.0, 0.95).in_keys

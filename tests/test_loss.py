"""TokenPPOLoss: the TorchRL LossModule layer over the PPO functions of the functional core.

The actor and critic here are tiny pure-torch modules (an embedding and a linear
layer over tokens), so these tests do not depend on ppo_objectives.llm.models.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.objectives import LossModule
from torchrl.objectives.utils import ValueEstimators
from torchrl.objectives.value import GAE

from ppo_objectives import functional as F
from ppo_objectives.loss import MINIMIND_PPO_DEFAULTS, TokenPPOLoss
from ppo_objectives import testing as T
from ppo_objectives.testing import make_mask
from ppo_objectives.value.gae import MaskedGAE

V = 11


class TokenPolicy(nn.Module):
    """Logits from an embedding of the token itself: log_prob [B, R] and entropy [B, R]."""

    def __init__(self, vocab=V, dim=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        logits = self.head(self.emb(tokens))  # [B, R, V]
        logp_all = torch.log_softmax(logits.float(), -1)
        logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy


class TokenCritic(nn.Module):
    def __init__(self, vocab=V, dim=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, tokens):
        return self.head(self.emb(tokens)).squeeze(-1)


def make_nets(seed=0, entropy=True):
    torch.manual_seed(seed)
    out_keys = ["log_prob", "entropy"] if entropy else ["log_prob"]
    policy = TokenPolicy()
    if not entropy:
        inner = policy
        policy = _FirstOutput(inner)
    actor = TensorDictModule(policy, in_keys=["tokens"], out_keys=out_keys)
    critic = TensorDictModule(TokenCritic(), in_keys=["tokens"], out_keys=["state_value"])
    return actor, critic


class _FirstOutput(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, tokens):
        return self.inner(tokens)[0]


def make_batch(actor, critic, B=4, R=6, seed=0, drift=0.3):
    """A [B, R] rollout batch whose stored log-probs/values differ from the networks' by noise."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(V, (B, R), generator=g)
    mask = make_mask(B, R, "right", generator=g)
    with torch.no_grad():
        logp, _ = actor.module(tokens) if isinstance(actor.module, TokenPolicy) else (actor.module(tokens), None)
        values = critic.module(tokens)
    td = TensorDict(
        {
            "tokens": tokens,
            "mask": mask,
            "sample_log_prob": logp + drift * torch.randn(B, R, generator=g),
            "ref_log_prob": logp + drift * torch.randn(B, R, generator=g),
            "advantage": torch.randn(B, R, generator=g),
            "value_target": torch.randn(B, R, generator=g),
            "state_value": values + drift * torch.randn(B, R, generator=g),
            ("next", "reward"): torch.randn(B, R, generator=g),
        },
        [B, R],
    )
    return td


def functional_reference(loss, td, actor, critic, **kw):
    """The same numbers straight from the functional core."""
    m = td["mask"]
    new_logp, entropy = actor.module(td["tokens"])
    values = critic.module(td["tokens"])
    adv = td["advantage"]
    if loss.normalize_advantage:
        adv = F.masked_whiten(adv, m)
    mode = loss.aggregation
    pol, stats = F.ppo_policy_loss(
        new_logp, td["sample_log_prob"], adv, m, (float(loss.clip_epsilon_low),
        float(loss.clip_epsilon_high)), dual_clip=loss.dual_clip, aggregation=mode,
        return_stats=True,
    )  # fmt: skip
    kl = F.reference_kl_penalty(new_logp, td["ref_log_prob"], m, estimator=loss.kl_estimator, aggregation=mode)
    vl, vstats = F.clipped_value_loss(
        values, td["state_value"], td["value_target"], m, float(loss.clip_value), aggregation=mode, return_stats=True
    )
    return {
        "loss_objective": pol,
        "loss_kl_ref": float(loss.kl_to_ref_coeff) * kl,
        "loss_critic": float(loss.critic_coeff) * vl,
        "loss_entropy": -float(loss.entropy_coeff) * F.aggregate_loss(entropy, m, mode),
        "kl_ref": kl,
        "entropy": F.masked_mean(entropy, m),
        "clip_fraction": stats["clip_fraction"],
        "clip_fraction_low": stats["clip_fraction_low"],
        "clip_fraction_high": stats["clip_fraction_high"],
        "kl_approx": stats["kl_approx"],
        "mean_ratio": stats["mean_ratio"],
        "max_ratio": stats["max_ratio"],
        "ESS": stats["ESS"],
        "value_clip_fraction": vstats["value_clip_fraction"],
        "explained_variance": F.explained_variance(values, td["value_target"], m),
    }


# --------------------------------------------------------------------------- equal to the functional core


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"clip_epsilon": (0.1, 0.3), "aggregation": "seq-mean-token-mean"},
        {"dual_clip": 3.0, "kl_estimator": "k2", "entropy_coeff": 0.01},
        {"normalize_advantage": True, "aggregation": "seq-mean-token-sum-norm", "kl_estimator": "k1"},
    ],
)
def test_module_outputs_equal_functional_outputs(options):
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    loss = TokenPPOLoss(actor, critic, **options)
    out = loss(td)
    ref = functional_reference(loss, td, actor, critic)
    for key, expected in ref.items():
        torch.testing.assert_close(out[key], expected.detach(), msg=key)
    assert torch.isfinite(out["loss_objective"])


def test_minimind_total_equals_minimind_formulas():
    # MiniMind's trainer/train_ppo.py, written out on the same tensors (kl_reward_coeff 0.02, vf_coef 0.5, clip 0.2).
    actor, critic = make_nets(seed=1)
    td = make_batch(actor, critic, seed=1)
    out = TokenPPOLoss.minimind(actor, critic)(td)
    m = td["mask"].float()
    new_logp, _ = actor.module(td["tokens"])
    values = critic.module(td["tokens"])
    adv, old, ref, ret, old_v = (td[k] for k in ("advantage", "sample_log_prob", "ref_log_prob", "value_target", "state_value"))
    ratio = torch.exp(new_logp - old)
    d = ref - new_logp
    kl_ref = ((torch.exp(d) - d - 1.0) * m).sum() / m.sum()
    policy_loss = (torch.max(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)) * m).sum() / m.sum() + 0.02 * kl_ref
    value_loss = 0.5 * (
        torch.max((values - ret) ** 2, (torch.clamp(values, old_v - 0.2, old_v + 0.2) - ret) ** 2) * m
    ).sum() / m.sum()
    total = policy_loss + 0.5 * value_loss
    ours = sum(out[k] for k in out.keys() if k.startswith("loss_"))
    torch.testing.assert_close(ours, total)
    torch.testing.assert_close(out["kl_approx"], ((0.5 * (new_logp - old) ** 2) * m).sum().detach() / m.sum())


def test_trailing_singleton_layout_gives_the_same_numbers():
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    flat = TokenPPOLoss(actor, critic)(td)
    torchrl_layout = td.clone()
    for key in ("mask", "sample_log_prob", "ref_log_prob", "advantage", "value_target", "state_value"):
        torchrl_layout[key] = td[key].unsqueeze(-1)
    out = TokenPPOLoss(actor, critic)(torchrl_layout)
    for key in flat.keys():
        torch.testing.assert_close(out[key], flat[key], msg=key)


def test_missing_advantage_runs_masked_gae_by_default():
    actor, critic = make_nets()
    td = make_batch(actor, critic).exclude("advantage", "value_target")
    loss = TokenPPOLoss(actor, critic)
    out = loss(td)
    assert isinstance(loss.value_estimator, MaskedGAE)
    assert float(loss.value_estimator.gamma) == 1.0 and float(loss.value_estimator.lmbda) == pytest.approx(0.95)
    adv, ret = F.masked_gae(td["next", "reward"], td["state_value"], td["mask"], 1.0, 0.95, average_gae=False)
    expected = TokenPPOLoss(actor, critic)(td.clone().update({"advantage": adv, "value_target": ret}))
    for key in expected.keys():
        torch.testing.assert_close(out[key], expected[key], msg=key)


def test_make_value_estimator_accepts_instance_class_and_torchrl_gae():
    actor, critic = make_nets()
    loss = TokenPPOLoss(actor, critic)
    gae = MaskedGAE(0.9, 0.5, average_gae=True)
    assert loss.make_value_estimator(gae) is loss and loss.value_estimator is gae
    loss.make_value_estimator(MaskedGAE, gamma=0.8)
    assert float(loss.value_estimator.gamma) == pytest.approx(0.8)
    assert loss.value_estimator.value_network is critic
    loss.make_value_estimator(ValueEstimators.GAE, gamma=0.9, lmbda=0.9)
    assert isinstance(loss.value_estimator, GAE)


def test_key_renames_are_forwarded_to_the_value_estimator():
    actor, critic = make_nets()
    loss = TokenPPOLoss(actor, critic)
    loss.make_value_estimator(MaskedGAE(1.0, 0.95))
    loss.set_keys(mask="valid", reward="score", advantage="adv")
    keys = loss.value_estimator.tensor_keys
    assert (keys.mask, keys.reward, keys.advantage) == ("valid", "score", "adv")


def test_half_precision_rollout_entries_are_computed_in_float32():
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    half = td.apply(lambda x: x.to(torch.bfloat16) if x.is_floating_point() else x)
    out = TokenPPOLoss(actor, critic)(half)
    ref = TokenPPOLoss(actor, critic)(half.apply(lambda x: x.float() if x.is_floating_point() else x))
    for key in ref.keys():
        assert out[key].dtype == torch.float32, key
        torch.testing.assert_close(out[key], ref[key], msg=key)


# --------------------------------------------------------------------------- masked diagnostics


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_garbage_at_masked_positions_changes_no_output(seed):
    actor, critic = make_nets()
    td = make_batch(actor, critic, seed=seed)
    clean = TokenPPOLoss(actor, critic, entropy_coeff=0.01)(td)
    dirty = td.clone()
    m = td["mask"]
    for key in ("sample_log_prob", "ref_log_prob", "advantage", "value_target", "state_value"):
        dirty[key] = torch.where(m, td[key], torch.tensor(float("nan")))
    out = TokenPPOLoss(actor, critic, entropy_coeff=0.01)(dirty)
    for key in clean.keys():
        torch.testing.assert_close(out[key], clean[key], msg=key)


def test_diagnostics_are_detached_and_losses_carry_gradients():
    actor, critic = make_nets()
    out = TokenPPOLoss(actor, critic, entropy_coeff=0.01)(make_batch(actor, critic))
    for key, value in out.items():
        assert value.shape == torch.Size([]), key
        assert value.requires_grad == key.startswith("loss_"), key


def test_empty_mask_gives_finite_zero_losses():
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    td["mask"] = torch.zeros_like(td["mask"])
    with pytest.warns(UserWarning, match=r"TokenPPOLoss: the mask of this batch has no valid token \(every entry is False\), "
                                         r"so every loss term and diagnostic is exactly 0 and the update does nothing; this "
                                         r"is a likely mistake"):
        out = TokenPPOLoss(actor, critic)(td)
    for key, value in out.items():
        assert torch.isfinite(value), key
    assert out["loss_objective"] == 0 and out["loss_critic"] == 0
    with F.value_checks(False):  # the check reads the mask: skipped with the other value checks
        TokenPPOLoss(actor, critic)(td)


def test_without_entropy_output_the_entropy_loss_is_zero():
    actor, critic = make_nets(entropy=False)
    out = TokenPPOLoss(actor, critic)(make_batch(actor, critic))
    assert out["loss_entropy"] == 0 and "entropy" not in out.keys()


def test_without_clip_value_the_critic_loss_is_the_plain_squared_error():
    actor, critic = make_nets()
    td = make_batch(actor, critic).exclude("state_value")
    out = TokenPPOLoss(actor, critic, clip_value=None, critic_coeff=1.0)(td)
    v = critic.module(td["tokens"])
    m = td["mask"]
    torch.testing.assert_close(out["loss_critic"], F.masked_mean(0.5 * (v - td["value_target"]) ** 2, m))
    assert "value_clip_fraction" not in out.keys()


def test_no_critic_means_no_critic_terms():
    actor, _ = make_nets()
    td = make_batch(*make_nets())
    out = TokenPPOLoss(actor, None)(td)
    assert "loss_critic" not in out.keys() and "explained_variance" not in out.keys()


def test_zero_kl_coeff_does_not_need_reference_log_probs():
    actor, critic = make_nets()
    out = TokenPPOLoss(actor, critic, kl_to_ref_coeff=0.0)(make_batch(actor, critic).exclude("ref_log_prob"))
    assert out["loss_kl_ref"] == 0 and "kl_ref" not in out.keys()


# --------------------------------------------------------------------------- gradients, state


def _grads(module):
    return [p.grad for p in module.parameters()]


@pytest.mark.parametrize("term", ["loss_objective", "loss_kl_ref", "loss_entropy", "loss_critic"])
def test_gradients_are_isolated_between_actor_and_critic(term):
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    loss = TokenPPOLoss(actor, critic, entropy_coeff=0.01)
    out = loss(td)
    out[term].backward()
    actor_grads = [g is not None and g.abs().sum() > 0 for g in _grads(actor)]
    critic_grads = [g is not None and g.abs().sum() > 0 for g in _grads(critic)]
    if term == "loss_critic":
        assert not any(actor_grads) and all(critic_grads)
    else:
        assert any(actor_grads) and not any(critic_grads)


def test_backward_of_the_sum_reaches_the_functional_parameters():
    actor, critic = make_nets()
    loss = TokenPPOLoss(actor, critic)
    out = loss(make_batch(actor, critic))
    sum(v for k, v in out.items() if k.startswith("loss_")).backward()
    for name, p in loss.named_parameters():
        assert p.grad is not None, name
    # the functional parameters are the networks' own
    assert {id(p) for p in loss.parameters()} == {id(p) for p in [*actor.parameters(), *critic.parameters()]}


@pytest.mark.parametrize("functional", [True, False])
def test_reset_parameters_recursive_changes_network_parameters(functional):
    actor, critic = make_nets()
    loss = TokenPPOLoss(actor, critic, functional=functional)
    before = [p.detach().clone() for p in loss.parameters()]
    loss.reset_parameters_recursive()
    after = list(loss.parameters())
    assert all(not torch.equal(b, a) for b, a in zip(before, after))


def test_state_dict_round_trip_restores_outputs():
    actor, critic = make_nets(seed=0)
    loss = TokenPPOLoss(actor, critic, kl_to_ref_coeff=0.1, clip_epsilon=(0.1, 0.25))
    td = make_batch(actor, critic)
    expected = loss(td)
    actor2, critic2 = make_nets(seed=1)
    other = TokenPPOLoss(actor2, critic2)
    other.load_state_dict(loss.state_dict())
    assert float(other.kl_to_ref_coeff) == pytest.approx(0.1) and float(other.clip_epsilon_high) == pytest.approx(0.25)
    out = other(td)
    for key in expected.keys():
        torch.testing.assert_close(out[key], expected[key], msg=key)


def test_coefficients_are_schedulable_buffers():
    actor, critic = make_nets()
    loss = TokenPPOLoss(actor, critic)
    buf = loss.kl_to_ref_coeff
    loss.kl_to_ref_coeff = 0.5
    assert loss.kl_to_ref_coeff is buf and float(buf) == 0.5
    assert {"clip_epsilon_low", "clip_epsilon_high", "critic_coeff", "kl_to_ref_coeff", "entropy_coeff", "clip_value"} <= set(
        dict(loss.named_buffers())
    )


def test_input_tensordict_is_not_modified():
    actor, critic = make_nets()
    td = make_batch(actor, critic).exclude("advantage", "value_target")
    snapshot = td.clone()
    TokenPPOLoss(actor, critic)(td)
    assert set(td.keys(True, True)) == set(snapshot.keys(True, True))
    assert (td == snapshot).all()


def test_functional_false_gives_the_same_numbers():
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    a = TokenPPOLoss(actor, critic)(td)
    b = TokenPPOLoss(actor, critic, functional=False)(td)
    for key in a.keys():
        torch.testing.assert_close(a[key], b[key])


# --------------------------------------------------------------------------- keys, dispatch, presets

FIELDS = [
    "tokens", "mask", "sample_log_prob", "ref_log_prob", "advantage", "value_target", "value",
    "log_prob", "entropy", "reward", "done", "terminated", "truncated",
]  # fmt: skip


@pytest.mark.parametrize("field", FIELDS)
def test_set_keys_round_trips_every_field(field):
    actor, critic = make_nets()
    loss = TokenPPOLoss(actor, critic)
    default = getattr(loss.tensor_keys, field)
    loss.set_keys(**{field: ("custom", field)})
    assert getattr(loss.tensor_keys, field) == ("custom", field)
    loss.set_keys(**{field: None})
    assert getattr(loss.tensor_keys, field) == default


def test_renamed_input_keys_are_read():
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    renamed = td.clone().rename_key_("sample_log_prob", ("old", "lp")).rename_key_("mask", "valid")
    loss = TokenPPOLoss(actor, critic)
    loss.set_keys(sample_log_prob=("old", "lp"), mask="valid")
    out = loss(renamed)
    ref = TokenPPOLoss(actor, critic)(td)
    torch.testing.assert_close(out["loss_objective"], ref["loss_objective"])
    assert ("old", "lp") in loss.in_keys and "valid" in loss.in_keys


def test_set_keys_rejects_unknown_field():
    actor, critic = make_nets()
    with pytest.raises(ValueError, match="is not an accepted tensordict key"):
        TokenPPOLoss(actor, critic).set_keys(old_log_prob="x")


def test_kwargs_dispatch_path():
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    loss = TokenPPOLoss(actor, critic)
    objective, critic_loss, kl_loss, entropy_loss = loss(**{k: td[k] for k in loss.in_keys if k in td.keys()})
    ref = loss(td)
    torch.testing.assert_close(objective, ref["loss_objective"])
    torch.testing.assert_close(critic_loss, ref["loss_critic"])
    torch.testing.assert_close(kl_loss, ref["loss_kl_ref"])
    assert loss.out_keys == ["loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy"]


def test_minimind_preset_sets_every_default():
    actor, critic = make_nets()
    loss = TokenPPOLoss.minimind(actor, critic)
    assert isinstance(loss, LossModule)
    assert float(loss.clip_epsilon_low) == pytest.approx(0.2) and float(loss.clip_epsilon_high) == pytest.approx(0.2)
    assert float(loss.critic_coeff) == 0.5 and float(loss.kl_to_ref_coeff) == pytest.approx(0.02)
    assert float(loss.clip_value) == pytest.approx(0.2) and float(loss.entropy_coeff) == 0.0
    assert loss.kl_estimator == "k3" and loss.aggregation == "token-mean" and not loss.normalize_advantage
    assert not hasattr(loss, "early_stop_kl")  # the training loop's trust region, not the loss's
    gae = loss.value_estimator
    assert float(gae.gamma) == 1.0 and float(gae.lmbda) == pytest.approx(0.95) and gae.average_gae
    assert "early_stop_kl" not in MINIMIND_PPO_DEFAULTS


def test_minimind_preset_accepts_overrides_and_rejects_unknown_ones():
    actor, critic = make_nets()
    loss = TokenPPOLoss.minimind(actor, critic, kl_to_ref_coeff=0.0, gamma=0.99)
    assert float(loss.kl_to_ref_coeff) == 0.0 and float(loss.value_estimator.gamma) == pytest.approx(0.99)
    with pytest.raises(TypeError, match=r"unknown overrides \['clip'\]"):
        TokenPPOLoss.minimind(actor, critic, clip=0.3)


# --------------------------------------------------------------------------- errors


def test_error_per_sequence_advantage_is_not_broadcast():
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    bad = TensorDict({**td.exclude("advantage").to_dict(), "advantage": torch.ones(4, 6, 2)}, [4, 6])
    with pytest.raises(ValueError, match=r"advantage 'advantage' has shape \(4, 6, 2\) .* expected \(4, 6\)"):
        TokenPPOLoss(actor, critic)(bad)


def test_error_per_sequence_advantage_in_a_batch_of_sequences():
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    seq = TensorDict({k: td[k] for k in ("tokens", "mask", "sample_log_prob", "ref_log_prob", "value_target", "state_value")}, [4])
    seq["advantage"] = torch.ones(4)
    with pytest.raises(ValueError, match=r"advantage 'advantage' has shape \(4,\) .* Broadcasting it would mix"):
        TokenPPOLoss(actor, critic)(seq)


def test_error_missing_sample_log_prob():
    actor, critic = make_nets()
    with pytest.raises(KeyError, match=r"TokenPPOLoss: the TensorDict has no 'sample_log_prob' \(the sampling log-probs\); "
                                       r"store the policy's per-token log-probs at rollout time \(or rename the key with "
                                       r"set_keys\(sample_log_prob=\.\.\.\)\)"):
        TokenPPOLoss(actor, critic)(make_batch(actor, critic).exclude("sample_log_prob"))


def test_error_missing_reference_log_probs_when_kl_is_on():
    actor, critic = make_nets()
    with pytest.raises(KeyError, match=r"TokenPPOLoss: the TensorDict has no 'ref_log_prob' \(reference log-probs\); needed "
                                       r"because kl_to_ref_coeff > 0 \(the in-loss KL to a reference policy\): run "
                                       r"KLPenaltyTransform\(ref\) on the batch first, which writes it \(ref = "
                                       r"frozen_reference\(actor_model, P\), or any module writing the reference's per-token "
                                       r"log-probs\), or build the loss with kl_to_ref_coeff=0\.0 to train without the in-loss KL"):
        TokenPPOLoss(actor, critic)(make_batch(actor, critic).exclude("ref_log_prob"))


def test_error_missing_value_target():
    actor, critic = make_nets()
    with pytest.raises(KeyError, match=r"TokenPPOLoss: the TensorDict has no 'value_target' \(value target\); run the value "
                                       r"estimator \(MaskedGAE\) first"):
        TokenPPOLoss(actor, critic)(make_batch(actor, critic).exclude("value_target"))


def test_error_missing_rollout_values_with_value_clipping():
    actor, critic = make_nets()
    with pytest.raises(KeyError, match=r"TokenPPOLoss: the TensorDict has no 'state_value' \(rollout values\); needed "
                                       r"because clip_value is set"):
        TokenPPOLoss(actor, critic)(make_batch(actor, critic).exclude("state_value"))


def test_error_actor_without_log_prob_output():
    _, critic = make_nets()
    actor = TensorDictModule(TokenCritic(), in_keys=["tokens"], out_keys=["logits"])
    with pytest.raises(KeyError, match=r"TokenPPOLoss: the TensorDict has no 'log_prob' \(the actor's log-probs\); the actor network did not write it"):
        TokenPPOLoss(actor, critic)(make_batch(*make_nets()))


def test_error_critic_without_value_output():
    actor, _ = make_nets()
    critic = TensorDictModule(TokenCritic(), in_keys=["tokens"], out_keys=["value"])
    with pytest.raises(KeyError, match=r"TokenPPOLoss: the TensorDict has no 'state_value' \(the critic's values\); the critic network did not write"):
        TokenPPOLoss(actor, critic)(make_batch(*make_nets()))


def test_error_entropy_bonus_without_entropy_output():
    actor, critic = make_nets(entropy=False)
    with pytest.raises(KeyError, match=r"TokenPPOLoss: the TensorDict has no 'entropy' \(the actor's entropy\); entropy_coeff is set but the "
                                       r"actor network did not write it; return the per-token entropy \[B, R\] from the actor \(e\.g\. "
                                       r"response_log_probs\(\.\.\., return_entropy=True\)\)"):
        TokenPPOLoss(actor, critic, entropy_coeff=0.01)(make_batch(actor, critic))


def test_error_mask_with_values_other_than_0_and_1():
    actor, critic = make_nets()
    td = make_batch(actor, critic)
    td["mask"] = td["mask"].float() * 2
    with pytest.raises(ValueError, match=r"\bmask\b"):
        TokenPPOLoss(actor, critic)(td)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"clip_epsilon": 0.0}, r"clip_epsilon=0\.0"),
        ({"clip_epsilon": (0.1, 0.2, 0.3)},
         r"clip_epsilon=\(0\.1, 0\.2, 0\.3\): give one float \(symmetric\) or a pair \(eps_low, eps_high\)"),
        ({"dual_clip": 1.0}, r"dual_clip=1\.0 .*\(the dual-clip constant c must exceed 1\)"),
        ({"aggregation": "mean"}, "aggregation='mean'"),
        ({"kl_estimator": "k4"}, r"kl_estimator='k4' is not one of \('k1', 'k2', 'k3', 'k3\+'\)"),
        ({"kl_to_ref_coeff": -0.1}, r"kl_to_ref_coeff=-0\.1 must be a float >= 0 and finite \(0 switches that term off\)"),
        ({"clip_value": -1.0}, "clip_value=-1.0 must be a finite number > 0"),
        ({"kl_clamp": 0.0}, "kl_clamp=0.0 must be a finite number > 0"),
    ],
)
def test_error_bad_hyperparameters(kwargs, match):
    actor, critic = make_nets()
    with pytest.raises((ValueError, TypeError), match=match):
        TokenPPOLoss(actor, critic, **kwargs)


def test_error_no_actor():
    with pytest.raises(TypeError, match="TokenPPOLoss needs an actor_network that writes per-token 'log_prob'"):
        TokenPPOLoss(None)


def test_error_unsupported_value_estimator():
    actor, critic = make_nets()
    with pytest.raises(NotImplementedError, match="not supported by TokenPPOLoss; pass a MaskedGAE"):
        TokenPPOLoss(actor, critic).make_value_estimator(ValueEstimators.TD0)


# --------------------------------------------------------------------------- devices


def test_runs_on_every_device(device):
    actor, critic = make_nets()
    td = make_batch(actor, critic).to(device)
    loss = TokenPPOLoss(actor, critic).to(device)
    out = loss(td)
    assert out["loss_objective"].device.type == device.type
    sum(v for k, v in out.items() if k.startswith("loss_")).backward()


# --------------------------------------------------------------------------- in_keys: what one call reads


def _factory_batch():
    """A response-layout batch made by the package's own pieces: env + collector postproc, critic, KL, GAE."""
    from ppo_objectives.llm.env import TokenLMEnv
    from ppo_objectives.llm.layouts import ToLLMBatch
    from ppo_objectives.llm.models import TinyLMConfig
    from ppo_objectives.llm.readouts import make_actor_critic
    from ppo_objectives.train.digit import DigitTask
    from ppo_objectives.transforms import KLPenaltyTransform

    torch.manual_seed(0)
    env = TokenLMEnv.from_task(DigitTask("reverse", 2), num_envs=4, seed=0)
    P, M = env.prompt_len, env.max_new_tokens
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=P + M), P)
    with torch.no_grad():
        llm = ToLLMBatch(P, M)(env.rollout(2 * M, ac.policy, break_when_any_done=False))
        ac.critic(llm)
        KLPenaltyTransform(ac.actor, coeff=0.05)(llm)
        MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(llm)
    return ac, llm


def test_in_keys_list_only_what_the_loss_and_its_networks_read():
    ac, llm = _factory_batch()
    loss = TokenPPOLoss(ac.actor, ac.critic)
    assert "tokens" not in loss.in_keys  # the factory's actor reads input_ids, not tokens
    assert set(loss.in_keys) == {"mask", "sample_log_prob", "ref_log_prob", "advantage", "value_target",
                                 "state_value", "input_ids", "attention_mask"}
    selected = llm.select(*loss.in_keys)  # strict: raises KeyError on a key the batch lacks
    out, ref = loss(selected), loss(llm)
    for key in ref.keys():
        torch.testing.assert_close(out[key], ref[key], msg=key)
    # the settings decide what is read: no reference KL, no critic -> neither ref_log_prob nor the targets
    bare = TokenPPOLoss(ac.actor, None, kl_to_ref_coeff=0.0)
    assert set(bare.in_keys) == {"mask", "sample_log_prob", "advantage", "input_ids", "attention_mask"}
    assert set(TokenPPOLoss(ac.actor, ac.critic, clip_value=None).in_keys) == set(loss.in_keys) - {"state_value"}
    torch.testing.assert_close(bare(llm.select(*bare.in_keys))["loss_objective"], bare(llm)["loss_objective"])


def test_the_networks_inputs_are_checked_before_the_value_estimator_runs():
    ac, llm = _factory_batch()
    loss = TokenPPOLoss(ac.actor, ac.critic)
    no_ids = llm.exclude("input_ids", "advantage", "value_target")  # MaskedGAE would call the critic first
    with pytest.raises(KeyError, match=r"TokenPPOLoss: the TensorDict has no 'input_ids' \(an input of the actor_network, "
                                       r"whose in_keys are \['input_ids', 'attention_mask'\]\); give the batch every entry "
                                       r"the actor_network reads"):
        loss(no_ids)


def test_minimind_refuses_an_unknown_override():
    actor, critic = T.tiny_actor_critic()
    with pytest.raises(TypeError, match=r"TokenPPOLoss.minimind\(\) got unknown overrides \['clip_epsilon_high'\]"):
        TokenPPOLoss.minimind(actor, critic, clip_epsilon_high=0.3)


def test_the_clip_range_is_one_argument_and_two_schedulable_buffers():
    actor, critic = T.tiny_actor_critic()
    loss = TokenPPOLoss(actor, critic, clip_epsilon=(0.2, 0.28))
    assert (float(loss.clip_epsilon_low), float(loss.clip_epsilon_high)) == pytest.approx((0.2, 0.28))
    assert {"clip_epsilon_low", "clip_epsilon_high"} <= loss._schedulable_buffers
    td = T.response_batch(batch_size=3, response_len=5, mask="holes", with_advantage=True, seed=3)
    new = td["sample_log_prob"] - 0.1
    pair = F.ppo_policy_loss(new, td["sample_log_prob"], td["advantage"], td["mask"], (0.2, 0.28))
    T.assert_matches_reference(pair, T.reference_ppo_policy_loss(new, td["sample_log_prob"], td["advantage"],
                                                                 td["mask"], (0.2, 0.28)))  # fmt: skip

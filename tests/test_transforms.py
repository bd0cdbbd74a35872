"""KLPenaltyTransform and the KL controllers, in the three places TorchRL runs transforms."""

import warnings

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import Bounded, Categorical, Composite, LazyTensorStorage, ReplayBuffer, Unbounded
from torchrl.envs import EnvBase, TransformedEnv
from torchrl.envs.utils import check_env_specs

from ppo_objectives import functional as F
from ppo_objectives.testing import make_mask
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform

V = 5


# --------------------------------------------------------------------------- tiny env / models


class TokenEnv(EnvBase):
    """One step = one token; reward 1 for token 1; episodes of ``horizon`` tokens."""

    def __init__(self, n=2, horizon=3):
        super().__init__(batch_size=[n])
        self.horizon = horizon
        self.observation_spec = Composite(
            token=Categorical(V, shape=(n,)), step=Unbounded(shape=(n,), dtype=torch.int64), shape=(n,)
        )
        self.action_spec = Categorical(V, shape=(n,))
        self.reward_spec = Bounded(0.0, 1.0, shape=(n, 1))

    def _reset(self, td):
        n = self.batch_size[0]
        zeros = torch.zeros(n, dtype=torch.long)
        return TensorDict(token=zeros, step=zeros.clone(), batch_size=self.batch_size)

    def _step(self, td):
        step = td["step"] + 1
        done = (step >= self.horizon).unsqueeze(-1)
        reward = (td["action"] == 1).float().unsqueeze(-1)
        return TensorDict(
            token=td["action"], step=step, reward=reward, done=done, terminated=done, batch_size=self.batch_size
        )

    def _set_seed(self, seed):
        return seed


class NextTokenPolicy(nn.Module):
    """Emits token + 1 with log-prob -0.5."""

    def forward(self, token):
        return (token + 1) % V, torch.full(token.shape, -0.5)


class ParityReference(nn.Module):
    """Reference log-prob of a token: -1 for even tokens, -0.5 for odd ones (so k1 = 0.5 or 0)."""

    def forward(self, action):
        return torch.where(action % 2 == 0, -1.0, -0.5)


def policy():
    return TensorDictModule(NextTokenPolicy(), in_keys=["token"], out_keys=["action", "sample_log_prob"])


def ref_model():
    return TensorDictModule(ParityReference(), in_keys=["action"], out_keys=["log_prob"])


def llm_batch(B=3, R=5, seed=0, trailing=False):
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(B, R, "right", generator=g)
    u = (lambda x: x.unsqueeze(-1)) if trailing else (lambda x: x)
    return TensorDict(
        {
            "sample_log_prob": u(-torch.rand(B, R, generator=g)),
            "ref_log_prob": u(-torch.rand(B, R, generator=g)),
            "mask": u(mask),
            ("next", "reward"): u(torch.randn(B, R, generator=g)),
        },
        [B, R],
    )


# --------------------------------------------------------------------------- offline: golden cases


def test_dense_reward_golden_case():
    # k1 = logp - ref = [-1 - (-1.5), -1 - (-1)] = [0.5, 0]; reward - 0.1 * k1; padding -> 0
    td = TensorDict(
        {
            "sample_log_prob": torch.tensor([[-1.0, -1.0, float("nan")]]),
            "ref_log_prob": torch.tensor([[-1.5, -1.0, float("nan")]]),
            "mask": torch.tensor([[1.0, 1.0, 0.0]]),
            ("next", "reward"): torch.tensor([[0.0, 2.0, 5.0]]),
        },
        [1, 3],
    )
    out = KLPenaltyTransform(coeff=0.1)(td)
    torch.testing.assert_close(out["kl_penalty"], torch.tensor([[0.5, 0.0, 0.0]]))
    torch.testing.assert_close(out["next", "reward"], torch.tensor([[-0.05, 2.0, 0.0]]))


def test_sequence_score_lands_on_the_last_valid_token_only():
    # row 0: 3 valid tokens, score 1 -> [0, 0, 1] minus 0.1 * kl; row 1: 1 valid token
    td = TensorDict(
        {
            "sample_log_prob": torch.full((2, 3), -1.0),
            "ref_log_prob": torch.tensor([[-1.5, -1.0, -1.0], [-2.0, -1.0, -1.0]]),
            "mask": torch.tensor([[True, True, True], [True, False, False]]),
            ("next", "reward"): torch.tensor([1.0, 3.0]),
        },
        [2],
    )
    out = KLPenaltyTransform(coeff=0.1)(td)
    expected = torch.tensor([[-0.05, 0.0, 1.0], [3.0 - 0.1, 0.0, 0.0]])
    torch.testing.assert_close(out["next", "reward"], expected)
    assert out["next", "reward"].sum(-1)[0] == pytest.approx(1.0 - 0.05)  # the score counted once, not R times


def test_sequence_score_with_trailing_singleton_keeps_the_torchrl_layout():
    td = TensorDict(
        {
            "sample_log_prob": torch.full((2, 3), -1.0),
            "ref_log_prob": torch.full((2, 3), -1.0),
            ("next", "reward"): torch.tensor([[1.0], [2.0]]),
        },
        [2],
    )
    out = KLPenaltyTransform()(td)["next", "reward"]
    assert out.shape == (2, 3, 1)
    torch.testing.assert_close(out.squeeze(-1), torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]]))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3+"])
@pytest.mark.parametrize("trailing", [False, True])
def test_kl_equals_functional_estimate(estimator, trailing):
    td = llm_batch(trailing=trailing)
    out = KLPenaltyTransform(coeff=0.2, estimator=estimator, clamp=10.0)(td.clone())
    sq = (lambda x: x.squeeze(-1)) if trailing else (lambda x: x)
    m = sq(td["mask"])
    kl = torch.where(m, F.kl_estimate(sq(td["sample_log_prob"]), sq(td["ref_log_prob"]), estimator, clamp=10.0), 0.0)
    torch.testing.assert_close(out["kl_penalty"], kl)
    reward = torch.where(m, sq(td["next", "reward"]) - 0.2 * kl, 0.0)
    torch.testing.assert_close(sq(out["next", "reward"]), reward)
    assert out["next", "reward"].shape == td["next", "reward"].shape


def test_garbage_at_masked_positions_changes_nothing():
    td = llm_batch(B=4, R=6, seed=3)
    m = td["mask"]
    dirty = td.clone()
    for key in ("sample_log_prob", "ref_log_prob", ("next", "reward")):
        dirty[key] = torch.where(m, td[key], torch.tensor(float("nan")))
    a, b = KLPenaltyTransform()(td.clone()), KLPenaltyTransform()(dirty)
    for key in ("kl_penalty", ("next", "reward")):
        torch.testing.assert_close(a[key], b[key])
        assert (b[key][~m] == 0).all()


def test_kwargs_dispatch_path():
    td = llm_batch()
    kl, ref, reward = KLPenaltyTransform(coeff=0.2)(
        sample_log_prob=td["sample_log_prob"], ref_log_prob=td["ref_log_prob"], mask=td["mask"],
        next_reward=td["next", "reward"],
    )  # fmt: skip
    expected = KLPenaltyTransform(coeff=0.2)(td.clone())
    torch.testing.assert_close(kl, expected["kl_penalty"])
    torch.testing.assert_close(reward, expected["next", "reward"])
    torch.testing.assert_close(ref, td["ref_log_prob"])


def test_runs_on_every_device(device):
    td = llm_batch().to(device)
    t = KLPenaltyTransform(coeff=AdaptiveKLController(0.1)).to(device)
    out = t(td)
    assert out["kl_penalty"].device.type == device.type and out["next", "reward"].device.type == device.type
    t.kl_controller.update(t.last_seq_kl, n_steps=3)


def test_add_to_reward_false_leaves_the_reward_alone():
    td = llm_batch()
    reward = td["next", "reward"].clone()
    out = KLPenaltyTransform(add_to_reward=False)(td.exclude(("next", "reward")))
    assert "kl_penalty" in out.keys() and ("next", "reward") not in out.keys(True)
    out = KLPenaltyTransform(add_to_reward=False)(td)
    torch.testing.assert_close(out["next", "reward"], reward)


def test_reference_model_runs_when_ref_log_prob_is_missing_and_is_preferred_otherwise():
    td = TensorDict(
        {"action": torch.tensor([[1, 2]]), "sample_log_prob": torch.full((1, 2), -0.5), ("next", "reward"): torch.zeros(1, 2)},
        [1, 2],
    )
    out = KLPenaltyTransform(ref_model(), coeff=1.0)(td.clone())
    torch.testing.assert_close(out["ref_log_prob"], torch.tensor([[-0.5, -1.0]]))
    torch.testing.assert_close(out["kl_penalty"], torch.tensor([[0.0, 0.5]]))
    pre = td.clone().set("ref_log_prob", torch.full((1, 2), -0.5))
    torch.testing.assert_close(KLPenaltyTransform(ref_model())(pre)["kl_penalty"], torch.zeros(1, 2))


def test_transform_is_idempotent():
    td = llm_batch()
    t = KLPenaltyTransform(coeff=0.3)
    once = t(td.clone())
    twice = t(once.clone())
    torch.testing.assert_close(twice["next", "reward"], once["next", "reward"])


def test_last_kl_statistics_are_masked_means():
    td = llm_batch(B=4, R=5, seed=2)
    t = KLPenaltyTransform()
    out = t(td.clone())
    m = td["mask"]
    torch.testing.assert_close(t.last_kl, F.masked_mean(out["kl_penalty"], m))
    torch.testing.assert_close(t.last_seq_kl, out["kl_penalty"].sum(-1).mean())


# --------------------------------------------------------------------------- ragged batches


def _ragged(lengths=(2, 4, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    subs = []
    for n in lengths:
        subs.append(
            TensorDict(
                {
                    "sample_log_prob": -torch.rand(n, generator=g),
                    "ref_log_prob": -torch.rand(n, generator=g),
                    ("next", "reward"): torch.randn(n, 1, generator=g),
                },
                [],
            )
        )
    return subs


def test_lazy_stacked_ragged_batch_is_penalised_per_response():
    subs = _ragged()
    expected = [KLPenaltyTransform(coeff=0.1)(s.clone().unsqueeze(0)) for s in subs]  # dense, one row each
    stacked = LazyStackedTensorDict.lazy_stack([s.clone() for s in subs])
    t = KLPenaltyTransform(coeff=0.1)
    out = t(stacked)
    rewards = out.get(("next", "reward"), as_list=True)
    kls = out.get("kl_penalty", as_list=True)
    for i, e in enumerate(expected):
        torch.testing.assert_close(rewards[i], e["next", "reward"][0])
        torch.testing.assert_close(kls[i], e["kl_penalty"][0])
    flat = torch.cat([e["kl_penalty"][0] for e in expected])
    torch.testing.assert_close(t.last_kl, flat.mean())


def test_lazy_stacked_rows_with_a_trailing_one_are_one_response_each():
    # each row holds one response's per-token entries [n, 1] (TorchRL's trailing 1): its KL sums over its n tokens
    subs = []
    for sub in _ragged(seed=2):
        subs.append(sub.apply(lambda x: x.unsqueeze(-1) if x.ndim == 1 else x))
    t = KLPenaltyTransform(coeff=0.1)
    t(LazyStackedTensorDict.lazy_stack([s.clone() for s in subs]))
    per_response = [float((s["sample_log_prob"] - s["ref_log_prob"]).sum()) for s in subs]  # k1 summed per row
    assert float(t.last_seq_kl) == pytest.approx(sum(per_response) / len(subs), rel=1e-6)


def test_nested_tensor_batch_is_penalised_per_response():
    subs = _ragged(seed=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
        nest = lambda key: torch.nested.as_nested_tensor([s[key] for s in subs], layout=torch.strided)  # noqa: E731
        td = TensorDict(
            {
                "sample_log_prob": nest("sample_log_prob"),
                "ref_log_prob": nest("ref_log_prob"),
                ("next", "reward"): nest(("next", "reward")),
            },
            [3],
        )
    t = KLPenaltyTransform(coeff=0.1)
    out = t(td)
    sums = []
    for i, s in enumerate(subs):
        e = KLPenaltyTransform(coeff=0.1)(s.clone().unsqueeze(0))
        torch.testing.assert_close(out["next", "reward"].unbind(0)[i], e["next", "reward"][0])
        sums.append(e["kl_penalty"].sum())
    torch.testing.assert_close(t.last_seq_kl, torch.stack(sums).mean())


# --------------------------------------------------------------------------- replay buffer, collector, env


def test_replay_buffer_penalises_on_extend_once():
    td = llm_batch(B=6, R=4)
    expected = KLPenaltyTransform(coeff=0.1)(td.clone())
    rb = ReplayBuffer(storage=LazyTensorStorage(6), batch_size=6, transform=KLPenaltyTransform(coeff=0.1))
    rb.extend(td.clone())
    stored = rb[:]  # the storage holds the penalised data
    torch.testing.assert_close(stored["next", "reward"], expected["next", "reward"])
    sample, info = rb.sample(return_info=True)  # forward on sample sees kl_penalty: no second penalty
    idx = info["index"]
    torch.testing.assert_close(sample["next", "reward"], expected["next", "reward"][idx])
    assert "kl_penalty" not in td.keys()  # extend did not modify the caller's data


def test_replay_buffer_forward_on_sample_penalises_raw_storage():
    td = llm_batch(B=6, R=4)
    expected = KLPenaltyTransform(coeff=0.1)(td.clone())
    rb = ReplayBuffer(storage=LazyTensorStorage(6), batch_size=6)
    rb.extend(td.clone())
    rb.append_transform(KLPenaltyTransform(coeff=0.1))  # added after the data went in: applied on sample
    sample, info = rb.sample(return_info=True)
    torch.testing.assert_close(sample["next", "reward"], expected["next", "reward"][info["index"]])


def test_collector_postproc_penalises_every_step():
    collector = Collector(
        TokenEnv(), policy(), frames_per_batch=8, total_frames=8, postproc=KLPenaltyTransform(ref_model(), coeff=0.1),
        auto_register_policy_transforms=False,
    )  # fmt: skip
    batch = next(iter(collector))
    collector.shutdown()
    # tokens 1, 2, 3 | 1: kl = [0, 0.5, 0, 0]; env reward = [1, 0, 0, 1]
    torch.testing.assert_close(batch["kl_penalty"], torch.tensor([[0.0, 0.5, 0.0, 0.0]] * 2))
    torch.testing.assert_close(batch["next", "reward"].squeeze(-1), torch.tensor([[1.0, -0.05, 0.0, 1.0]] * 2))


def test_transformed_env_penalises_each_step_and_updates_specs():
    t = KLPenaltyTransform(ref_model(), coeff=0.1)
    env = TransformedEnv(TokenEnv(), t)
    assert isinstance(env.reward_spec, Unbounded)  # the penalty leaves the env's [0, 1] bounds
    assert {"kl_penalty", "ref_log_prob"} <= set(env.observation_spec.keys())
    t.set_missing_tolerance(True)  # check_env_specs steps with random actions and no log-probs
    check_env_specs(env)
    t.set_missing_tolerance(False)
    rollout = env.rollout(3, policy())
    torch.testing.assert_close(rollout["next", "kl_penalty"], torch.tensor([[0.0, 0.5, 0.0]] * 2))
    torch.testing.assert_close(rollout["next", "reward"].squeeze(-1), torch.tensor([[1.0, -0.05, 0.0]] * 2))
    torch.testing.assert_close(rollout["next", "ref_log_prob"], torch.tensor([[-0.5, -1.0, -0.5]] * 2))


def test_transformed_env_inv_does_nothing():
    env = TransformedEnv(TokenEnv(), KLPenaltyTransform(ref_model()))
    td = env.reset()
    td["action"] = torch.ones(2, dtype=torch.long)
    assert set(env.transform.inv(td.clone()).keys(True)) == set(td.keys(True))


def test_controller_state_is_saved_with_the_transform():
    t = KLPenaltyTransform(coeff=AdaptiveKLController(0.2, target=1.0, horizon=10))
    t.kl_controller.update(torch.tensor(5.0), n_steps=5)
    other = KLPenaltyTransform(coeff=AdaptiveKLController(0.7, target=3.0, horizon=99))
    other.load_state_dict(t.state_dict())
    assert float(other.coeff) == pytest.approx(0.2 * 1.1)
    assert float(other.kl_controller.target) == 1.0


def test_adaptive_coefficient_is_used_at_the_next_call():
    ctl = AdaptiveKLController(0.5, target=0.1, horizon=1)
    t = KLPenaltyTransform(coeff=ctl)
    td = llm_batch()
    out = t(td.clone())
    ctl.update(t.last_kl, n_steps=1)  # the transform's own mean KL drives the controller
    out2 = t(td.clone())
    m = td["mask"]
    diff = (td["next", "reward"] - out2["next", "reward"])[m] / out2["kl_penalty"][m].clamp(min=1e-6)
    assert float(ctl.coeff) != 0.5
    torch.testing.assert_close(diff[out2["kl_penalty"][m] > 1e-3], torch.full_like(diff, float(ctl.coeff))[out2["kl_penalty"][m] > 1e-3])
    assert out is not out2


# --------------------------------------------------------------------------- controllers


def test_fixed_controller_never_changes():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        assert float(ctl.update(kl, n_steps=64)) == pytest.approx(0.05)


def test_adaptive_controller_follows_ziegler_et_al():
    ctl = AdaptiveKLController(init_coeff=0.1, target=2.0, horizon=100)
    # KL 3 -> e = 3/2 - 1 = 0.5 clipped to 0.2 -> beta = 0.1 * (1 + 0.2 * 20/100) = 0.104
    assert float(ctl.update(3.0, n_steps=20)) == pytest.approx(0.104)
    # KL 1.8 -> e = -0.1 -> beta = 0.104 * (1 - 0.1 * 0.2) = 0.10192
    assert float(ctl.update(torch.tensor(1.8), n_steps=20)) == pytest.approx(0.10192)


def test_adaptive_controller_takes_the_losses_kl_ref_tensor_without_sync(device):
    ctl = AdaptiveKLController(0.2, target=0.05).to(device)
    kl_ref = torch.tensor(0.1, device=device, requires_grad=True) * 1.0
    out = ctl.update(kl_ref, n_steps=8)
    assert out.device.type == device.type and not out.requires_grad


# --------------------------------------------------------------------------- errors


def test_error_bad_estimator():
    with pytest.raises(ValueError, match="estimator='kl' is not one of"):
        KLPenaltyTransform(estimator="kl")


def test_error_coeff_that_is_not_a_controller():
    with pytest.raises(TypeError, match="is not a KL controller"):
        KLPenaltyTransform(coeff=nn.Linear(1, 1))


def test_error_negative_coefficients():
    with pytest.raises(ValueError, match="coeff=-1.0 must be a float >= 0"):
        FixedKLController(-1.0)
    with pytest.raises(ValueError, match=r"init_coeff=-0\.1 must be a float >= 0 and finite"):
        AdaptiveKLController(-0.1)
    with pytest.raises(ValueError, match="target=0.0 must be a finite number > 0"):
        AdaptiveKLController(0.1, target=0.0)


def test_error_missing_log_probs():
    with pytest.raises(KeyError, match=r"KLPenaltyTransform: the TensorDict has no 'sample_log_prob' \(the sampling "
                                       r"log-probs\); store the policy's per-token log-probs at rollout time, or name the "
                                       r"entry with set_keys\(log_prob=\.\.\.\)"):
        KLPenaltyTransform()(llm_batch().exclude("sample_log_prob"))


def test_error_missing_reference_without_model():
    with pytest.raises(KeyError, match=r"KLPenaltyTransform: the TensorDict has no 'ref_log_prob' \(the reference log-probs\); no "
                                       r"ref_model was given: precompute the reference log-probs or pass ref_model="):
        KLPenaltyTransform()(llm_batch().exclude("ref_log_prob"))


def test_error_reference_model_without_its_output():
    bad = TensorDictModule(ParityReference(), in_keys=["action"], out_keys=["logits"])
    td = llm_batch().exclude("ref_log_prob").set("action", torch.ones(3, 5, dtype=torch.long))
    with pytest.raises(KeyError, match="no 'log_prob' \\(the ref_model output\\)"):
        KLPenaltyTransform(bad)(td)


def test_error_missing_reward_with_add_to_reward():
    with pytest.raises(KeyError, match="no \\('next', 'reward'\\) \\(the reward, needed because add_to_reward=True\\)"):
        KLPenaltyTransform()(llm_batch().exclude(("next", "reward")))


def test_error_reward_of_unrelated_shape():
    td = llm_batch()
    bad = TensorDict({**td.exclude(("next", "reward")).to_dict(), ("next", "reward"): torch.zeros(3, 5, 2)}, [3, 5])
    with pytest.raises(ValueError, match=r"reward .* has shape \(3, 5, 2\) .* broadcasting it would mix"):
        KLPenaltyTransform()(bad)


def test_error_reference_of_other_shape():
    td = TensorDict({"sample_log_prob": torch.zeros(2, 3), "ref_log_prob": torch.zeros(2, 4), ("next", "reward"): torch.zeros(2, 3)}, [2])
    with pytest.raises(ValueError, match=r"reference log-probs 'ref_log_prob' has shape \(2, 4\) but log-probs 'sample_log_prob' has shape \(2, 3\)"):
        KLPenaltyTransform()(td)


def test_error_log_probs_without_token_axis():
    td = TensorDict({"sample_log_prob": torch.zeros(()), "ref_log_prob": torch.zeros(())}, [])
    with pytest.raises(ValueError, match="needs a token axis"):
        KLPenaltyTransform(add_to_reward=False)(td)


def test_error_env_step_without_policy_log_prob():
    env = TransformedEnv(TokenEnv(), KLPenaltyTransform(ref_model()))
    with pytest.raises(KeyError, match=r"KLPenaltyTransform: the TensorDict has no 'sample_log_prob' \(the log-prob of the "
                                       r"sampled token\); the policy must write it before env\.step; e\.g\. ProbabilisticActor\(\.\.\., "
                                       r"return_log_prob=True\), or call set_missing_tolerance\(True\) to let steps without "
                                       r"it through unpenalised"):
        env.rand_step(env.reset())


def test_error_env_without_reference_model():
    env = TransformedEnv(TokenEnv(), KLPenaltyTransform())
    with pytest.raises(KeyError, match=r"KLPenaltyTransform: inside an env the reference log-prob of each new token must "
                                       r"be computed at that step \(the root entry holds the previous step's\); pass "
                                       r"ref_model="):
        env.rollout(2, policy())


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: KLPenaltyTransform(clamp=0.0), "clamp=0.0 must be a finite number > 0"),
        (lambda: AdaptiveKLController(0.1, horizon=0), r"horizon=0.0 must be a finite number > 0.0 \(samples over which"),
        (lambda: AdaptiveKLController(0.1, clip=-0.2), "clip=-0.2 must be a finite number > 0"),
    ],
)
def test_error_bad_transform_and_controller_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_error_ragged_batch_without_log_probs():
    subs = [s.exclude("sample_log_prob") for s in _ragged()]
    with pytest.raises(KeyError, match="no 'sample_log_prob' \\(the sampling log-probs\\).*set_keys\\(log_prob="):
        KLPenaltyTransform()(LazyStackedTensorDict.lazy_stack(subs))


def test_error_mask_with_values_other_than_0_and_1():
    td = llm_batch()
    td["mask"] = td["mask"].float() * 3
    with pytest.raises(ValueError, match=r"\bmask\b"):
        KLPenaltyTransform()(td)


def test_error_sequence_score_of_a_row_without_valid_tokens():
    td = TensorDict(
        {
            "sample_log_prob": torch.zeros(2, 3), "ref_log_prob": torch.zeros(2, 3),
            "mask": torch.tensor([[True, False, False], [False, False, False]]), ("next", "reward"): torch.ones(2),
        },
        [2],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"rows \[1\] have no valid token .* sequence score would be dropped"):
        KLPenaltyTransform()(td)
    # a dense reward on an empty row is fine: there is nothing to drop
    dense = td.clone().set(("next", "reward"), torch.ones(2, 3))
    assert (KLPenaltyTransform()(dense)["next", "reward"][1] == 0).all()


def test_error_reference_on_another_device():
    td = llm_batch()
    td = TensorDict({**td.exclude("ref_log_prob").to_dict()}, [3, 5]).set(
        "ref_log_prob", torch.empty(3, 5, device="meta")
    )
    with pytest.raises(ValueError, match=r"\bref_log_prob on meta"):
        KLPenaltyTransform()(td)


def test_error_nan_coefficients():
    with pytest.raises(ValueError, match=r"coeff=nan must be a float >= 0 and finite \(the weight of the KL penalty\)"):
        FixedKLController(float("nan"))
    with pytest.raises(ValueError, match="init_coeff=inf must be a float >= 0 and finite"):
        AdaptiveKLController(float("inf"))


def test_adaptive_controller_ignores_a_non_finite_kl():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=100)
    assert float(ctl.update(float("nan"), n_steps=10)) == pytest.approx(0.2)
    assert float(ctl.update(torch.tensor(float("inf")), n_steps=10)) == pytest.approx(0.2 * 1.02)  # clipped to +0.2


def test_error_adaptive_step_that_could_flip_the_coefficient_sign():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=100)
    with pytest.raises(ValueError, match=r"n_steps=1000 with horizon=100.0 .* zero or negative"):
        ctl.update(0.0, n_steps=1000)

"""Regression tests for bugs that other LLM-RL stacks shipped in the same code.

Each test names the peer's issue, states the property that must hold, and checks it
against a reference written here from first principles (plain loops over floats, or
arithmetic done by hand in the comments). ``docs/design.md`` ("Bugs we guard against")
lists them.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from ppo_objectives import KLPenaltyTransform, MaskedGAE, TokenPPOLoss, functional as F
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.testing import assert_matches_reference, reference_gae_response, response_batch
from ppo_objectives.value.critic_free import (
    GroupAdvantage,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
)

# --------------------------------------------------------------------------- #
# slime #657: rejected tokens stayed in the denominator
# --------------------------------------------------------------------------- #


def _naive_kept_token_mean(log_prob, sample_log_prob, adv, mask, weights, eps=0.2):
    """Clipped surrogate averaged over the valid tokens whose weight is not 0 (a plain loop)."""
    total, n = 0.0, 0
    for b in range(log_prob.shape[0]):
        for t in range(log_prob.shape[1]):
            if not mask[b, t] or weights[b, t] == 0:
                continue
            r = math.exp(float(log_prob[b, t] - sample_log_prob[b, t]))
            a = float(adv[b, t])
            total += float(weights[b, t]) * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
            n += 1
    return total / max(n, 1)


@pytest.mark.parametrize("mode", ["token-mis", "icepop"])
def test_rejected_tokens_leave_the_denominator_slime_657(mode):
    # 5 valid tokens; the rollout engine disagrees by e^3 on the last 3: both modes reject them (C = 2)
    sample = torch.full((1, 5), -1.0)
    rollout = torch.tensor([[-1.0, -1.0, -4.0, -4.0, -4.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    weights = F.rollout_correction_weights(sample, rollout, mask, mode)
    assert weights.tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]
    log_prob = torch.tensor([[-0.9, -1.1, -1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, 2.0, 5.0, 5.0, 5.0]])
    got = F.ppo_policy_loss(log_prob, sample, adv, mask, 0.2, weights=weights)
    want = _naive_kept_token_mean(log_prob, sample, adv, mask, weights)
    # the 2 kept tokens: -(1 * e^0.1 clipped... ) -> their mean, divided by 2 and not by 5
    assert got.item() == pytest.approx(want, rel=1e-6)
    counted_all = F.aggregate_loss(torch.zeros(1, 5).index_fill_(1, torch.tensor([0, 1]), 1.0), mask)
    assert got.item() == pytest.approx(want) and counted_all.item() == pytest.approx(2 / 5)  # the old 5/2 shrink


def test_rejected_sequences_leave_the_sequence_count_slime_657():
    # two rows; seq-mis rejects row 1 as a whole (its product of ratios e^3 exceeds C = 2)
    sample = torch.full((2, 3), -1.0)
    rollout = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    weights = F.rollout_correction_weights(sample, rollout, mask, "seq-mis")
    assert weights.tolist() == [[1.0] * 3, [0.0] * 3]
    log_prob, adv = sample.clone(), torch.tensor([[1.0, 2.0, 3.0], [9.0, 9.0, 9.0]])
    for aggregation, want in (("seq-mean-token-mean", -2.0), ("seq-mean-token-sum", -6.0), ("token-mean", -2.0)):
        # only row 0 takes part: ratio 1, loss -A per token; its token mean -2, its token sum -6, one sequence
        got = F.ppo_policy_loss(log_prob, sample, adv, mask, 0.2, weights=weights, aggregation=aggregation)
        assert got.item() == pytest.approx(want), aggregation


def _loss_batch(rollout_log_prob):
    g = torch.Generator().manual_seed(0)
    B, R = 3, 4
    logits = torch.randn(B, R, 5, generator=g)
    lp = torch.log_softmax(logits, -1)[..., 0]
    return TensorDict(
        {
            "tokens": torch.zeros(B, R, dtype=torch.long),
            "mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool),
            "sample_log_prob": lp,
            "rollout_log_prob": rollout_log_prob(lp),
            "ref_log_prob": lp - 0.3,
            "advantage": torch.randn(B, R, generator=g),
            "value_target": torch.randn(B, R, generator=g),
            "state_value": torch.zeros(B, R),
        },
        [B],
    )


class _Shift(torch.nn.Module):
    """Per-token log-probs (or values) ``base + w``: a one-parameter network, with an entropy."""

    def __init__(self, base):
        super().__init__()
        self.base, self.w = base, torch.nn.Parameter(torch.tensor(-0.05))

    def forward(self, tokens):
        x = self.base + self.w
        return x, -x  # log_prob, entropy


def _networks(td):
    actor = TensorDictModule(_Shift(td["sample_log_prob"]), in_keys=["tokens"], out_keys=["log_prob", "entropy"])
    critic = TensorDictModule(lambda tokens: torch.zeros(tokens.shape), in_keys=["tokens"], out_keys=["state_value"])
    return actor, critic


def test_rejection_masks_the_policy_term_only_in_the_loss_module_slime_657():
    td = _loss_batch(lambda lp: lp.clone().index_fill_(1, torch.tensor([1]), -30.0))  # column 1 rejected (w = e^29)
    actor, critic = _networks(td)
    kw = dict(entropy_coeff=0.01, kl_to_ref_coeff=0.1, clip_value=None)
    plain = TokenPPOLoss(actor, critic, **kw)(td)
    loss = TokenPPOLoss(actor, critic, rollout_correction="token-mis", **kw)
    out = loss(td)
    kept = td["mask"].clone()
    kept[:, 1] = False
    want = F.ppo_policy_loss(actor.module(td["tokens"])[0], td["sample_log_prob"], td["advantage"], kept, 0.2)
    torch.testing.assert_close(out["loss_objective"], want)
    # the critic, the entropy bonus and the reference KL keep every valid token: unchanged by rejection
    for key in ("loss_critic", "loss_entropy", "loss_kl_ref"):
        torch.testing.assert_close(out[key], plain[key], msg=key)
    assert out["rollout_mask_fraction"].item() == pytest.approx(2 / 8)  # 2 of the 8 valid tokens are in column 1


def test_a_fixed_normalizer_is_refused_with_a_rejecting_mode():
    td = _loss_batch(lambda lp: lp.clone())
    actor, critic = _networks(td)
    loss = TokenPPOLoss(actor, critic, rollout_correction="icepop")
    with pytest.raises(ValueError, match=r"rejects tokens.*pass process_group=pg"):
        loss(td, normalizer=8.0)
    with pytest.raises(ValueError, match=r"give normalizer= or process_group=, not both"):
        TokenPPOLoss(actor, critic)(td, normalizer=8.0, process_group=object())


# --------------------------------------------------------------------------- #
# GRPO: a group of equal rewards must give exactly 0 (float rounding / tiny std)
# --------------------------------------------------------------------------- #

EQUAL_GROUPS = [(0.7, 16), (123.456, 5), (10.1, 8)]


@pytest.mark.parametrize("value,n", EQUAL_GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_equal_rewards_in_a_group_give_exactly_zero_advantage(value, n, dtype):
    # a group of equal rewards next to a group {1, 0}: the first gets exactly 0, the second its own GRPO values
    scores = torch.cat([torch.full((n,), value), torch.tensor([1.0, 0.0])]).to(dtype)
    group = torch.cat([torch.zeros(n, dtype=torch.long), torch.tensor([3, 3])])
    mask = torch.ones(n + 2, 2)
    alone = torch.tensor([1.0, 0.0]).to(dtype)
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        adv = fn(scores, group, mask)
        assert adv[:n].eq(0).all(), (fn.__name__, adv[:n].flatten()[:4])
        torch.testing.assert_close(adv[n:], fn(alone, torch.tensor([3, 3]), torch.ones(2, 2)))
    for kind in ("grpo", "dr_grpo", "rloo"):
        td = TensorDict({"score": scores, "group": group, "mask": mask.bool()}, [n + 2])
        assert GroupAdvantage(kind)(td)["advantage"][:n].eq(0).all(), kind


# --------------------------------------------------------------------------- #
# Half precision: masked statistics accumulate in float32
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_statistics_accumulate_in_float32(dtype):
    ones = torch.ones(70_000, dtype=dtype)
    m = torch.ones(70_000, dtype=torch.bool)
    assert F.masked_mean(ones, m).item() == 1.0  # float16: the sum overflows at 65,504, the count too
    assert F.masked_sum(ones, m).item() == 70_000.0
    assert F.aggregate_loss(ones.reshape(7, 10_000), m.reshape(7, 10_000)).item() == 1.0
    small = torch.full((70_000,), 1e-4, dtype=dtype)
    exact = float(small[0].double())  # the value float16 / bfloat16 holds for 1e-4
    assert F.masked_mean(small, m).item() == pytest.approx(exact, rel=1e-5)
    alternating = small * (torch.arange(70_000) % 2).to(dtype)  # 0 and s: variance s^2 / 4
    assert F.masked_var(alternating, m).item() == pytest.approx(exact**2 / 4, rel=1e-4)
    for out in (F.masked_mean(ones, m), F.masked_sum(ones, m), F.masked_var(ones, m)):
        assert out.dtype == torch.float32


def test_entropy_diagnostic_of_a_half_precision_actor_is_exact():
    B, R = 7, 10_000
    entropy = torch.full((B, R), 2.0, dtype=torch.float16)
    lp = torch.full((B, R), -2.0, dtype=torch.float16)

    class Half(torch.nn.Module):
        def forward(self, tokens):
            return lp, entropy

    actor = TensorDictModule(Half(), in_keys=["tokens"], out_keys=["log_prob", "entropy"])
    td = TensorDict({"tokens": torch.zeros(B, R, dtype=torch.long), "mask": torch.ones(B, R, dtype=torch.bool),
                     "sample_log_prob": lp.float(), "advantage": torch.ones(B, R)}, [B])
    out = TokenPPOLoss(actor, None, kl_to_ref_coeff=0.0, entropy_coeff=0.5)(td)
    assert out["entropy"].item() == 2.0
    assert out["loss_entropy"].item() == -1.0


# --------------------------------------------------------------------------- #
# Diagnostics over empty padding rows
# --------------------------------------------------------------------------- #


def test_observed_sequence_kl_skips_rows_without_valid_tokens():
    # k1 per token = log_prob - ref: row 0 sums 0.5, row 1 sums 1.0, row 2 has no valid token
    logp = torch.full((3, 2), -1.0)
    ref = torch.tensor([[-1.25, -1.25], [-1.5, -1.5], [-9.0, -9.0]])
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]], dtype=torch.bool)
    td = TensorDict({"sample_log_prob": logp, "ref_log_prob": ref, "mask": mask}, [3])
    t = KLPenaltyTransform(coeff=0.1, add_to_reward=False)
    t(td)
    assert t.last_seq_kl.item() == pytest.approx((0.5 + 1.0) / 2)
    assert t.last_kl.item() == pytest.approx(1.5 / 4)


# --------------------------------------------------------------------------- #
# A prompt token equal to the pad id
# --------------------------------------------------------------------------- #


def _env(prompts, pad_id=1):
    return TokenLMEnv(prompts, lambda p, pm, r, rm: torch.zeros(r.shape[0]), num_envs=1, prompt_len=4,
                      max_new_tokens=2, vocab_size=8, eos_id=7, pad_id=pad_id, seed=0)


@pytest.mark.parametrize("ids", [[5, 1, 6], [[5, 1, 6]], [[1, 5, 1, 6]]])
def test_a_prompt_token_equal_to_the_pad_id_is_kept(ids):
    td = _env([{"input_ids": ids}]).reset()
    row, mask = td["tokens"][0, :4], td["attention_mask"][0, :4]
    assert row[mask].tolist() == [5, 1, 6]  # the inner 1 is a token; only the leading pad of the 2-D batch goes


def test_a_mask_of_another_shape_than_the_prompt_is_refused():
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2,\) but its input_ids \(3,\)"):
        _env([{"input_ids": [5, 1, 6], "attention_mask": [1, 1]}]).reset()


# --------------------------------------------------------------------------- #
# One-token answers: a [B] batch with [B, 1] entries is B responses, not one episode
# --------------------------------------------------------------------------- #


def test_one_token_answers_give_per_row_value_targets():
    rewards = torch.tensor([1.0, 0, 1, 0, 0, 1, 0, 0])
    td = TensorDict({("next", "reward"): rewards[:, None], "state_value": torch.zeros(8, 1),
                     "mask": torch.ones(8, 1, dtype=torch.bool)}, [8])
    out = MaskedGAE(gamma=1.0, lmbda=1.0)(td)
    # each row is its own one-token episode: G = r (the misreading gave [3, 2, 2, 1, 1, 1, 0, 0])
    assert out["value_target"].flatten().tolist() == rewards.tolist()
    assert out["value_target"].shape == (8, 1)


def test_one_token_batch_of_the_response_layout_matches_the_reference():
    td = response_batch(batch_size=6, response_len=1, seed=3)
    adv, target = reference_gae_response(td["next", "reward"], td["state_value"], td["mask"], 0.9, 0.8)
    out = MaskedGAE(gamma=0.9, lmbda=0.8)(td.clone())
    assert_matches_reference(out["value_target"], target, name="value_target")
    assert_matches_reference(out["advantage"], adv, name="advantage")


def test_a_trajectory_with_flags_stays_one_episode():
    # TorchRL's per-step layout of one trajectory [T] with [T, 1] entries and ('next', 'done') flags
    T = 4
    td = TensorDict({("next", "reward"): torch.ones(T, 1), "state_value": torch.zeros(T, 1),
                     ("next", "state_value"): torch.zeros(T, 1),
                     ("next", "done"): torch.tensor([[False], [False], [False], [True]]),
                     ("next", "terminated"): torch.tensor([[False], [False], [False], [True]])}, [T])
    out = MaskedGAE(gamma=1.0, lmbda=1.0)(td)
    assert out["value_target"].flatten().tolist() == [4.0, 3.0, 2.0, 1.0]


def test_one_token_answers_through_the_collector_and_the_job_scoring():
    from torchrl.collectors import Collector

    from ppo_objectives.llm.layouts import ToLLMBatch
    from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
    from ppo_objectives.llm.policy import make_actor

    torch.manual_seed(0)
    # reward: 1 when the one answer token is even; prompts of two tokens; M = 1
    env = TokenLMEnv([[2, 3], [4, 5]], lambda p, pm, r, rm: (r[:, 0] % 2 == 0).float(), num_envs=8, prompt_len=2,
                     max_new_tokens=1, vocab_size=8, eos_id=7, pad_id=0, seed=0)
    actor = make_actor(TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=8, block_size=3)))
    collector = Collector(env, actor, frames_per_batch=8, total_frames=8, reset_at_each_iter=True,
                          auto_register_policy_transforms=False, postproc=ToLLMBatch(2, 1))
    llm = next(iter(collector))
    collector.shutdown()
    assert llm["mask"].shape == (8, 1) and llm.batch_size == (8,)
    llm.set("state_value", torch.zeros(8, 1))
    llm.set("ref_log_prob", llm["sample_log_prob"].clone())  # KL 0: the reward is the score
    KLPenaltyTransform(coeff=0.1)(llm)
    MaskedGAE(gamma=1.0, lmbda=1.0)(llm)
    torch.testing.assert_close(llm["value_target"][:, 0], llm["score"])
    torch.testing.assert_close(llm["kl_penalty"], torch.zeros(8, 1))


@pytest.mark.parametrize("shared_trunk", [True, False])
def test_one_token_answers_in_the_job_rollout(shared_trunk):
    from ppo_objectives import train as T
    from ppo_objectives.llm.models import TinyLMConfig
    from ppo_objectives.llm.readouts import frozen_reference, make_actor_critic
    from ppo_objectives.transforms import FixedKLController

    torch.manual_seed(0)
    env = TokenLMEnv([[2, 3], [4, 5]], lambda p, pm, r, rm: (r[:, 0] % 2 == 0).float(), num_envs=8, prompt_len=2,
                     max_new_tokens=1, vocab_size=8, eos_id=7, pad_id=0, seed=0)
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=8, block_size=3), 2, shared_trunk=shared_trunk)
    kl = KLPenaltyTransform(frozen_reference(ac.actor_model, 2), coeff=FixedKLController(0.0))
    gae = MaskedGAE(gamma=1.0, lmbda=1.0)
    cfg = T.TrainConfig(num_envs=8, preset="pico")
    collector = T.make_collector(cfg, None, ac.policy, env)
    try:
        llm = T.rollout_batch(iter(collector), ac, kl, gae, env.prompt_len, env.max_new_tokens)
    finally:
        collector.shutdown()
    # one token per episode, gamma = lambda = 1, no KL: G = score and A = score - V_old, row by row
    assert llm["value_target"].shape == (8, 1)
    torch.testing.assert_close(llm["value_target"][:, 0], llm["score"])
    torch.testing.assert_close(llm["advantage"], llm["score"][:, None] - llm["state_value"])

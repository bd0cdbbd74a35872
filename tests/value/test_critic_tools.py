"""The critic's tools: decoupled and length-adaptive GAE lambda, one trunk forward for a shared critic,
the rollout's V_old from the env policy, critic-only warm-up steps, and the stall flag."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from ppo_objectives import MaskedGAE
from ppo_objectives import functional as F
from ppo_objectives import testing as K
from ppo_objectives.llm.models import TinyLMConfig
from ppo_objectives.llm.readouts import make_actor_critic
from ppo_objectives.train.monitor import CollapseGuard


def _reference_per_row(td, gamma, lams, normalize):
    """The kit's loop reference, one row at a time with that row's lambda, whitened over the batch."""
    rows = [K.reference_gae_response(td["next", "reward"][i : i + 1], td["state_value"][i : i + 1],
                                     td["mask"][i : i + 1], gamma=gamma, lmbda=float(lams[i]), average_gae=False)[0]
            for i in range(td.batch_size[0])]
    adv = torch.cat(rows)
    return F.masked_whiten(adv, td["mask"]) if normalize else adv


@pytest.mark.parametrize("kind", ["right", "holes", "empty_rows", "mixed"])
@pytest.mark.parametrize("alpha", [0.05, 0.5, 2.0])
def test_length_adaptive_lambda_matches_a_per_row_loop(kind, alpha):
    td = K.response_batch(batch_size=7, response_len=9, mask=kind, seed=3)
    lams = F.length_adaptive_lmbda(td["mask"], alpha)
    n = td["mask"].sum(-1).float()
    want_lam = torch.where(n > 0, (1 - 1 / (alpha * n.clamp(min=1))).clamp(0, 1), torch.zeros(()))
    torch.testing.assert_close(lams, want_lam)
    out = MaskedGAE(gamma=1.0, lmbda=1.0, length_alpha=alpha, average_gae=True)(td.clone())
    K.assert_matches_reference(out["advantage"], _reference_per_row(td, 1.0, lams, True), name="advantage")
    # the value target keeps lmbda (1.0: Monte-Carlo returns)
    want_target = K.reference_gae_response(td["next", "reward"], td["state_value"], td["mask"], gamma=1.0,
                                           lmbda=1.0, average_gae=False)[1]
    K.assert_matches_reference(out["value_target"], want_target, name="value_target")


def test_decoupled_lambda_advantage_and_target_use_their_own_lambda():
    td = K.response_batch(batch_size=5, response_len=8, mask="holes", seed=1)
    out = MaskedGAE(gamma=0.99, lmbda=1.0, policy_lmbda=0.8)(td.clone())
    r, v, m = td["next", "reward"], td["state_value"], td["mask"]
    K.assert_matches_reference(out["advantage"], K.reference_gae_response(r, v, m, gamma=0.99, lmbda=0.8,
                                                                          average_gae=False)[0], name="advantage")
    K.assert_matches_reference(out["value_target"], K.reference_gae_response(r, v, m, gamma=0.99, lmbda=1.0,
                                                                             average_gae=False)[1], name="target")
    K.assert_mask_invariant(MaskedGAE(gamma=1.0, lmbda=1.0, length_alpha=0.5), td)


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_masked_gae_takes_one_lambda_per_row(backend):
    td = K.response_batch(batch_size=6, response_len=70, mask="mixed", seed=2)  # more than one block of 64
    lams = torch.tensor([0.0, 0.5, 0.5, 0.9, 1.0, 0.5])
    adv, ret = F.masked_gae(td["next", "reward"], td["state_value"], td["mask"], 1.0, lams, backend=backend)
    K.assert_matches_reference(adv, _reference_per_row(td, 1.0, lams, True), name="advantage")


def test_per_row_lambda_and_decoupled_lambda_errors():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"lmbda has shape \(3,\).*\[\*B\] = \(2,\)"):
        F.masked_gae(r, r, None, 1.0, torch.ones(3))
    with pytest.raises(ValueError, match=r"lmbda holds 1.5, outside \[0, 1\]"):
        F.masked_gae(r, r, None, 1.0, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="policy_lmbda=0.9 and length_alpha=1.0 both set"):
        MaskedGAE(1.0, 1.0, policy_lmbda=0.9, length_alpha=1.0)
    with pytest.raises(ValueError, match="length_alpha"):
        MaskedGAE(1.0, 1.0, length_alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        F.length_adaptive_lmbda(torch.ones(2, 3), 0.0)
    td = K.collector_batch(num_envs=2, steps=5, seed=0)
    with pytest.raises(ValueError, match="take the response form .* done flags"):
        MaskedGAE(1.0, 1.0, policy_lmbda=0.5)(td)


# --------------------------------------------------------------------------- #
# A critic on the actor's trunk: one forward, V_old from the env policy
# --------------------------------------------------------------------------- #


def _batch(V=16, B=3, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDict(input_ids=torch.randint(V, (B, T), generator=g), attention_mask=torch.ones(B, T, dtype=torch.bool),
                      batch_size=[B])


def _grads(ac, td, use_shared: bool):
    for p in ac.actor_model.parameters():
        p.grad = None
    ac.critic_head.zero_grad(set_to_none=True)
    ac.critic_head.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    if not use_shared:  # the same read-outs, each running its own forward
        ac.actor.module.shared_forward = ac.critic.module.shared_forward = None
    lp = ac.actor(td.copy())["log_prob"]  # shallow copies: the same input tensors, as in TokenPPOLoss
    v = ac.critic(td.copy())["state_value"]
    (lp.sum() + (v ** 2).sum()).backward()
    return [p.grad.clone() for p in ac.actor_model.parameters()] + [ac.critic_head.weight.grad.clone()]


def test_shared_trunk_runs_one_forward_with_the_gradients_of_two():
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=8), 3, shared_trunk=True)
    td = _batch()
    calls = []
    ac.actor_model.register_forward_hook(lambda m, i, o: calls.append(1))
    shared = _grads(ac, td, True)
    assert len(calls) == 1  # the critic took the actor's forward
    calls.clear()
    separate = _grads(ac, td, False)  # the same read-outs without the shared forward: two forwards
    assert len(calls) == 2
    for a, b in zip(shared, separate):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # one summed backward vs two: float order


def test_shared_forward_is_not_reused_after_a_backward_nor_across_grad_modes():
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=8), 3, shared_trunk=True)
    td = _batch()
    calls = []
    ac.actor_model.register_forward_hook(lambda m, i, o: calls.append(1))
    ac.critic(td)["state_value"].sum().backward()  # the kept output's graph is freed
    ac.critic(td)["state_value"].sum().backward()  # runs the trunk again (no "backward twice" error)
    with torch.no_grad():
        ac.actor(td)
    ac.critic(td)  # grad mode differs from the kept no-grad output: a new forward
    assert len(calls) == 4


def test_env_policy_writes_the_rollout_values_the_critic_computes():
    from torchrl.collectors import Collector

    from ppo_objectives.llm.env import TokenLMEnv
    from ppo_objectives.llm.layouts import trajectories_to_llm_batch
    from ppo_objectives.train.digit import DigitTask

    torch.manual_seed(0)
    task = DigitTask("reverse", 2)
    env = TokenLMEnv.from_task(task, num_envs=4, seed=0)
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=6), env.prompt_len, shared_trunk=True)
    ac.critic_head.weight.data.normal_()
    col = Collector(env, ac.policy, frames_per_batch=12, total_frames=12, reset_at_each_iter=True,
                    auto_register_policy_transforms=False)
    llm = trajectories_to_llm_batch(next(iter(col)), env.prompt_len, env.max_new_tokens)
    col.shutdown()
    assert "state_value" in llm.keys()
    with torch.no_grad():
        want = ac.critic(llm.exclude("state_value"))["state_value"]
    K.assert_matches_reference(llm["state_value"], torch.where(llm["mask"], want, 0.0), name="V_old", atol=1e-5)


def test_critic_only_warmup_leaves_the_actor_unchanged(tmp_path):
    from ppo_objectives import train as T

    def run(critic_warmup):
        cfg = T.TrainConfig(iterations=2, preset="pico", num_envs=8, warmup_steps=2, critic_warmup=critic_warmup,
                            out=str(tmp_path / str(critic_warmup)), no_progress=True, no_plot=True, save_every=1)
        rows = T.train(cfg)
        return rows, torch.load(tmp_path / str(critic_warmup) / "checkpoint.pt", weights_only=False)

    # the actor's log-probs of the update equal the rollout's up to rounding: the rollout reads them from the
    # KV-cached forward, the update from a full one, and some CPUs round the two differently (4.7e-15 seen)
    rows, _ = run(1)
    assert rows[0]["kl_approx_max"] < 1e-12 and rows[0]["updates"] > 0 and rows[0]["grad_norm"] == 0.0
    assert rows[1]["kl_approx_max"] > 1e-6  # the actor moves from iteration 2 on
    plain, _ = run(0)
    assert plain[0]["kl_approx_max"] > 1e-6


# --------------------------------------------------------------------------- #
# The stall flag
# --------------------------------------------------------------------------- #


def _row(it, reward, exact=0.0, **kw):
    return dict(iteration=it, reward=reward, exact=exact, response_len=4.0, entropy=1.0, kl_approx_max=0.0, **kw)


def test_a_flat_run_is_flagged_as_a_stall_and_a_rising_or_solved_one_is_not():
    guard = CollapseGuard(stall_patience=8)
    lines = []
    for it in range(1, 21):
        lines += guard.update(_row(it, 0.31))  # the tiny-Llama copy seed: 0.31 forever
    assert guard.stalls == 1 and any("STALL: no progress for 8 iterations" in line for line in lines)
    assert not any("held-out" in line for line in lines)  # no evaluation ran: no "best -inf" to report
    rising = CollapseGuard(stall_patience=8)
    assert not any(rising.update(_row(it, 0.3 + 0.02 * it)) for it in range(1, 21))
    solved = CollapseGuard(stall_patience=8)
    for it in range(1, 21):
        row = _row(it, 0.97, exact=0.96)
        solved.update(row)
        assert row["warn_stall"] == 0


def test_held_out_progress_resets_the_stall_and_progress_is_reported():
    guard = CollapseGuard(stall_patience=4)
    flagged, lines = [], []
    for it in range(1, 12):
        row = _row(it, 0.2, eval_greedy=0.5 if it < 9 else 0.7)
        lines += guard.update(row)
        flagged.append(row["warn_stall"])
    assert flagged[4:8] == [1, 1, 1, 1] and flagged[8] == 0  # the held-out accuracy rose at iteration 9
    assert any("STALL" in line and "held-out greedy best 0.500" in line for line in lines)
    state = guard.state_dict()
    other = CollapseGuard(stall_patience=4)
    other.load_state_dict(state)
    assert other.since_progress == guard.since_progress and other.best_eval == 0.7
    assert not math.isnan(other.best)
    del lines

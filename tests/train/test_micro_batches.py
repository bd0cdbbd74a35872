"""--micro-batches M: each minibatch's gradient summed over M row slices, the same step with less memory held."""

import pytest
import torch
from test_loop import _pieces

from ppo_objectives import TokenPPOLoss
from ppo_objectives import functional as F
from ppo_objectives import testing as K
from ppo_objectives import train as T
from ppo_objectives.train.update import merge_micro_batches


def _flat(params):
    return torch.cat([p.detach().flatten() for p in params])


def _update(micro_batches, *, critic_only=False, poison_row=None, **cfg_kw):
    """One ppo_update from the same seed, rollout and parameters; returns (stats, actor, critic, slice sizes)."""
    kw = dict(ppo_epochs=2, minibatches=2, early_stop_kl=0.0) | cfg_kw
    cfg, task, env, ac, kl, gae, loss, opts = _pieces(micro_batches=micro_batches, **kw)
    collector = T.make_collector(cfg, task, ac.policy, env)
    try:
        llm = T.rollout_batch(iter(collector), ac, kl, gae, env.prompt_len, env.max_new_tokens)
    finally:
        collector.shutdown()
    if poison_row is not None:  # one row whose advantage is NaN: its slice's loss is not finite
        llm["advantage"][poison_row] = float("nan")
    rows = []
    loss.register_forward_pre_hook(lambda module, args, kwargs: rows.append(args[0].batch_size[0]), with_kwargs=True)
    stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0), critic_only=critic_only)
    return stats, _flat(ac.actor_parameters()), _flat(ac.critic_parameters()), rows


@pytest.mark.parametrize("micro_batches, shared_trunk", [(2, False), (3, False), (2, True)])
def test_the_accumulated_step_equals_the_minibatch_step(micro_batches, shared_trunk):
    one, actor1, critic1, rows1 = _update(1, shared_trunk=shared_trunk)
    m, actor_m, critic_m, rows_m = _update(micro_batches, shared_trunk=shared_trunk)
    assert one["updates"] == m["updates"] == 4
    torch.testing.assert_close(actor_m, actor1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(critic_m, critic1, rtol=1e-4, atol=1e-5)
    for key in ("loss_objective", "loss_critic", "loss_entropy", "kl_approx", "clip_fraction", "entropy",
                "value_clip_fraction", "max_ratio"):
        assert m[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert m["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    # what the memory is for: no forward sees more than a slice of a minibatch's rows
    assert max(rows_m) == -(-max(rows1) // micro_batches) < max(rows1)


def test_the_trust_region_takes_the_same_decisions_on_the_summed_minibatch():
    kw = dict(ppo_epochs=4, minibatches=4, early_stop_kl=1e-3)
    one, actor1, _, _ = _update(1, **kw)
    two, actor2, _, _ = _update(2, **kw)
    assert one["early_stopped"] == 1  # the test would not test the rollback without a crossing
    for key in ("updates", "early_stopped", "rolled_back", "step_fraction", "skipped_steps"):
        assert two[key] == one[key], key
    torch.testing.assert_close(actor2, actor1, rtol=1e-4, atol=1e-5)


def test_critic_only_steps_accumulate_the_value_loss_alone():
    one, actor1, critic1, _ = _update(1, critic_only=True)
    two, actor2, critic2, _ = _update(2, critic_only=True)
    torch.testing.assert_close(actor2, actor1, rtol=0, atol=0)  # the actor does not move in either
    torch.testing.assert_close(critic2, critic1, rtol=1e-4, atol=1e-5)
    assert two["loss_critic"] == pytest.approx(one["loss_critic"], rel=1e-4)


def test_a_slice_that_is_not_finite_skips_the_whole_minibatch_step():
    one, actor1, _, _ = _update(1, poison_row=0, ppo_epochs=1)
    two, actor2, _, _ = _update(2, poison_row=0, ppo_epochs=1)
    assert one["skipped_steps"] == two["skipped_steps"] == 1 and one["updates"] == two["updates"] == 1
    torch.testing.assert_close(actor2, actor1, rtol=1e-4, atol=1e-5)


def test_merged_slices_give_the_minibatch_terms_and_token_means():
    actor, critic = K.tiny_actor_critic()
    loss = TokenPPOLoss(actor, critic, kl_to_ref_coeff=0.1, entropy_bonus=True)
    td = K.response_batch(batch_size=7, response_len=6, mask="holes", with_advantage=True, seed=5)
    td["sample_log_prob"] = td["sample_log_prob"] - 0.3 * torch.rand(td["sample_log_prob"].shape)
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        loss.aggregation = aggregation
        norm = F.loss_normalizer(td["mask"], aggregation)
        with torch.no_grad():
            whole = loss(td.clone(), normalizer=norm)
            parts = [(loss(td[idx].clone(), normalizer=norm), td[idx]["mask"].sum())
                     for idx in torch.tensor_split(torch.arange(7), 3)]
        merged = merge_micro_batches(parts)
        assert set(merged.keys()) == set(whole.keys())
        for key in whole.keys():
            if key in ("ESS", "explained_variance"):  # not token means: the slices' token-weighted mean
                continue
            torch.testing.assert_close(merged[key], whole[key].float(), rtol=1e-5, atol=1e-6, msg=key)


def test_a_slice_without_valid_tokens_counts_for_nothing():
    from tensordict import TensorDict

    a = TensorDict({"loss_objective": torch.tensor(0.5), "entropy": torch.tensor(2.0)})
    empty = TensorDict({"loss_objective": torch.tensor(0.0), "entropy": torch.tensor(float("nan"))})
    merged = merge_micro_batches([(a, torch.tensor(3)), (empty, torch.tensor(0))])
    assert float(merged["entropy"]) == 2.0 and float(merged["loss_objective"]) == 0.5


def test_micro_batches_below_one_are_refused():
    with pytest.raises(ValueError, match="micro_batches"):
        T.TrainConfig(preset="pico", micro_batches=0)


def test_micro_batches_under_torchrun_are_refused(tmp_path, monkeypatch, cli_error):
    from _flags import SMALL

    for k, v in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    err = cli_error(["--iterations", "1", "--out", str(tmp_path), "--micro-batches", "2", *SMALL])
    assert "--micro-batches 2 under torchrun" in err and "drop --micro-batches" in err


def test_the_job_runs_with_micro_batches(tmp_path):
    import csv

    from _flags import SHORT

    T.main([*SHORT, "--iterations", "1", "--micro-batches", "2", "--out", str(tmp_path)])
    with (tmp_path / "metrics.csv").open() as f:
        row = next(csv.DictReader(f))
    assert int(float(row["updates"])) > 0 and float(row["loss_critic"]) >= 0


def test_chat_word_accumulates_over_four_slices_by_default_and_the_flag_overrides_it():
    assert T.TrainConfig(task="chat-word", model="m").micro_batches == 4
    assert T.TrainConfig(task="chat-word", model="m", micro_batches=1).micro_batches == 1
    assert T.TrainConfig(task="chat-add2", model="m").micro_batches == 1
    assert T.TrainConfig(preset="pico").micro_batches == 1

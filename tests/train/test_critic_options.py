"""The critic's options: critic-only passes per policy pass (--critic-steps) and what of its own trunk trains
(--critic-train)."""

import pytest
import torch
from test_loop import _pieces

from ppo_objectives import train as T
from ppo_objectives.llm.critic_trunk import decoder_layers, freeze_critic_trunk, parse_critic_train
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig

transformers = pytest.importorskip("transformers")


def _tiny():
    torch.manual_seed(0)
    return TinyCausalLM(TinyLMConfig.preset("nano", vocab_size=16, block_size=8))


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return HFCausalLMAdapter.from_config(cfg)


def _trained(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------- --critic-train


@pytest.mark.parametrize("build", [_tiny, _llama], ids=["tiny", "llama"])
def test_no_attention_freezes_exactly_the_attention_of_every_layer(build):
    model = build()
    everything = _trained(model)
    left = freeze_critic_trunk(model, "no-attention")
    frozen = everything - _trained(model)
    assert frozen and all(".attn." in n or ".self_attn." in n for n in frozen)
    assert not any(".attn." in n or ".self_attn." in n for n in _trained(model))
    assert left == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("build", [_tiny, _llama], ids=["tiny", "llama"])
def test_top_n_trains_the_top_layers_and_the_final_norm_only(build):
    model = build()
    n_layers = len(decoder_layers(model))
    freeze_critic_trunk(model, "top:1")
    trained = _trained(model)
    top = f"{n_layers - 1}."
    outside = {n for n in trained if ".layers." not in n and "blocks." not in n}
    assert all(top in n for n in trained - outside)  # every trained layer parameter is the top layer's
    assert outside and all("norm" in n or "ln_f" in n for n in outside)  # the final norm, not embeddings or the head
    assert any(top in n for n in trained)


def test_all_leaves_every_parameter_trained():
    model = _tiny()
    assert freeze_critic_trunk(model, "all") == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("spec", ["top:0", "top:x", "top", "attention", 3])
def test_a_bad_spec_is_refused_with_the_forms_it_takes(spec):
    with pytest.raises(ValueError, match="is not one of all, no-attention, top:N"):
        parse_critic_train(spec)


def test_more_top_layers_than_the_model_has_is_refused():
    with pytest.raises(ValueError, match=r"top:9: the model has 2 decoder layers; give N <= 2"):
        freeze_critic_trunk(_tiny(), "top:9")


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="has no nn.ModuleList of decoder layers"):
        freeze_critic_trunk(torch.nn.Linear(3, 3), "top:1")


def test_the_frozen_part_of_the_critic_does_not_move_in_an_update():
    cfg, task, env, ac, kl, gae, loss, opts = _pieces(ppo_epochs=1, minibatches=2, early_stop_kl=0.0)
    assert not ac.shared_trunk
    freeze_critic_trunk(ac.critic_model, "top:1")
    opts = (opts[0], torch.optim.AdamW(ac.critic_parameters(), lr=3e-3))  # the trained part alone
    before = {n: p.detach().clone() for n, p in ac.critic_model.named_parameters()}
    collector = T.make_collector(cfg, task, ac.policy, env)
    try:
        llm = T.rollout_batch(iter(collector), ac, kl, gae, env.prompt_len, env.max_new_tokens)
    finally:
        collector.shutdown()
    T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    moved = {n for n, p in ac.critic_model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= _trained(ac.critic_model)


def test_critic_train_needs_the_critics_own_trunk():
    with pytest.raises(ValueError, match="--critic-train top:2 freezes part of the critic's own trunk.*--no-shared-trunk"):
        T.TrainConfig(preset="pico", shared_trunk=True, critic_train="top:2")
    with pytest.raises(ValueError, match="--critic-train 'top:-1' is not one of"):
        T.TrainConfig(preset="pico", critic_train="top:-1")


# ----------------------------------------------------------------------------- --critic-steps


def _update(critic_steps):
    cfg, task, env, ac, kl, gae, loss, opts = _pieces(ppo_epochs=1, minibatches=2, early_stop_kl=0.0,
                                                      critic_steps=critic_steps)  # fmt: skip
    collector = T.make_collector(cfg, task, ac.policy, env)
    try:
        llm = T.rollout_batch(iter(collector), ac, kl, gae, env.prompt_len, env.max_new_tokens)
    finally:
        collector.shutdown()
    stats = T.ppo_update(llm, loss, ac, opts, cfg, torch.Generator().manual_seed(0))
    flat = lambda ps: torch.cat([p.detach().flatten() for p in ps])  # noqa: E731
    return stats, flat(ac.actor_parameters()), flat(ac.critic_parameters())


def test_critic_steps_add_critic_only_passes_and_leave_the_policy_step_as_it_was():
    one, actor1, critic1 = _update(1)
    three, actor3, critic3 = _update(3)
    assert one["updates"] == three["updates"] == 2
    assert one["critic_updates"] == 2 and three["critic_updates"] == 6  # three steps for each of the policy's
    assert "loss_critic_after" not in one and three["loss_critic_after"] < three["loss_critic"]
    torch.testing.assert_close(actor3, actor1, rtol=0, atol=0)  # the critic's own trunk: the actor never moves
    assert not torch.equal(critic3, critic1)


def test_critic_steps_below_one_and_on_a_critic_free_advantage_are_refused():
    with pytest.raises(ValueError, match="critic_steps"):
        T.TrainConfig(preset="pico", critic_steps=0)
    with pytest.raises(ValueError, match="--critic-steps configure the critic, but --advantage grpo has none"):
        T.TrainConfig(preset="pico", advantage="grpo", critic_steps=2)


def test_the_job_takes_both_options_and_logs_the_critics_steps(tmp_path):
    import csv

    from _flags import SHORT

    T.main([*SHORT, "--iterations", "1", "--critic-train", "top:1", "--critic-steps", "2", "--out", str(tmp_path)])
    with (tmp_path / "metrics.csv").open() as f:
        row = next(csv.DictReader(f))
    assert int(float(row["critic_updates"])) == 2 * int(float(row["updates"])) > 0
    assert float(row["loss_critic_after"]) >= 0


def test_the_command_line_refuses_critic_train_on_a_shared_trunk(cli_error, tmp_path):
    from _flags import SHORT

    err = cli_error([*SHORT, "--shared-trunk", "--critic-train", "no-attention", "--out", str(tmp_path)])
    assert "--critic-train no-attention freezes part of the critic's own trunk" in err


# ----------------------------------------------------------------------------- --gae-level


def test_the_job_runs_turn_level_gae(tmp_path):
    import csv

    from _flags import SHORT

    T.main([*SHORT, "--iterations", "1", "--gae-level", "turn", "--out", str(tmp_path)])
    with (tmp_path / "metrics.csv").open() as f:
        row = next(csv.DictReader(f))
    assert float(row["loss_critic"]) >= 0 and int(float(row["updates"])) > 0


def test_turn_level_gae_refuses_a_cut_at_holes_a_length_lambda_and_a_critic_free_advantage():
    with pytest.raises(ValueError, match="--gae-level turn runs GAE over the assistant's turns with one lambda"):
        T.TrainConfig(preset="pico", gae_level="turn", holes="cut")
    with pytest.raises(ValueError, match="--gae-level turn runs GAE over the assistant's turns with one lambda"):
        T.TrainConfig(preset="pico", gae_level="turn", length_alpha=0.5)
    with pytest.raises(ValueError, match="--gae-level configure the critic, but --advantage rloo has none"):
        T.TrainConfig(preset="pico", gae_level="turn", advantage="rloo")


# ----------------------------------------------------------------------------- --length-floor


def test_the_length_adaptive_lambda_has_a_floor_for_short_answers():
    from ppo_objectives import functional as F
    from ppo_objectives.value.gae import MaskedGAE
    from tensordict import TensorDict

    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert F.length_adaptive_lmbda(mask, 0.25).tolist() == [0.0, 0.5]  # 1 - 1 / (0.25 * 2) = -1: clamped at 0
    assert F.length_adaptive_lmbda(mask, 0.25, floor=0.9).tolist() == pytest.approx([0.9, 0.9])
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    td = TensorDict({"next": {"reward": r}, "state_value": v, "mask": mask}, batch_size=[2, 8])
    adv = MaskedGAE(lmbda=1.0, length_alpha=0.25, length_floor=0.9)(td.clone())["advantage"]
    ref, _ = F.masked_gae(r, v, mask, 1.0, torch.tensor([0.9, 0.9]), average_gae=False)
    torch.testing.assert_close(adv, ref)


def test_a_floor_without_a_length_alpha_or_outside_the_unit_interval_is_refused():
    with pytest.raises(ValueError, match="--length-floor 0.9 bounds the length-adaptive lambda, but --length-alpha"):
        T.TrainConfig(preset="pico", length_floor=0.9)
    with pytest.raises(ValueError, match="length_floor"):
        T.TrainConfig(preset="pico", length_alpha=1.0, length_floor=1.5)
    with pytest.raises(ValueError, match="floor"):
        from ppo_objectives import functional as F

        F.length_adaptive_lmbda(torch.ones(1, 2, dtype=torch.bool), 1.0, floor=-0.1)

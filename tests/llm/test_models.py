"""TinyCausalLM, its KV cache, the env policy and the training-time actor / critic."""

import copy

import pytest
import torch
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType, set_exploration_type

from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.llm.layouts import trajectories_to_llm_batch
from ppo_objectives.llm.models import PRESETS, TinyCausalLM, TinyLMConfig, position_ids_from_mask
from ppo_objectives.llm.policy import NextTokenLogits, make_actor, sample_with_kv_cache
from ppo_objectives.llm.readouts import ResponseLogProbs, ResponseValues, make_actor_critic
from ppo_objectives.testing import reference_log_probs
from ppo_objectives.train.digit import DigitTask


def _lm(vocab=16, block=16, preset="pico", seed=0, device="cpu"):
    torch.manual_seed(seed)
    return TinyCausalLM(TinyLMConfig.preset(preset, vocab_size=vocab, block_size=block)).to(device).eval()


def _left_padded_batch(device="cpu"):
    # row 0: two pads then 4 tokens; row 1: six real tokens
    ids = torch.tensor([[0, 0, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], device=device)
    return ids, ids != 0


# ----------------------------------------------------------------------------- config


def test_presets_build_models_of_increasing_size():
    sizes = [
        sum(p.numel() for p in TinyCausalLM(TinyLMConfig.preset(n, vocab_size=16, block_size=16)).parameters())
        for n in ("pico", "nano", "micro")
    ]
    assert set(PRESETS) == {"pico", "nano", "micro"}
    assert sizes == sorted(sizes) and sizes[0] < 10_000


def test_config_rejects_width_not_divisible_by_heads():
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        TinyLMConfig(n_embd=30, n_head=4)


def test_config_rejects_unknown_preset_and_bad_sizes():
    with pytest.raises(ValueError, match=r"unknown preset 'giga'; choose one of \['micro', 'nano', 'pico'\]"):
        TinyLMConfig.preset("giga")
    with pytest.raises(ValueError, match="n_layer=0 must be a positive int"):
        TinyLMConfig(n_layer=0)
    with pytest.raises(ValueError, match="dropout=1.5 must be in"):
        TinyLMConfig(dropout=1.5)
    with pytest.raises(TypeError, match="config must be a TinyLMConfig, got dict"):
        TinyCausalLM({"n_layer": 1})


def test_position_ids_ignore_left_padding():
    ids, mask = _left_padded_batch()
    # row 0: pads share position 0, real tokens count 0, 1, 2, 3
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]


# ----------------------------------------------------------------------------- the model


def test_left_padding_matches_the_unpadded_sequence(device):
    lm = _lm(device=device)
    ids, mask = _left_padded_batch(device)
    padded = lm(ids, mask).logits[0, 2:]
    alone = lm(ids[:1, 2:]).logits[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def test_garbage_at_padding_changes_no_valid_logit(device):
    lm = _lm(device=device)
    ids, mask = _left_padded_batch(device)
    garbage = ids.clone()
    garbage[0, :2] = torch.tensor([13, 14])  # different tokens under mask False
    a, b = lm(ids, mask).logits, lm(garbage, mask).logits
    torch.testing.assert_close(a[mask], b[mask])
    assert torch.isfinite(b).all()  # pad queries attend to themselves: never an empty softmax


def test_kv_cache_logits_equal_full_forward(device):
    lm = _lm(device=device)
    ids, mask = _left_padded_batch(device)
    full = lm(ids, mask).logits
    pos = position_ids_from_mask(mask)
    cache = lm.new_cache(2, 8, device=device)
    with torch.no_grad():
        pre = lm(ids[:, :3], mask[:, :3], position_ids=pos[:, :3], cache=cache, cache_slots=0).logits
        steps = [
            lm(ids[:, t : t + 1], mask[:, t : t + 1], position_ids=pos[:, t : t + 1], cache=cache, cache_slots=t).logits
            for t in range(3, 6)
        ]
    torch.testing.assert_close(torch.cat([pre, *steps], 1), full, atol=1e-5, rtol=1e-5)


def test_kv_cache_with_per_row_slots_equals_full_forward():
    # row 0 is two tokens ahead of row 1: tensor slots write each row at its own column
    lm = _lm()
    ids = torch.randint(2, 16, (2, 6))
    full = lm(ids).logits
    cache = lm.new_cache(2, 6)
    with torch.no_grad():
        lm(ids[:1, :4], cache=None)  # unrelated call, no effect
        lm(ids[:, :2], cache=cache, cache_slots=0)
        # row 0 advances over columns 2, 3; row 1 over column 2 twice (rewritten, same value)
        lm(ids[:, 2:3], cache=cache, cache_slots=torch.tensor([[2], [2]]))
        out = lm(
            torch.stack([ids[0, 3:4], ids[1, 2:3]]),
            cache=cache,
            cache_slots=torch.tensor([[3], [2]]),
            position_ids=torch.tensor([[3], [2]]),
        ).logits
    torch.testing.assert_close(out[0, 0], full[0, 3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 0], full[1, 2], atol=1e-5, rtol=1e-5)


def test_cache_errors_name_the_problem():
    lm = _lm(block=8)
    with pytest.raises(ValueError, match="max_len=9 exceeds block_size=8: the model has no position embedding beyond "
                                         "it; build the model with block_size >= 9"):
        lm.new_cache(1, 9)
    cache = lm.new_cache(2, 8)
    with pytest.raises(ValueError, match="cache holds 2 rows but input_ids has B=1"):
        lm(torch.zeros(1, 1, dtype=torch.long), cache=cache, cache_slots=0)
    with pytest.raises(ValueError, match="cache_slots is required"):
        lm(torch.zeros(2, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="T=9 > block_size=8"):
        lm(torch.zeros(1, 9, dtype=torch.long))


def test_model_input_errors_name_the_tensor():
    lm = _lm(block=8)
    with pytest.raises(TypeError, match=r"input_ids must be an integer tensor of token ids, got dtype torch\.float32; use \.long\(\)"):
        lm(torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\], got shape \(2,\); add a batch dim with \[None\]"):
        lm(torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 2\) but input_ids has shape \(1, 3\): one flag "
                                         r"per token is needed \(no broadcasting\)"):
        lm(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="input_ids holds token id 20, outside"):
        lm(torch.tensor([[1, 20]]))
    with pytest.raises(ValueError, match=r"position holds 9, outside \[1, 6\]"):
        with torch.no_grad():
            NextTokenLogits(lm)(torch.ones(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.bool), torch.tensor([9]))
    with pytest.raises(ValueError, match="there is no response to value"):
        ResponseValues(lm, 3)(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool))


def test_sample_with_kv_cache_log_probs_equal_a_full_forward():
    lm = _lm(block=12)
    prompts = torch.tensor([[0, 3, 4, 14], [5, 6, 7, 14]])
    pmask = prompts != 0
    resp, logp, mask = sample_with_kv_cache(
        lm, prompts, pmask, 4, eos_id=1, generator=torch.Generator().manual_seed(0)
    )
    seq = torch.cat([prompts, resp], 1)
    logits = lm(seq, torch.cat([pmask, mask], 1)).logits
    ref = reference_log_probs(logits[:, 3:7], resp).float()
    torch.testing.assert_close(logp[mask], ref[mask], atol=1e-5, rtol=1e-5)
    assert (logp[~mask] == 0).all() and (resp[~mask] == 0).all()


# ----------------------------------------------------------------------------- the env policy


def _rollout_logits(head, env, steps, seed=0):
    """Drive env with greedy-free sampling from head's logits; return (tds, logits) per step."""
    g = torch.Generator().manual_seed(seed)
    td = env.reset()
    out = []
    for _ in range(steps):
        with torch.no_grad():
            logits = head(td["tokens"], td["attention_mask"], td["position"])
        out.append((td.clone(), logits))
        td["action"] = torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(-1)
        _, td = env.step_and_maybe_reset(td)  # done rows get a fresh prompt (partial reset)
    return out


def test_cached_next_token_logits_equal_full_forward_through_partial_resets():
    task = DigitTask("reverse", 3, min_digits=1)  # varying prompt lengths: left padding
    env = TokenLMEnv.from_task(task, num_envs=5, seed=1)
    lm = _lm(block=env.seq_len)
    cached, full = NextTokenLogits(lm), NextTokenLogits(lm, use_kv_cache=False)
    resets = 0
    for td, logits in _rollout_logits(cached, env, steps=14):
        resets += int((td["position"] == env.prompt_len).sum())
        with torch.no_grad():
            ref = full(td["tokens"], td["attention_mask"], td["position"])
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert resets > 5  # the rollout really went through partial resets


def test_cache_is_rebuilt_after_an_optimizer_step():
    env = TokenLMEnv.from_task(DigitTask("copy", 3), num_envs=3, seed=0)
    lm = _lm(block=env.seq_len)
    head = NextTokenLogits(lm)
    td = env.reset()
    with torch.no_grad():
        head(td["tokens"], td["attention_mask"], td["position"])
    td["action"] = torch.tensor([3, 4, 5])
    td = env.step(td)["next"]
    opt = torch.optim.SGD(lm.parameters(), lr=1.0)
    lm(td["tokens"], td["attention_mask"]).logits.sum().backward()
    opt.step()  # new weights: the cached keys/values are stale
    with torch.no_grad():
        cached = head(td["tokens"], td["attention_mask"], td["position"])
        ref = NextTokenLogits(lm, use_kv_cache=False)(td["tokens"], td["attention_mask"], td["position"])
    torch.testing.assert_close(cached, ref, atol=1e-5, rtol=1e-5)


def test_cache_notices_a_different_buffer_with_the_same_positions():
    env = TokenLMEnv.from_task(DigitTask("copy", 3), num_envs=2, seed=0)
    lm = _lm(block=env.seq_len)
    head = NextTokenLogits(lm)
    td = env.reset()
    with torch.no_grad():
        head(td["tokens"], td["attention_mask"], td["position"])
        td["action"] = torch.tensor([3, 4])
        nxt = env.step(td)["next"]
        other = nxt.clone()
        other["tokens"][:, 0] = 9  # same position, different prefix
        cached = head(other["tokens"], other["attention_mask"], other["position"])
        ref = NextTokenLogits(lm, use_kv_cache=False)(other["tokens"], other["attention_mask"], other["position"])
    torch.testing.assert_close(cached, ref, atol=1e-5, rtol=1e-5)


def test_cache_prefills_stale_rows_at_different_positions():
    # row 0 is stale mid-episode (its prefix changed), row 1 was just reset: the stale rows end at
    # different columns, so the module takes the prefill-then-step path instead of one window
    env = TokenLMEnv.from_task(DigitTask("copy", 3), num_envs=2, seed=0)
    lm = _lm(block=env.seq_len)
    head, full = NextTokenLogits(lm), NextTokenLogits(lm, use_kv_cache=False)
    td = env.reset()
    with torch.no_grad():
        for tok in (3, 4):
            head(td["tokens"], td["attention_mask"], td["position"])
            td["action"] = torch.tensor([tok, tok])
            td = env.step(td)["next"]
        head(td["tokens"], td["attention_mask"], td["position"])  # cache now at position P + 2
        mixed = td.clone()
        mixed["tokens"][0, 0] = 9  # row 0: same position, different prefix
        fresh = env.reset()
        for key in ("tokens", "attention_mask", "position"):
            mixed[key][1] = fresh[key][1]  # row 1: a new episode at position P
        cached = head(mixed["tokens"], mixed["attention_mask"], mixed["position"])
        ref = full(mixed["tokens"], mixed["attention_mask"], mixed["position"])
    torch.testing.assert_close(cached, ref, atol=1e-5, rtol=1e-5)


def test_actor_sample_log_prob_equals_a_direct_forward():
    env = TokenLMEnv.from_task(DigitTask("reverse", 3), num_envs=4, seed=0)
    lm = _lm(block=env.seq_len)
    actor = make_actor(lm)
    with torch.no_grad():
        roll = env.rollout(3, actor, break_when_any_done=False)
    for t in range(3):
        step = roll[:, t]
        logits = lm(step["tokens"], step["attention_mask"]).logits  # [N, S, V]
        last = step["position"] - 1
        at = logits[torch.arange(4), last]
        ref = reference_log_probs(at, step["action"]).float()
        torch.testing.assert_close(step["sample_log_prob"], ref, atol=1e-5, rtol=1e-5)
    assert roll["sample_log_prob"].dtype == torch.float32


def test_actor_is_greedy_under_deterministic_exploration():
    env = TokenLMEnv.from_task(DigitTask("reverse", 3), num_envs=4, seed=0)
    lm = _lm(block=env.seq_len)
    actor = make_actor(lm)
    td = env.reset()
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        td = actor(td)
    assert torch.equal(td["action"], td["logits"].argmax(-1))


def test_actor_runs_with_gradients_without_the_cache():
    env = TokenLMEnv.from_task(DigitTask("copy", 2), num_envs=2, seed=0)
    lm = _lm(block=env.seq_len)
    td = make_actor(lm)(env.reset())
    td["sample_log_prob"].sum().backward()
    assert lm.wte.weight.grad is not None


# ----------------------------------------------------------------------------- LLM-layout actor / critic


def test_response_log_probs_equal_the_policy_log_probs_of_the_rollout():
    task = DigitTask("reverse", 2, min_digits=1)
    env = TokenLMEnv.from_task(task, num_envs=4, seed=0)
    ac = make_actor_critic(_lm(block=env.seq_len), prompt_len=env.prompt_len)
    with torch.no_grad():
        roll = env.rollout(12, ac.policy, break_when_any_done=False)  # several episodes per row
    llm = trajectories_to_llm_batch(roll, env.prompt_len, env.max_new_tokens)
    assert llm.batch_size[0] > 4
    logp = ac.actor(llm)["log_prob"]  # [B, R], one full forward per response
    m = llm["mask"]
    torch.testing.assert_close(logp[m], llm["sample_log_prob"][m], atol=1e-5, rtol=1e-5)


def test_actor_critic_output_shapes_and_entropy_bounds():
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=8), prompt_len=3)
    td = TensorDict(input_ids=torch.randint(16, (4, 8)), attention_mask=torch.ones(4, 8, dtype=torch.bool), batch_size=[4])
    ac.actor(td)
    ac.critic(td)
    assert td["log_prob"].shape == td["entropy"].shape == td["state_value"].shape == (4, 5)
    assert (td["entropy"] >= 0).all() and (td["entropy"] <= torch.log(torch.tensor(16.0)) + 1e-5).all()
    assert (td["state_value"] == 0).all()  # the value head starts at zero


def test_shared_trunk_shares_weights_and_separate_trunk_copies_them():
    cfg = TinyLMConfig.preset("pico", vocab_size=16, block_size=8)
    shared = make_actor_critic(cfg, prompt_len=3, shared_trunk=True)
    separate = make_actor_critic(cfg, prompt_len=3)
    assert shared.shared_trunk and shared.critic_model is shared.actor_model
    assert len(shared.critic_parameters()) == 2  # just the value head
    assert not separate.shared_trunk
    a, c = separate.actor_model.wte.weight, separate.critic_model.wte.weight
    assert torch.equal(a, c) and a.data_ptr() != c.data_ptr()
    assert not {id(p) for p in separate.actor_parameters()} & {id(p) for p in separate.critic_parameters()}


def test_a_shared_trunk_forward_without_a_backward_is_freed_with_its_last_user():
    """A minibatch the trust region stops is scored (actor and critic, with gradients) and never backpropagated. Its
    trunk forward, every activation saved for backward, must be freed when its outputs are: a hook that held the
    forward's output kept it alive through the autograd graph (7 GiB per stopped minibatch on a 175-token SmolLM2
    batch)."""
    import gc
    import weakref

    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=8), prompt_len=3, shared_trunk=True)
    td = TensorDict(input_ids=torch.randint(16, (4, 8)), attention_mask=torch.ones(4, 8, dtype=torch.bool),
                    batch_size=[4])
    seen = []
    handle = ac.actor_model.register_forward_hook(lambda module, args, out: seen.append(weakref.ref(out.hidden)))
    ac.actor(td)
    ac.critic(td)  # takes the actor's trunk forward: one forward for both
    handle.remove()
    assert len(seen) == 1 and seen[0]() is not None
    del td
    gc.collect()
    assert seen[0]() is None  # nothing but the outputs held the forward


def test_response_modules_reject_sequences_without_a_response():
    lm = _lm(block=8)
    with pytest.raises(ValueError, match=r"prompt_len=0 must be an int >= 1 \(the prompt width P\)"):
        ResponseLogProbs(lm, 0)
    with pytest.raises(ValueError, match="prompt_len=True must be an int >= 1"):
        ResponseValues(lm, True)
    with pytest.raises(ValueError, match="there is no response to score"):
        ResponseLogProbs(lm, 4)(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool))


@pytest.mark.parametrize("wrong", [2, 4], ids=["narrower", "wider"])
def test_read_outs_refuse_a_batch_whose_prompts_are_not_prompt_len_wide(wrong):
    from ppo_objectives.llm.layouts import ToLLMBatch
    from ppo_objectives.llm.readouts import frozen_reference

    env = TokenLMEnv.from_task(DigitTask("reverse", 2), num_envs=4, seed=0)  # P = 3, M = 3
    good = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=8), env.prompt_len)
    with torch.no_grad():
        llm = ToLLMBatch(env.prompt_len, env.max_new_tokens)(env.rollout(6, good.policy, break_when_any_done=False))
    ac = make_actor_critic(good.actor_model, wrong)
    read = 6 - wrong
    for net, who in ((ac.critic, "make_actor_critic's critic"), (ac.actor, "make_actor_critic's actor")):
        with pytest.raises(ValueError, match=rf"{who} was built with prompt_len={wrong}, but this batch's prompts are "
                                             rf"P=3 wide \(input_ids has S=6 columns and response_ids R=3: "
                                             rf"P = S - R\), "
                                             rf"so it would read {read} response columns instead of 3; build it with "
                                             rf"the env's prompt width, make_actor_critic\(model, "
                                             rf"prompt_len=env.prompt_len\)"):
            net(llm.clone())
    with pytest.raises(ValueError, match=r"frozen_reference was built with prompt_len=.*frozen_reference\(actor_model, "
                                         r"prompt_len=env.prompt_len\)"):
        frozen_reference(good.actor_model, wrong)(llm.clone())
    assert good.critic(llm.clone())["state_value"].shape == (llm.shape[0], 3)  # the env's width passes


# ----------------------------------------------------------------------------- Hugging Face adapter


def _tiny_llama(vocab=16):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return HFCausalLMAdapter.from_config(cfg).eval()


def test_hf_adapter_drives_the_env_and_matches_its_own_forward():
    lm = _tiny_llama()
    env = TokenLMEnv.from_task(DigitTask("reverse", 2), num_envs=3, seed=0)
    ac = make_actor_critic(lm, prompt_len=env.prompt_len)
    assert ac.policy.module[0].module.use_kv_cache  # Llama takes the per-row cache (tests/llm/test_hf.py)
    with torch.no_grad():
        roll = env.rollout(2, ac.policy, break_when_any_done=False)
    step = roll[:, 1]
    logits = lm.hf_model(
        input_ids=step["tokens"], attention_mask=step["attention_mask"].long(),
        position_ids=position_ids_from_mask(step["attention_mask"]),
    ).logits.float()
    at = logits[torch.arange(3), step["position"] - 1]
    ref = reference_log_probs(at, step["action"]).float()
    torch.testing.assert_close(step["sample_log_prob"], ref, atol=1e-5, rtol=1e-5)
    td = TensorDict(input_ids=roll[:, -1]["next", "tokens"], attention_mask=roll[:, -1]["next", "attention_mask"],
                    batch_size=[3])
    assert ac.critic(ac.actor(td))["state_value"].shape == (3, env.max_new_tokens)


def test_hf_adapter_left_padding_matches_the_unpadded_sequence():
    lm = _tiny_llama()
    ids, mask = _left_padded_batch()
    ids = ids.clamp(max=15)
    padded = lm(ids, mask).logits[0, 2:]
    alone = lm(ids[:1, 2:]).logits[0]
    torch.testing.assert_close(padded, alone, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- shared read-outs


def test_value_head_inits_are_the_documented_ones():
    from ppo_objectives.llm.readouts import value_head

    zeros = value_head(8)
    assert isinstance(zeros, torch.nn.Linear) and zeros.weight.shape == (1, 8)
    assert (zeros.weight == 0).all() and (zeros.bias == 0).all()
    torch.manual_seed(0)
    normal = value_head(4095, init="normal")
    assert (normal.bias == 0).all()
    assert normal.weight.std().item() == pytest.approx(1 / 4096**0.5, rel=0.05)
    with pytest.raises(ValueError, match="init='ones' is unknown"):
        value_head(8, init="ones")
    with pytest.raises(ValueError, match="hidden_size=0 must be an int >= 1"):
        value_head(0)


def test_make_actor_critic_value_head_is_value_head_zeros():
    # the training job's numbers depend on this init and on the RNG draws of building the networks
    cfg = TinyLMConfig.preset("pico", vocab_size=16, block_size=8)
    torch.manual_seed(0)
    ac = make_actor_critic(cfg, prompt_len=3)
    after = torch.rand(3)
    torch.manual_seed(0)
    lm = TinyCausalLM(cfg)
    critic_lm = copy.deepcopy(lm)
    head = torch.nn.Linear(cfg.n_embd, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    assert torch.equal(torch.rand(3), after)
    assert torch.equal(ac.critic_head.weight, head.weight) and torch.equal(ac.critic_head.bias, head.bias)
    assert all(torch.equal(a, b) for a, b in zip(ac.critic_model.parameters(), critic_lm.parameters()))


def test_read_log_probs_keeps_the_entropy_out_of_the_graph_when_asked():
    from ppo_objectives.llm.readouts import read_log_probs

    logits = torch.randn(2, 5, 7, requires_grad=True)
    ids = torch.randint(7, (2, 5))
    starts = torch.tensor([2, 2])
    lp, ent = read_log_probs(logits, ids, starts, 3, return_entropy=True, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    lp2, ent2 = read_log_probs(logits, ids, starts, 3, return_entropy=True)
    assert ent2.requires_grad
    torch.testing.assert_close(lp, lp2)
    torch.testing.assert_close(ent, ent2.detach())


def test_response_and_full_sequence_read_outs_agree_on_the_response_tokens():
    # one read-out family: the same HF model read through both layouts gives the same numbers
    pytest.importorskip("transformers")
    from ppo_objectives.llm.chat import CausalLMCritic, CausalLMTokenLogProbs

    adapter = _tiny_llama()
    P, R = 3, 4
    ids = torch.randint(16, (2, P + R))
    mask = torch.ones(2, P + R, dtype=torch.bool)
    resp_lp, resp_ent = ResponseLogProbs(adapter, P)(ids, mask)
    full_lp, full_ent = CausalLMTokenLogProbs(adapter.hf_model).log_probs(ids, mask)
    torch.testing.assert_close(resp_lp, full_lp[:, P:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(resp_ent, full_ent[:, P:], rtol=1e-5, atol=1e-5)
    critic = CausalLMCritic(adapter.hf_model)
    assert critic.backbone is adapter.hf_model.get_decoder()
    values = ResponseValues(adapter, P)
    values.value_head.load_state_dict(critic.head.state_dict())
    before, _ = critic.values(ids, mask)
    torch.testing.assert_close(values(ids, mask), before[:, P:], rtol=1e-5, atol=1e-5)


def test_hf_helpers_find_the_decoder_and_name_a_missing_output():
    from ppo_objectives.llm.hf import hf_decoder, hf_forward

    adapter = _tiny_llama()
    decoder = adapter.hf_model.model
    assert hf_decoder(adapter.hf_model) is decoder and hf_decoder(decoder) is decoder
    plain = torch.nn.Embedding(4, 2)
    assert hf_decoder(plain) is plain
    ids = torch.tensor([[1, 2, 3]])
    hidden = hf_forward(decoder, ids, torch.ones(1, 3, dtype=torch.bool))
    assert hidden.shape == (1, 3, 16)
    with pytest.raises(TypeError, match="returned no logits; pass a Hugging Face causal LM"):
        hf_forward(decoder, ids, output="logits")


@pytest.mark.parametrize("shared_trunk", [False, True])
def test_make_actor_critic_critic_trunk_gets_no_value_gradient_on_the_first_update(shared_trunk):
    # as its docstring says: the head starts at w = 0, so d(value)/d(hidden) = w = 0 for the trunk
    torch.manual_seed(0)
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=8), prompt_len=3,
                           shared_trunk=shared_trunk)
    td = TensorDict(input_ids=torch.randint(16, (2, 7)), attention_mask=torch.ones(2, 7, dtype=torch.bool), batch_size=[2])
    values = ac.critic(td)["state_value"]
    assert (values == 0).all()
    ((values - 1.0) ** 2).mean().backward()
    trunk = [p for p in ac.critic_model.parameters() if p.grad is not None]
    assert trunk and all((p.grad == 0).all() for p in trunk)
    assert ac.critic_head.weight.grad.abs().sum() > 0 and ac.critic_head.bias.grad.abs().sum() > 0
    # the docstring's recipe for a head whose trunk learns from the first step
    from ppo_objectives.llm.readouts import value_head

    ac.critic_head.weight.data.copy_(value_head(ac.critic_head.weight.shape[1], init="normal").weight)
    ac.critic_model.zero_grad(set_to_none=True)
    ((ac.critic(td)["state_value"] - 1.0) ** 2).mean().backward()
    assert any((p.grad != 0).any() for p in ac.critic_model.parameters() if p.grad is not None)

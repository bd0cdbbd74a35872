"""Multi-turn episodes: the environment's turns are holes that the policy reads, never samples and never trains.

Token-level tests (a TinyCausalLM and token ids chosen by hand) for the env, the converter, the
KV cache and GAE; the text-level tests (a tokenizer with a chat template) are in
``tests/train/test_turns_text.py``.
"""

from __future__ import annotations

import pytest
import torch
from torchrl.collectors import Collector
from torchrl.envs.utils import check_env_specs

from ppo_objectives import functional as F
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.layouts import trajectories_to_llm_batch
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import NextTokenLogits, make_actor
from ppo_objectives.value.gae import MaskedGAE

V, EOS, P, M = 16, 15, 3, 24
TOOL = (12, 13, 14)  # the environment's tokens: never sampled by the scripted policies below


def reply_by_prompt(response_ids, assistant_mask, *, conversation, prompt_id):
    """The env's turn: rows of an even prompt get one reply, odd ones two; then the episode ends."""
    conversation.append(response_ids.tolist())
    if len(conversation) > 1 + prompt_id % 2:
        return None
    return torch.tensor(TOOL[: 1 + len(conversation) % 3])


def prompts(k, generator):
    ids = torch.randint(1, 10, (k, P), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones(k, P, dtype=torch.bool),
            "prompt_id": torch.randint(0, 4, (k,), generator=generator)}


def turns_env(num_envs=4, **kw):
    kw = {"env_turn_fn": reply_by_prompt, "max_turn_tokens": 4, **kw}
    return TokenLMEnv(prompts, lambda p, pm, r, rm: rm.sum(-1).float(), num_envs=num_envs, prompt_len=P,
                      max_new_tokens=M, vocab_size=V, eos_id=EOS, seed=0, **kw)


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    return TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=V, block_size=P + M)).eval()


def collect(env, lm, frames):
    collector = Collector(env, make_actor(lm), frames_per_batch=frames, total_frames=frames, reset_at_each_iter=True,
                          auto_register_policy_transforms=False)
    try:
        return next(iter(collector))
    finally:
        collector.shutdown()


def test_the_multi_turn_env_passes_torchrls_spec_check():
    check_env_specs(turns_env())


def test_env_turn_tokens_are_holes_of_the_response_layout():
    env = turns_env()
    batch = collect(env, tiny_lm(), 4 * M)
    llm = trajectories_to_llm_batch(batch, P, M)
    assert llm.batch_size[0] > 0
    resp, mask, attn = llm["response_ids"], llm["mask"], llm["attention_mask"][:, P:]
    holes = attn & ~mask
    assert bool(holes.any()), "no environment turn in the batch"
    for b in range(llm.batch_size[0]):
        hole_tokens = set(resp[b][holes[b]].tolist())
        assert hole_tokens <= set(TOOL)
        last = int(attn[b].nonzero().max())
        assert bool(mask[b, last]), "a response ends with the assistant's token, never with a hole"
    # never sampled: no step wrote a hole column, so it has no behaviour log-prob and no reward
    assert bool((llm["sample_log_prob"][holes] == 0).all()) and bool((llm["token_reward"][holes] == 0).all())
    # the response mask is the env's own record of the columns the policy wrote, episode by episode
    final = batch["next", "assistant_mask"][batch["next", "done"].squeeze(-1)]
    assert torch.equal(final[:, P:], mask)
    assert bool((llm["sample_log_prob"][mask] < 0).all())


def test_rows_end_at_different_turns():
    env = turns_env(num_envs=8)
    llm = trajectories_to_llm_batch(collect(env, tiny_lm(1), 8 * M), P, M)
    runs = _runs_per_row(llm["mask"])
    episodes = llm.batch_size[0]
    assert episodes >= 8 and len(set(runs)) > 1, runs  # some rows took more assistant turns than others
    for b in range(episodes):  # an even prompt: at most 2 assistant turns, an odd one at most 3
        assert runs[b] <= 2 + int(llm["prompt_id"][b]) % 2


def _runs_per_row(mask):
    previous = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], 1)
    return (mask & ~previous).sum(-1).tolist()


class _Counting(torch.nn.Module):
    """The model, counting the tokens each forward receives."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.widths = lm, []
        self.supports_kv_cache, self.vocab_size, self.lm_head = lm.supports_kv_cache, lm.vocab_size, lm.lm_head

    def new_cache(self, *a, **k):
        return self.lm.new_cache(*a, **k)

    def forward(self, input_ids, *a, **k):
        self.widths.append(input_ids.shape[-1])
        return self.lm(input_ids, *a, **k)


def test_the_kv_cache_feeds_the_env_turn_and_equals_re_encoding_the_conversation():
    env, lm = turns_env(), tiny_lm(2)
    counting = _Counting(lm)
    head = NextTokenLogits(counting)
    g = torch.Generator().manual_seed(0)
    td, worst, env_turns = env.reset(), 0.0, 0
    with torch.no_grad():
        for step in range(M):
            cached = head(td["tokens"], td["attention_mask"], td["position"])
            full = lm(td["tokens"], td["attention_mask"]).logits.gather(
                1, (td["position"] - 1)[:, None, None].expand(-1, 1, V)).squeeze(1)
            worst = max(worst, float((cached - full).abs().max()))
            td["action"] = torch.multinomial(cached.softmax(-1), 1, generator=g).squeeze(-1).clamp(max=EOS - 1)
            td["action"] = torch.where(torch.rand(4, generator=g) < 0.3, EOS, td["action"])
            nxt = env.step(td)["next"]
            env_turns += int((nxt["turns"] - td["turns"]).sum())
            td = nxt
            if bool(td["done"].all()):
                break
    assert worst < 1e-5
    assert env_turns >= 2
    # after the first call (the prompts), no forward is wider than an env turn plus the token before it
    assert max(counting.widths[1:]) <= len(TOOL) + 1, counting.widths


def test_gae_skips_the_holes_as_an_independent_multi_turn_reference_does():
    env = turns_env(num_envs=6)
    llm = trajectories_to_llm_batch(collect(env, tiny_lm(3), 6 * M), P, M)
    g = torch.Generator().manual_seed(5)
    mask = llm["mask"]
    llm.set(("next", "reward"), torch.randn(mask.shape, generator=g) * mask)
    llm.set("state_value", torch.randn(mask.shape, generator=g))
    gamma, lmbda = 0.9, 0.8
    MaskedGAE(gamma=gamma, lmbda=lmbda, average_gae=False)(llm)
    for b in range(mask.shape[0]):  # the reference: GAE over the row's assistant tokens, in order, as one trajectory
        cols = mask[b].nonzero().squeeze(-1).tolist()
        r, v = llm["next", "reward"][b, cols].tolist(), llm["state_value"][b, cols].tolist()
        adv, running = [0.0] * len(cols), 0.0
        for i in reversed(range(len(cols))):
            next_v = v[i + 1] if i + 1 < len(cols) else 0.0
            running = r[i] + gamma * next_v - v[i] + gamma * lmbda * running
            adv[i] = running
        torch.testing.assert_close(llm["advantage"][b, cols], torch.tensor(adv), atol=1e-5, rtol=1e-5)
        assert bool((llm["advantage"][b][~mask[b]] == 0).all())


def test_holes_take_no_gradient():
    env = turns_env()
    llm = trajectories_to_llm_batch(collect(env, tiny_lm(4), 4 * M), P, M)
    mask = llm["mask"]
    holes = llm["attention_mask"][:, P:] & ~mask
    log_prob = llm["sample_log_prob"].clone().requires_grad_(True)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    loss = F.ppo_policy_loss(log_prob, llm["sample_log_prob"], adv, mask, 0.2)
    loss.backward()
    assert bool(holes.any())
    assert bool((log_prob.grad[holes] == 0).all()) and bool((log_prob.grad[mask] != 0).any())


def test_a_reply_that_does_not_fit_ends_the_episode_truncated_and_is_counted():
    def long_reply(response_ids, assistant_mask, *, conversation):
        return torch.full((M,), TOOL[0])

    env = turns_env(env_turn_fn=long_reply)
    td = env.reset()
    td["action"] = torch.full((4,), EOS)
    nxt = env.step(td)["next"]
    assert bool(nxt["truncated"].all()) and not bool(nxt["terminated"].any())
    assert env.env_turns_cut == 4
    assert int(nxt["position"][0]) == P + 1  # nothing of the reply was written


def test_a_reply_that_is_not_appended_leaves_nothing_in_the_conversation():
    def recorded_long_reply(response_ids, assistant_mask, *, conversation):
        conversation.append("a reply the model never reads")
        return torch.full((M,), TOOL[0])

    env = turns_env(env_turn_fn=recorded_long_reply)
    td = env.reset()
    td["action"] = torch.full((4,), EOS)
    env.step(td)
    assert [env.conversation(i) for i in range(4)] == [[]] * 4 and all(env.turn_cut(i) for i in range(4))
    env.reset()  # a reset row starts uncut
    assert not any(env.turn_cut(i) for i in range(4))
    # the turn budget: the reply is not appended either, and it is not a cut
    env = turns_env(env_turn_fn=lambda r, m, *, conversation: conversation.append("x") or torch.tensor([TOOL[0]]),
                    max_turns=1)
    td = env.reset()
    td["action"] = torch.full((4,), EOS)
    env.step(td)
    assert env.conversation(0) == [] and not env.turn_cut(0)
    with pytest.raises(ValueError, match=r"TokenLMEnv.turn_cut: this env has one turn"):
        turns_env(env_turn_fn=None, max_turn_tokens=None).turn_cut(0)


def test_the_turn_budget_ends_the_episode_truncated():
    env = turns_env(env_turn_fn=lambda r, m, *, conversation: torch.tensor([TOOL[0]]), max_turns=2)
    td = env.reset()
    ends = []
    for _ in range(4):
        td["action"] = torch.full((4,), EOS)
        td = env.step(td)["next"]
        ends.append(bool(td["done"][0]))
    assert ends == [False, True, True, True] and bool(td["truncated"].all())


def test_a_finished_row_stepped_again_is_left_as_it_is():
    env = turns_env(env_turn_fn=lambda r, m, *, conversation: None)
    td = env.reset()
    td["action"] = torch.full((4,), EOS)
    done = env.step(td)["next"]
    done["action"] = torch.full((4,), 5)
    again = env.step(done)["next"]
    assert torch.equal(again["tokens"], done["tokens"]) and bool(again["done"].all())
    assert bool((again["reward"] == 0).all())


@pytest.mark.parametrize("kw, error, match", [
    (dict(env_turn_fn=None, max_turn_tokens=None, max_turns=2), ValueError,
     r"max_turns budgets the turns of a multi-turn env.*pass env_turn_fn"),
    (dict(env_turn_fn=None, max_turns=None, max_turn_tokens=2), ValueError, r"max_turn_tokens budgets .*drop max_turn_tokens"),
    (dict(env_turn_fn=3), TypeError, r"env_turn_fn must be callable"),
    (dict(max_turn_tokens=M + 1), ValueError, r"max_turn_tokens=25 exceeds max_new_tokens=24"),
    (dict(max_turns=0), ValueError, r"max_turns"),
])
def test_bad_turn_settings_are_refused(kw, error, match):
    with pytest.raises(error, match=match):
        turns_env(**kw)


def test_an_env_turn_fn_without_a_conversation_parameter_is_refused_at_construction():
    def tool(response_ids, assistant_mask):
        return None

    with pytest.raises(TypeError, match=r"TokenLMEnv env_turn_fn tool\(response_ids, assistant_mask\) has no "
                                        r"'conversation' parameter, but the env calls it as env_turn_fn\(response_ids, "
                                        r"assistant_mask, conversation=list\) .*; add the parameter, e.g. def "
                                        r"tool\(response_ids, assistant_mask, conversation\): \.\.\., "
                                        r"or accept \*\*kwargs"):
        turns_env(env_turn_fn=tool)
    with pytest.raises(TypeError, match=r"env_turn_fn <lambda>\(r, m\) has no 'conversation' parameter.*"
                                        r"def env_turn\("):
        turns_env(env_turn_fn=lambda r, m: None)
    assert turns_env(env_turn_fn=lambda r, m, **kwargs: None).multi_turn  # **kwargs takes conversation=


@pytest.mark.parametrize("reply, match", [
    ([], r"returned .* for row 0: it must return the environment turn's token ids \(a non-empty 1-D"),
    ("calc", r"returned 'calc' for row 0"),
    (torch.tensor([1.5]), r"returned tensor\(\[1.5000\]\) for row 0"),
    ([[1, 2]], r"a non-empty 1-D sequence of ints"),
    ([V], r"returned token id 16 for row 0, outside the vocabulary \[0, 16\)"),
])
def test_a_bad_env_turn_is_an_error_naming_the_row_and_the_fix(reply, match):
    env = turns_env(env_turn_fn=lambda r, m, *, conversation: reply)
    td = env.reset()
    td["action"] = torch.full((4,), EOS)
    with pytest.raises(ValueError, match=match):
        env.step(td)


def test_a_single_turn_env_has_no_conversation():
    env = TokenLMEnv(torch.tensor([[1, 2]]), lambda p, pm, r, rm: torch.zeros(p.shape[0]), num_envs=1, prompt_len=2,
                     max_new_tokens=2, vocab_size=V, eos_id=EOS)
    with pytest.raises(ValueError, match="this env has one turn"):
        env.conversation(0)


def test_an_episode_takes_at_most_max_turns_times_max_turn_tokens_steps():
    assert turns_env().max_steps == M  # no turn budget: as many as fit
    env = turns_env(max_turns=2)  # 4 tokens a turn
    assert env.max_steps == 8
    td, steps = env.reset(), 0
    while not bool(td["done"].all()):
        td["action"] = torch.full((4,), 5)  # never the end-of-turn token: every turn runs to its budget
        td = env.step(td)["next"]
        steps += 1
    assert steps == env.max_steps and bool(td["done"].all())


def test_an_end_of_turn_token_equal_to_the_pad_id_stays_in_every_turns_mask_torchrl_chatenv():
    """TorchRL's ChatEnv builds its masks as ``tokens != pad``; with SmolLM2's pad, ``<|im_end|>``, every end-of-turn
    token vanished from the assistant's turns. Ours come from who wrote each token."""
    env = TokenLMEnv(prompts, lambda p, pm, r, rm: rm.sum(-1).float(), num_envs=4, prompt_len=P, max_new_tokens=M,
                     vocab_size=V, eos_id=EOS, pad_id=EOS, env_turn_fn=reply_by_prompt, max_turn_tokens=4, seed=0)
    batch = collect(env, tiny_lm(5), 4 * M)
    llm = trajectories_to_llm_batch(batch, P, M)
    ends = (llm["response_ids"] == EOS) & llm["attention_mask"][:, P:]
    assert bool(ends.any()) and bool(llm["mask"][ends].all())

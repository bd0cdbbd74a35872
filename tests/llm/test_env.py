"""TokenLMEnv (one step = one token), the DigitTask toy task, and the collector -> LLM layout."""

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.envs.utils import check_env_specs

from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.layouts import trajectories_to_llm_batch
from ppo_objectives.train.digit import DigitTask


class _Scripted(torch.nn.Module):
    """Policy that writes a scripted response: the task's answer, or fixed token lists per row."""

    def __init__(self, task=None, prompt_len=None, responses=None):
        super().__init__()
        self.task, self.P, self.responses = task, prompt_len, responses

    def forward(self, tokens, attention_mask, position):
        j = position - self.P  # response index of the token to emit
        if self.responses is not None:
            table = self.responses.to(tokens.device)
        else:
            table = self.task.targets(tokens[:, : self.P], attention_mask[:, : self.P])
        return table.gather(1, j.clamp(max=table.shape[1] - 1)[:, None]).squeeze(-1), torch.zeros(len(j))


def _policy(**kw):
    return TensorDictModule(_Scripted(**kw), ["tokens", "attention_mask", "position"], ["action", "sample_log_prob"])


# ----------------------------------------------------------------------------- the task


def test_encoding_of_the_worked_string():
    task = DigitTask("reverse", 3)
    assert task.encode("123<") == [3, 4, 5, 14]
    assert task.encode("321.") == [5, 4, 3, 1]
    assert task.decode([3, 4, 5, 14]) == "123<"
    with pytest.raises(ValueError, match=r"cannot encode '1a': characters \['a'\] are not in the vocabulary '_\.0123456789\+=<>'"):
        task.encode("1a")


@pytest.mark.parametrize(
    "op, prompt, answer",
    [
        ("reverse", "123<", "321."),
        ("copy", "123>", "123."),
        ("add", "95+07=", "102."),  # 95 + 7 = 102, zero-padded to 3 digits
        ("add", "12+34=", "046."),
    ],
)
def test_targets_are_the_correct_answers(op, prompt, answer):
    task = DigitTask(op, 2 if op == "add" else 3)
    ids = torch.tensor([task.encode(prompt)])
    assert task.decode(task.targets(ids, torch.ones_like(ids, dtype=torch.bool))[0]) == answer


def test_targets_of_left_padded_prompts():
    task = DigitTask("reverse", 3, min_digits=1)
    ids = torch.tensor([task.encode("__7<"), task.encode("_12<")])
    assert [task.decode(t) for t in task.targets(ids, ids != 0)] == ["7.__", "21._"]
    task = DigitTask("copy", 3, min_digits=1)
    ids = torch.tensor([task.encode("__7>"), task.encode("_12>")])
    assert [task.decode(t) for t in task.targets(ids, ids != 0)] == ["7.__", "12._"]


def test_reward_gives_partial_credit():
    task = DigitTask("reverse", 3)
    prompt = torch.tensor([task.encode("123<")] * 5)
    resp = torch.tensor([task.encode(s) for s in ("321.", "311.", "32._", "3210", "....")])
    mask = torch.tensor([[True] * 4, [True] * 4, [True, True, True, False], [True] * 4, [True, False, False, False]])
    # 4 target tokens "3 2 1 .": all hit; 3 of 4; 2 of 4 (third digit and EOS missing);
    # 3 of 4 (no EOS); 0 of 4
    expected = torch.tensor([1.0, 0.75, 0.5, 0.75, 0.0])
    torch.testing.assert_close(task.reward(prompt, prompt != 0, resp, mask), expected)


def test_reward_ignores_tokens_after_the_mask():
    task = DigitTask("copy", 2)
    prompt = torch.tensor([task.encode("45>")])
    resp = torch.tensor([task.encode("4.5.")])
    # the mask ends at the first EOS, so the later "5." cannot earn credit: "4" and nothing else
    r = task.reward(prompt, prompt != 0, resp[:, :3], torch.tensor([[True, True, False]]))
    torch.testing.assert_close(r, torch.tensor([1 / 3]))


def test_task_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"DigitTask op='mul' is unknown; choose one of \('copy', 'reverse', 'add'\)"):
        DigitTask("mul")
    with pytest.raises(ValueError, match=r"num_digits=0 must be an int in \[1, 9\]"):
        DigitTask("copy", 0)
    with pytest.raises(ValueError, match="min_digits=4 must be in"):
        DigitTask("copy", 3, min_digits=4)
    with pytest.raises(ValueError, match="fixed-width operands"):
        DigitTask("add", 3, min_digits=1)


# ----------------------------------------------------------------------------- specs and steps


@pytest.mark.parametrize("op", ["copy", "reverse", "add"])
def test_env_specs_pass_check_env_specs(op, device):
    env = TokenLMEnv.from_task(DigitTask(op, 2), num_envs=3, device=device, seed=0)
    check_env_specs(env, break_when_any_done="both")


def test_step_writes_the_token_and_advances_the_position(device):
    task = DigitTask("copy", 2)
    env = TokenLMEnv.from_task(task, num_envs=2, device=device, seed=0)
    td = env.reset()
    P = env.prompt_len
    assert (td["position"] == P).all() and not td["attention_mask"][:, P:].any()
    td["action"] = torch.tensor([7, 8], device=device)
    nxt = env.step(td)["next"]
    assert nxt["tokens"][:, P].tolist() == [7, 8]
    assert nxt["attention_mask"][:, : P + 1].all() and not nxt["attention_mask"][:, P + 1 :].any()
    assert (nxt["position"] == P + 1).all()
    assert not nxt["done"].any() and (nxt["reward"] == 0).all()


def test_scripted_correct_answers_earn_reward_one_on_the_last_token(device):
    task = DigitTask("reverse", 3)
    env = TokenLMEnv.from_task(task, num_envs=4, device=device, seed=0)
    roll = env.rollout(10, _policy(task=task, prompt_len=env.prompt_len).to(device), break_when_any_done=True)
    assert roll.shape == (4, 4)  # 3 digits + EOS
    reward = roll["next", "reward"].squeeze(-1)
    assert reward[:, :3].eq(0).all() and reward[:, 3].eq(1).all()
    assert roll["next", "terminated"][:, 3].all() and not roll["next", "truncated"].any()


def test_no_eos_is_truncated_at_max_new_tokens():
    task = DigitTask("reverse", 3)
    env = TokenLMEnv.from_task(task, num_envs=2, seed=0)
    # respond "9999" to every prompt: no EOS within max_new_tokens = 4
    resp = torch.tensor([task.encode("9999")] * 2)
    roll = env.rollout(10, _policy(responses=resp, prompt_len=env.prompt_len), break_when_any_done=True)
    assert roll.shape == (2, 4)
    assert roll["next", "truncated"][:, -1].all() and not roll["next", "terminated"].any()
    assert roll["next", "done"][:, -1].all() and not roll["next", "done"][:, :-1].any()


def test_deterministic_rollouts_with_known_rewards():
    # prompts fixed by a list source; responses fixed by the script: rewards by hand
    task = DigitTask("reverse", 3)
    prompts = [task.encode("123<"), task.encode("456<")]
    env = TokenLMEnv(prompts, task.reward, num_envs=2, prompt_len=4, max_new_tokens=4, vocab_size=16, eos_id=1)
    resp = torch.tensor([task.encode("321."), task.encode("6.__")])
    roll = env.rollout(4, _policy(responses=resp, prompt_len=4), break_when_any_done=False)
    reward = roll["next", "reward"].squeeze(-1)
    # row 0: "321." = 4/4 on step 3; row 1: "6." ends at step 1 with 1 of "654." = 1/4,
    # then the row is reset with the next prompt of the cycle ("123<") and answers "32" before the cut
    assert reward.tolist() == [[0.0, 0.0, 0.0, 1.0], [0.0, 0.25, 0.0, 0.0]]
    assert task.decode(roll[1, 2]["tokens"][:4]) == "123<"
    env2 = TokenLMEnv(prompts, task.reward, num_envs=2, prompt_len=4, max_new_tokens=4, vocab_size=16, eos_id=1)
    again = env2.rollout(4, _policy(responses=resp, prompt_len=4), break_when_any_done=False)
    assert torch.equal(again["next", "reward"], roll["next", "reward"])


def test_same_seed_same_prompts_different_seed_different_prompts():
    task = DigitTask("reverse", 3)
    a = TokenLMEnv.from_task(task, num_envs=8, seed=3).reset()["tokens"]
    b = TokenLMEnv.from_task(task, num_envs=8, seed=3).reset()["tokens"]
    c = TokenLMEnv.from_task(task, num_envs=8, seed=4).reset()["tokens"]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_partial_reset_draws_prompts_for_the_reset_rows_only():
    prompts = [[3, 14], [4, 14], [5, 14], [6, 14]]
    task = DigitTask("reverse", 1)
    env = TokenLMEnv(prompts, task.reward, num_envs=2, prompt_len=2, max_new_tokens=2, vocab_size=16, eos_id=1)
    td = env.reset()  # rows get prompts 0 and 1
    td["_reset"] = torch.tensor([[False], [True]])
    td = env.reset(td)  # row 1 gets prompt 2, row 0 keeps prompt 0
    assert td["tokens"][:, :2].tolist() == [[3, 14], [5, 14]]


def test_reset_left_pads_shorter_prompts():
    task = DigitTask("copy", 3, min_digits=1)
    env = TokenLMEnv(
        [task.encode("7>"), task.encode("123>")], task.reward,
        num_envs=2, prompt_len=4, max_new_tokens=4, vocab_size=16, eos_id=1,
    )
    td = env.reset()
    assert [task.decode(r) for r in td["tokens"][:, :4]] == ["__7>", "123>"]
    assert td["attention_mask"][:, :4].tolist() == [[False, False, True, True], [True] * 4]


def test_token_reward_fn_is_added_to_every_step():
    task = DigitTask("copy", 2)
    shaping = lambda resp, mask, index: torch.full(index.shape, 0.1)  # noqa: E731
    env = TokenLMEnv.from_task(task, num_envs=2, seed=0, token_reward_fn=shaping)
    roll = env.rollout(3, _policy(task=task, prompt_len=env.prompt_len), break_when_any_done=True)
    torch.testing.assert_close(roll["next", "reward"].squeeze(-1), torch.tensor([[0.1, 0.1, 1.1]] * 2))


# ----------------------------------------------------------------------------- prompt sources


def test_prompt_sources_tensor_iterable_dicts_and_callable():
    task = DigitTask("reverse", 2)
    kw = dict(num_envs=3, prompt_len=3, max_new_tokens=3, vocab_size=16, eos_id=1)
    tensor = torch.tensor([[0, 3, 14], [4, 5, 14]])  # left-padded 2-D tensor, cycled
    assert TokenLMEnv(tensor, task.reward, **kw).reset()["tokens"][:, :3].tolist() == [[0, 3, 14], [4, 5, 14], [0, 3, 14]]
    loader = [{"input_ids": torch.tensor([[6, 7, 14], [0, 8, 14]])}]  # DataLoader-like batches of dicts, restarted
    out = TokenLMEnv(loader, task.reward, **kw).reset()["tokens"][:, :3]
    assert out.tolist() == [[6, 7, 14], [0, 8, 14], [6, 7, 14]]
    gen = (torch.tensor([9, 14]) for _ in range(10))  # a one-shot generator
    assert TokenLMEnv(gen, task.reward, **kw).reset()["tokens"][:, 2].tolist() == [14, 14, 14]
    sampler = lambda k, g: torch.full((k, 3), 5)  # noqa: E731
    assert (TokenLMEnv(sampler, task.reward, **kw).reset()["tokens"][:, :3] == 5).all()


def test_prompt_source_errors_name_the_problem():
    task = DigitTask("reverse", 2)
    kw = dict(num_envs=2, prompt_len=3, max_new_tokens=3, vocab_size=16, eos_id=1)
    with pytest.raises(ValueError, match="prompt 0 has 5 tokens but the env's prompt_len is P=3"):
        TokenLMEnv([[2, 3, 4, 5, 14]], task.reward, **kw).reset()
    with pytest.raises(ValueError, match="the prompt source is empty"):
        TokenLMEnv([], task.reward, **kw)
    with pytest.raises(TypeError, match=r"prompts must be a callable \(k, generator\) -> prompts, a tensor, a list of "
                                        r"token-id sequences, or an iterable / DataLoader of them; got float"):
        TokenLMEnv(3.5, task.reward, **kw)
    with pytest.raises(ValueError, match="the prompt iterator is exhausted"):
        env = TokenLMEnv(iter([[3, 14]]), task.reward, **kw)
        env.reset()
        env.reset()
    with pytest.raises(ValueError, match="the prompt sampler returned 1 prompts for k=2"):
        TokenLMEnv(lambda k, g: [[3, 14]], task.reward, **kw).reset()


@pytest.mark.parametrize("prompts, got", [
    (["3 + 4 =", "1 + 1 ="], r"got the string '3 \+ 4 =' at index 0"),
    ("3 + 4 =", r"got the string '3 \+ 4 ='"),
    (iter([["3 + 4 ="]]), r"got the string '3 \+ 4 ='"),
], ids=["list", "one-string", "iterable"])
def test_text_prompts_are_refused_with_how_to_tokenize_them(prompts, got):
    task = DigitTask("reverse", 2)
    kw = dict(num_envs=2, prompt_len=3, max_new_tokens=3, vocab_size=16, eos_id=1)
    with pytest.raises(TypeError, match=r"TokenLMEnv prompts must be token ids \(1-D int tensors or lists, .*\), "
                                        + got + r"; tokenize the text first, e.g. \[tokenizer\(p\)\['input_ids'\] "
                                        r"for p in texts\], or train on text prompts with "
                                        r"TokenLMEnv.from_task\(TextTask"):
        TokenLMEnv(prompts, task.reward, **kw).reset()


@pytest.mark.parametrize("prompt, got, fix", [
    (torch.tensor([3, 4, 14]), r"a 1-D tensor of shape \(3,\)", r"\[prompt\] or prompt.unsqueeze\(0\)"),
    ([3, 4, 14], r"a flat list of 3 token ids", r"\[prompt\]"),
], ids=["tensor", "list"])
def test_one_prompt_given_alone_is_refused_with_the_fix(prompt, got, fix):
    task = DigitTask("reverse", 2)
    kw = dict(num_envs=2, prompt_len=3, max_new_tokens=3, vocab_size=16, eos_id=1)
    with pytest.raises(ValueError, match=rf"TokenLMEnv prompts is one prompt, {got}, but a batch of prompts is "
                                         rf"expected .*: iterating it would give single token ids, not prompts; "
                                         rf"pass {fix}$"):
        TokenLMEnv(prompt, task.reward, **kw)
    env = TokenLMEnv([prompt], task.reward, **kw)  # the fix works
    assert env.reset()["tokens"][:, :3].tolist() == [[3, 4, 14]] * 2


def test_an_iterable_of_token_ids_instead_of_prompts_is_refused_with_the_fix():
    task = DigitTask("reverse", 2)
    kw = dict(num_envs=2, prompt_len=3, max_new_tokens=3, vocab_size=16, eos_id=1)
    tokens = (t for t in torch.tensor([3, 4, 14]))  # iterating one prompt yields its token ids
    with pytest.raises(ValueError, match=r"the prompt source gave a single token id \(3\) where a prompt \(1-D token "
                                         r"ids\) or a batch of them is expected.*give a list of prompts \(\[prompt\]"):
        TokenLMEnv(tokens, task.reward, **kw).reset()


def test_out_of_vocabulary_prompts_and_actions_are_refused():
    task = DigitTask("reverse", 2)
    kw = dict(num_envs=1, prompt_len=3, max_new_tokens=3, vocab_size=16, eos_id=1)
    with pytest.raises(ValueError, match=r"prompt 0 holds token id 20, outside the vocabulary \[0, 16\)"):
        TokenLMEnv([[3, 20, 14]], task.reward, **kw).reset()
    env = TokenLMEnv.from_task(task, num_envs=2, seed=0)
    td = env.reset()
    td["action"] = torch.tensor([3, 99])
    with pytest.raises(ValueError, match=r"action 99 of row 1 is outside the vocabulary \[0, 16\)"):
        env.step(td)


def test_env_rejects_bad_arguments():
    task = DigitTask("reverse", 2)
    kw = dict(num_envs=2, prompt_len=3, max_new_tokens=3, vocab_size=16, eos_id=1)
    with pytest.raises(ValueError, match="TokenLMEnv num_envs=0 must be an int >= 1"):
        TokenLMEnv(task, task.reward, **{**kw, "num_envs": 0})
    with pytest.raises(ValueError, match=r"TokenLMEnv eos_id=16 is outside the vocabulary \[0, 16\)"):
        TokenLMEnv(task, task.reward, **{**kw, "eos_id": 16})
    with pytest.raises(TypeError, match="reward_fn must be callable, got NoneType"):
        TokenLMEnv(task, None, **kw)


# ----------------------------------------------------------------------------- collector batch -> LLM layout


def test_trajectories_to_llm_batch_reassembles_each_response():
    task = DigitTask("reverse", 3)
    prompts = [task.encode("123<"), task.encode("456<")]
    env = TokenLMEnv(prompts, task.reward, num_envs=2, prompt_len=4, max_new_tokens=4, vocab_size=16, eos_id=1)
    resp = torch.tensor([task.encode("321."), task.encode("6.__")])
    roll = env.rollout(6, _policy(responses=resp, prompt_len=4), break_when_any_done=False)
    roll["sample_log_prob"] = -torch.arange(12.0).reshape(2, 6)  # step ids, to see the gather
    llm = trajectories_to_llm_batch(roll, 4, 4)
    # finished episodes in (row, step) order. Prompts cycle 123<, 456<, 123<, ...: row 0 "321." on
    # 123< (steps 0-3, then a cut episode); row 1 "6." on 456< (steps 0-1), on 123< (steps 2-3;
    # cycle position 2), on 123< again (steps 4-5; at step 3 both rows reset: row 0 takes 456<)
    assert [task.decode(r) for r in llm["response_ids"]] == ["321.", "6.__", "6.__", "6.__"]
    assert llm["mask"].sum(-1).tolist() == [4, 2, 2, 2]
    assert llm["sample_log_prob"][0].tolist() == [0.0, -1.0, -2.0, -3.0]
    assert llm["sample_log_prob"][2].tolist() == [-8.0, -9.0, 0.0, 0.0]  # row 1, steps 2-3
    torch.testing.assert_close(llm["score"], torch.tensor([1.0, 0.25, 0.0, 0.0]))  # "6." vs "654." hits the 6
    assert llm["terminated"].all() and not llm["truncated"].any()
    torch.testing.assert_close(llm["token_reward"].sum(-1), llm["score"])


def test_trajectories_cut_by_the_batch_start_are_dropped():
    task = DigitTask("reverse", 3)
    env = TokenLMEnv.from_task(task, num_envs=2, seed=0)
    roll = env.rollout(8, _policy(task=task, prompt_len=env.prompt_len), break_when_any_done=False)
    tail = roll[:, 2:]  # episodes of steps 0-3 are cut: only the ones of steps 4-7 survive
    llm = trajectories_to_llm_batch(tail, env.prompt_len, env.max_new_tokens)
    assert llm.batch_size == (2,) and (llm["score"] == 1).all()
    with pytest.raises(ValueError, match=r"expected a collector batch \[\*N, T\] \(time last\), got batch_size \(\): "
                                         r"pass the collector's output, not a single step"):
        trajectories_to_llm_batch(roll[0, 0], 4, 4)
    stacked = trajectories_to_llm_batch(roll.unsqueeze(0), env.prompt_len, env.max_new_tokens)  # [W, N, T]
    assert stacked.batch_size == (4,)
    single = trajectories_to_llm_batch(roll[0], env.prompt_len, env.max_new_tokens)  # a [T] batch
    assert single.batch_size == (2,)
    assert isinstance(single, TensorDict)


# ----------------------------------------------------------------------------- ToLLMBatch: the collector postproc


def _collector(env, policy, postproc=None, batches=1):
    from torchrl.collectors import Collector

    N, M = env.batch_size[0], env.max_new_tokens
    return Collector(env, policy, frames_per_batch=N * M, total_frames=batches * N * M, reset_at_each_iter=True,
                     auto_register_policy_transforms=False, postproc=postproc)


def test_to_llm_batch_as_collector_postproc_gives_the_loss_layout_with_the_reward_for_gae():
    from ppo_objectives.llm import layouts
    from ppo_objectives.llm.models import TinyLMConfig
    from ppo_objectives.llm.readouts import make_actor_critic
    from ppo_objectives.loss import TokenPPOLoss
    from ppo_objectives.transforms import KLPenaltyTransform
    from ppo_objectives.value.gae import MaskedGAE

    task = DigitTask("reverse", 2)
    env = TokenLMEnv.from_task(task, num_envs=4, seed=0, token_reward_fn=lambda ids, m, j: 0.1 * (j == 0).float())
    policy = _policy(task=task, prompt_len=env.prompt_len)
    P, M = env.prompt_len, env.max_new_tokens
    post = layouts.ToLLMBatch(P, M)
    assert repr(post) == f"ToLLMBatch(prompt_len={P}, max_new_tokens={M})"
    collector = _collector(env, policy, postproc=post)
    try:
        llm = next(iter(collector))
    finally:
        collector.shutdown()
    # the same batch by hand: what users copied from ppo_objectives/train.py (rollout_batch)
    env2 = TokenLMEnv.from_task(task, num_envs=4, seed=0, token_reward_fn=lambda ids, m, j: 0.1 * (j == 0).float())
    raw_collector = _collector(env2, policy)
    try:
        by_hand = trajectories_to_llm_batch(next(iter(raw_collector)), P, M)
    finally:
        raw_collector.shutdown()
    by_hand.set(("next", "reward"), by_hand["token_reward"].clone())
    assert llm.batch_size == (4,) and set(llm.keys(True, True)) == set(by_hand.keys(True, True))
    for key in by_hand.keys(True, True):
        assert torch.equal(llm[key], by_hand[key]), key
    assert (llm["score"] == 1).all()  # the scripted policy answers correctly
    torch.testing.assert_close(llm["next", "reward"][:, 0], torch.full((4,), 0.1))  # the shaping on token 0
    # it feeds the critic, the KL penalty, MaskedGAE and the loss as it comes
    torch.manual_seed(0)
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=P + M), P)
    with torch.no_grad():
        ac.critic(llm)
        KLPenaltyTransform(ac.actor, coeff=0.1)(llm)
        MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(llm)
    assert not torch.equal(llm["next", "reward"], llm["token_reward"])  # the penalty went into the GAE reward only
    out = TokenPPOLoss(ac.actor, ac.critic)(llm)
    assert all(torch.isfinite(out[k]) for k in ("loss_objective", "loss_critic", "loss_kl_ref"))

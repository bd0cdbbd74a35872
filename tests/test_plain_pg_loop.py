"""The plain PyTorch loop the benchmarks compare the job with (``benchmarks/plain_pg_loop.py``), multi-turn.

Its conversations are built the way a user writes them with ``generate``; they must be the same
token rows the job's env builds from the same assistant tokens, so that the two sides train on
the same thing, and its loss must read the tool's tokens without training them.
"""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from plain_pg_loop import pg_backward, pg_loss, plain_pg_step, sample_group_batch  # noqa: E402

from ppo_objectives.llm.env import TokenLMEnv  # noqa: E402
from ppo_objectives.testing import tiny_chat_checkpoint, tiny_chat_tokenizer  # noqa: E402
from ppo_objectives.train.text import TextExample, TextTask, number_reward  # noqa: E402


def two_replies(messages, answer):
    """The tool: a reply after the first two assistant turns, then the end of the episode."""
    turns = sum(m["role"] == "assistant" for m in messages)
    return f"result {answer} ({turns})" if turns <= 2 else None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tok = tiny_chat_tokenizer()
    examples = [TextExample([{"role": "user", "content": f"what is {i}+{i}?"}], {"answer": 2 * i}, f"ex{i}")
                for i in range(4)]
    task = TextTask(examples, number_reward, tok, max_new_tokens=100, tool=two_replies, max_turns=3,
                    max_turn_tokens=5)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_checkpoint(tmp_path_factory.mktemp("plain")))
    eos = torch.tensor([task.eos_id])
    # a random model that ends some turns itself (a raised end-of-turn logit): turns end at the token and at the budget
    model.lm_head.register_forward_hook(lambda m, i, out: out.index_add(-1, eos, torch.full((*out.shape[:-1], 1), 4.0)))
    torch.manual_seed(0)
    batch = sample_group_batch(model, task, torch.Generator().manual_seed(1), prompts_per_batch=2, group_size=2)
    return task, model, batch


def replay_in_env(task: TextTask, batch: dict, prompt_id: torch.Tensor) -> dict:
    """The job's env stepped with the plain loop's assistant tokens, row by row; its final observation."""
    k = prompt_id.numel()
    source = {"input_ids": task.prompt_ids[prompt_id], "attention_mask": task.prompt_mask[prompt_id],
              "prompt_id": prompt_id}
    env = TokenLMEnv(lambda n, g: source, task.reward, num_envs=k, prompt_len=task.prompt_len,
                     max_new_tokens=task.answer_len, vocab_size=len(task.tokenizer), eos_id=task.eos_id,
                     pad_id=task.pad_id, env_turn_fn=task.env_turn, max_turns=task.max_turns,
                     max_turn_tokens=task.max_turn_tokens)
    written = [batch["resp"][r][batch["resp_mask"][r]].tolist() for r in range(k)]
    td, step = env.reset(), [0] * k
    while not bool(td["done"].all()):
        action = []
        for r in range(k):
            action.append(written[r][step[r]] if not bool(td["done"][r]) else task.pad_id)
            step[r] += not bool(td["done"][r])
        td["action"] = torch.tensor(action)
        td = env.step(td)["next"]
    return td


def test_plain_conversations_are_the_envs_token_rows(setup):
    task, _, batch = setup
    prompt_id = torch.tensor([int((task.prompt_ids == row).all(1).nonzero()[0]) for row in
                              batch["out"][:, :task.prompt_len]])
    td = replay_in_env(task, batch, prompt_id)
    P, R = task.prompt_len, batch["resp"].shape[1]
    assert bool((batch["resp_attn"] & ~batch["resp_mask"]).any()), "no tool turn: the holes would go untested"
    ended = batch["resp_mask"] & (batch["resp"] == task.eos_id)
    assert 0 < int(ended.sum()) < int(batch["resp_mask"].any(1).sum()) * task.max_turns, \
        "every turn ends the same way: the end-of-turn and the budget endings would not both be tested"
    assert int(td["attention_mask"][:, P + R:].sum()) == 0
    assert torch.equal(td["attention_mask"][:, P:P + R], batch["resp_attn"])
    assert torch.equal(td["assistant_mask"][:, P:P + R], batch["resp_mask"])
    assert torch.equal(torch.where(batch["resp_attn"], td["tokens"][:, P:P + R], -1),
                       torch.where(batch["resp_attn"], batch["resp"], -1))


def test_plain_loss_reads_tool_tokens_and_never_trains_them(setup):
    task, model, batch = setup
    adv = batch["adv"].clone()
    batch = dict(batch, adv=torch.ones_like(adv))
    holes = batch["resp_attn"] & ~batch["resp_mask"]
    # an independent reference: the full forward's log-probs of the assistant's tokens, averaged
    full_mask = torch.cat([batch["prompt_mask"].bool(), batch["resp_attn"]], 1)
    positions = (full_mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch["out"], attention_mask=full_mask.long(), position_ids=positions).logits
        P = task.prompt_len
        logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, batch["resp"][..., None])[..., 0]
        want = -(logp * batch["resp_mask"]).sum() / batch["resp_mask"].sum()
        assert float(pg_loss(model, batch)) == pytest.approx(float(want), abs=1e-5)
        # the tool's tokens change the loss only as context: replacing one changes the later log-probs
        other = dict(batch, out=batch["out"].clone())
        r, c = holes.nonzero()[0].tolist()
        other["out"][r, P + c] = (other["out"][r, P + c] + 1) % len(task.tokenizer)
        assert float(pg_loss(model, other)) != pytest.approx(float(want), abs=1e-7)


def test_micro_batches_give_the_whole_batchs_gradient(setup):
    task, model, batch = setup
    batch = dict(batch, adv=torch.linspace(-1.0, 1.0, batch["out"].shape[0]))  # the sampled groups may all tie
    grads = []
    for parts in (1, 3):  # 3 slices of uneven size
        model.zero_grad(set_to_none=True)
        pg_backward(model, batch, parts)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_micro_batches_must_be_an_int_from_1(setup, bad):
    task, model, batch = setup
    with pytest.raises(ValueError, match=r"plain_pg_step micro_batches=.* must be an int >= 1 \(1: the whole batch"):
        plain_pg_step(model, torch.optim.SGD(model.parameters(), lr=0.0), task, torch.Generator(), micro_batches=bad)
    with pytest.raises(ValueError, match=r"pg_backward micro_batches=.* must be an int >= 1 \(1: the whole batch"):
        pg_backward(model, batch, bad)

"""The anchor bench_real_lm.py compares the job with: a plain PyTorch policy-gradient loop on a causal LM.

What a user writes in about sixty lines without this package: ``model.generate`` samples
``group_size`` completions of ``prompts_per_batch`` training prompts at temperature 1 (whole
vocabulary), the reward is the task's, each completion's advantage is its reward minus its
group's mean, and one AdamW step at ``lr`` descends ``-mean over tokens(advantage * log p)``.
No critic, no reference KL, no clipping, no minibatches. Log-probs come from the model's own
logits, kept for the response positions only (``logits_to_keep``), so the loop pays no more
than it must.

On a multi-turn task (a ``TextTask`` with a ``tool``, e.g. ``chat-calc``) each row is a
conversation, as a user writes it with ``generate``: every assistant turn is one ``generate``
call on the conversation's tokens so far (left-padded, the whole conversation re-encoded each
turn: ``generate`` keeps no cache across calls), at most ``max_turn_tokens`` tokens, ending at
the end-of-turn token; the tool gets the conversation's messages and its reply is appended as
tokens, never trained (the loss masks it out), until the tool returns ``None``, the turns run
out or the conversation's budget (``max_new_tokens``) is spent. The reward scores the last
assistant message.

It shares with the job only what makes the comparison fair: the same model directory, the same
training prompts (``TextTask.prompt_ids``), the same reward, the same held-out measurement
(``ppo_objectives.train.text.evaluate``) and, multi-turn, the same tool and the same tokens for
its turns (``TextTask.env_turn_ids``: the chat template's rendering of the reply).

    python benchmarks/plain_pg_loop.py --model DIR --task chat-add1 --minutes 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a fresh clone, no install

from ppo_objectives.train.calc import calc_examples, calc_tool, tool_calls_well_formed
from ppo_objectives.train.calc_sum import calc_sum_calls_well_formed, calc_sum_examples, calc_sum_tool
from ppo_objectives.train.config import TASK_DEFAULTS
from ppo_objectives.train.text_job import EVAL_SEED_OFFSET
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.train.pretrained import load_tokenizer
from ppo_objectives.train.text import TextTask, arithmetic_examples, evaluate, number_reward
from ppo_objectives.train.word import final_number_reward, word_examples
from ppo_objectives._validate import check_int

MICRO_BATCHES_WHAT = " (1: the whole batch in one backward)"

#: The multi-turn tasks: ``(examples of a split, the tool, the held-out check of the calls)``.
TOOL_TASKS = {"chat-calc": (calc_examples, calc_tool, tool_calls_well_formed),
              "chat-calc-sum": (calc_sum_examples, calc_sum_tool, calc_sum_calls_well_formed)}


def held_out_evaluator(task: TextTask, seed: int, samples: int = 1, well_formed=None):
    """``fn(hf_model) -> {eval_greedy, eval_sampled[, eval_tool_calls]}``: the job's held-out measurement, for any
    HF causal LM (not part of the loop: both sides are measured by it). ``well_formed(messages) -> bool``: the
    fraction of greedy conversations whose tool calls it accepts is ``eval_tool_calls``."""
    gen = torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET)

    def fn(hf_model) -> dict:
        lm = HFCausalLMAdapter(hf_model)
        greedy = evaluate(lm, task, greedy=True)
        sampled = evaluate(lm, task, greedy=False, generator=gen, samples=samples)
        row = dict(eval_greedy=greedy.accuracy, eval_sampled=sampled.accuracy)
        if well_formed is not None:
            row["eval_tool_calls"] = sum(map(well_formed, greedy.conversations)) / len(greedy.conversations)
        return row

    return fn


def plain_pg_loop(model_dir, task, *, seed: int, minutes: float, eval_minutes: float, evaluate_fn,
                  prompts_per_batch: int = 8, group_size: int = 4, lr: float = 1e-5, micro_batches: int = 1,
                  on_row=None) -> list[dict]:
    """Train ``model_dir`` on ``task`` (a ``TextTask``) for ``minutes`` of training time; returns the rows
    ``{iteration, train_s, reward, generate_s, update_s[, eval_greedy, eval_sampled]}`` (evaluation time excluded).

    ``evaluate_fn(hf_model) -> dict`` measures the held-out task: at iteration 0, after the first
    iteration past each multiple of ``eval_minutes`` of training time, and at the end (the job's
    ``--eval-minutes`` rule)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rows, train_s, it, next_eval = [dict(iteration=0, train_s=0.0, **evaluate_fn(model))], 0.0, 0, 60.0 * eval_minutes
    while train_s < 60.0 * minutes:
        row = plain_pg_step(model, opt, task, gen, prompts_per_batch=prompts_per_batch, group_size=group_size,
                            micro_batches=micro_batches)
        it += 1
        train_s += row["generate_s"] + row["update_s"]
        row = dict(iteration=it, train_s=train_s, **row)
        if train_s >= next_eval or train_s >= 60.0 * minutes:
            next_eval = (train_s // (60.0 * eval_minutes) + 1) * 60.0 * eval_minutes
            row.update(evaluate_fn(model))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def plain_pg_step(model, opt, task, gen: torch.Generator, *, prompts_per_batch: int = 8,
                  group_size: int = 4, micro_batches: int = 1) -> dict:
    """One iteration of the loop: ``{reward, generate_s, update_s, response_tokens, answers}`` (``answers``: the
    batch's completions or conversations). One AdamW step on the
    whole batch; ``micro_batches`` > 1 accumulates its gradient over that many slices of rows (the same
    gradient, a fraction of the activations' memory)."""
    check_int("micro_batches", micro_batches, where="plain_pg_step ", what=MICRO_BATCHES_WHAT)  # before generating
    t0 = time.perf_counter()
    batch = sample_group_batch(model, task, gen, prompts_per_batch=prompts_per_batch, group_size=group_size)
    t1 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    pg_backward(model, batch, micro_batches)
    opt.step()
    t2 = time.perf_counter()
    return dict(reward=float(batch["reward"].mean()), generate_s=t1 - t0, update_s=t2 - t1,
                response_tokens=int(batch["resp_mask"].sum()), answers=int(batch["out"].shape[0]))


def sample_group_batch(model, task, gen: torch.Generator, *, prompts_per_batch: int = 8,
                       group_size: int = 4) -> dict:
    """``group_size`` completions of each of ``prompts_per_batch`` prompts drawn with ``gen`` (``model.generate``
    at T = 1 from torch's global stream), their rewards and group-mean advantages."""
    M, P = task.answer_len, task.prompt_len
    idx = torch.randint(len(task.examples), (prompts_per_batch,), generator=gen).repeat_interleave(group_size)
    if task.tool is not None:
        return sample_conversations(model, task, idx, group_size)
    ids, mask = task.prompt_ids[idx], task.prompt_mask[idx].long()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=M, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, eos_token_id=task.eos_id,
                             pad_token_id=task.pad_id)
    resp = out[:, P:]
    # valid response tokens: up to and including the first EOS
    ended = (resp == task.eos_id).long().cumsum(1)
    resp_mask = (ended - (resp == task.eos_id).long()) == 0
    reward = task.score(task.completions(resp, resp_mask), idx)
    adv = (reward.view(-1, group_size) - reward.view(-1, group_size).mean(1, keepdim=True)).view(-1)
    return dict(out=out, resp=resp, resp_mask=resp_mask, resp_attn=resp_mask, prompt_mask=mask, reward=reward,
                adv=adv)


def sample_conversations(model, task, idx: torch.Tensor, group_size: int) -> dict:
    """One conversation per prompt ``idx`` (a multi-turn task): each assistant turn a ``generate`` call on the
    conversation so far, each tool reply appended as tokens; the batch of :func:`sample_group_batch`, with
    ``resp_mask`` the assistant's tokens and ``resp_attn`` every token after the prompt."""
    eos = task.eos_id
    prompts = [task.prompt_ids[i][task.prompt_mask[i]].tolist() for i in idx.tolist()]
    resp = [[] for _ in prompts]  # token ids after the prompt
    trained = [[] for _ in prompts]  # True: the assistant wrote it
    chats = [task.examples[i].messages() for i in idx.tolist()]
    alive = list(range(len(prompts)))
    for turn in range(task.max_turns):
        left = {r: task.answer_len - len(resp[r]) for r in alive}  # each conversation's own budget
        budget = min(task.max_turn_tokens, max(left.values()))
        rows = [prompts[r] + resp[r] for r in alive]
        width = max(map(len, rows))
        ids = torch.tensor([[task.pad_id] * (width - len(x)) + x for x in rows])
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in rows])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=budget, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=task.pad_id)
        still = []
        for r, new in zip(alive, out[:, width:].tolist()):
            new = new[:new.index(eos) + 1] if eos in new else new
            new = new[:left[r]]
            resp[r] += new
            trained[r] += [True] * len(new)
            text = task.tokenizer.decode(new, skip_special_tokens=True)
            chats[r].append({"role": "assistant", "content": text})
            if turn + 1 == task.max_turns:
                continue
            reply = task.tool(chats[r], **task.examples[int(idx[r])].fields)
            if reply is None:
                continue
            hole = task.env_turn_ids(chats[r], reply, closed=bool(new) and new[-1] == eos)
            if len(resp[r]) + len(hole) + 1 > task.answer_len:
                continue  # the reply does not fit the conversation's budget: the episode ends here
            chats[r].append({"role": task.env_role, "content": reply})
            resp[r] += hole
            trained[r] += [False] * len(hole)
            still.append(r)
        alive = still
        if not alive:
            break
    R = max(map(len, resp))
    resp_t = torch.tensor([x + [task.pad_id] * (R - len(x)) for x in resp])
    resp_mask = torch.tensor([m + [False] * (R - len(m)) for m in trained])
    resp_attn = torch.tensor([[True] * len(x) + [False] * (R - len(x)) for x in resp])
    prompt_ids, prompt_mask = task.prompt_ids[idx], task.prompt_mask[idx].long()
    reward = task.score_conversations(chats, idx)
    adv = (reward.view(-1, group_size) - reward.view(-1, group_size).mean(1, keepdim=True)).view(-1)
    return dict(out=torch.cat([prompt_ids, resp_t], 1), resp=resp_t, resp_mask=resp_mask, resp_attn=resp_attn,
                prompt_mask=prompt_mask, reward=reward, adv=adv)


def pg_backward(model, batch: dict, micro_batches: int = 1) -> None:
    """Accumulate the gradient of :func:`pg_loss` over ``micro_batches`` slices of the batch's rows (the last one
    may be shorter): the whole batch's gradient, with the activations of one slice at a time."""
    check_int("micro_batches", micro_batches, where="pg_backward ", what=MICRO_BATCHES_WHAT)
    n = batch["out"].shape[0]
    step = -(-n // micro_batches)
    for start in range(0, n, step):
        pg_loss(model, batch, slice(start, start + step)).backward()


def pg_loss(model, batch: dict, rows: slice = slice(None)) -> torch.Tensor:
    """The policy-gradient loss of a ``sample_group_batch``: advantage-weighted log-probs of the response
    tokens the model wrote (``resp_mask``; a tool's tokens are read, never trained), from the model's logits at
    the positions ``generate`` used, averaged over the valid tokens of the whole batch. ``rows`` takes a slice of
    the rows: the losses of the slices of a partition sum to the batch's loss (gradient accumulation)."""
    resp, resp_mask = batch["resp"][rows], batch["resp_mask"][rows]
    full_mask = torch.cat([batch["prompt_mask"][rows].bool(), batch["resp_attn"][rows]], 1)
    positions = (full_mask.long().cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=batch["out"][rows], attention_mask=full_mask.long(), position_ids=positions,
                   logits_to_keep=resp.shape[1] + 1).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, resp[..., None]).squeeze(-1)  # [B, R]
    return -(batch["adv"][rows, None] * logp * resp_mask).sum() / batch["resp_mask"].sum().clamp(min=1)


def build_tasks(name: str, tokenizer) -> tuple[TextTask, TextTask, object]:
    """The training and held-out ``TextTask`` of ``name`` with the job's budgets, and the tool-call check
    (``chat-calc``, ``chat-calc-sum``; ``None`` for the single-turn tasks)."""
    if name in TOOL_TASKS:
        examples, tool, well_formed = TOOL_TASKS[name]
        turns = {k: TASK_DEFAULTS[name][k] for k in ("max_new_tokens", "max_turns", "max_turn_tokens")}
        train, held_out = (TextTask(examples(split), number_reward, tokenizer, name=name, tool=tool, **turns)
                           for split in ("train", "eval"))
        return train, held_out, well_formed
    if name == "chat-word":
        budget = TASK_DEFAULTS[name]["max_new_tokens"]
        train, held_out = (TextTask(word_examples(split), final_number_reward, tokenizer, name=name,
                                    max_new_tokens=budget) for split in ("train", "eval"))
        return train, held_out, None
    train, held_out = (TextTask(arithmetic_examples(name, split), number_reward, tokenizer, max_new_tokens=16)
                       for split in ("train", "eval"))
    return train, held_out, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--task", default="chat-add1", choices=("chat-add1", "chat-add2", *TOOL_TASKS, "chat-word"))
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-minutes", type=float, default=1.0)
    a = p.parse_args(argv)
    task, held_out, well_formed = build_tasks(a.task, load_tokenizer(a.model))
    for row in plain_pg_loop(a.model, task, seed=a.seed, minutes=a.minutes, eval_minutes=a.eval_minutes,
                             evaluate_fn=held_out_evaluator(held_out, a.seed, well_formed=well_formed)):
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

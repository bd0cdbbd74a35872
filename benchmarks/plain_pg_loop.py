"""The anchor bench_real_lm.py compares the job with: a plain PyTorch policy-gradient loop on a causal LM.

What a user writes in about sixty lines without this package: ``model.generate`` samples
``group_size`` completions of ``prompts_per_batch`` training prompts at temperature 1 (whole
vocabulary), the reward is the task's, each completion's advantage is its reward minus its
group's mean, and one AdamW step at ``lr`` descends ``-mean over tokens(advantage * log p)``.
No critic, no reference KL, no clipping, no minibatches. Log-probs come from the model's own
logits, kept for the response positions only (``logits_to_keep``), so the loop pays no more
than it must.

It shares with the job only what makes the comparison fair: the same model directory, the same
training prompts (``TextTask.prompt_ids``), the same reward, and the same held-out measurement
(``ppo_objectives.train.text.evaluate``).

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

from ppo_objectives.train.text_job import EVAL_SEED_OFFSET
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.train.pretrained import load_tokenizer
from ppo_objectives.train.text import TextTask, arithmetic_examples, evaluate, number_reward


def held_out_evaluator(task: TextTask, seed: int, samples: int = 1):
    """``fn(hf_model) -> {eval_greedy, eval_sampled}``: the job's held-out measurement, for any HF causal LM
    (not part of the loop: both sides are measured by it)."""
    gen = torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET)

    def fn(hf_model) -> dict:
        lm = HFCausalLMAdapter(hf_model)
        greedy = evaluate(lm, task, greedy=True)
        sampled = evaluate(lm, task, greedy=False, generator=gen, samples=samples)
        return dict(eval_greedy=greedy.accuracy, eval_sampled=sampled.accuracy)

    return fn


def plain_pg_loop(model_dir, task, *, seed: int, minutes: float, eval_minutes: float, evaluate_fn,
                  prompts_per_batch: int = 8, group_size: int = 4, lr: float = 1e-5, on_row=None) -> list[dict]:
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
        row = plain_pg_step(model, opt, task, gen, prompts_per_batch=prompts_per_batch, group_size=group_size)
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
                  group_size: int = 4) -> dict:
    """One iteration of the loop: ``{reward, generate_s, update_s, response_tokens}``."""
    t0 = time.perf_counter()
    batch = sample_group_batch(model, task, gen, prompts_per_batch=prompts_per_batch, group_size=group_size)
    t1 = time.perf_counter()
    loss = pg_loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    t2 = time.perf_counter()
    return dict(reward=float(batch["reward"].mean()), generate_s=t1 - t0, update_s=t2 - t1,
                response_tokens=int(batch["resp_mask"].sum()))


def sample_group_batch(model, task, gen: torch.Generator, *, prompts_per_batch: int = 8,
                       group_size: int = 4) -> dict:
    """``group_size`` completions of each of ``prompts_per_batch`` prompts drawn with ``gen`` (``model.generate``
    at T = 1 from torch's global stream), their rewards and group-mean advantages."""
    M, P = task.answer_len, task.prompt_len
    idx = torch.randint(len(task.examples), (prompts_per_batch,), generator=gen).repeat_interleave(group_size)
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
    return dict(out=out, resp=resp, resp_mask=resp_mask, prompt_mask=mask, reward=reward, adv=adv)


def pg_loss(model, batch: dict) -> torch.Tensor:
    """The policy-gradient loss of a ``sample_group_batch``: advantage-weighted log-probs of the response
    tokens, from the model's logits at the positions ``generate`` used, averaged over the valid tokens."""
    resp, resp_mask = batch["resp"], batch["resp_mask"]
    full_mask = torch.cat([batch["prompt_mask"].bool(), resp_mask], 1)
    positions = (full_mask.long().cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=batch["out"], attention_mask=full_mask.long(), position_ids=positions,
                   logits_to_keep=resp.shape[1] + 1).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, resp[..., None]).squeeze(-1)  # [B, R]
    return -(batch["adv"][:, None] * logp * resp_mask).sum() / resp_mask.sum().clamp(min=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--task", default="chat-add1", choices=("chat-add1", "chat-add2"))
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-minutes", type=float, default=1.0)
    a = p.parse_args(argv)
    tok = load_tokenizer(a.model)
    task = TextTask(arithmetic_examples(a.task, "train"), number_reward, tok, max_new_tokens=16)
    held_out = TextTask(arithmetic_examples(a.task, "eval"), number_reward, tok, max_new_tokens=16)
    for row in plain_pg_loop(a.model, task, seed=a.seed, minutes=a.minutes, eval_minutes=a.eval_minutes,
                             evaluate_fn=held_out_evaluator(held_out, a.seed)):
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

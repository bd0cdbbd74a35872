"""What a multi-turn iteration costs against a single-turn one of the same total tokens, on SmolLM2.

What it compares, in one process, on the same model, the same ``chat-calc`` prompts (``N`` rows)
and the same token buffer, with every token forced so that the lengths are exact (the model's
forward runs at every step; its sampled token is replaced):

- ``multi``: 3 assistant turns of 16 tokens, each of the first two followed by the environment's
  turn of ``K`` tokens (the rendered ``"calc result: 943"``): 48 sampled tokens, ``48 + 2K`` in all;
  the env policy feeds each environment turn to its KV cache in one forward;
- ``single-total``: one turn of ``48 + 2K`` sampled tokens: the same total tokens;
- ``single-sampled``: one turn of 48 sampled tokens in the same buffer: the same sampled tokens.

Each side is timed as a rollout (env steps with the env policy's forward) plus an update (the
actor-critic's loss forward and backward on the response layout, shared trunk, as the job's
update on one minibatch of all ``N`` rows). Printed: the median of ``--repeats`` over each
side, and the ratios of ``multi`` to the single-turn sides. Run it alone on the machine.

    python benchmarks/bench_turns.py --model runs/smollm2 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout

from ppo_objectives.llm.env import TokenLMEnv  # noqa: E402
from ppo_objectives.llm.policy import NextTokenLogits  # noqa: E402
from ppo_objectives.llm.readouts import make_actor_critic  # noqa: E402
from ppo_objectives.loss import TokenPPOLoss  # noqa: E402
from ppo_objectives.train.calc import calc_examples, calc_tool  # noqa: E402
from ppo_objectives.train.pretrained import load_causal_lm, load_tokenizer  # noqa: E402
from ppo_objectives.train.text import TextTask, number_reward  # noqa: E402

TURN, TURNS = 16, 3


def make_env(task: TextTask, n: int, vocab: int, budget: int, reply: torch.Tensor | None) -> TokenLMEnv:
    """An env over the first ``n`` training prompts; with ``reply`` a multi-turn one whose environment turn is
    ``reply`` after each of the first two assistant turns."""
    source = {"input_ids": task.prompt_ids[:n], "attention_mask": task.prompt_mask[:n], "prompt_id": torch.arange(n)}

    def env_turn(response_ids, assistant_mask, *, conversation):
        conversation.append(1)
        return reply if len(conversation) < TURNS else None

    kw = dict(env_turn_fn=env_turn, max_turns=TURNS, max_turn_tokens=TURN) if reply is not None else {}
    return TokenLMEnv(lambda k, g: source, lambda p, pm, r, rm: torch.zeros(p.shape[0]), num_envs=n,
                      prompt_len=task.prompt_len, max_new_tokens=budget, vocab_size=vocab, eos_id=task.eos_id,
                      pad_id=task.pad_id, **kw)


def rollout(env: TokenLMEnv, head: NextTokenLogits, filler: int, sampled: int, eos_id: int) -> tuple:
    """Step the env to the end of every row's episode, forcing ``filler`` tokens (the end-of-turn token as the
    ``sampled``-th token of a single-turn episode); returns the final observation."""
    td, step = env.reset(), 0
    with torch.no_grad():
        while not bool(td["done"].all()):
            head(td["tokens"], td["attention_mask"], td["position"])  # the policy's forward, as in a rollout
            step += 1
            token = eos_id if (not env.multi_turn and step == sampled) else filler
            td["action"] = torch.full((env.batch_size[0],), token)
            td = env.step(td)["next"]
    return td


def update(ac, loss_module, td, P: int) -> None:
    """One loss forward and backward on the response layout of the rows in ``td``."""
    from tensordict import TensorDict

    tokens, attn = td["tokens"], td["attention_mask"]
    mask = td["assistant_mask"][:, P:] if "assistant_mask" in td.keys() else attn[:, P:]
    B, R = mask.shape
    llm = TensorDict(input_ids=tokens, attention_mask=attn, response_ids=tokens[:, P:], mask=mask,
                     sample_log_prob=torch.full((B, R), -1.0) * mask, state_value=torch.zeros(B, R),
                     advantage=torch.randn(B, R) * mask, value_target=torch.zeros(B, R), batch_size=[B])
    out = loss_module(llm)
    (out["loss_objective"] + out["loss_critic"]).backward()
    ac.actor_model.zero_grad(set_to_none=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("runs/smollm2-135m-instruct"))
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a checkpoint directory; python -m ppo_objectives.pretrained --gguf "
                f"smollm2 --out {args.model}")
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    task = TextTask(calc_examples("train")[: args.rows], number_reward, tok, max_new_tokens=TURN, name="calc")
    chat = [*task.examples[0].messages(), {"role": "assistant", "content": "calc(23*41)"}]
    reply = torch.tensor(task.env_turn_ids(chat, calc_tool([{"role": "assistant", "content": "calc(23*41)"}]),
                                           closed=False))
    K = reply.numel()
    sampled, total = TURNS * TURN, TURNS * TURN + 2 * K
    lm = load_causal_lm(args.model)
    ac = make_actor_critic(lm, task.prompt_len, shared_trunk=True, entropy_grad=False)
    loss_module = TokenPPOLoss(ac.actor, ac.critic, kl_to_ref_coeff=0.0, functional=False)
    filler = tok("1", add_special_tokens=False)["input_ids"][0]
    sides = {
        "multi": (make_env(task, args.rows, lm.vocab_size, total + 1, reply), sampled),
        "single-total": (make_env(task, args.rows, lm.vocab_size, total, None), total),
        "single-sampled": (make_env(task, args.rows, lm.vocab_size, total, None), sampled),
    }
    times: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}
    for _ in range(args.repeats + 1):  # the first round warms up
        for side, (env, n_sampled) in sides.items():
            head = NextTokenLogits(lm)
            t0 = time.perf_counter()
            td = rollout(env, head, filler, n_sampled, task.eos_id)
            t1 = time.perf_counter()
            update(ac, loss_module, td, task.prompt_len)
            times[side].append((t1 - t0, time.perf_counter() - t1))
            cols = int(td["attention_mask"][0, task.prompt_len:].sum())
            steps = int(td["assistant_mask"][0, task.prompt_len:].sum()) if env.multi_turn else cols
            assert steps == n_sampled, (side, steps)
    print(f"SmolLM2, {args.rows} rows, {args.threads} threads; environment turn K = {K} tokens; median of "
          f"{args.repeats}")
    print("| side | sampled tokens | tokens after the prompt | rollout s | update s | iteration s | multi / side |")
    print("|---|---|---|---|---|---|---|")
    med = {s: [statistics.median(x[i] for x in v[1:]) for i in (0, 1)] for s, v in times.items()}
    for side, (r, u) in med.items():
        n_sampled = sides[side][1]
        ratio = (sum(med["multi"]) / (r + u))
        print(f"| {side} | {n_sampled} | {total} | {r:.2f} | {u:.2f} | {r + u:.2f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

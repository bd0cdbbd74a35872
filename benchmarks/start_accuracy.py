"""Where a task starts: the pretrained model's held-out accuracy before any training, greedy and sampled.

What it measures, per task: the study's held-out protocol (``plain_pg_loop.held_out_evaluator``, the one
every side of ``study_critic.py`` is measured by: 200 problems, greedy and one sample each at T = 1 from the
generator of ``--seed``) on the untrained model, and on a multi-turn task the fraction of greedy conversations
whose tool calls were all well-formed. A task is worth a study when the start leaves room to learn (the
critic study asks at most 0.5 greedy and 0.2 sampled of a new multi-turn task). One torch thread; each
task's row is written to ``benchmarks/results/start_accuracy/TASK.json`` at once, and a re-run skips the
rows already there (``--force`` measures again).

    python benchmarks/start_accuracy.py --model runs/smollm2 --tasks chat-calc chat-calc-sum
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "start_accuracy"
TASKS = ("chat-add1", "chat-add2", "chat-calc", "chat-calc-sum", "chat-word")


def measure(model: Path, task: str, seeds: list[int]) -> dict:
    """Greedy once (it does not depend on the seed), then one sampled evaluation per seed."""
    import torch
    from plain_pg_loop import build_tasks
    from sides import machine
    from transformers import AutoModelForCausalLM

    from ppo_objectives.llm.hf import HFCausalLMAdapter
    from ppo_objectives.train.pretrained import load_tokenizer
    from ppo_objectives.train.text import evaluate
    from ppo_objectives.train.text_job import EVAL_SEED_OFFSET

    torch.set_num_threads(1)
    _, held_out, well_formed = build_tasks(task, load_tokenizer(model))
    lm = HFCausalLMAdapter(AutoModelForCausalLM.from_pretrained(str(model)).eval())
    t0 = time.perf_counter()
    done = lambda what: print(f"{task}: {what} done at {time.perf_counter() - t0:.0f} s", flush=True)  # noqa: E731
    print(f"{task}: {1 + len(seeds)} evaluations of {len(held_out.examples)} problems (greedy, then a sampled one "
          "per seed)", flush=True)
    with torch.no_grad():
        greedy = evaluate(lm, held_out, greedy=True)
        done(f"greedy {greedy.accuracy:.3f}")
        sampled = {}
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET)
            sampled[seed] = evaluate(lm, held_out, greedy=False, samples=1, generator=gen).accuracy
            done(f"sampled (seed {seed}) {sampled[seed]:.3f}")
    calls = None if well_formed is None else sum(map(well_formed, greedy.conversations)) / len(greedy.conversations)
    print(f"{task}: greedy {greedy.accuracy:.3f}, sampled " + ", ".join(f"{v:.3f} (seed {k})" for k, v in
          sampled.items()) + ("" if calls is None else f", well-formed tool calls {calls:.3f}"), flush=True)
    return dict(task=task, model=str(model), problems=len(held_out.examples), machine=machine(),
                seconds=time.perf_counter() - t0, eval_greedy=greedy.accuracy, eval_sampled=sampled,
                eval_tool_calls=calls, greedy_completions=greedy.completions[:6])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("runs/smollm2-135m-instruct"))
    p.add_argument("--tasks", nargs="+", default=["chat-calc-sum"], choices=TASKS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="the sampled evaluation's seeds")
    p.add_argument("--force", action="store_true", help="measure tasks whose rows exist again, replacing them")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a checkpoint directory; python -m ppo_objectives.pretrained --gguf "
                f"smollm2 --out {args.model}")
    for task in args.tasks:
        path = RESULTS / f"{task}.json"
        if path.exists() and not args.force:
            print(f"{task}: written already, skipped (--force measures again)")
            continue
        row = measure(args.model, task, args.seeds)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Seconds per step of 32 answers: the job's PPO iteration against a step of TRL's ``GRPOTrainer``, on SmolLM2.

What it compares, each side in a process of its own, one after the other, with the same torch
threads, the same model directory, the same training prompts of ``chat-add1`` and the same reward
(:func:`~ppo_objectives.train.text.number_reward`):

- ``job``: ``python -m ppo_objectives.train --task chat-add1`` at the ``pretrained`` recipe (32 answers
  per iteration, 16 new tokens, a reference model for the KL in the reward, one pass of two
  minibatches, a critic on the actor's trunk). The time of an iteration is its ``rollout_s +
  reference_s + update_s`` (``metrics.csv``), without the held-out evaluations.
- ``job-no-kl``: the same with ``--kl-reward-coeff 0`` (no reference model).
- ``trl``: ``trl.GRPOTrainer`` with its own defaults (DAPO loss, ``beta=0`` so no reference model,
  one optimizer step per generation batch, ``scale_rewards="group"``), except where a setting has an
  obvious counterpart in the job: 32 completions per step (``per_device_train_batch_size=32``,
  ``generation_batch_size=32``), 8 per prompt (``num_generations=8``: GRPO needs groups; the job
  draws 32 prompts), ``max_completion_length=16``, ``temperature=1.0``, ``learning_rate=2e-5``,
  float32 (``bf16=False``, the job's default precision) and no activation checkpointing
  (``gradient_checkpointing=False``, the job's default). The time of a step is from
  ``on_step_begin`` to ``on_step_end`` of a ``TrainerCallback``: generation, scoring and the update.

Printed: the median over the steps after the first (a warm-up) of each side, the ratio of each job
side to ``trl``, and the peak resident memory of each process. Each side's row is written to
``benchmarks/results/trl_step/SIDE.json`` as it finishes; a re-run skips the rows already there
(``--force`` runs them again). Run it alone on the machine: two sides at once time each other.

    pip install -e ".[bench]"      # TRL, outside the library's own dependencies
    python benchmarks/bench_trl_step.py --model runs/smollm2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "trl_step"
SIDES = ("job", "job-no-kl", "trl")


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def job_side(model: Path, steps: int, threads: int, extra: list[str]) -> dict:
    """The job's iteration times: ``rollout_s + reference_s + update_s`` of each iteration."""
    from ppo_objectives import train as T

    with tempfile.TemporaryDirectory(prefix="bench_trl_job_") as out:
        flags = ["--model", str(model), "--task", "chat-add1", "--iterations", str(steps), "--out", out,
                 "--threads", str(threads), "--no-progress", "--no-plot", "--eval-every", "0",
                 "--save-every", "100000", *extra]
        rows = T.train(T.TrainConfig(**vars(T.build_parser().parse_args(flags))))
    return dict(step_s=[r["rollout_s"] + r["reference_s"] + r["update_s"] for r in rows if r["iteration"] >= 1],
                answers=[int(r["episodes"]) for r in rows if r["iteration"] >= 1])


def trl_side(model: Path, steps: int, threads: int) -> dict:
    """TRL ``GRPOTrainer`` step times, with the settings of the module docstring."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ppo_objectives.train.text import arithmetic_examples, number_reward

    torch.set_num_threads(threads)
    examples = arithmetic_examples("chat-add1", "train")
    data = Dataset.from_list([{"prompt": e.messages(), "answer": e.fields["answer"]} for e in examples])

    def reward(prompts, completions, answer, **kwargs):
        return [number_reward(c[-1]["content"], a) for c, a in zip(completions, answer)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory(prefix="bench_trl_") as out:
        config = GRPOConfig(output_dir=out, use_cpu=True, report_to="none", max_steps=steps, seed=0,
                            per_device_train_batch_size=32, generation_batch_size=32, num_generations=8,
                            max_completion_length=16, temperature=1.0, learning_rate=2e-5, bf16=False,
                            gradient_checkpointing=False, logging_steps=1, save_strategy="no", disable_tqdm=True)
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(model)), args=config, train_dataset=data,
                              reward_funcs=reward, processing_class=AutoTokenizer.from_pretrained(str(model)),
                              callbacks=[Clock()])
        trainer.train()
        defaults = {k: str(getattr(config, k)) for k in ("loss_type", "beta", "num_iterations", "scale_rewards",
                                                          "epsilon", "optim", "lr_scheduler_type", "max_grad_norm")}
    return dict(step_s=times, answers=[32] * len(times), trl_defaults=defaults)


def run_side(side: str, args) -> dict:
    if side == "trl":
        out = trl_side(args.model, args.steps, args.threads)
    else:
        out = job_side(args.model, args.steps, args.threads, ["--kl-reward-coeff", "0"] if side == "job-no-kl" else [])
    return dict(side=side, threads=args.threads, steps=args.steps, peak_rss_gib=_peak_gib(), **out)


def summary(rows: dict[str, dict]) -> None:
    med = {side: statistics.median(r["step_s"][1:] or r["step_s"]) for side, r in rows.items()}
    print("| side | s per step (median, after the first) | steps | answers per step | peak RSS GiB | ratio to trl |")
    print("|---|---|---|---|---|---|")
    for side, r in rows.items():
        ratio = f"{med[side] / med['trl']:.2f}x" if "trl" in med else "-"
        print(f"| {side} | {med[side]:.2f} | {len(r['step_s'])} | {statistics.median(r['answers']):.0f} | "
              f"{r['peak_rss_gib']:.2f} | {ratio} |")
    if "trl" in rows:
        print("TRL settings in force:", ", ".join(f"{k}={v}" for k, v in rows["trl"]["trl_defaults"].items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("runs/smollm2-135m-instruct"))
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--steps", type=int, default=6, help="steps per side; the first is a warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--force", action="store_true", help="run the sides whose rows exist again")
    p.add_argument("--one-side", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first is a warm-up), got {args.steps}")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a checkpoint directory; python -m ppo_objectives.pretrained --gguf "
                f"smollm2 --out {args.model}")
    if args.one_side:
        path = RESULTS / f"{args.one_side}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run_side(args.one_side, args)))
        return 0
    for side in args.sides:
        path = RESULTS / f"{side}.json"
        if path.exists() and not args.force:
            print(f"{side}: {path} exists, skipped", file=sys.stderr)
            continue
        print(f"{side}: {args.steps} steps, {args.threads} threads", file=sys.stderr, flush=True)
        cmd = [sys.executable, str(HERE), "--one-side", side, "--model", str(args.model), "--steps", str(args.steps),
               "--threads", str(args.threads)]
        if subprocess.call(cmd, cwd=HERE.parents[1]):
            print(f"error: the {side} side failed", file=sys.stderr)
            return 1
    rows = {side: json.loads((RESULTS / f"{side}.json").read_text()) for side in SIDES
            if (RESULTS / f"{side}.json").exists()}
    summary(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Held-out accuracy per PPO iteration on SmolLM2, over seeds, for named variants of the job; and their comparison.

What it compares: the job (``python -m ppo_objectives.train --model DIR --task TASK``, its
``pretrained`` recipe, 30 iterations) run as several **variants** (a label, the checkout it runs
from and extra flags), on the same model, training prompts, seeds and held-out problems. A
variant is for example the job before a change (``--checkout`` a worktree of the earlier commit)
and after it, or the recipe with and without its KL penalty. Iterations, not minutes, are the
axis: this measures what a change does to learning, not to speed.

Held-out set: ``chat-add1``: all of its 100 problems (its 30 held-out ones and its 70 training
ones: a larger set, at the price of including problems the policy trains on); ``chat-add2``: its
200 held-out problems. Each is answered greedily (16 new tokens) by the pretrained model and by
the actor after every ``--eval-every`` iterations (a callback of ``train.train``; not counted in
the job's own times). Each finished run is one JSON file,
``benchmarks/results/per_iteration/TASK/VARIANT/seedS.json``, written at once: a re-run skips
the runs already there, so the measurement can be stopped and continued.

``--summary`` reads every file and prints, per task and evaluation point, each variant's mean
accuracy over seeds (min-max) and, for each pair of variants, the difference of their means with
a 95% bootstrap confidence interval (seeds and problems resampled, paired on problems), and
draws one plot per task.

    python benchmarks/learning_per_iteration.py --variant before --checkout /tmp/before --task chat-add1 --seeds 0 1 2
    python benchmarks/learning_per_iteration.py --variant after --task chat-add1 --seeds 0 1 2
    python benchmarks/learning_per_iteration.py --variant no-kl --task chat-add1 --seeds 0 --train-args "--kl-reward-coeff 0"
    python benchmarks/learning_per_iteration.py --summary
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "per_iteration"
DEFAULT_MODEL = Path("runs/smollm2-135m-instruct")
TASKS = ("chat-add1", "chat-add2")


def held_out_examples(task: str):
    """The problems every variant is evaluated on (see the module docstring)."""
    from ppo_objectives.train.text import arithmetic_examples

    if task == "chat-add1":
        return arithmetic_examples(task, "eval") + arithmetic_examples(task, "train")
    return arithmetic_examples(task, "eval")


def one_run(model: Path, task: str, seed: int, iterations: int, eval_every: int, threads: int,
            train_args: list[str]) -> dict:
    """Train one seed with the checkout on ``sys.path``; returns its row (held-out correctness per evaluation)."""
    import torch

    from ppo_objectives import train as T
    from ppo_objectives.llm.hf import HFCausalLMAdapter
    from ppo_objectives.train.pretrained import load_tokenizer
    from ppo_objectives.train.text import TextTask, evaluate, number_reward

    task_eval = TextTask(held_out_examples(task), number_reward, load_tokenizer(model), max_new_tokens=16)
    evals: dict[int, list[float]] = {}
    times: list[float] = []

    def greedy(lm, iteration: int) -> None:
        evals[iteration] = evaluate(lm, task_eval, greedy=True).rewards
        print(f"  iteration {iteration}: held-out greedy {statistics.mean(evals[iteration]):.3f}", file=sys.stderr,
              flush=True)

    def after_each_iteration(row: dict, run) -> None:
        times.append(row["rollout_s"] + row["reference_s"] + row["update_s"])
        it = int(row["iteration"])
        if it % eval_every == 0 or it == iterations:
            greedy(run.ac.actor_model, it)

    with tempfile.TemporaryDirectory(prefix="per_iteration_") as out:
        flags = ["--model", str(model), "--task", task, "--seed", str(seed), "--iterations", str(iterations),
                 "--out", out, "--threads", str(threads), "--no-progress", "--no-plot", "--save-every", "100000",
                 "--eval-every", "0", *train_args]
        cfg = T.TrainConfig(**vars(T.build_parser().parse_args(flags)))
        t0 = time.perf_counter()
        rows = T.train(cfg, callbacks=[after_each_iteration])
        wall = time.perf_counter() - t0
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the training's peak RSS
    from transformers import AutoModelForCausalLM

    # the pretrained model's accuracy, measured after the run so that its copy is not in the training's peak
    start = AutoModelForCausalLM.from_pretrained(str(model), local_files_only=True, dtype=torch.float32)
    if threads:
        torch.set_num_threads(threads)
    greedy(HFCausalLMAdapter(start), 0)
    keep = ("iteration", "reward", "kl_ref", "early_stopped", "rolled_back", "collapse", "response_len")
    return dict(task=task, seed=seed, iterations=iterations, train_args=train_args,
                held_out=len(task_eval.examples), evals={str(k): evals[k] for k in sorted(evals)},
                iteration_s=times, wall_s=wall, peak_rss_gib=peak_gib,
                rows=[{k: r.get(k) for k in keep} for r in rows if r["iteration"] > 0])


def run_variant(args) -> int:
    checkout = Path(args.checkout).resolve() if args.checkout else HERE.parents[1]
    for seed in args.seeds:
        path = RESULTS / args.task / args.variant / f"seed{seed}.json"
        if path.exists():
            print(f"{path} exists: skipped", file=sys.stderr)
            continue
        print(f"{args.task} {args.variant} seed {seed} (from {checkout})", file=sys.stderr, flush=True)
        cmd = [sys.executable, str(HERE), "--one-run", "--task", args.task, "--seeds", str(seed), "--model",
               str(Path(args.model).resolve()), "--iterations", str(args.iterations), "--eval-every",
               str(args.eval_every), "--threads", str(args.threads), "--train-args", args.train_args,
               "--row-out", str(path)]
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        rc = subprocess.call(cmd, env=env, cwd=checkout)
        if rc:
            print(f"error: the run of {args.variant} seed {seed} failed (exit {rc})", file=sys.stderr)
            return rc
    return 0


def bootstrap_diff(a: list[list[float]], b: list[list[float]], n: int = 4000, seed: int = 0) -> tuple:
    """Mean of ``b`` minus mean of ``a`` (each a list of per-seed correctness lists over the same problems), and
    its 95% interval: seeds resampled within each side, problems resampled jointly (paired)."""
    rng = random.Random(seed)
    P = len(a[0])
    point = statistics.mean(map(statistics.mean, b)) - statistics.mean(map(statistics.mean, a))
    diffs = []
    for _ in range(n):
        probs = [rng.randrange(P) for _ in range(P)]
        sa = [a[rng.randrange(len(a))] for _ in a]
        sb = [b[rng.randrange(len(b))] for _ in b]
        ma = sum(s[p] for s in sa for p in probs) / (len(sa) * P)
        mb = sum(s[p] for s in sb for p in probs) / (len(sb) * P)
        diffs.append(mb - ma)
    diffs.sort()
    return point, diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


def summary(plot: bool, baseline: str) -> int:
    for task_dir in sorted(p for p in RESULTS.glob("*") if p.is_dir()):
        runs: dict[str, list[dict]] = {}
        for f in sorted(task_dir.glob("*/seed*.json")):
            runs.setdefault(f.parent.name, []).append(json.loads(f.read_text()))
        if not runs:
            continue
        points = sorted({int(k) for rs in runs.values() for r in rs for k in r["evals"]})
        names = sorted(runs)
        held = {r["held_out"] for rs in runs.values() for r in rs}
        print(f"\n## {task_dir.name}: held-out greedy accuracy per iteration ({'/'.join(map(str, held))} problems)\n")
        print("| iteration | " + " | ".join(f"{n} (seeds: {len(runs[n])})" for n in names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for it in points:
            cells = []
            for n in names:
                accs = [statistics.mean(r["evals"][str(it)]) for r in runs[n] if str(it) in r["evals"]]
                cells.append(f"{statistics.mean(accs):.3f} ({min(accs):.2f}-{max(accs):.2f})" if accs else "")
            print(f"| {it} | " + " | ".join(cells) + " |")
        pairs = ([(baseline, n) for n in names if n != baseline] if baseline in names
                 else [(a, b) for i, a in enumerate(names) for b in names[i + 1:]])
        for a, b in pairs:
            print(f"\n{b} - {a}, mean difference [95% bootstrap interval over seeds and problems]:")
            for it in points:
                ea = [r["evals"][str(it)] for r in runs[a] if str(it) in r["evals"]]
                eb = [r["evals"][str(it)] for r in runs[b] if str(it) in r["evals"]]
                if ea and eb:
                    d, lo, hi = bootstrap_diff(ea, eb)
                    print(f"  iteration {it:3d}: {d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
        for n in names:
            secs = [s for r in runs[n] for s in r["iteration_s"][1:]]
            flags = sum(int(row.get("early_stopped") or 0) for r in runs[n] for row in r["rows"])
            peaks = [r["peak_rss_gib"] for r in runs[n] if "peak_rss_gib" in r]
            peak = f", peak RSS {min(peaks):.2f}-{max(peaks):.2f} GiB" if peaks else ""
            print(f"{n}: median {statistics.median(secs):.1f} s per iteration (job's clock, threads as run), "
                  f"{flags} early-stopped iterations{peak}")
        if plot:
            _plot(task_dir.name, runs, names)
    return 0


def _plot(task: str, runs: dict, names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        for j, r in enumerate(runs[n]):
            its = sorted(int(k) for k in r["evals"])
            ax.plot(its, [statistics.mean(r["evals"][str(k)]) for k in its], alpha=0.8,
                    color=f"C{names.index(n)}", label=n if j == 0 else None)
    ax.set(xlabel="iteration", ylabel="held-out greedy accuracy", title=f"{task}: each line one seed", ylim=(0, 1.02))
    ax.legend()
    fig.tight_layout()
    path = RESULTS / f"{task}.png"
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--variant", help="the label of this variant (a folder name under results/per_iteration/TASK)")
    p.add_argument("--checkout", default="", help="the checkout whose ppo_objectives runs (default: this one)")
    p.add_argument("--task", choices=TASKS, default="chat-add1")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="checkpoint directory (python -m ppo_objectives.pretrained --gguf smollm2 --out DIR)")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (two runs at a time: 1 each)")
    p.add_argument("--train-args", default="", help="extra flags of the job for this variant")
    p.add_argument("--summary", action="store_true", help="print the tables and draw the plots of every result")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--baseline", default="before", help="--summary: the variant the others are compared with")
    p.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.summary:
        return summary(not args.no_plot, args.baseline)
    if args.one_run:
        row = one_run(args.model, args.task, args.seeds[0], args.iterations, args.eval_every, args.threads,
                      args.train_args.split())
        args.row_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.row_out.with_suffix(".tmp")
        tmp.write_text(json.dumps(row))
        tmp.replace(args.row_out)
        return 0
    if not args.variant:
        p.error("--variant is required (or --summary)")
    if args.iterations < 1 or args.eval_every < 1:
        p.error("--iterations and --eval-every must be >= 1")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a checkpoint directory; write it with: python -m "
                f"ppo_objectives.pretrained --gguf smollm2 --out {args.model}")
    if args.checkout and not (Path(args.checkout) / "ppo_objectives").is_dir():
        p.error(f"--checkout {args.checkout} has no ppo_objectives package")
    return run_variant(args)


if __name__ == "__main__":
    raise SystemExit(main())

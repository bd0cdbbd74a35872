"""What the critic buys: PPO with a critic against critic-free estimators, a plain loop and TRL, on SmolLM2.

What it compares, per task, on the same model, training prompts, reward and held-out problems
(200 per task; greedy and sampled at T = 1 at the start and after the first iteration past every
5 training minutes), 15 training minutes a run, seeds 0, 1, 2:

- ``ppo``: the job's recipe, PPO with the critic (``python -m ppo_objectives.train``);
- ``grpo`` / ``rloo``: the same job with ``--advantage grpo`` / ``--advantage rloo`` (no critic);
- ``grpo8`` / ``rloo8``: the same with groups of 8 answers per prompt instead of 4;
- ``plain``: the plain PyTorch policy-gradient loop of ``plain_pg_loop.py``;
- ``trl``: TRL's ``GRPOTrainer``, its defaults but for the settings with a counterpart in the job
  (``sides.TRL_SETTINGS``; every default in force is recorded in its rows); on ``chat-calc`` with the
  same tool, or its refusal.

Tasks: ``chat-add2`` (two-digit addition, 16 tokens), ``chat-calc`` (multi-turn, a calculator tool)
and ``chat-word`` (two-step word problems with factors up to 6, after one worked exchange, answered
with their working, 64 tokens).

Training time is each side's own clock (generation, scoring, updates; evaluations excluded). Each
run is a process of its own with one torch thread, pinned to a core of its own; run two at a time
(``--runs`` in pairs) so that both see the same load. Each finished run's row (with the machine's
CPU) is written at once to ``benchmarks/results/critic/TASK/SIDE/seedS.json`` and a re-run skips the
rows already there. Minutes compare only within one machine: on another, give ``--results DIR`` and
run every side that the comparison needs there; the summary warns when a task's rows come from more than one.

``--summary`` prints, per task: held-out accuracy (greedy / sampled) at 0, 5, 10 and 15 minutes,
median over seeds, each with the median training minute it was measured at (a side evaluates after
the first iteration past each mark, so up to one iteration late); the minutes and the rollout samples
to reach 0.9 of the best side's final sampled accuracy (median over the seeds that reach it, and how many
do when not all); the iterations (optimizer steps for TRL) and
rollout tokens of the whole run; seconds per iteration; peak memory; and,
for each other side, the difference ``ppo - side`` at 5, 10 and 15 minutes over seeds with a
bootstrap 95% interval (seeds resampled on both sides); where ``grpo8`` or ``rloo8`` ran, the rollout answers that
the job (one answer per prompt) and that side needed to reach the side's final accuracy, and their ratio. It draws
``benchmarks/critic_TASK.png``: held-out sampled accuracy against training minutes, iterations and rollout tokens.

    pip install -e ".[bench]"        # TRL, outside the library's own dependencies
    python benchmarks/study_critic.py --model runs/smollm2 --runs chat-add2:ppo:0 chat-add2:grpo:0
    python benchmarks/study_critic.py --summary
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from sides import (
    at_minutes,
    check_model,
    evaluated,
    machine,
    mark_evaluation,
    median,
    reach_cell,
    run_side,
    run_specs,
    runner_arguments,
    train_minutes,
    warn_machines,
)

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "critic"
TASKS = ("chat-add2", "chat-calc", "chat-calc-sum", "chat-word")
SIDES = {"ppo": [], "grpo": ["--advantage", "grpo"], "rloo": ["--advantage", "rloo"], "plain": None, "trl": None,
         # SAO's claim: one rollout per prompt with a critic against groups of 8, in rollout answers to an accuracy
         "grpo8": ["--advantage", "grpo", "--group-size", "8"], "rloo8": ["--advantage", "rloo", "--group-size", "8"]}
MARKS = (0, 5, 10, 15)
MINUTES = 15.0


def row_path(results: Path, spec: str) -> Path:
    task, side, seed = spec.split(":")
    return results / task / side / f"seed{seed}.json"


def one_run(model: Path, task: str, side: str, seed: int, minutes: float) -> dict:
    return dict(task=task, side=side, seed=seed, minutes=minutes, machine=machine(),
                **run_side(model, task, side, seed, minutes, SIDES[side]))


def load_runs(results: Path | None = None) -> dict[str, dict[str, list[dict]]]:
    """``{task: {side: [run, ...]}}`` of the rows written so far under ``results`` (default: the study's)."""
    runs: dict[str, dict[str, list[dict]]] = {}
    for path in sorted((RESULTS if results is None else results).glob("*/*/seed*.json")):
        run = json.loads(path.read_text())
        runs.setdefault(run["task"], {}).setdefault(run["side"], []).append(run)
    return runs


def bootstrap_diff(a: list[float], b: list[float], n: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """``mean(a) - mean(b)`` and its bootstrap 95% interval, each side's seeds resampled with replacement."""
    rng = random.Random(seed)
    diffs = sorted(statistics.fmean(rng.choices(a, k=len(a))) - statistics.fmean(rng.choices(b, k=len(b)))
                   for _ in range(n))
    return statistics.fmean(a) - statistics.fmean(b), diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


def difference_line(label: str, a: list[list[dict]], b: list[list[dict]]) -> str:
    """``- label (N against M seeds): 5 min d [lo, hi]; ...``: ``mean(a) - mean(b)`` of the held-out sampled accuracy
    at each mark after 0 with its bootstrap 95% interval (:func:`bootstrap_diff`); ``a`` and ``b`` hold one run's
    rows per seed."""
    cells = []
    for m in MARKS[1:]:
        d, lo, hi = bootstrap_diff([at_minutes(rows, "eval_sampled", m) for rows in a],
                                   [at_minutes(rows, "eval_sampled", m) for rows in b])
        cells.append(f"{m} min {d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    thin = "; a side of one seed has no spread of its own, so this is not yet a test" if min(len(a), len(b)) < 2 else ""
    return f"- {label} ({len(a)} against {len(b)} seeds{thin}): " + "; ".join(cells)


def reach(rows: list[dict], target: float) -> tuple[float, float]:
    """Training minutes and rollout samples at the first evaluation whose sampled accuracy reaches ``target``."""
    samples = 0.0
    for m, r in zip(train_minutes(rows), rows):
        samples += r.get("episodes", 32.0) if r["iteration"] >= 1 else 0.0
        if evaluated(r, "eval_sampled") and r["eval_sampled"] >= target:
            return m, samples
    return float("nan"), float("nan")


def answers_line(side: str, ppo: list[list[dict]], grouped: list[list[dict]]) -> str:
    """SAO's claim checked: the rollout answers the job (one answer per prompt) and a side with groups of 8 each
    needed to reach that side's own final sampled accuracy (median over its seeds), median over the seeds that reach
    it, and their ratio (SAO: at most 0.5). Evaluations come every 5 minutes, so a count is that of the first
    evaluation past the target, not of the iteration that crossed it."""
    target = median([at_minutes(rows, "eval_sampled", MINUTES) for rows in grouped])
    cells, counts = [], []
    for name, runs in (("ppo", ppo), (side, grouped)):
        hits = [reach(rows, target)[1] for rows in runs]
        counts.append(median(hits))
        cells.append(f"{name} {reach_cell(hits, '.0f', count=True)}")
    return (f"- to {side}'s final {target:.3f}: " + ", ".join(cells) +
            f"; ppo / {side} {counts[0] / counts[1] if counts[1] else float('nan'):.2f} (SAO's claim: at most 0.50)")


def summary(results: Path, plot: bool) -> None:
    runs = load_runs(results)
    if not runs:
        print("no rows yet: run the sides first")
        return
    for task in TASKS:
        sides = runs.get(task)
        if not sides:
            continue
        warn_machines(task, [r for rs in sides.values() for r in rs])
        print(f"\n## {task}\n")
        done = {s: [r for r in rs if not r.get("refused")] for s, rs in sides.items()}
        finals = {s: median([at_minutes(r["rows"], "eval_sampled", MINUTES) for r in rs]) for s, rs in done.items()}
        target = 0.9 * max((v for v in finals.values() if v == v), default=float("nan"))
        print("| side | seeds | " + " | ".join(f"{m} min" for m in MARKS) + " | "
              f"minutes to {target:.2f} | samples to "
              f"{target:.2f} | iterations | rollout tokens | s per iteration | peak GiB |")
        print("|---|---|" + "---|" * len(MARKS) + "---|---|---|---|---|---|")
        for side, rs in sides.items():
            if not done[side]:
                print(f"| {side} | refused: {rs[0]['refused'][:160]} |")
                continue
            cells = [f"{median([at_minutes(r['rows'], 'eval_greedy', m) for r in done[side]]):.3f} / "
                     f"{median([at_minutes(r['rows'], 'eval_sampled', m) for r in done[side]]):.3f} "
                     f"({median([mark_evaluation(r['rows'], m)[0] for r in done[side]]):.1f})" for m in MARKS]
            hits = [reach(r["rows"], target) for r in done[side]]
            secs = median([r_["rollout_s"] + r_["reference_s"] + r_["update_s"] for r in done[side]
                           for r_ in r["rows"] if r_["iteration"] >= 1])
            peak = median([r.get("peak_rss_gib", float("nan")) for r in done[side]])
            its = median([max(r_["iteration"] for r_ in r["rows"]) for r in done[side]])
            tokens = median([sum(r_.get("rollout_tokens", 0.0) or 0.0 for r_ in r["rows"]) for r in done[side]])
            print(f"| {side} | {len(done[side])} | " + " | ".join(cells) +
                  f" | {reach_cell([h[0] for h in hits], '.1f')} | {reach_cell([h[1] for h in hits], '.0f')} | "
                  f"{its:.0f} | {tokens:,.0f} | {secs:.1f} | {peak:.2f} |")
        if "ppo" in done and done["ppo"]:
            print("\nppo - side, held-out sampled accuracy, mean over seeds [bootstrap 95%]:\n")
            for side in (s for s in done if s != "ppo" and done[s]):
                print(difference_line(side, [r["rows"] for r in done["ppo"]], [r["rows"] for r in done[side]]))
            grouped = [s for s in ("grpo8", "rloo8") if done.get(s)]
            if grouped:
                print("\nrollout answers to a side's final accuracy, the job's one answer per prompt against groups of 8 "
                      "(median over the seeds that reach it):\n")
                for side in grouped:
                    print(answers_line(side, [r["rows"] for r in done["ppo"]], [r["rows"] for r in done[side]]))
        if plot:
            _plot(task, done, HERE.parent if results == RESULTS else results)


def _plot(task: str, sides: dict[str, list[dict]], where: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for k, (side, rs) in enumerate(sides.items()):
        for j, run in enumerate(rs):
            rows = run["rows"]
            tokens, total = [], 0.0
            for r in rows:
                total += r.get("rollout_tokens", 0.0) or 0.0
                tokens.append(total)
            xs = (train_minutes(rows), [r["iteration"] for r in rows], tokens)
            for ax, x in zip(axes, xs):
                pts = [(xi, r["eval_sampled"]) for xi, r in zip(x, rows) if evaluated(r, "eval_sampled")]
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=f"C{k}", alpha=0.8, label=side if j == 0 else None)
    for ax, label in zip(axes, ("training minutes", "iterations (optimizer steps for trl)", "rollout tokens")):
        ax.set(xlabel=label)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="held-out accuracy, sampled at T = 1", ylim=(0, 1.02))
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{task} on SmolLM2-135M-Instruct, 200 held-out problems, one line per seed")
    fig.tight_layout()
    path = where / f"critic_{task}.png"
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> int:
    p = runner_arguments(__doc__, [f"{t}:{s}:{k}" for t in TASKS for k in (0, 1, 2) for s in SIDES], MINUTES, "TASK:SIDE:SEED",
                         RESULTS)
    args = p.parse_args(argv)
    if args.summary:
        summary(args.results, not args.no_plot)
        return 0
    check_model(p, args.model)
    for spec in [args.one_run] if args.one_run else args.runs:
        task, side, seed = (spec.split(":") + ["", ""])[:3]
        if task not in TASKS or side not in SIDES or not seed.isdigit():
            p.error(f"--runs {spec}: give TASK:SIDE:SEED with TASK one of {list(TASKS)} and SIDE one of "
                    f"{list(SIDES)}, e.g. chat-add2:ppo:0")

    def run(spec: str) -> dict:
        task, side, seed = spec.split(":")
        return one_run(args.model, task, side, int(seed), args.minutes)

    return run_specs(HERE, args, row_path, run, lambda: summary(args.results, not args.no_plot))


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the main job learn? Its default recipe over many seeds and every task, as a distribution.

Runs ``python -m ppo_objectives.train`` (the default recipe, nothing tuned) for
``--seeds`` seeds of each ``--task``, ``--jobs`` processes at a time, each with
``--threads`` torch threads, and reads back every run's ``metrics.csv``. Per seed it
prints the mean reward of the 10 iterations ending at iterations 50, 100 and the
last one, the exact-match rate of the last 10, the collapses the job's collapse
guard declared (5+ bad iterations in a row: EOS-first answers, no reward, or a
deterministic policy that does not solve the task), the iterations with a
per-token KL spike, the trust-region steps undone, wall time and iterations/s.
Then min / median / max over seeds and a ``Goals:`` block.

Learning is a property of a distribution, so the same command should be run
again with the floating-point path perturbed (``--threads 2``: other reduction
orders in every matrix product; the runs diverge from the one-thread runs within
a few iterations) and the goals must hold both times.

    python benchmarks/bench_learning.py                          # 16 seeds x reverse/copy/add, 300 its
    python benchmarks/bench_learning.py --tasks reverse --threads 2
    python benchmarks/bench_learning.py --quick                  # 2 seeds x 40 its, a smoke test
    python benchmarks/bench_learning.py --train-args "--no-rollback"   # MiniMind's early stop, for comparison
    python benchmarks/bench_learning.py --tasks reverse --baseline-args "--lr 1e-3 --no-rollback" --baseline-seeds 8

``--baseline-args`` runs a second recipe (the default plus those flags) on the first
``--baseline-seeds`` seeds, interleaved with the default runs so that both meet the same
machine load, and prints its table, its collapses, the ratio of iterations/s and whether the two
recipes' last-10 rewards on the same seeds differ (medians, Mann-Whitney U permutation test); the plot
adds the baseline's median and quartile band in orange.

    python benchmarks/bench_learning.py --tasks reverse --baseline-args "--collector-backend ray --workers 2" \
        --baseline-seeds 16

Outputs under ``--out`` (default ``runs/bench_learning``): one folder per run,
``summary.csv`` (one row per run) and ``learning.png`` (``--plot``: reward and response length
per task, the median over seeds with its quartile and min-max bands, every seed faint, collapsed
seeds in red).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package of this checkout

from ppo_objectives.train import read_metrics

GOAL_REWARD, GOAL_EXACT = 0.95, 0.9  # reverse: mean reward / exact match of the last 10 iterations


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _window(rows, end: int, key: str = "reward", width: int = 10) -> float:
    """Mean of ``key`` over the ``width`` iterations ending at iteration ``end`` (nan if not reached)."""
    xs = [r[key] for r in rows if end - width < r["iteration"] <= end]
    return statistics.fmean(xs) if len(xs) == width or (xs and end >= rows[-1]["iteration"]) else float("nan")


def run_one(task: str, seed: int, args, out: Path, recipe: str = "default") -> dict:
    extra = shlex.split(args.train_args) + (shlex.split(args.baseline_args) if recipe == "baseline" else [])
    out = out / recipe if recipe != "default" else out
    run_dir = out / task / f"seed{seed}"
    cmd = [sys.executable, "-m", "ppo_objectives.train", "--task", task, "--seed", str(seed),
           "--iterations", str(args.iterations), "--threads", str(args.threads), "--out", str(run_dir),
           "--overwrite", "--no-progress", "--no-plot", *extra]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = run_dir / "wall_s.txt"  # written last: the run finished
    if args.reuse and done.exists() and len(read_metrics(run_dir / "metrics.csv")) == args.iterations:
        wall = float(done.read_text())
    else:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        (out / task).mkdir(parents=True, exist_ok=True)
        (out / task / f"seed{seed}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        done.write_text(f"{wall:.3f}")
    rows = read_metrics(run_dir / "metrics.csv")
    last = int(rows[-1]["iteration"])
    starts = sum(1 for a, b in zip([{"collapse": 0.0}] + rows, rows) if b["collapse"] and not a["collapse"])
    return dict(
        recipe=recipe, task=task, seed=seed, start=_window(rows, 10), r50=_window(rows, 50), r100=_window(rows, 100),
        r_last=_window(rows, last), exact=_window(rows, last, "exact"), collapses=starts,
        collapsed_its=int(sum(r["collapse"] for r in rows)), spikes=int(sum(r["warn_kl_spike"] for r in rows)),
        rolled_back=int(sum(r.get("rolled_back", 0) for r in rows)), wall_s=wall, its_per_s=len(rows) / wall,
        iterations=last, rows=rows,
    )  # fmt: skip


def _fmt(x: float, spec: str = ".3f") -> str:
    return "   -" if x != x else format(x, spec)


def print_table(results: list[dict], args) -> None:
    head = (f"{'task':8s} {'seed':>4s} {'r@10':>6s} {'r@50':>6s} {'r@100':>6s} {'r@last':>6s} {'exact':>6s} "
            f"{'collapses':>9s} {'spikes':>6s} {'pulled':>6s} {'wall_s':>7s} {'it/s':>6s}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['task']:8s} {r['seed']:4d} {_fmt(r['start']):>6s} {_fmt(r['r50']):>6s} {_fmt(r['r100']):>6s} "
              f"{_fmt(r['r_last']):>6s} {_fmt(r['exact'], '.2f'):>6s} {r['collapses']:9d} {r['spikes']:6d} "
              f"{r['rolled_back']:6d} {r['wall_s']:7.1f} {r['its_per_s']:6.2f}")  # fmt: skip
    print()
    print(f"distribution over seeds (min / median / max), {args.iterations} iterations:")
    for task in args.tasks:
        rs = [r for r in results if r["task"] == task]
        line = [f"  {task:8s}"]
        for key, spec in (("r_last", ".3f"), ("exact", ".2f"), ("its_per_s", ".2f")):
            xs = [r[key] for r in rs]
            line.append(f"{key} {min(xs):{spec}} / {statistics.median(xs):{spec}} / {max(xs):{spec}}")
        line.append(f"collapses {sum(r['collapses'] for r in rs)} in {sum(r['collapses'] > 0 for r in rs)}"
                    f"/{len(rs)} seeds")
        print(";  ".join(line))


def print_goals(results: list[dict], args, baseline: list[dict]) -> None:
    print("\nGoals:")
    for task in args.tasks:
        rs = [r for r in results if r["task"] == task]
        collapsed = sum(r["collapses"] > 0 for r in rs)
        if task == "reverse":
            ok = [r for r in rs if r["r_last"] >= GOAL_REWARD and r["exact"] >= GOAL_EXACT and not r["collapses"]]
            verdict = "met" if len(ok) == len(rs) else "NOT met"
            print(f"  reverse: {len(ok)}/{len(rs)} seeds with last-10 reward >= {GOAL_REWARD}, exact >= {GOAL_EXACT} "
                  f"and no collapse (goal: all) -> {verdict}")
        else:
            print(f"  {task}: {collapsed}/{len(rs)} seeds collapsed (goal: none) -> "
                  f"{'met' if not collapsed else 'NOT met'}; median last-10 reward "
                  f"{statistics.median(r['r_last'] for r in rs):.3f}")  # fmt: skip
    its = [r["its_per_s"] for r in results]
    print(f"  speed: median {statistics.median(its):.2f} it/s per run ({args.jobs} runs at a time, "
          f"{args.threads} thread(s) each; compare runs of the same command)")
    if baseline:
        b_its = statistics.median(r["its_per_s"] for r in baseline)
        same = [r for r in results if (r["task"], r["seed"]) in {(b["task"], b["seed"]) for b in baseline}]
        m_its = statistics.median(r["its_per_s"] for r in same)
        print(f"  speed vs baseline ({args.baseline_args}), same seeds, same run: {m_its:.2f} / {b_its:.2f} it/s "
              f"= {m_its / b_its:.2f}x (goal >= 1.0x) -> {'met' if m_its >= b_its else 'NOT met'}")
        print(f"  baseline collapses: {sum(r['collapses'] > 0 for r in baseline)}/{len(baseline)} seeds; "
              f"default: {sum(r['collapses'] > 0 for r in same)}/{len(same)} on the same seeds")
        print(same_distribution([r["r_last"] for r in same], [r["r_last"] for r in baseline]))


def same_distribution(a: list[float], b: list[float], draws: int = 5000) -> str:
    """The last-10 rewards of the default (``a``) and the baseline (``b``): their medians and a two-sided
    permutation test of the Mann-Whitney U statistic (is one recipe's reward stochastically larger?)."""

    def u(x, y):
        return sum((p > q) + 0.5 * (p == q) for p in x for q in y)

    centre = len(a) * len(b) / 2
    observed = abs(u(a, b) - centre)
    pooled, rng, hits = a + b, random.Random(0), 0
    for _ in range(draws):
        rng.shuffle(pooled)
        hits += abs(u(pooled[: len(a)], pooled[len(a) :]) - centre) >= observed
    p = hits / draws
    verdict = "no difference detected" if p >= 0.05 else "the distributions differ"
    return (f"  last-10 reward, default vs baseline on the same seeds: median {statistics.median(a):.3f} vs "
            f"{statistics.median(b):.3f}; Mann-Whitney U permutation test p = {p:.2f} ({verdict} at 0.05)")


def write_summary(results: list[dict], out: Path) -> None:
    keys = [k for k in results[0] if k != "rows"]
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows({k: r[k] for k in keys} for r in results)


def _bands(runs: list[list[float]]) -> tuple[list[float], ...]:
    """Per iteration over seeds: min, 25th percentile, median, 75th percentile, max."""
    cols = list(zip(*runs))
    quart = [statistics.quantiles(c, n=4, method="inclusive") if len(c) > 1 else [c[0]] * 3 for c in cols]
    return ([min(c) for c in cols], [q[0] for q in quart], [q[1] for q in quart], [q[2] for q in quart],
            [max(c) for c in cols])


def _plot_signal(ax, task_runs: list[dict], key: str) -> None:
    """One task's ``key`` curve: the median over seeds, the quartile and min-max bands, every seed faint."""
    n = min(len(r["rows"]) for r in task_runs)
    it = [x["iteration"] for x in task_runs[0]["rows"][:n]]
    runs = [[x[key] for x in r["rows"][:n]] for r in task_runs]
    for r, y in zip(task_runs, runs):
        ax.plot(it, y, lw=0.5, alpha=0.9 if r["collapses"] else 0.25, color="red" if r["collapses"] else "grey")
    lo, q1, med, q3, hi = _bands(runs)
    ax.fill_between(it, lo, hi, color="C0", alpha=0.15, lw=0, label="min-max")
    ax.fill_between(it, q1, q3, color="C0", alpha=0.35, lw=0, label="25-75%")
    ax.plot(it, med, color="C0", lw=2, label="median")
    ax.grid(alpha=0.3)


def _plot_baseline(ax, task_runs: list[dict], key: str, label: str) -> None:
    """The baseline recipe's ``key``: its median and quartile band, in a second colour."""
    n = min(len(r["rows"]) for r in task_runs)
    it = [x["iteration"] for x in task_runs[0]["rows"][:n]]
    _, q1, med, q3, _ = _bands([[x[key] for x in r["rows"][:n]] for r in task_runs])
    ax.fill_between(it, q1, q3, color="C1", alpha=0.25, lw=0)
    ax.plot(it, med, color="C1", lw=1.5, label=f"median, {label}")


def plot(results: list[dict], args, out: Path, baseline: list[dict] = ()) -> Path:
    """Reward and response length per task: median and bands over seeds (collapsed seeds in red); the baseline
    recipe's median and quartiles in orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(args.tasks), figsize=(5 * len(args.tasks), 7), squeeze=False, sharex=True)
    for col, task in enumerate(args.tasks):
        task_runs = [r for r in results if r["task"] == task]
        _plot_signal(axes[0, col], task_runs, "reward")
        _plot_signal(axes[1, col], task_runs, "response_len")
        base_runs = [r for r in baseline if r["task"] == task]
        if base_runs:
            for row, key in ((0, "reward"), (1, "response_len")):
                _plot_baseline(axes[row, col], base_runs, key, f"{args.baseline_args} ({len(base_runs)} seeds)")
        n_bad = sum(r["collapses"] > 0 for r in task_runs)
        axes[0, col].set_title(f"{task}: reward over {len(task_runs)} seeds ({n_bad} collapsed, red)")
        axes[0, col].set_ylim(-0.02, 1.02)
        axes[0, col].legend(loc="lower right", fontsize="small")
        axes[1, col].set_title("response length (tokens)")
        axes[1, col].set_ylim(bottom=0)
        axes[1, col].set_xlabel("iteration")
    fig.suptitle(f"bench_learning: {args.seeds} seeds, threads={args.threads}, {_cpu_name()}")
    fig.tight_layout()
    path = Path(args.plot) if args.plot else out / "learning.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=16, help="seeds 0..K-1 of each task")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--tasks", nargs="+", default=["reverse", "copy", "add"], choices=["reverse", "copy", "add"])
    p.add_argument("--iterations", type=int, default=300, help="the main job's default")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (2 on 2 cores)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (2 perturbs the float path)")
    p.add_argument("--train-args", default="", help="extra flags for the training job, e.g. '--no-rollback'")
    p.add_argument("--baseline-args", default="", help="flags of a second recipe to compare, e.g. "
                   "'--lr 1e-3 --no-rollback' (the recipe before the trust-region fix)")
    p.add_argument("--baseline-seeds", type=int, default=4, help="seeds of the baseline recipe (the first K)")
    p.add_argument("--out", default="runs/bench_learning")
    p.add_argument("--plot", default=None, help="where to draw the curves (default: OUT/learning.png)")
    p.add_argument("--quick", action="store_true", help="2 seeds x 40 iterations: a smoke test")
    p.add_argument("--reuse", action="store_true", help="read the runs already finished under --out (same "
                   "command) instead of running them again: an interrupted benchmark continues")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.iterations = 2, 40
    if args.seeds < 1 or args.jobs < 1 or args.iterations < 10:
        p.error("--seeds and --jobs must be >= 1 and --iterations >= 10")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"bench_learning: {_cpu_name()}, {os.cpu_count()} cores, python {platform.python_version()}; "
          f"{args.seeds} seeds x {args.tasks}, {args.iterations} iterations, {args.jobs} at a time, "
          f"--threads {args.threads} {args.train_args}".rstrip())
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = []
    for task in args.tasks:
        for i, seed in enumerate(seeds):
            jobs.append((task, seed, "default"))
            if args.baseline_args and i < args.baseline_seeds:
                jobs.append((task, seed, "baseline"))  # interleaved: both recipes see the same load
    from tqdm import tqdm

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool, tqdm(total=len(jobs), desc="runs", file=sys.stderr) as bar:
        futures = [pool.submit(run_one, task, seed, args, out, recipe) for task, seed, recipe in jobs]
        everything = []
        for fut in futures:
            everything.append(r := fut.result())
            bar.update(1)
            bar.set_postfix(last=f"{r['recipe']} {r['task']}/{r['seed']}: {r['r_last']:.2f}")
    print(f"{len(jobs)} runs in {time.perf_counter() - t0:.0f} s\n")
    results = [r for r in everything if r["recipe"] == "default"]
    baseline = [r for r in everything if r["recipe"] == "baseline"]
    print_table(results, args)
    if baseline:
        print(f"\nbaseline recipe: {args.baseline_args}")
        print_table(baseline, args)
    print_goals(results, args, baseline)
    write_summary(everything, out)
    print(f"\nper-run rows: {out / 'summary.csv'}; curves: {plot(results, args, out, baseline)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

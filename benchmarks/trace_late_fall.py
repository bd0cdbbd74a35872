"""Where a late fall happens: the job's recipe evaluated on the held-out problems after every update.

Two of the study's runs of the job fell between their last two evaluations while their training
reward stayed level (``chat-add2`` seed 2: 0.710 to 0.445 held-out sampled; ``chat-calc-sum``
seed 0: 0.975 to 0.865). An evaluation every 5 training minutes cannot tell a slow decline from
one update that breaks the policy and the next that mends it. This script runs the study's
``ppo`` side (``study_critic.py``: the same flags, seed and training minutes) with a held-out
evaluation after every update as well. The evaluation draws from a generator of its own, so the
training run is the study's, random number for random number: its training rewards match the
study's row iteration by iteration where the machine and the code are the same (``--summary``
says whether they do). Each finished run's row is written at once to
``benchmarks/results/late_fall/TASK/seedS.json``; a re-run skips the rows already there.

``--summary`` prints, per run and update: the training reward (of the rollouts before the update)
and the study's at that iteration, held-out greedy and sampled accuracy after the update, the
change in sampled accuracy since the previous update, the sequence KL to the reference and the
entropy; then the largest one-update fall beside the binomial standard error of the evaluation.

    python benchmarks/trace_late_fall.py --model runs/smollm2 --runs chat-calc-sum:0
    python benchmarks/trace_late_fall.py --summary
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from sides import check_model, job_run, machine, run_specs, runner_arguments
from study_critic import TASKS, load_runs

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "late_fall"
STUDY = HERE.parent / "results" / "critic-xeon"
MINUTES = 15.0


def row_path(results: Path, spec: str) -> Path:
    task, seed = spec.split(":")
    return results / task / f"seed{seed}.json"


def one_run(model: Path, task: str, seed: int, minutes: float) -> dict:
    return dict(task=task, seed=seed, minutes=minutes, machine=machine(),
                **job_run(model, task, seed, minutes, ["--eval-every", "1"], eval_minutes=0.0))


def summary(results: Path, study: Path) -> None:
    studied = load_runs(study) if study.exists() else {}
    paths = sorted(results.glob("*/seed*.json"))
    if not paths:
        print("no rows yet: run a trace first")
        return
    for path in paths:
        run = json.loads(path.read_text())
        ref = {r["seed"]: r for r in studied.get(run["task"], {}).get("ppo", [])}.get(run["seed"])
        ref_reward = {int(r["iteration"]): r["reward"] for r in ref["rows"]} if ref else {}
        print(f"\n## {run['task']}, seed {run['seed']} ({run['machine']})\n")
        print("| iteration | training reward | study's | greedy after | sampled after | change | seq KL | entropy |")
        print("|---|---|---|---|---|---|---|---|")
        previous, falls, same = None, [], []
        for r in run["rows"]:
            it = int(r["iteration"])
            in_study = it >= 1 and it in ref_reward
            if in_study:
                same.append(ref_reward[it] == r["reward"])
            study_cell = f"{ref_reward[it]:.3f}" if in_study else ""
            change = r["eval_sampled"] - previous if previous is not None else float("nan")
            if change == change:
                falls.append((change, it))
            previous = r["eval_sampled"]
            print(f"| {it} | {r['reward']:.3f} | {study_cell} | {r['eval_greedy']:.3f} | {r['eval_sampled']:.3f} | "
                  f"{change:+.3f} | {r['seq_kl']:.2f} | {r['entropy']:.3f} |")
        n = 200
        worst = min(falls, default=(float("nan"), -1))
        p = previous if previous is not None else float("nan")
        se = math.sqrt(2 * p * (1 - p) / n)  # of a difference of two independent 200-problem evaluations
        fall = (f"largest one-update fall of held-out sampled accuracy: {worst[0]:+.3f} (update {worst[1]})"
                if worst[0] < 0 else "no update lowered held-out sampled accuracy")
        print(f"\n{fall}; the standard error of a difference of two {n}-problem evaluations at {p:.2f}: {se:.3f}")
        if same:
            print(f"training rewards equal to the study's row at {sum(same)} of {len(same)} iterations")


def main(argv=None) -> int:
    default = [f"{t}:0" for t in TASKS if t == "chat-calc-sum"]
    p = runner_arguments(__doc__, default, MINUTES, "TASK:SEED", RESULTS)
    p.add_argument("--study", type=Path, default=STUDY, help="--summary: the study_critic.py rows to set beside "
                   "the trace (the same machine's)")
    args = p.parse_args(argv)
    if args.summary:
        summary(args.results, args.study)
        return 0
    for spec in [args.one_run] if args.one_run else args.runs:
        task, seed = (spec.split(":") + [""])[:2]
        if task not in TASKS or not seed.isdigit():
            p.error(f"--runs {spec}: give TASK:SEED with TASK one of {list(TASKS)}, e.g. chat-calc-sum:0")
    check_model(p, args.model)

    def run(spec: str) -> dict:
        task, seed = spec.split(":")
        return one_run(args.model, task, int(seed), args.minutes)

    return run_specs(HERE, args, row_path, run, lambda: summary(args.results, args.study))


if __name__ == "__main__":
    raise SystemExit(main())

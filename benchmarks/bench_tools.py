"""chat-calc on SmolLM2 for 20 training minutes a run: PPO with the critic against its variants and TRL.

What it compares, on the same model, the same ``chat-calc`` training prompts, tool, reward and
200 held-out problems (greedy and sampled at T = 1, every 5 training minutes):

- ``job``: ``python -m ppo_objectives.train --task chat-calc`` at its recipe: PPO with the critic,
  ``MaskedGAE`` skipping the tool's turns (``--holes skip``); seeds 0, 1, 2;
- ``job-cut``: the same with ``--holes cut`` (TorchRL's semantics for its ``valid`` key: a turn
  bootstraps from the critic's value after the tool's reply); seed 0;
- ``job-grpo``: the same with ``--advantage grpo`` (no critic, groups of 4); seed 0;
- ``plain``: the plain PyTorch policy-gradient loop (``plain_pg_loop.py``, as a user writes it:
  ``generate`` turn by turn, a group baseline over 4 conversations of each of 8 prompts, one AdamW
  step at 1e-5 per batch), driving the same tool turns: it shares with the job the model, the
  training prompts, the tool, the tokens of the tool's turns (``TextTask.env_turn_ids``), the
  reward, the turn budgets and the held-out measurement; seed 0;
- ``trl``: TRL's ``GRPOTrainer`` with the same tool (``tools=[calc]``), if its tool path accepts
  SmolLM2's chat template; the row records TRL's own refusal when it does not.

Training time is each side's own clock (rollouts and updates, evaluations excluded: the job's
``--time-limit 20 --eval-minutes 5``); ``sides.py`` runs the sides. Each run is a process of its own, with one torch thread;
run two at a time so that both see the same load. Each finished run's row is written at once to
``benchmarks/results/tools/SIDE/seedS.json`` (the run's ``metrics.csv`` rows); a re-run skips the
rows already there. ``--summary`` prints held-out accuracy at 0, 5, 10 and 20 minutes (the
evaluation made for each mark: a side evaluates after the first iteration past every 5 minutes), the
iterations, seconds per iteration and the well-formed tool-call rate per side, and draws
``benchmarks/tools.png`` (held-out sampled accuracy against training minutes).

    python benchmarks/bench_tools.py --model runs/smollm2 --runs job:0 job-cut:0   # one pair, side by side
    python benchmarks/bench_tools.py --summary
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from sides import (
    at_minutes,
    check_model,
    evaluated,
    machine,
    run_side,
    run_specs,
    runner_arguments,
    train_minutes,
)

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "tools"
SIDES = {
    "job": [],
    "job-cut": ["--holes", "cut"],
    "job-grpo": ["--advantage", "grpo"],
    "plain": None,
    "trl": None,
}
MARKS = (0, 5, 10, 20)


def row_path(results: Path, spec: str) -> Path:
    side, _, seed = spec.partition(":")
    return results / side / f"seed{seed}.json"


def one_run(model: Path, side: str, seed: int, minutes: float) -> dict:
    return dict(side=side, seed=seed, minutes=minutes, machine=machine(), **run_side(model, "chat-calc", side, seed, minutes, SIDES[side]))


def summary(results: Path, plot: bool) -> None:
    found = sorted(results.glob("*/seed*.json"))
    if not found:
        print("no rows yet: run the sides first")
        return
    runs = [json.loads(p.read_text()) for p in found]
    print("| side | seed | " + " | ".join(f"greedy / sampled, {m} min" for m in MARKS)
          + " | iterations | s per iteration | tool-call rate at the end |")
    print("|---|---|" + "---|" * len(MARKS) + "---|---|---|")
    for run in runs:
        if run.get("refused"):
            print(f"| {run['side']} | {run['seed']} | refused: {run['refused'][:200]} |")
            continue
        rows = run["rows"]
        cells = [f"{at_minutes(rows, 'eval_greedy', m):.3f} / {at_minutes(rows, 'eval_sampled', m):.3f}" for m in MARKS]
        its = [r for r in rows if r["iteration"] >= 1]
        secs = statistics.median(r["rollout_s"] + r["reference_s"] + r["update_s"] for r in its)
        calls = [r["eval_tool_calls"] for r in rows if evaluated(r, "eval_tool_calls")]
        print(f"| {run['side']} | {run['seed']} | " + " | ".join(cells)
              + f" | {len(its)} | {secs:.1f} | {calls[-1] if calls else float('nan'):.3f} |")
    if plot:
        _plot(runs, HERE.parent if results == RESULTS else results)


def _plot(runs: list[dict], where: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        pts = [(m, r["eval_sampled"]) for m, r in zip(train_minutes(run["rows"]), run["rows"])
               if evaluated(r, "eval_sampled")]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{run['side']} seed {run['seed']}")
    ax.set(xlabel="training minutes (rollouts and updates)", ylabel="held-out accuracy, sampled at T = 1",
           title="chat-calc on SmolLM2-135M-Instruct, 200 held-out problems", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(where / "tools.png", dpi=120)
    print(f"plot: {where / 'tools.png'}")


def main(argv=None) -> int:
    p = runner_arguments(__doc__, ["job:0", "job-cut:0", "job-grpo:0", "plain:0", "trl:0", "job:1", "job:2"], 20.0, "SIDE:SEED",
                         RESULTS)
    args = p.parse_args(argv)
    if args.summary:
        summary(args.results, not args.no_plot)
        return 0
    check_model(p, args.model)
    for spec in [args.one_run] if args.one_run else args.runs:
        side, _, seed = spec.partition(":")
        if side not in SIDES or not seed.isdigit():
            p.error(f"--runs {spec}: give SIDE:SEED with SIDE one of {sorted(SIDES)}, e.g. job:0")

    def run(spec: str) -> dict:
        side, _, seed = spec.partition(":")
        return one_run(args.model, side, int(seed), args.minutes)

    return run_specs(HERE, args, row_path, run, lambda: summary(args.results, not args.no_plot))


if __name__ == "__main__":
    raise SystemExit(main())

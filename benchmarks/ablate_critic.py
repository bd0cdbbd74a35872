"""What each critic lever buys: the job's recipe against the recipe with one lever changed, on SmolLM2.

What it compares, per task, on the same model, training prompts, reward, held-out problems and
evaluation protocol as ``study_critic.py`` (200 per task; greedy and sampled at T = 1 at the start
and after the first iteration past every 5 training minutes), 15 training minutes a run:

- ``recipe``: ``python -m ppo_objectives.train`` at the pretrained recipe (the study's ``ppo`` side);
- one run per lever in :data:`LEVERS`, the recipe plus that lever's flags: more critic steps per
  policy step, critic-only warm-up iterations, a larger critic learning rate, a lambda of the
  policy's own (decoupled; length-adaptive), a critic with a trunk of its own (all of it trained,
  its attention frozen, or its top layers only), and GAE over turns instead of tokens;
- the best combination of the screens (``floor-0.9-warmup-2``);
- on the multi-turn task, the recipe without the warm-up it gives a cold critic when the first
  iteration's rewards are rare (``rare-reward-warmup-0``: the recipe as it was before that default),
  and with one warm-up iteration instead of two (``rare-reward-warmup-1``).

Screening runs one seed of every lever per task; the levers that move held-out sampled accuracy
by 0.05 or more then run seeds 1 and 2 (``--runs TASK:LEVER:SEED ...``). Each run is a process
of its own with one torch thread, pinned to a core of its own, two at a time, and each finished
run's row (with the machine's CPU) is written at once to ``benchmarks/results/critic_levers/
TASK/LEVER/seedS.json``; a re-run skips the rows already there.

``--summary`` prints, per task and lever: held-out sampled accuracy at 5, 10 and 15 minutes
(median over seeds), the minutes and the rollout answers to 0.9 of the best lever's final
accuracy, the iterations a run made, seconds per iteration and peak memory, and ``lever - recipe``
at each mark with a bootstrap 95% interval over seeds (a lever of one seed has no interval of its
own). ``--recipe-from DIR`` counts the ``ppo`` rows of ``study_critic.py --results DIR`` (the same
machine's) as runs of the recipe, for the seeds whose ``recipe`` row this script has not written
itself. Minutes compare only within one machine: give each machine its own ``--results``; the summary
warns when a task's rows come from more than one.

    python benchmarks/ablate_critic.py --model runs/smollm2 --runs chat-add2:recipe:0 chat-add2:critic-steps-2:0
    python benchmarks/ablate_critic.py --summary
"""

from __future__ import annotations

import json
from pathlib import Path

from sides import (at_minutes, check_model, machine, median, reach_cell, run_side, run_specs, runner_arguments,
                   warn_machines)
from study_critic import MARKS, difference_line, reach

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "critic_levers"
TASKS = ("chat-add2", "chat-calc-sum")
MINUTES = 15.0

#: Each lever: the flags it adds to the recipe.
LEVERS: dict[str, list[str]] = {
    "recipe": [],
    "critic-steps-2": ["--critic-steps", "2"],  # SAO: two critic steps per policy step
    "critic-warmup-2": ["--critic-warmup", "2"],  # value pretraining on the first policy's rollouts
    "critic-lr-3e-3": ["--critic-lr", "3e-3"],  # the critic's learning rate above the recipe's 1e-3
    "policy-lmbda-0.95": ["--policy-lmbda", "0.95"],  # decoupled GAE: lambda 1 for the critic, 0.95 for the policy
    "length-alpha-1": ["--length-alpha", "1"],  # length-adaptive lambda: 0.8 at 5 tokens, 0.95 at 20
    "length-alpha-0.05-floor-0.9": ["--length-alpha", "0.05", "--length-floor", "0.9"],  # VAPO's alpha, floored
    "own-trunk": ["--no-shared-trunk"],  # a separate value model initialised from the LM
    "own-trunk-no-attention": ["--no-shared-trunk", "--critic-train", "no-attention"],  # SAO's frozen attention
    "own-trunk-top-4": ["--no-shared-trunk", "--critic-train", "top:4"],
    "turn-level": ["--gae-level", "turn"],  # Turn-PPO (single-turn tasks: one baseline per response)
    # the combination that the chat-add2 screens chose (VAPO's pair: value pretraining and a policy lambda below the
    # critic's; the own-trunk screen moved as much but costs 1.3x the time per iteration)
    "floor-0.9-warmup-2": ["--length-alpha", "0.05", "--length-floor", "0.9", "--critic-warmup", "2"],
    # multi-turn tasks: the recipe before it warmed a cold critic up where the first rewards are rare (its rows on
    # chat-calc-sum were written as the recipe's, and moved here when the default changed)
    "rare-reward-warmup-0": ["--rare-reward-warmup", "0"],
    # the same warm-up on rare first rewards, one critic-only iteration instead of the default two
    "rare-reward-warmup-1": ["--rare-reward-warmup", "1"],
}


def applies(task: str, lever: str) -> bool:
    """Whether the job takes ``lever`` on ``task``: it refuses ``--rare-reward-warmup`` on a single-turn task."""
    if "--rare-reward-warmup" not in LEVERS[lever]:
        return True
    from ppo_objectives.train.config import MULTI_TURN_TASKS  # torch: imported only when a lever needs it

    return task in MULTI_TURN_TASKS


def row_path(results: Path, spec: str) -> Path:
    task, lever, seed = spec.split(":")
    return results / task / lever / f"seed{seed}.json"


def one_run(model: Path, task: str, lever: str, seed: int, minutes: float) -> dict:
    return dict(task=task, lever=lever, seed=seed, minutes=minutes, machine=machine(),
                **run_side(model, task, "ppo", seed, minutes, LEVERS[lever]))


def load_runs(results: Path) -> dict[str, dict[str, list[dict]]]:
    """``{task: {lever: [run, ...]}}`` of the rows written so far."""
    runs: dict[str, dict[str, list[dict]]] = {}
    for path in sorted(results.glob("*/*/seed*.json")):
        run = json.loads(path.read_text())
        runs.setdefault(run["task"], {}).setdefault(run["lever"], []).append(run)
    return runs


def summary(results: Path, recipe_from: Path | None = None) -> None:
    runs = load_runs(results)
    if recipe_from is not None:  # the study's ppo rows are runs of the recipe under the same protocol
        from study_critic import load_runs as study_runs

        for task, sides in study_runs(recipe_from).items():
            if task in TASKS and sides.get("ppo"):
                recipe = runs.setdefault(task, {}).setdefault("recipe", [])
                own = {r["seed"] for r in recipe}  # a seed the ablation ran itself (at its own code) wins
                recipe.extend(r for r in sides["ppo"] if r["seed"] not in own)
    if not runs:
        print("no rows yet: run the levers first")
        return
    for task, levers in runs.items():
        warn_machines(task, [r for rs in levers.values() for r in rs],
                      "give each machine its own --results (and --recipe-from)")
        finals = {k: median([at_minutes(r["rows"], "eval_sampled", MINUTES) for r in rs]) for k, rs in levers.items()}
        target = 0.9 * max((v for v in finals.values() if v == v), default=float("nan"))
        print(f"\n## {task}\n")
        print("| lever | seeds | " + " | ".join(f"{m} min" for m in MARKS[1:]) +
              f" | minutes to {target:.2f} | answers to {target:.2f} | iterations | s per iteration | peak GiB |")
        print("|---|---|" + "---|" * (len(MARKS) - 1) + "---|---|---|---|---|")
        for lever, rs in sorted(levers.items(), key=lambda kv: kv[0] != "recipe"):
            cells = [f"{median([at_minutes(r['rows'], 'eval_sampled', m) for r in rs]):.3f}" for m in MARKS[1:]]
            hits = [reach(r["rows"], target) for r in rs]
            secs = median([x["rollout_s"] + x["reference_s"] + x["update_s"] for r in rs for x in r["rows"]
                           if x["iteration"] >= 1])
            print(f"| {lever} | {len(rs)} | " + " | ".join(cells) +
                  f" | {reach_cell([h[0] for h in hits], '.1f', '')} | {reach_cell([h[1] for h in hits], '.0f', '')} | "
                  f"{median([len(r['rows']) - 1 for r in rs]):.0f} | {secs:.1f} | "
                  f"{median([r.get('peak_rss_gib', float('nan')) for r in rs]):.2f} |")
        if "recipe" in levers:
            print("\nlever - recipe, held-out sampled accuracy, mean over seeds [bootstrap 95%]:\n")
            recipe = [r["rows"] for r in levers["recipe"]]
            for lever, rs in levers.items():
                if lever != "recipe":
                    print(difference_line(lever, [r["rows"] for r in rs], recipe))


def main(argv=None) -> int:
    default = [f"{t}:{lever}:0" for t in TASKS for lever in LEVERS if applies(t, lever)]
    p = runner_arguments(__doc__, default, MINUTES, "TASK:LEVER:SEED", RESULTS)
    p.add_argument("--recipe-from", type=Path, help="--summary: also count the ppo rows of study_critic.py under "
                   "this directory (the same machine's) as runs of the recipe")
    args = p.parse_args(argv)
    if args.summary:
        summary(args.results, args.recipe_from)
        return 0
    for spec in [args.one_run] if args.one_run else args.runs:
        task, lever, seed = (spec.split(":") + ["", ""])[:3]
        if task not in TASKS or lever not in LEVERS or not seed.isdigit():
            p.error(f"--runs {spec}: give TASK:LEVER:SEED with TASK one of {list(TASKS)} and LEVER one of "
                    f"{list(LEVERS)}, e.g. chat-add2:critic-steps-2:0")
        if not applies(task, lever):
            p.error(f"--runs {spec}: {lever} applies to a multi-turn task only: give it with one of "
                    f"{[t for t in TASKS if applies(t, lever)]}")
    check_model(p, args.model)

    def run(spec: str) -> dict:
        task, lever, seed = spec.split(":")
        return one_run(args.model, task, lever, int(seed), args.minutes)

    return run_specs(HERE, args, row_path, run, lambda: summary(args.results, args.recipe_from))


if __name__ == "__main__":
    raise SystemExit(main())

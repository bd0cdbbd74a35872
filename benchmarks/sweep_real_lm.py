"""The measurements behind the job's ``pretrained`` recipe: one change to it at a time, same seed, same budget.

Each variant is the job (``python -m ppo_objectives.train --model DIR --task chat-add1``) with
the flags shown added to the default recipe, run for ``--minutes`` of training time one after
the other on the same machine, evaluated on the held-out set by the same rule as
``bench_real_lm.py`` (after the first iteration past every ``--eval-minutes``, and at the end).
Printed: held-out greedy / sampled accuracy at each evaluation, iterations, seconds per
iteration with its split, and the last iterations' reward and KL to the pretrained model.
One seed per variant: it shows large effects and says nothing about small ones.

    python benchmarks/sweep_real_lm.py                                 # every variant below, 5 minutes each
    python benchmarks/sweep_real_lm.py --variants default "--kl-reward-coeff 0" "--no-average-gae "   # a flag alone: end it
                                                                                        # with a space

``--against-study`` (with ``--summary-only``, ``--task chat-add2``) sets each variant's rows, every seed found, against
the recipe's rows of ``study_critic.py`` (its ``ppo`` side) at 5, 10 and 15 training minutes: the difference of the
means over seeds, held-out sampled accuracy, with a bootstrap 95% interval.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # bench_real_lm; this checkout

from bench_real_lm import DEFAULT_MODEL, run_job  # noqa: E402

from ppo_objectives.train.pretrained import export_hf_checkpoint

#: One change to the default recipe each ("default": none).
VARIANTS = (
    "default",
    "--lr 1e-5",
    "--lr 4e-5",
    "--kl-reward-coeff 0",
    "--kl-reward-coeff 0.05",
    "--critic-warmup 2",
    "--lmbda 1.0 --policy-lmbda 0.95",
    "--length-alpha 0.5",
    "--minibatches 1",
    "--minibatches 4",
    "--no-shared-trunk",
)


def _name(variant: str) -> str:
    return variant.strip().replace("--", "").replace(" ", "_") or "default"


def _evals(rows: list[dict]) -> str:
    return ", ".join(f"{r['train_s'] / 60:.1f}m {r['eval_greedy']:.2f}/{r['eval_sampled']:.2f}"
                     for r in rows if not math.isnan(r.get("eval_greedy", math.nan)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--task", default="chat-add1", choices=("chat-add1", "chat-add2"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--eval-minutes", type=float, default=2.5)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/sweep_real_lm"))
    p.add_argument("--summary-only", action="store_true")
    p.add_argument("--against-study", action="store_true",
                   help="with --summary-only: each variant against study_critic.py's rows of the recipe")
    args = p.parse_args(argv)
    if args.against_study and not args.summary_only:
        p.error("--against-study reads rows already written: add --summary-only")
    if args.against_study:
        return _print_against_study(args)
    if not args.summary_only and not (args.model / "config.json").is_file():
        export_hf_checkpoint("smollm2", args.model)
    print(f"| variant ({args.task}, seed {args.seed}, {args.minutes:g} min) | held-out greedy/sampled at minute | "
          f"iterations | s / iteration (rollout, reference, update) | reward, last 3 | kl_ref, last |")
    print("|---|---|---|---|---|---|")
    for variant in args.variants:
        run_dir = args.out / args.task / f"seed{args.seed}" / _name(variant)
        result = run_dir / "rows.json"
        if not args.summary_only:
            args.train_args = "" if variant.strip() == "default" else variant.strip()
            rows = run_job(args.model, args.task, args.seed, args.minutes, args, run_dir / "job")
            result.write_text(json.dumps(rows))
        if not result.exists():
            continue
        rows = json.loads(result.read_text())
        its = [r for r in rows if r["iteration"] > 0]
        split = [sum(r[k] for r in its) / len(its) for k in ("rollout_s", "reference_s", "update_s")]
        last = its[-3:]
        print(f"| `{variant}` | {_evals(rows)} | {len(its)} | {sum(split):.1f} ({', '.join(f'{x:.1f}' for x in split)})"
              f" | {sum(r['reward'] for r in last) / len(last):.2f} | {its[-1]['kl_ref']:.3f} |", flush=True)
    return 0


def _print_against_study(args) -> int:
    """Each variant's rows, every seed, against the study's rows of the recipe (:func:`study_critic.difference_line`)."""
    from study_critic import difference_line, load_runs

    recipe = [r["rows"] for r in load_runs().get(args.task, {}).get("ppo", [])]
    if not recipe:
        print(f"error: study_critic.py has no rows of the recipe on {args.task}: run its {args.task}:ppo:SEED first",
              file=sys.stderr)
        return 2
    print(f"variant - recipe on {args.task}, held-out sampled accuracy, mean over seeds [bootstrap 95%]:\n")
    for variant in args.variants:
        paths = sorted((args.out / args.task).glob(f"seed*/{_name(variant)}/rows.json"))
        print(difference_line(f"`{variant}`", [json.loads(q.read_text()) for q in paths], recipe) if paths else
              f"- `{variant}`: no rows under {args.out / args.task}/seed*/{_name(variant)}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m ppo_objectives.train``: the training job's command line.

:func:`main` parses the flags into a :class:`~ppo_objectives.train.config.TrainConfig`, refuses
what the run cannot honour with an ``error:`` line (exit 2), runs the iterations with the job's
own loop (:func:`~ppo_objectives.train.loop.train`) or, with ``--loop torchrl``, with TorchRL's
``Trainer`` (:func:`~ppo_objectives.train.trainer.train_with_trainer`; the same metrics), and
prints a one-line summary.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from ppo_objectives.train.config import TrainConfig, build_parser, check_launch
from ppo_objectives.train.loop import train
from ppo_objectives.train.trainer import train_with_trainer

def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # a configuration this run cannot honour is an error line, not a traceback
        cfg = TrainConfig(**vars(args))
        check_launch(cfg)
    except (ValueError, TypeError, ImportError, OSError, RuntimeError) as err:
        parser.error(str(err))
    t0 = time.perf_counter()
    rows = (train_with_trainer if cfg.loop == "torchrl" else train)(cfg)
    if rows and int(os.environ.get("RANK", 0)) == 0:
        print(_summary(rows, time.perf_counter() - t0, cfg))
    return 0


def _summary(rows: list[dict], wall: float, cfg: TrainConfig) -> str:
    """The run's last line: reward start -> end, held-out accuracy (text tasks), speed, failures."""
    evals = [r for r in rows if not math.isnan(r.get("eval_greedy", math.nan))]
    rows = [r for r in rows if r["iteration"] > 0]
    if not rows:
        return f"no iteration run; metrics in {Path(cfg.out) / 'metrics.csv'}"
    k = min(5, len(rows))
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    collapsed = sum(int(r["collapse"]) for r in rows)
    spikes = sum(int(r["warn_kl_spike"]) for r in rows)
    held_out = ""
    if len(evals) > 1:
        held_out = (f"held-out greedy {evals[0]['eval_greedy']:.3f} -> {evals[-1]['eval_greedy']:.3f}, sampled "
                    f"{evals[0]['eval_sampled']:.3f} -> {evals[-1]['eval_sampled']:.3f}; ")
    return (
        f"reward (mean of {k} iterations): start {first:.3f} -> end {last:.3f}; "
        f"exact-match at the end {rows[-1]['exact']:.2f}; {held_out}{len(rows)} iterations in "
        f"{wall:.0f}s ({len(rows) / wall:.2f} it/s); collapsed iterations {collapsed}, KL spikes {spikes}; "
        f"metrics in {Path(cfg.out) / 'metrics.csv'}"
    )

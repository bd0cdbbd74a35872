"""``python -m ppo_objectives.train``: the training job's command line.

:func:`main` parses the flags into a :class:`~ppo_objectives.train.config.TrainConfig`, refuses
what the run cannot honour with one ``error:`` line that names the flag and the fix, after a
one-line usage hint (exit 2, no traceback), runs the iterations with the job's loop
(:func:`~ppo_objectives.train.loop.train`), and prints a one-line summary (its speed in s/it below one iteration a
second; a text run without held-out prompts says so instead of an accuracy). ``--config FILE`` puts the flags of a
TOML file or of a run's ``run_config.json`` before the command line's
(:mod:`~ppo_objectives.train.config_file`).
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from dataclasses import fields
from pathlib import Path

from ppo_objectives.train.config import TrainConfig, build_parser
from ppo_objectives.train.config_file import config_flags
from ppo_objectives.train.launch import check_launch
from ppo_objectives.train.loggers import read_metrics
from ppo_objectives.train.loop import run_checked
from ppo_objectives.train.monitor import most_conversations_cut

def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    config_file = getattr(parser.parse_known_args(argv)[0], "config", None)  # its flags first: the command line wins
    try:
        args = parser.parse_args([*(config_flags(config_file) if config_file else ()), *argv])
    except (ValueError, TypeError, ImportError, OSError) as err:
        parser.error(str(err))
    try:  # a configuration this run cannot honour is an error line, not a traceback
        cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k != "config"})
        check_launch(cfg)
    except (ValueError, TypeError, ImportError, OSError, RuntimeError) as err:
        parser.error(flag_message(str(err)))
    t0 = time.perf_counter()
    rows = run_checked(cfg)
    if rows and int(os.environ.get("RANK", 0)) == 0:
        print(_summary(rows, time.perf_counter() - t0, cfg))
    return 0


#: Argument names of the modules a flag configures that are not the flag's own (``DigitTask(num_digits=...)``).
_FLAG_OF = {"num_digits": "digits"}


def flag_message(message: str) -> str:
    """``message`` with the flag named: a check of :class:`TrainConfig` or of a module it configures reads
    ``TrainConfig lr=0.0 must be ...`` or ``gamma=1.5 is outside ...``; on the command line that is ``--lr 0.0
    must be ...``, ``--gamma 1.5 is outside ...`` (the flags are those arguments' names). Any other message is
    returned as it is.

    Example:
        >>> flag_message("TrainConfig num_envs=0 must be an int >= 1")
        '--num-envs 0 must be an int >= 1'
        >>> flag_message("num_digits=9 is too many")
        '--digits 9 is too many'
        >>> flag_message("no such file x.jsonl")
        'no such file x.jsonl'
    """
    match = re.match(r"(?:TrainConfig )?(\w+)=(\S+) (.*)", message, re.DOTALL)
    names = {f.name for f in fields(TrainConfig)}
    name = _FLAG_OF.get(match[1], match[1]) if match else None
    if name not in names:
        return message
    return f"--{name.replace('_', '-')} {match[2]} {match[3]}"


def _speed(iterations: int, wall: float) -> str:
    """``"2.50 it/s"``, or seconds per iteration below one iteration a second (``"72.0 s/it"``)."""
    rate = iterations / max(wall, 1e-9)
    return f"{rate:.2f} it/s" if rate >= 1.0 else f"{wall / iterations:.1f} s/it"


def _summary(rows: list[dict], wall: float, cfg: TrainConfig) -> str:
    """The run's last line: reward start -> end, held-out accuracy (text tasks), speed, failures."""
    logged = Path(cfg.out) / "metrics.csv"
    whole_run = read_metrics(logged) if cfg.resume and logged.exists() else rows  # resumed: row 0 was logged before
    evals = [r for r in whole_run if not math.isnan(r.get("eval_greedy", math.nan))]
    rows = [r for r in rows if r["iteration"] > 0]
    if not rows:
        return f"no iteration run; metrics in {Path(cfg.out) / 'metrics.csv'}"
    k = min(5, len(rows))
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    collapsed = sum(int(r["collapse"]) for r in rows)
    spikes = sum(int(r["warn_kl_spike"]) for r in rows)
    held_out = ""
    if cfg.recipe == "pretrained" and not evals:  # --task jsonl without --eval-prompts (or none)
        held_out = "no held-out evaluation; "
    if len(evals) > 1:
        held_out = (f"held-out greedy {evals[0]['eval_greedy']:.3f} -> {evals[-1]['eval_greedy']:.3f}, sampled "
                    f"{evals[0]['eval_sampled']:.3f} -> {evals[-1]['eval_sampled']:.3f} (iteration "
                    f"{evals[0]['iteration']:g} -> {evals[-1]['iteration']:g}); ")
    return (
        f"reward (mean of {k} iterations): start {first:.3f} -> end {last:.3f}; "
        f"exact-match at the end {rows[-1]['exact']:.2f}; {held_out}{len(rows)} iterations in "
        f"{wall:.0f}s ({_speed(len(rows), wall)}); collapsed iterations {collapsed}, KL spikes {spikes}; "
        f"{_cut_turns(rows, cfg)}metrics in {Path(cfg.out) / 'metrics.csv'}"
    )


def _cut_turns(rows: list[dict], cfg: TrainConfig) -> str:
    """A multi-turn run whose token budget cut most conversations in some iteration says so, with the flag to raise
    (``""`` otherwise)."""
    cut = [r for r in rows if most_conversations_cut(r)]
    if not cut:
        return ""
    last = cut[-1]
    return (f"MOST CONVERSATIONS CUT in {len(cut)} of {len(rows)} iterations (env_turns_cut {last['env_turns_cut']:g} "
            f"of {last['episodes']:g} in iteration {last['iteration']:g}): raise --max-new-tokens {cfg.max_new_tokens}; ")

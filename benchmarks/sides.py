"""The sides the learning benchmarks run on a text task, each on its own training clock, in the same row format.

Every side trains the same model directory on the same training prompts, with the same reward, and
is measured by the same held-out protocol (the job's: greedy and sampled at T = 1 on every held-out
problem, at the start and after the first iteration past each ``eval_minutes`` of training time).
Training time is rollouts (generation), scoring and updates; the evaluations are not counted.

- :func:`job_run`: ``python -m ppo_objectives.train`` with extra flags (the recipe, ``--advantage
  grpo``, ``--holes cut``, ...), in a process of its own;
- :func:`plain_run`: the plain PyTorch policy-gradient loop of ``plain_pg_loop.py``;
- :func:`trl_run`: TRL's ``GRPOTrainer`` with its own defaults except the settings with an obvious
  counterpart in the job (:data:`TRL_SETTINGS`); on ``chat-calc`` / ``chat-calc-sum`` with the same tool
  (``tools=``).

Each returns ``{rows, peak_rss_gib, ...}``: ``rows`` are ``metrics.csv``-like dicts with ``iteration``,
``rollout_s``, ``reference_s``, ``update_s``, ``rollout_tokens`` (generated tokens of the iteration) and,
on evaluated rows, ``eval_greedy`` / ``eval_sampled`` (and ``eval_tool_calls`` on ``chat-calc``).
:func:`train_minutes` and :func:`at_minutes` read them.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve()

#: What TRL's ``GRPOTrainer`` is given beyond its defaults: the job's counterparts (32 answers per step in groups
#: of 8, the task's response budget, T = 1, the recipe's learning rate, float32, no activation checkpointing).
#: ``max_steps`` is set far past the time budget, so its linear learning-rate decay stays within 1% of the start.
TRL_SETTINGS = dict(per_device_train_batch_size=32, generation_batch_size=32, num_generations=8, temperature=1.0,
                    learning_rate=2e-5, bf16=False, gradient_checkpointing=False)

#: TRL's settings per task on top of :data:`TRL_SETTINGS`: on ``chat-word`` one backward over 32 completions of 64
#: tokens after a three-message prompt passed 18 GiB and was killed for memory, so TRL accumulates 4 micro-batches
#: of 8 there (its own ``gradient_accumulation_steps``: still 32 completions per optimizer step).
TRL_TASK_SETTINGS = {"chat-word": dict(per_device_train_batch_size=8, gradient_accumulation_steps=4)}

#: TRL defaults recorded with each of its rows.
TRL_DEFAULTS_SHOWN = ("loss_type", "beta", "num_iterations", "scale_rewards", "epsilon", "optim", "lr_scheduler_type",
                      "max_grad_norm", "top_k", "top_p")


def _peak_gib(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 2**20  # kB on Linux


def job_run(model: Path, task: str, seed: int, minutes: float, flags: list[str], eval_minutes: float = 5.0) -> dict:
    """One run of the job with ``flags``; its ``metrics.csv`` rows and the last evaluation's samples."""
    from ppo_objectives import train as T

    with tempfile.TemporaryDirectory(prefix="bench_job_") as out:
        cmd = [sys.executable, "-m", "ppo_objectives.train", "--task", task, "--model", str(model), "--seed", str(seed),
               "--time-limit", str(minutes), "--iterations", "100000", "--eval-minutes", str(eval_minutes),
               "--threads", "1", "--out", out, "--no-progress", "--no-plot", "--save-every", "100000", *flags]
        subprocess.run(cmd, check=True, cwd=HERE.parents[1])
        rows = T.read_metrics(Path(out) / "metrics.csv")
        samples = (Path(out) / "samples.txt").read_text()
    for r in rows:
        r["rollout_tokens"] = r.get("response_len", 0.0) * r.get("episodes", 0.0) if r["iteration"] >= 1 else 0.0
    return dict(flags=flags, rows=rows, samples=samples[-6000:], peak_rss_gib=_peak_gib(resource.RUSAGE_CHILDREN))


#: Gradient accumulation of the plain loop per task (the same gradient as one backward over the batch): on
#: ``chat-word`` (32 answers of 64 tokens after a three-message prompt) its one backward peaked past 16 GiB and was
#: killed for memory beside another run; ``chat-calc-sum``'s rows (a 130-token prompt, 128 tokens) are longer still.
PLAIN_MICRO_BATCHES = {"chat-word": 4, "chat-calc-sum": 4}


def plain_run(model: Path, task: str, seed: int, minutes: float, eval_minutes: float = 5.0) -> dict:
    """One run of the plain loop (``plain_pg_loop.py``), its rows in the job's timing columns."""
    import torch
    from plain_pg_loop import build_tasks, held_out_evaluator, plain_pg_loop

    from ppo_objectives.train.pretrained import load_tokenizer

    torch.set_num_threads(1)
    train, held_out, well_formed = build_tasks(task, load_tokenizer(model))
    micro_batches = PLAIN_MICRO_BATCHES.get(task, 1)
    rows = plain_pg_loop(model, train, seed=seed, minutes=minutes, eval_minutes=eval_minutes,
                         micro_batches=micro_batches, evaluate_fn=held_out_evaluator(held_out, seed, well_formed=well_formed))
    for r in rows:
        r.update(rollout_s=r.pop("generate_s", 0.0), reference_s=0.0, update_s=r.get("update_s", 0.0),
                 rollout_tokens=r.pop("response_tokens", 0))
    return dict(rows=rows, micro_batches=micro_batches, peak_rss_gib=_peak_gib())


def trl_run(model: Path, task: str, seed: int, minutes: float, eval_minutes: float = 5.0) -> dict:
    """TRL's ``GRPOTrainer`` for ``minutes`` of its own training time (``on_step_begin`` to ``on_step_end``), the
    held-out protocol run from a callback (not counted); on ``chat-calc`` TRL's own refusal when it refuses."""
    import torch
    from datasets import Dataset
    from plain_pg_loop import build_tasks, held_out_evaluator
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ppo_objectives.train.pretrained import load_tokenizer

    torch.set_num_threads(1)
    train, held_out, well_formed = build_tasks(task, load_tokenizer(model))
    evaluate_fn = held_out_evaluator(held_out, seed, well_formed=well_formed)
    data = Dataset.from_list([{"prompt": e.messages(), **e.fields} for e in train.examples])
    score = train.reward_fn

    def reward(prompts, completions, answer, **kwargs):
        return [score(c[-1]["content"], a) for c, a in zip(completions, answer)]

    settings = {**TRL_SETTINGS, **TRL_TASK_SETTINGS.get(task, {})}
    rows: list[dict] = []
    clock = dict(train_s=0.0, next_eval=60.0 * eval_minutes, t0=0.0)

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            rows.append(dict(iteration=0, rollout_s=0.0, reference_s=0.0, update_s=0.0, rollout_tokens=0,
                             **evaluate_fn(model)))

        def on_step_begin(self, args, state, control, **kw):
            clock["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            step_s = time.perf_counter() - clock["t0"]
            clock["train_s"] += step_s
            row = dict(iteration=state.global_step, rollout_s=step_s, reference_s=0.0, update_s=0.0)
            if clock["train_s"] >= clock["next_eval"] or clock["train_s"] >= 60.0 * minutes:
                clock["next_eval"] = (clock["train_s"] // (60.0 * eval_minutes) + 1) * 60.0 * eval_minutes
                row.update(evaluate_fn(model))
            rows.append(row)
            control.should_training_stop = clock["train_s"] >= 60.0 * minutes

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs and rows:
                rows[-1]["rollout_tokens"] = logs["completions/mean_length"] * settings["generation_batch_size"]
                rows[-1]["reward"] = logs.get("reward", float("nan"))

    tools = {}
    if task in ("chat-calc", "chat-calc-sum"):
        def calc(a: int, b: int) -> str:
            """Multiply two whole numbers.

            Args:
                a: the first number
                b: the second number
            """
            return str(int(a) * int(b))

        def add(a: int, b: int) -> str:
            """Add two whole numbers.

            Args:
                a: the first number
                b: the second number
            """
            return str(int(a) + int(b))

        tools = dict(tools=[calc] if task == "chat-calc" else [calc, add])
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as out:
        config = GRPOConfig(output_dir=out, use_cpu=True, report_to="none", seed=seed, max_steps=100000,
                            max_completion_length=train.answer_len, logging_steps=1, save_strategy="no",
                            disable_tqdm=True, **settings)
        defaults = {k: str(getattr(config, k, None)) for k in TRL_DEFAULTS_SHOWN}
        try:
            trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(model)), args=config,
                                  train_dataset=data, reward_funcs=reward,
                                  processing_class=AutoTokenizer.from_pretrained(str(model)), callbacks=[Clock()],
                                  **tools)
        except Exception as err:  # TRL's refusal is the result
            return dict(refused=f"{type(err).__name__}: {err}", rows=[], trl_defaults=defaults)
        trainer.train()
    return dict(rows=rows, trl_defaults=defaults, trl_settings=settings, peak_rss_gib=_peak_gib())


def run_side(model: Path, task: str, side: str, seed: int, minutes: float, flags: list[str] | None) -> dict:
    """One run: the plain loop (``side`` "plain"), TRL (``side`` "trl"), else the job with ``flags``."""
    if side == "plain":
        return plain_run(model, task, seed, minutes)
    if side == "trl":
        return trl_run(model, task, seed, minutes)
    return job_run(model, task, seed, minutes, flags)


def train_minutes(rows: list[dict]) -> list[float]:
    """The training minutes at each row (rollouts, scoring and updates; evaluations excluded)."""
    total, out = 0.0, []
    for r in rows:
        if r["iteration"] >= 1:
            total += r["rollout_s"] + r["reference_s"] + r["update_s"]
        out.append(total / 60.0)
    return out


def evaluated(row: dict, key: str) -> bool:
    """The row holds an evaluation's ``key`` (present, not nan)."""
    value = row.get(key)
    return value is not None and value == value


def mark_evaluation(rows: list[dict], minute: float, within: float = 5.0) -> tuple[float, dict]:
    """``(training minute, row)`` of the evaluation made for the mark ``minute``: the first one at or after it and
    before ``minute + within`` (a side evaluates after the first iteration past each mark, so up to one iteration
    late); ``(nan, {})`` when there is none. Row 0 for 0."""
    for m, r in zip(train_minutes(rows), rows):
        if minute - 1e-9 <= m < minute + within and any(evaluated(r, k) for k in ("eval_greedy", "eval_sampled")):
            return m, r
    return float("nan"), {}


def at_minutes(rows: list[dict], key: str, minute: float) -> float:
    """The held-out ``key`` of the evaluation made for the mark ``minute`` (:func:`mark_evaluation`); nan if none."""
    row = mark_evaluation(rows, minute)[1]
    return row[key] if evaluated(row, key) else float("nan")


def median(xs: list[float]) -> float:
    """The median of the values that are not nan (a run that never reached a target, a mark never evaluated);
    nan when none is.

    Example:
        >>> median([3.0, float("nan"), 5.0]), median([float("nan")])
        (4.0, nan)
    """
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def reach_cell(hits: list[float], fmt: str, unit: str = " seeds", count: bool = False) -> str:
    """A table cell for what the runs needed to reach a target (minutes, answers; nan where a run never reached
    it): the median over the runs that reached it, "not reached" where none did, and "(k of n)" when some did
    not (always, with ``count``).

    Example:
        >>> reach_cell([9.4, float("nan"), 10.0], ".1f"), reach_cell([float("nan")], ".0f"), reach_cell([3.0], ".0f")
        ('9.7 (2 of 3 seeds)', 'not reached (0 of 1 seeds)', '3')
    """
    reached = sum(h == h for h in hits)
    of = "" if reached == len(hits) and not count else f" ({reached} of {len(hits)}{unit})"
    return (format(median(hits), fmt) if reached else "not reached") + of


def runner_arguments(doc: str, default_runs: list[str], minutes: float, spec: str, results: Path):
    """The command line of a learning benchmark: ``--model``, ``--runs`` (``spec`` names their form), ``--minutes``,
    ``--results`` (default ``results``), ``--summary``, ``--no-plot`` (and ``--one-run``, the pair runner's own)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("runs/smollm2-135m-instruct"))
    p.add_argument("--runs", nargs="+", default=default_runs, help=f"{spec} runs, two at a time in the order given")
    p.add_argument("--minutes", type=float, default=minutes, help="training minutes per run")
    p.add_argument("--results", type=Path, default=results,
                   help="directory of the rows; per-minute rows compare only within one machine, so give each "
                        "machine its own")
    p.add_argument("--summary", action="store_true", help="print the tables of the rows written and draw the plots")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--one-run", help=argparse.SUPPRESS)
    return p


def machine() -> str:
    """The CPU's model name (``/proc/cpuinfo``) and its core count, recorded in every row."""
    import os
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def warn_machines(task: str, runs: list[dict], fix: str = "give each machine its own --results") -> None:
    """Print one warning when a task's rows come from more than one machine: minutes compare only within one."""
    machines = sorted({r.get("machine", "unrecorded") for r in runs})
    if len(machines) > 1:
        print(f"\nwarning: the {task} rows come from {len(machines)} machines ({'; '.join(machines)}): their minutes "
              f"do not compare; {fix}")


def check_model(parser, model: Path) -> None:
    """``--model`` must be a checkpoint directory: else one ``error:`` line with the command that makes one."""
    if not (model / "config.json").is_file():
        parser.error(f"--model {model} is not a checkpoint directory; python -m ppo_objectives.pretrained --gguf "
                     f"smollm2 --out {model}")


def run_pairs(script: Path, specs: list[str], row_path: Callable[[str], Path], model: Path, minutes: float,
              results: Path) -> int:
    """Run ``script --one-run SPEC`` for each spec whose row is not written yet, two processes at a time (one torch
    thread each, pinned to cores 0 and 1 where the machine has them, so both see the same load), in the order
    given; 1 when a run failed."""
    import os

    todo = [s for s in specs if not row_path(s).exists()]
    for s in specs:
        if s not in todo:
            print(f"{s}: written already, skipped", file=sys.stderr)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    for i in range(0, len(todo), 2):
        pair = todo[i:i + 2]
        print(f"running {' and '.join(pair)} ({minutes:g} training minutes each, evaluations on top)", file=sys.stderr)
        procs = [subprocess.Popen(
            [sys.executable, str(script), "--one-run", s, "--model", str(model), "--minutes", str(minutes),
             "--results", str(results)],
            preexec_fn=(lambda c=cores[k]: os.sched_setaffinity(0, {c})) if len(cores) >= 2 else None,
        ) for k, s in enumerate(pair)]  # fmt: skip
        if any(proc.wait() for proc in procs):
            print("error: a run failed (its output is above)", file=sys.stderr)
            return 1
    return 0


def run_specs(script: Path, args, row_path: Callable[[Path, str], Path], one_run: Callable[[str], dict],
              summary: Callable[[], None]) -> int:
    """A runner's work: under ``--one-run SPEC`` (the pair runner's child) that run, its row
    ``row_path(args.results, SPEC)`` written at once; else every spec of ``--runs`` not written yet, two processes at a
    time (:func:`run_pairs`), then ``summary()``. 1 when a run failed."""
    rows_at = lambda spec: row_path(args.results, spec)  # noqa: E731
    if args.one_run:
        write_row(rows_at(args.one_run), one_run(args.one_run))
        return 0
    if run_pairs(script, args.runs, rows_at, args.model, args.minutes, args.results):
        return 1
    summary()
    return 0


def write_row(path: Path, row: dict) -> None:
    """A finished run's row, written at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row))

"""The job's loop and its command line: :func:`train` and :func:`main`.

Each iteration is rollout (:mod:`~ppo_objectives.train.rollout`) -> update
(:mod:`~ppo_objectives.train.update`) -> log (``metrics.csv``, the TorchRL logger,
the collapse guard, a progress bar) -> checkpoint, with a held-out evaluation for
text tasks and a plot at the end.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ppo_objectives.train import text_job
from ppo_objectives.train.build import Run, build
from ppo_objectives.train.checkpoints import (
    INPUT_SHA256,
    checkpoint_state,
    rng_states,
    save_checkpoint,
    write_run_config,
)
from ppo_objectives.train.config import METRICS, TrainConfig, check_launch, columns
from ppo_objectives.train.distributed import (
    Dist,
    all_reduce,
    check_ranks_in_sync,
    close_distributed,
    gathered_for_rollout,
    init_distributed,
    release_host_memory,
)
from ppo_objectives.train.loggers import append_metrics, close_logger, log_row, make_logger, read_metrics, warn_line
from ppo_objectives.train.monitor import FLAGS, CollapseGuard
from ppo_objectives.train.monitor import plot_metrics as _plot
from ppo_objectives.train.rollout import collect_batch, rollout_stats, score_batch
from ppo_objectives.train.text_job import EVAL_COLUMNS
from ppo_objectives.train.update import ppo_update

# --------------------------------------------------------------------------- #
# The loop
# --------------------------------------------------------------------------- #


def train(cfg: TrainConfig) -> list[dict[str, float]]:
    """Run PPO as configured; returns the metrics rows of the iterations run now.

    Under ``torchrun`` (``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` set) every process runs this
    as one rank of a data-parallel job and gets the same rows (all-reduced over the ranks).
    """
    return run_training(cfg, _train)


def run_training(cfg: TrainConfig, body) -> list[dict[str, float]]:
    """The frame of a run: the launch checks, ``--threads``, the process group around ``body(cfg, d) -> rows``;
    ``--no-progress`` also silences transformers' progress bars ("Loading weights", ...) for the run."""
    check_launch(cfg)
    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = init_distributed(cfg.device)
    try:
        with _hf_progress_bars(not cfg.no_progress):
            return body(cfg, d)
    finally:
        torch.set_num_threads(threads_before)
        close_distributed(d)  # body has returned: its DDP wrappers are freed while the group is alive


@contextlib.contextmanager
def _hf_progress_bars(shown: bool):
    """transformers' own progress bars off inside (``shown=False``; as they were after), on as they are otherwise;
    nothing to do without transformers."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    before = hf_logging.is_progress_bar_enabled()
    if not shown:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if before and not shown:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def started(cfg: TrainConfig, d: Dist):
    """``(run, rows, bar, logger)`` of a built run with its reporters (rank 0: the progress bar unless
    ``--no-progress``, ``--logger``) and, for a text task from its start, row 0 (the pretrained model's held-out
    evaluation); on exit the reporters are closed, the collector shut down and the DDP reducers freed."""
    run = build(cfg, d)
    rows: list[dict[str, float]] = []
    bar, logger = _reporters(cfg, d, run.start_it, run.out)
    try:
        if run.evaluation is not None and run.start_it == 0:
            rows.append(_log_start(run.evaluation(run.ac.actor_model, 0, "start"), cfg, d, run.out, logger))
        yield run, rows, bar, logger
    finally:
        _close_reporters(bar, logger)
        run.collector.shutdown()
        run.loss_module = None
        run.ddp_wrappers.clear()  # free the DDP reducers now, while the process group is alive


def _train(cfg: TrainConfig, d: Dist) -> list[dict[str, float]]:
    with started(cfg, d) as (run, rows, bar, logger):  # --- the loop: rollout -> update -> log -> checkpoint
        train_s = 0.0  # rollouts and updates since this process started (--time-limit)
        for it in range(run.start_it, cfg.iterations):
            row, train_s, last = end_iteration(run, it, _iteration(run, it), train_s, bar, logger)
            rows.append(row)
            if last:
                break
        ac = run.ac
        check_ranks_in_sync([ac.actor_model, ac.critic_model, ac.critic_head], d.group)
        if d.group is not None and d.main:
            print(f"parameters identical on all {d.world} ranks", file=sys.stderr, flush=True)
    finish_run(cfg, d, run.guard, run.out)
    return rows


def _iteration(run: Run, it: int) -> dict[str, float]:
    """One PPO iteration: rollout, scoring (V_old, reference, KL penalty, GAE), update, KL controller; its row."""
    cfg, pg = run.cfg, run.d.group
    # 1. rollout through the collector, then KL penalty and GAE on the LLM layout
    t0 = time.perf_counter()
    with gathered_for_rollout(run.ac.actor_model):  # --fsdp: the whole actor (else nothing)
        llm = collect_batch(run.collector_iter, run.device, run.P, run.M, policy_version=run.policy_version(it))
    t_ref = time.perf_counter()
    llm = score_batch(llm, run.ac, run.kl_transform, run.gae)  # V_old, reference log-probs, KL penalty, GAE
    t1 = time.perf_counter()
    # 2. PPO epochs x minibatches, approx-KL trust region, non-finite guard (critic only while
    #    it < --critic-warmup: the actor keeps the policy that made the rollouts)
    stats = ppo_update(llm, run.loss_module, run.ac, run.optimizers, cfg, run.gen, process_group=pg,
                       critic_only=it < cfg.critic_warmup)
    t2 = time.perf_counter()
    # 3. KL coefficient update; the collector's policy shares the weights (in-process) or receives them (workers)
    row = close_iteration(run, it, llm, dict(rollout_s=t_ref - t0, reference_s=t1 - t_ref, update_s=t2 - t1), stats)
    if cfg.remote_rollouts:
        run.collector.update_policy_weights_()  # the next rollout's policy version
    release_host_memory()  # the rollout's and the update's freed host memory, back to the system
    return row


def close_iteration(run: Run, it: int, llm, times: dict[str, float], stats: dict[str, float]) -> dict[str, float]:
    """After the update: the rollout's statistics, the in-reward KL coefficient's update (on the all-rank KL: beta
    stays identical on every rank) and the iteration's row (``times``: ``rollout_s``, ``reference_s``,
    ``update_s``; ``stats``: the update's)."""
    roll = rollout_stats(llm, run.kl_transform, run.d.group)
    coeff = run.controller.update(roll.pop("seq_kl_t"), n_steps=int(roll["episodes"]))
    n_tok = roll.pop("tokens")
    return dict(iteration=it + 1, **roll, kl_reward_coeff=float(coeff), **times,
                tokens_per_s=n_tok / max(times["rollout_s"], 1e-9), **stats)  # fmt: skip


def end_iteration(run: Run, it: int, row: dict, train_s: float, bar, logger) -> tuple[dict, float, bool]:
    """The end of iteration ``it``: the held-out evaluation when due (text tasks), the collapse guard's columns and
    warning lines, metrics.csv / ``--logger`` / the bar, the checkpoint every ``--save-every`` iterations and at
    the end. Returns ``(logged row, training seconds so far, whether it was the last iteration)``."""
    cfg = run.cfg
    spent = row["rollout_s"] + row["reference_s"] + row["update_s"]
    train_s += spent
    last = it + 1 == cfg.iterations or _out_of_time(cfg, train_s, run.d.group, run.device)
    if run.evaluation is not None:  # held-out accuracy of the updated policy
        row.update(_evaluate_if_due(run, it + 1, last, train_s))
    row = _log_iteration(row, run.guard, run.d, run.out, bar, logger, columns(cfg), spent if cfg.time_limit else 1)
    if (it + 1) % cfg.save_every == 0 or last:  # checkpoint and plot; text tasks: the Hugging Face export
        _save(run, it + 1)
    return row, train_s, last


def _evaluate_if_due(run: Run, iteration: int, last: bool, train_s: float) -> dict[str, float]:
    """The held-out evaluation after ``iteration`` when it is due (every ``--eval-every`` iterations, or each time
    another ``--eval-minutes`` of training time have passed, and after the last iteration); else nan columns."""
    cfg = run.cfg
    if cfg.eval_minutes:
        step = 60.0 * cfg.eval_minutes
        due = train_s >= run.next_eval_s
        if due:  # the next multiple of the interval after now
            run.next_eval_s = (train_s // step + 1) * step
    else:
        due = bool(cfg.eval_every) and iteration % cfg.eval_every == 0
    if not (due or last):
        return dict.fromkeys(EVAL_COLUMNS, math.nan)
    return run.evaluation(run.ac.actor_model, iteration, "after the update")


def _out_of_time(cfg: TrainConfig, train_s: float, pg, device: torch.device) -> bool:
    """``--time-limit`` reached (on any rank's clock under torchrun, so every rank stops together)."""
    if not cfg.time_limit:
        return False
    flag = torch.tensor(float(train_s >= 60.0 * cfg.time_limit), device=device)
    return bool(all_reduce(flag, pg, dist.ReduceOp.MAX))


def _save(run: Run, iteration: int) -> None:
    """``checkpoint.pt`` and the plot; for a text task also the actor as a Hugging Face directory, ``OUT/hf``."""
    rng = rng_states(run.gen, run.env._generator, run.device)
    _checkpoint(iteration, run.cfg, run.d, run.stateful, rng, run.out, run.input_sha256)
    if run.d.main and run.cfg.recipe == "pretrained":
        text_job.export_hf(run.ac.actor_model, run.task.tokenizer, run.out / "hf")


def plot_metrics(csv_path: Path, png_path: Path) -> None:
    """Plot ``metrics.csv`` into ``png_path`` (:func:`ppo_objectives.train.monitor.plot_metrics`)."""
    _plot(read_metrics(csv_path), png_path, title=f"PPO run {Path(csv_path).parent.name}")


def _log_start(evaluated: dict, cfg: TrainConfig, d: Dist, out: Path, logger) -> dict:
    """Row 0 of a text run: the held-out evaluation of the pretrained model, before any rollout (its other
    columns are nan, which the collapse guard and the plot skip)."""
    row = {**dict.fromkeys(columns(cfg), math.nan), "iteration": 0, **evaluated}
    if d.main:
        append_metrics(out / "metrics.csv", row, columns(cfg))
        log_row(logger, row, 0, columns(cfg))
        line = (f"held-out before training: greedy {row['eval_greedy']:.3f}, sampled {row['eval_sampled']:.3f}"
                if not math.isnan(row["eval_greedy"]) else
                "no held-out evaluation (--task jsonl without --eval-prompts, or --eval-prompts none)")
        print(line, file=sys.stderr, flush=True)
    return row


def _reporters(cfg: TrainConfig, d: Dist, start_it: int, out: Path) -> tuple:
    """Rank 0's progress bar (``None`` with ``--no-progress``) and ``--logger``'s TorchRL logger
    (``None`` without one; under ``out/logs``, named after ``out``, continuing after ``start_it``)."""
    if not d.main:
        return None, None
    logger = make_logger(cfg.logger, out, out.resolve().name, start_step=start_it)
    if cfg.no_progress:
        return None, logger
    from tqdm import tqdm

    if cfg.time_limit:  # the bar counts training seconds towards the limit
        return tqdm(total=round(60 * cfg.time_limit), desc="ppo (training s)", unit="s", dynamic_ncols=True), logger
    return tqdm(total=cfg.iterations, initial=start_it, desc="ppo", dynamic_ncols=True), logger


def _close_reporters(bar, logger) -> None:
    if bar is not None:
        bar.close()
    close_logger(logger)


def _log_iteration(row: dict, guard: CollapseGuard, d: Dist, out: Path, bar, logger=None,
                   columns: tuple = METRICS, bar_step: float = 1) -> dict:
    """Add the collapse guard's columns to ``row``; on rank 0 append it to ``metrics.csv``, send it to
    the ``--logger`` (step: the iteration) and print the guard's warnings; show it on the progress bar.
    Returns ``row``."""
    warnings_now = guard.update(row)
    if d.main:
        append_metrics(out / "metrics.csv", row, columns)
        log_row(logger, row, int(row["iteration"]), columns)
        for line in warnings_now:
            warn_line(line, bar)
    if bar is not None:
        flagged = "+".join(f for f in FLAGS if row[f"warn_{f}"])  # a collapse is always flagged
        warn = {"warn": "COLLAPSE" if row["collapse"] else flagged} if flagged else {}
        held_out = {k: f"{row[k]:.2f}" for k in ("eval_greedy", "eval_sampled") if not math.isnan(row.get(k, math.nan))}
        bar.set_postfix(reward=f"{row['reward']:.3f}", exact=f"{row['exact']:.2f}", kl=f"{row['kl_ref']:.4f}",
                        **held_out, **warn)
        bar.training_s = getattr(bar, "training_s", bar.n) + bar_step  # whole seconds (or iterations) on the bar
        bar.update(min(int(bar.training_s), bar.total) - bar.n)
    return row


def _checkpoint(iteration: int, cfg: TrainConfig, d: Dist, stateful: dict, rng: dict, out: Path,
                input_sha256: dict | None = None) -> None:
    """Write ``checkpoint.pt`` (rank 0; a collective under torchrun) and redraw the plot: it follows the run.
    The saved configuration is the flags plus ``input_sha256``, the hashes of the input files the run read
    (``--task jsonl``), which ``--resume`` holds the files against."""
    config = {**asdict(cfg), INPUT_SHA256: dict(input_sha256 or {})}
    state = checkpoint_state(iteration, config, d, stateful, rng)
    if d.main:
        save_checkpoint(out / "checkpoint.pt", state)
        write_run_config(out, iteration, config)  # what --resume compares its flags and input files with
        if not cfg.no_plot:
            plot_metrics(out / "metrics.csv", out / "training.png")


def finish_run(cfg: TrainConfig, d: Dist, guard: CollapseGuard, out: Path) -> None:
    """The final plot, and a :class:`TrainingCollapseWarning` (issued from :func:`train`) when the run collapsed."""
    csv_path = out / "metrics.csv"
    if d.main and not cfg.no_plot and csv_path.exists():
        plot_metrics(csv_path, out / "training.png")
    if d.main and guard.collapses:
        warnings.warn(f"the PPO run in {out} collapsed: {guard.summary()}; see the warn_* and collapse columns "
                      f"of {csv_path} and {out / 'training.png'}", TrainingCollapseWarning, stacklevel=3)


class TrainingCollapseWarning(RuntimeWarning):
    """Raised (as a warning) at the end of a run that went through a collapse (:class:`CollapseGuard`)."""

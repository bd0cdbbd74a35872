"""The job's loop: :func:`train`, one PPO iteration after another, read top to bottom.

Each iteration is rollout (:mod:`~ppo_objectives.train.rollout`) -> scoring (``V_old``, the
reference log-probs, the KL penalty, GAE) -> update (:mod:`~ppo_objectives.train.update`) -> KL
controller -> log (``metrics.csv``, the TorchRL logger, the collapse guard, a progress bar) ->
checkpoint, with a held-out evaluation for text tasks and a plot at the end; then the callbacks.

Callbacks (``train(cfg, callbacks=[...])``) are how a user adds their own step to the loop:

- each is called as ``callback(row, run)`` once per iteration, after the iteration's row is
  logged (``metrics.csv``, ``--logger``) and its checkpoint, when due, is written;
- ``row`` is that row (the columns of :data:`~ppo_objectives.train.METRICS`, explained
  in :mod:`ppo_objectives.train`), ``run`` the :class:`~ppo_objectives.train.build.Run` the
  loop trains (``run.ac`` the actor-critic, ``run.loss_module``, ``run.optimizers``,
  ``run.env``, ``run.collector``, ``run.out`` the run's directory, ...): a callback may read
  them, save more, or change them (an optimizer's learning rate, say) at its own risk;
- returning ``True`` stops the run after this iteration: the loop writes the checkpoint (when
  it was not due anyway) and the final plot, and ``--resume`` continues from there; ``None`` or
  ``False`` goes on. Every callback is called, even after one asked to stop;
- under ``torchrun`` every rank calls it with the same row (rows are all-reduced), so a
  decision taken from the row is the same on every rank; a decision from anything local must
  be agreed between the ranks by the callback, or the ranks hang.

Example:
    >>> import tempfile
    >>> from ppo_objectives.train import TrainConfig
    >>> def stop_at_iteration_2(row, run):
    ...     return row["iteration"] >= 2
    >>> cfg = TrainConfig(iterations=50, preset="pico", num_envs=8, warmup_steps=2, no_plot=True,
    ...                   no_progress=True, out=tempfile.mkdtemp())
    >>> [row["iteration"] for row in train(cfg, callbacks=[stop_at_iteration_2])]
    [1, 2]
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
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
from ppo_objectives.train.config import TrainConfig
from ppo_objectives.train.distributed import (
    Dist,
    all_reduce,
    check_ranks_in_sync,
    close_distributed,
    gathered_for_rollout,
    init_distributed,
    release_host_memory,
)
from ppo_objectives.train.launch import check_launch
from ppo_objectives.train.loggers import (METRICS, append_metrics, close_logger, columns, log_row, make_logger,
                                         read_metrics, warn_line)
from ppo_objectives.train.monitor import FLAGS, CollapseGuard, most_conversations_cut, plot_metrics
from ppo_objectives.train.rollout import collect_batch, rollout_stats, score_batch
from ppo_objectives.train.text_job import EVAL_COLUMNS, EVAL_TURN_COLUMNS
from ppo_objectives.train.update import ppo_update

#: ``callback(row, run) -> bool | None``: see the module docstring.
Callback = Callable[[dict, Run], "bool | None"]


def train(cfg: TrainConfig, callbacks: Sequence[Callback] = ()) -> list[dict[str, float]]:
    """Run PPO as configured; returns the metrics rows of the iterations run now.

    ``callbacks``: called after each iteration (see the module docstring); one returning ``True``
    stops the run. Under ``torchrun`` (``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` set) every
    process runs this as one rank of a data-parallel job and gets the same rows (all-reduced).
    """
    check_launch(cfg)
    return run_checked(cfg, callbacks)


def run_checked(cfg: TrainConfig, callbacks: Sequence[Callback] = ()) -> list[dict[str, float]]:
    """:func:`train` of a configuration :func:`~ppo_objectives.train.check_launch` has passed (the command
    line checks it first, to turn a refusal into an ``error:`` line)."""
    # --- plumbing: --threads, the process group, transformers' progress bars (off with --no-progress)
    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = init_distributed(cfg.device)
    try:
        with _hf_progress_bars(not cfg.no_progress):
            return _train(cfg, d, tuple(callbacks))
    finally:
        torch.set_num_threads(threads_before)
        close_distributed(d)  # _train has returned: its DDP wrappers are freed while the group is alive


def _train(cfg: TrainConfig, d: Dist, callbacks: tuple) -> list[dict[str, float]]:
    run = build(cfg, d)  # tasks, env + collector, actor-critic, reference, KL transform, GAE, loss, optimizers
    pg, rows = d.group, []
    bar, logger = _reporters(cfg, d, run.start_it, run.out)  # plumbing: rank 0's progress bar and --logger
    try:
        if run.evaluation is not None and run.start_it == 0:  # text tasks: row 0, the pretrained model
            rows.append(_log_start(run.evaluation(run.ac.actor_model, 0, "start"), cfg, d, run.out, logger))
        train_s = 0.0  # rollouts and updates since this process started (--time-limit, --eval-minutes)
        for it in range(run.start_it, cfg.iterations):
            # 1. rollout through the collector, in the response layout
            t0 = time.perf_counter()
            cut_before = run.env.env_turns_cut if cfg.multi_turn else 0
            with gathered_for_rollout(run.ac.actor_model):  # --fsdp: the whole actor (else nothing)
                llm = collect_batch(run.collector_iter, run.device, run.P, run.M,
                                    policy_version=run.policy_version(it))
            t_ref = time.perf_counter()
            # 2. scoring: V_old, the reference's log-probs, the KL penalty in the reward, GAE
            llm = score_batch(llm, run.ac, run.kl_transform, run.gae)
            t1 = time.perf_counter()
            # 3. the rollout's metrics (on every rank's responses); after the first rollout, whether the critic
            #    trains alone first (--critic-warmup, or --rare-reward-warmup where that rollout's rewards are rare)
            roll = rollout_stats(llm, run.kl_transform, pg)
            turns = {k: roll.pop(k) for k in ("turns", "turn_tokens")}  # columns of a multi-turn task
            if cfg.multi_turn:
                turns["env_turns_cut"] = run.env.env_turns_cut - cut_before
            else:
                turns = {}
            if said := run.warmup.decide(dict(iteration=it + 1, **roll, **turns)):
                warn_line(said, bar)
            # 4. PPO epochs x minibatches, approx-KL trust region, non-finite guard (the critic's steps alone in
            #    the warm-up: the actor keeps the policy that made the rollouts)
            stats = ppo_update(llm, run.loss_module, run.ac, run.optimizers, cfg, run.gen, process_group=pg,
                               critic_only=run.warmup.critic_only(it))
            t2 = time.perf_counter()
            # 5. the in-reward KL coefficient (on the all-rank KL: identical on every rank) and the row
            coeff = run.controller.update(roll.pop("seq_kl_t"), n_steps=int(roll["episodes"]))
            n_tok = roll.pop("tokens")
            row = dict(iteration=it + 1, **roll, **turns, kl_reward_coeff=float(coeff), rollout_s=t_ref - t0,
                       reference_s=t1 - t_ref, update_s=t2 - t1, tokens_per_s=n_tok / max(t_ref - t0, 1e-9),
                       **stats)  # fmt: skip
            # multi-turn: the first cut turn is said, and so is every iteration where most conversations were cut
            if row.get("env_turns_cut") and (not cut_before or most_conversations_cut(row)):
                warn_line(f"iteration {it + 1}: {row['env_turns_cut']} environment turns did not fit --max-new-tokens "
                          f"{cfg.max_new_tokens} ({row['episodes']:g} conversations); each ended its episode there "
                          f"(truncated, scored as it stood): raise --max-new-tokens (env_turns_cut counts them)", bar)
            if cfg.remote_rollouts:  # workers receive the weights (in-process, the collector shares them)
                run.collector.update_policy_weights_()
            release_host_memory()  # plumbing: the freed host memory of the rollout and update, back to the system
            # 6. held-out evaluation when due, the collapse guard, metrics.csv / --logger / bar, checkpoint
            spent = t2 - t0
            train_s += spent
            last = it + 1 == cfg.iterations or _out_of_time(cfg, train_s, pg, run.device)
            if run.evaluation is not None:
                row.update(_evaluate_if_due(run, it + 1, last, train_s))
            row = _log_iteration(row, run.guard, d, run.out, bar, logger, columns(cfg), spent if cfg.time_limit else 1)
            saved = (it + 1) % cfg.save_every == 0 or last
            if saved:  # checkpoint and plot; text tasks: the Hugging Face export
                _save(run, it + 1)
            rows.append(row)
            # 7. the user's callbacks: any of them may stop the run
            stop = [bool(callback(row, run)) for callback in callbacks]
            if any(stop) and not saved:
                _save(run, it + 1)
            if last or any(stop):
                break
        ac = run.ac
        check_ranks_in_sync([ac.actor_model, ac.critic_model, ac.critic_head], pg)
        if pg is not None and d.main:
            print(f"parameters identical on all {d.world} ranks", file=sys.stderr, flush=True)
    finally:  # plumbing: reporters, the collector, the DDP reducers (freed while the process group is alive)
        _close_reporters(bar, logger)
        run.collector.shutdown()
        run.loss_module = None
        run.ddp_wrappers.clear()
    _finish_run(cfg, d, run.guard, run.out)
    return rows


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
        return dict.fromkeys((*EVAL_COLUMNS, *(EVAL_TURN_COLUMNS if cfg.multi_turn else ())), math.nan)
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


def _plot_run(csv_path: Path, png_path: Path) -> None:
    """Redraw the run's ``metrics.csv`` into ``png_path`` (:func:`ppo_objectives.train.monitor.plot_metrics`)."""
    plot_metrics(read_metrics(csv_path), png_path, title=f"PPO run {Path(csv_path).parent.name}")


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
            _plot_run(out / "metrics.csv", out / "training.png")


def _finish_run(cfg: TrainConfig, d: Dist, guard: CollapseGuard, out: Path) -> None:
    """The final plot, and a :class:`TrainingCollapseWarning` (issued from :func:`train`) when the run collapsed."""
    csv_path = out / "metrics.csv"
    if d.main and not cfg.no_plot and csv_path.exists():
        _plot_run(csv_path, out / "training.png")
    if d.main and guard.collapses:
        warnings.warn(f"the PPO run in {out} collapsed: {guard.summary()}; see the warn_* and collapse columns "
                      f"of {csv_path} and {out / 'training.png'}", TrainingCollapseWarning, stacklevel=3)


class TrainingCollapseWarning(RuntimeWarning):
    """Raised (as a warning) at the end of a run that went through a collapse (:class:`CollapseGuard`)."""

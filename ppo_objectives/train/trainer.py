"""The job's PPO iteration as a :class:`torchrl.trainers.Trainer`: our components, TorchRL's loop and hooks.

:func:`make_trainer` wires the pieces :func:`~ppo_objectives.train.build.build` returns into
TorchRL's ``Trainer`` (plain ``Trainer``: ``PPOTrainer`` / ``OnPolicyTrainer`` set an ``action``
key on the loss, which ``TokenPPOLoss`` has not, run GAE once per epoch where the KL penalty
must be applied once per batch, and push weights from ``loss_module.actor_network``, which an
in-process collector cannot take; ``GRPOTrainer`` without its vLLM weight sender and replay
buffer is ``Trainer``). One collected batch runs these stages, in TorchRL's order:

- ``batch_process``: collector rows -> response layout (from workers: each frame's policy
  version checked against the learner's pushes), ``V_old``, ``KLPenaltyTransform``,
  ``MaskedGAE`` (:func:`~ppo_objectives.train.rollout.score_batch`);
- ``pre_optim_steps``: a fresh approx-KL trust region
  (:class:`~ppo_objectives.train.update.TrustRegionUpdate`);
- ``pre_epoch``: the minibatch permutation of the epoch, from the run's generator;
- ``process_optim_batch``: the next minibatch; ``StopIteration`` ends the epoch (and every
  epoch once the trust region stopped the update);
- the optimization stepper, :class:`TrustRegionStepper`: forward, trust-region check (pull
  back and stop), non-finite guards, backward, per-model clipping, both AdamW steps;
- ``post_steps``: the last step's trust-region check, then the KL controller, then TorchRL's
  ``UpdateWeights`` for rollout workers, processes or Ray actors (rolled-back steps are never
  pushed);
- ``post_steps_log``: the iteration's row: held-out evaluation, collapse guard,
  ``metrics.csv``, the TorchRL logger, checkpoints, and ``request_stop`` after ``--iterations``.

On the same configuration and seed its ``metrics.csv`` equals the job's (``python -m
ppo_objectives.train``) in every column but the timings: the same generator draws the same
permutations in the same order (``tests/train/test_trainer.py``). Not supported: ``--fsdp``
(gathering the sharded actor for the rollout needs a hook around collection, which ``Trainer``
does not have).
"""

from __future__ import annotations

import time

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.trainers import OptimizationStepper, Trainer, UpdateWeights

from ppo_objectives.train.build import Run
from ppo_objectives.train.config import TrainConfig
from ppo_objectives.train.distributed import release_host_memory
from ppo_objectives.train.loop import close_iteration, end_iteration, finish_run, run_training, started
from ppo_objectives.train.rollout import response_layout, score_batch
from ppo_objectives.train.update import TrustRegionUpdate, minibatch_count

__all__ = ["TrustRegionStepper", "make_trainer", "train_with_trainer"]


class _Shared:
    """What the hooks of one collected batch share: the job's ``_iteration`` locals."""

    def __init__(self, run: Run):
        self.run, self.it = run, run.start_it
        self.t_end = time.perf_counter()  # end of the previous iteration: the rollout started then
        self.times, self.stats, self.train_s = {}, {}, 0.0
        self.llm = self.u = self.row = None
        self.epoch = self.j = self.n_minibatches = 0


class _Rollout:
    """``batch_process``: ``[N, T]`` collector rows -> the response layout ``[B]``, scored and penalised."""

    def __init__(self, s: _Shared):
        self.s = s

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        s, run = self.s, self.s.run
        llm = response_layout(batch, run.device, run.P, run.M, policy_version=run.policy_version(s.it))
        t_ref = time.perf_counter()
        s.llm = score_batch(llm, run.ac, run.kl_transform, run.gae)
        s.times = dict(rollout_s=t_ref - s.t_end, reference_s=time.perf_counter() - t_ref)
        return s.llm


class _Minibatches:
    """``pre_epoch`` (the epoch's permutation) and ``process_optim_batch`` (its next minibatch)."""

    def __init__(self, s: _Shared):
        self.s, self.parts, self.j, self.last = s, [], 0, None

    def new_epoch(self, batch: TensorDictBase) -> TensorDictBase:
        """The job's ``randperm(B, generator=gen)`` split in ``min(minibatches, most rows of any rank)`` parts;
        none once the trust region stopped the update. Returns the batch (``Trainer`` keeps what it gets)."""
        n = self.s.n_minibatches
        self.j, self.parts = 0, []
        if not self.s.u.stopped and n:
            perm = torch.randperm(batch.batch_size[0], generator=self.s.run.gen).to(batch.device)
            self.parts = list(torch.tensor_split(perm, n))
        self.s.epoch += 1
        return batch

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        # StopIteration ends the epoch: a hook returning None would be replaced by its input, the whole batch
        if self.s.u.stopped or self.j >= len(self.parts):
            raise StopIteration
        self.last = batch[self.parts[self.j]]
        self.s.j, self.j = self.j, self.j + 1
        return self.last


class TrustRegionStepper(OptimizationStepper):
    """One minibatch of the job's update as a TorchRL optimization stepper.

    The loss forward, the approx-KL trust region (past ``early_stop_kl`` the last kept step is
    pulled back and the update stops), the non-finite guards, one backward, gradient clipping per
    model and the AdamW steps of the actor and the critic (each snapshotted first), with
    :class:`~ppo_objectives.train.update.TrustRegionUpdate`, the engine of the job's own update.
    Holds both optimizers' states for TorchRL's checkpointing.
    """

    def __init__(self, s: _Shared, minibatches: _Minibatches):
        self.s, self.minibatches = s, minibatches

    def begin(self) -> None:
        """``pre_optim_steps``: a fresh trust region for the collected batch."""
        s, run = self.s, self.s.run
        s.t_update, s.epoch = time.perf_counter(), -1
        s.n_minibatches = minibatch_count(s.llm.batch_size[0], run.cfg, s.llm.device, run.d.group)
        s.u = TrustRegionUpdate(run.loss_module, run.ac, run.optimizers, run.cfg, run.d.group,
                                critic_only=s.it < run.cfg.critic_warmup)  # fmt: skip

    def step(self, trainer: Trainer, mb: TensorDictBase) -> TensorDictBase:
        kl_now = self.s.u.minibatch(mb, self.s.epoch, self.s.j)
        return TensorDict({"kl_approx": torch.tensor(kl_now)}, [])

    def finish(self) -> None:
        """``post_steps``, before the weight push: the last step's trust-region check, the update's statistics."""
        u, s = self.s.u, self.s
        if u.rollback and u.steps and not u.stopped:
            u.check_last_step(self.minibatches.last)
        s.stats = u.stats(s.run.device)
        s.times["update_s"] = time.perf_counter() - s.t_update

    def state_dict(self) -> dict:
        return {f"optimizer{i}": o.state_dict() for i, o in enumerate(self.s.run.optimizers)}

    def load_state_dict(self, state_dict: dict) -> None:
        for i, o in enumerate(self.s.run.optimizers):
            o.load_state_dict(state_dict[f"optimizer{i}"])


def _close_iteration(s: _Shared):
    """``post_steps``, after the stepper's check: the KL controller's update and the iteration's row."""

    def hook() -> None:
        s.row = close_iteration(s.run, s.it, s.llm, s.times, s.stats)

    return hook


class _IterationLog:
    """``post_steps_log``: the end of the iteration (evaluation, collapse guard, metrics.csv, logger, progress bar,
    checkpoint), then the stop after ``--iterations`` or ``--time-limit``."""

    def __init__(self, s: _Shared, trainer: Trainer, bar, logger):
        self.s, self.trainer, self.bar, self.logger, self.rows = s, trainer, bar, logger, []

    def __call__(self, batch: TensorDictBase) -> None:
        s = self.s
        release_host_memory()
        row, s.train_s, last = end_iteration(s.run, s.it, s.row, s.train_s, self.bar, self.logger)
        self.rows.append(row)
        s.it += 1
        if last:
            self.trainer.request_stop("iterations done")
        s.t_end = time.perf_counter()


def _refuse_fsdp(cfg: TrainConfig, where: str) -> None:
    if cfg.fsdp:
        raise ValueError(f"{where}: --fsdp is not supported: gathering the sharded actor for the rollout needs a hook "
                         f"around collection, which torchrl's Trainer has not; use the job (python -m "
                         f"ppo_objectives.train) or DDP")


def make_trainer(run: Run, bar=None, logger=None) -> tuple[Trainer, list[dict]]:
    """A TorchRL ``Trainer`` running the job's PPO iterations on ``run`` (from :func:`~ppo_objectives.train.build.build`).

    Returns the trainer and the list its iterations append their rows to. ``bar`` and ``logger``
    are the job's progress bar and TorchRL logger (or ``None``). ``trainer.train()`` runs from the
    run's start iteration to ``cfg.iterations`` and closes the collector.
    """
    cfg = run.cfg
    _refuse_fsdp(cfg, "make_trainer")
    s = _Shared(run)
    minibatches = _Minibatches(s)
    stepper = TrustRegionStepper(s, minibatches)
    trainer = Trainer(
        collector=run.collector, total_frames=2**62, frame_skip=1,  # the stop is request_stop after --iterations
        optim_steps_per_batch=cfg.minibatches, num_epochs=cfg.ppo_epochs, loss_module=run.loss_module,
        optimizer=None, optimization_stepper=stepper, logger=None, progress_bar=False,
        seed=None,  # a seed would reseed torch and the collector: the job's seeding stands
        auto_log_optim_steps=False,
    )  # fmt: skip
    trainer.register_op("batch_process", _Rollout(s))
    trainer.register_op("pre_optim_steps", stepper.begin)
    trainer.register_op("pre_epoch", minibatches.new_epoch)
    trainer.register_op("process_optim_batch", minibatches)
    trainer.register_op("post_steps", stepper.finish)  # the rollback comes before any weight push
    trainer.register_op("post_steps", _close_iteration(s))
    if cfg.remote_rollouts:
        UpdateWeights(run.collector, 1).register(trainer)  # collector.update_policy_weights_()
    log = _IterationLog(s, trainer, bar, logger)
    trainer.register_op("post_steps_log", log)
    trainer.register_op("shutdown", lambda: finish_run(cfg, run.d, run.guard, run.out))
    return trainer, log.rows


def train_with_trainer(cfg: TrainConfig) -> list[dict[str, float]]:
    """:func:`~ppo_objectives.train.loop.train` with TorchRL's ``Trainer`` as the loop: the same frame
    (:func:`~ppo_objectives.train.loop.run_training`: checks, threads, process group), the same start and teardown
    (:func:`~ppo_objectives.train.loop.started`: reporters, a text task's row 0) and rows."""
    _refuse_fsdp(cfg, "train_with_trainer")
    return run_training(cfg, _train_with_trainer)


def _train_with_trainer(cfg: TrainConfig, d) -> list[dict[str, float]]:
    with started(cfg, d) as (run, rows, bar, logger):
        trainer, trained = make_trainer(run, bar, logger)
        if run.start_it < cfg.iterations:
            trainer.train()
    return rows + trained

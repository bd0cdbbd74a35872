"""Tutorial 11: token-level PPO with a critic as a TorchRL ``Trainer``, built in a page.

TorchRL's ``Trainer`` runs a loop of stages: collect a batch, process it, run epochs of
optimization steps over minibatches, then post-step and logging hooks. Our components drop into
those stages:

- ``batch_process``: the collector's ``[N, T]`` rows become the response layout, the critic's
  values are read, ``KLPenaltyTransform`` puts the per-token KL into the rewards and ``MaskedGAE``
  writes the advantages (``score_batch``);
- ``pre_epoch`` / ``process_optim_batch``: the minibatches of each epoch;
- the optimization stepper (``TrustRegionStepper``): ``TokenPPOLoss``, the approx-KL trust region
  that stops the epochs and pulls back a step that went too far, gradient clipping, the actor's and
  the critic's AdamW steps;
- ``post_steps``: the trust region's last check, the KL controller, and TorchRL's own
  ``UpdateWeights`` when collector workers run in other processes;
- ``post_steps_log``: the collapse guard, ``metrics.csv``, checkpoints, and the stop.

``make_trainer`` does the wiring from the pieces ``build()`` returns. This page builds the
trainer, runs it, and runs the job's own loop (``python -m ppo_objectives.train``) on the same
configuration: the metrics agree in every column but the timings. From the command line the same
trainer is ``python -m ppo_objectives.train --loop torchrl``.

Run it: ``python tutorials/11_torchrl_trainer.py`` (two runs of 6 iterations of the pico model, a
few seconds on a CPU).
"""

import tempfile
from pathlib import Path

import torch

from ppo_objectives import train as T
from ppo_objectives.train.build import build
from ppo_objectives.train.distributed import close_distributed, init_distributed
from ppo_objectives.train.trainer import make_trainer

FLAGS = dict(iterations=6, preset="pico", num_envs=16, warmup_steps=5, no_plot=True, no_progress=True)
tmp = Path(tempfile.mkdtemp())

# 1. The pieces: env + collector, actor-critic, KLPenaltyTransform, MaskedGAE, TokenPPOLoss, optimizers.
cfg = T.TrainConfig(out=str(tmp / "trainer"), **FLAGS)
threads = torch.get_num_threads()
torch.set_num_threads(cfg.threads)  # the toy recipe's one thread, as the job sets it: the same float path
d = init_distributed(cfg.device)  # a single process here; under torchrun every rank builds its own
run = build(cfg, d)
print(f"collector {type(run.collector).__name__}, loss {type(run.loss_module).__name__}, "
      f"estimator {type(run.gae).__name__}, KL {type(run.kl_transform).__name__}")

# 2. The trainer: TorchRL's Trainer with our steps as its hooks and stepper.
trainer, rows = make_trainer(run)
print(f"trainer {type(trainer).__module__}.{type(trainer).__name__}, stepper {type(trainer.optimization_stepper).__name__}"
      if hasattr(trainer, "optimization_stepper") else f"trainer {type(trainer).__name__}")
trainer.train()  # runs the 6 iterations, then closes the collector
close_distributed(d)
torch.set_num_threads(threads)

# 3. The job's own loop on the same configuration and seed.
job = T.train(T.TrainConfig(out=str(tmp / "job"), **FLAGS))

TIMING = {"rollout_s", "reference_s", "update_s", "tokens_per_s"}
print("\niteration  reward (trainer)  reward (job)  kl_ref (trainer)  kl_ref (job)")
for a, b in zip(rows, job):
    print(f"{a['iteration']:9d}  {a['reward']:16.4f}  {b['reward']:12.4f}  {a['kl_ref']:16.6f}  {b['kl_ref']:12.6f}")
different = [k for a, b in zip(rows, job) for k in a if k not in TIMING and a[k] != b[k]]
print(f"columns that differ between the trainer and the job: {different or 'none'}")
assert not different

"""Tutorial 11: token-level PPO with a critic, composed into TorchRL's own ``Trainer``.

``torchrl.trainers.Trainer`` owns the loop but builds none of its operations: it is given a
collector, a loss module and an optimizer, and everything else is a hook registered at a named
stage (``trainer.register_op(stage, fn)``). For each batch the collector yields, it runs:

1. ``batch_process``: turn the collected batch into training data;
2. ``pre_steps_log``: log what was collected;
3. ``num_epochs`` x ``optim_steps_per_batch`` optimization steps, each one ``process_optim_batch``
   (pick the minibatch) and then the optimization stepper (loss, backward, gradient clipping,
   optimizer step); ``post_optim_complete_log`` then gets the losses averaged over the steps;
4. ``post_steps``: whatever follows an update;
5. ``post_steps_log``: log after the update.

This package's public pieces go into those stages:

- the collector: TorchRL's ``Collector`` on :class:`~ppo_objectives.llm.env.TokenLMEnv` (one step is
  one token), with ``postproc=ToLLMBatch(P, M)``, so that it yields the response layout ``[B]`` (one
  row per finished response, ``[B, R]`` entries and a ``mask``) instead of per-token steps;
- ``batch_process``: the critic writes ``V_old``,
  :class:`~ppo_objectives.transforms.KLPenaltyTransform` subtracts ``beta * KL`` to a frozen
  reference from every token's reward, :class:`~ppo_objectives.value.gae.MaskedGAE` writes the
  advantages. Once per batch: the penalty must be in the rewards before GAE reads them, and
  neither may run again in the epochs;
- ``process_optim_batch``: random rows of the batch;
- the loss module, :class:`~ppo_objectives.loss.TokenPPOLoss`, and the stepper, TorchRL's
  ``DefaultOptimizationStepper``: it sums the loss's ``loss_*`` terms, clips the gradient norm and
  steps one AdamW over the actor's and the critic's parameters (one parameter group each);
- ``post_steps``: the KL controller (:class:`~ppo_objectives.transforms.AdaptiveKLController`) moves
  ``beta`` towards a target KL;
- ``pre_steps_log``, ``post_optim_complete_log``, ``post_steps_log``: the reward, the update's
  statistics, a progress line.

Why the plain ``Trainer``: TorchRL's ``PPOTrainer`` / ``OnPolicyTrainer`` set an ``action`` key on
the loss (``TokenPPOLoss`` reads the response layout, which has none), run GAE at every epoch (a
``pre_epoch`` hook), where the KL penalty must enter the rewards once per batch, and register an
``UpdateWeights`` hook. This collector runs in this process and its policy shares the actor's
weights, so no weight push is needed: the next batch is sampled with the updated weights. Left out
to keep the page short: the approx-KL trust region (the ``kl_approx`` column shows the updates that
went far), checkpoints, metrics file and collapse guard of the training job (``python -m
ppo_objectives.train``, which runs its own loop).

Run it: ``python tutorials/11_torchrl_trainer.py`` (100 batches of the pico model on "reverse" with
3 digits, about 15 s on one CPU thread). It asserts that the mean reward of the last 5
batches beats that of the first 5 by more than 0.2; on a 2-core x86 machine it goes from about 0.3
to 0.66 (seed 0), 0.98 (seed 1) and 0.81 (seed 2). ``PPO_TUTORIAL_SEED=N`` picks another seed.
"""

import math
import os
import time

import torch
from torchrl.collectors import Collector
from torchrl.trainers import DefaultOptimizationStepper, Trainer

from ppo_objectives import KLPenaltyTransform, MaskedGAE, TokenPPOLoss
from ppo_objectives.llm import TinyCausalLM, TinyLMConfig, TokenLMEnv, ToLLMBatch, frozen_reference, make_actor_critic
from ppo_objectives.train.digit import DigitTask, warm_start
from ppo_objectives.transforms import AdaptiveKLController

# ---------------------------------------------------------------- hyper-parameters
SEED = int(os.environ.get("PPO_TUTORIAL_SEED", 0))
BATCHES = 100  # collected batches = PPO iterations
NUM_ENVS = 64  # env rows: about one response per row per batch
WARMUP_STEPS = 100  # supervised steps teaching the answer format (3 digits, then EOS)
PPO_EPOCHS, MINIBATCHES = 4, 8  # passes over each batch x minibatches per pass
LR, CRITIC_LR = 3e-3, 3e-3  # one AdamW, a parameter group (and learning rate) for each
MAX_GRAD_NORM = 1.0
KL_COEF, KL_TARGET, KL_HORIZON = 0.02, 1.0, 1_000  # starting beta; target KL per response (nats); horizon (responses)

torch.manual_seed(SEED)  # the policy's sampling and the networks' initialisation
torch.set_num_threads(1)  # a tiny model: one thread is the fastest
gen = torch.Generator().manual_seed(SEED)  # the warm start's data and the minibatch rows

# ---------------------------------------------------------------- 1. task, env, networks (as in tutorial 05)
task = DigitTask("reverse", num_digits=3)  # "123<" -> "321." ; reward = fraction of the 4 answer tokens right
env = TokenLMEnv.from_task(task, num_envs=NUM_ENVS, seed=SEED)
P, M = env.prompt_len, env.max_new_tokens
lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=task.vocab_size, block_size=P + M))
warm_start(lm, task, WARMUP_STEPS, lr=3e-3, generator=gen, device="cpu")  # the format; the digits are PPO's job
ac = make_actor_critic(lm, prompt_len=P, entropy_grad=False)  # policy (env), actor + critic (loss)
ref = frozen_reference(ac.actor_model, P)  # a frozen copy of the warm-started model

# ---------------------------------------------------------------- 2. the pieces the Trainer is given
collector = Collector(
    env,
    ac.policy,
    frames_per_batch=NUM_ENVS * M,  # M tokens per row: every row finishes (at least) one response
    total_frames=BATCHES * NUM_ENVS * M,  # the collector stops after BATCHES batches, and with it the Trainer
    reset_at_each_iter=True,  # every batch starts fresh prompts (no response is cut by a batch boundary)
    auto_register_policy_transforms=False,  # plumbing: our policy needs no transform from the env
    postproc=ToLLMBatch(P, M),  # per-token steps [N, T] -> response layout [B]
)
kl_transform = KLPenaltyTransform(ref, coeff=AdaptiveKLController(KL_COEF, target=KL_TARGET, horizon=KL_HORIZON))
gae = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)  # advantages whitened over the valid tokens
# loss_objective (clipped PPO) + loss_critic (clipped value loss) + loss_kl_ref and loss_entropy (0 here: the KL is in
# the reward, and there is no entropy bonus); kl_approx and clip_fraction are logged, not optimized
loss_module = TokenPPOLoss(ac.actor, ac.critic, kl_to_ref_coeff=0.0, functional=False)
optimizer = torch.optim.AdamW(
    [dict(params=ac.actor_parameters(), lr=LR), dict(params=ac.critic_parameters(), lr=CRITIC_LR)], weight_decay=0.0
)

trainer = Trainer(
    collector=collector,
    total_frames=BATCHES * NUM_ENVS * M,  # plumbing: the Trainer counts the rows [B] of processed batches, fewer
    frame_skip=1,
    loss_module=loss_module,
    optimizer=optimizer,
    optimization_stepper=DefaultOptimizationStepper(),  # sum of loss_*, backward, clip, optimizer.step
    num_epochs=PPO_EPOCHS,
    optim_steps_per_batch=MINIBATCHES,  # per epoch
    clip_grad_norm=True,
    clip_norm=MAX_GRAD_NORM,
    progress_bar=False,
    logger=None,  # a torchrl Logger (CSV, TensorBoard, W&B) would receive every logged value
    seed=None,  # plumbing: a seed here would reseed torch and the env; ours are seeded above
    auto_log_optim_steps=False,  # plumbing: the averaged losses go to our post_optim_complete_log hook (6.)
)


# ---------------------------------------------------------------- 3. batch_process: V_old, KL penalty, GAE
@torch.no_grad()
def score_batch(batch):
    ac.critic(batch)  # "state_value" [B, R]: V_old
    kl_transform(batch)  # "ref_log_prob"; ("next", "reward") -= beta * (log_prob - ref_log_prob), per token
    gae(batch)  # "advantage", "value_target"
    return batch


trainer.register_op("batch_process", score_batch)


# ---------------------------------------------------------------- 4. process_optim_batch: a minibatch
def random_rows(batch):
    B = batch.batch_size[0]
    return batch[torch.randperm(B, generator=gen)[: math.ceil(B / MINIBATCHES)]]


trainer.register_op("process_optim_batch", random_rows)


# ---------------------------------------------------------------- 5. post_steps: the KL controller
def update_kl_coeff():
    # the batch's mean KL of a response to the reference (the transform keeps it); n_steps: its responses, about
    # one per row (the controller's horizon counts responses)
    kl_transform.kl_controller.update(kl_transform.last_seq_kl, n_steps=NUM_ENVS)


trainer.register_op("post_steps", update_kl_coeff)

# ---------------------------------------------------------------- 6. logging hooks
history = []  # one dict per batch


def log_reward(batch):  # pre_steps_log: what it returns goes to the Trainer's logger
    history.append(dict(reward=batch["score"].mean().item(), exact=(batch["score"] == 1).float().mean().item(),
                        seq_kl=kl_transform.last_seq_kl.item()))
    return dict(reward=history[-1]["reward"])


def log_losses(optim_steps, average_losses):  # post_optim_complete_log: the losses averaged over the batch's steps
    history[-1].update(kl_approx=average_losses["kl_approx"].item(), clip=average_losses["clip_fraction"].item())


def print_progress(batch):  # post_steps_log
    i, h = len(history), history[-1]
    if i == 1 or i % 5 == 0:
        # reward: mean task score (fraction of the 4 answer tokens right); exact: share of fully right answers;
        # seq_kl: KL of a response to the reference (nats, summed over its tokens; 0 at first: the reference is
        # the starting policy); beta: the KL coefficient after the controller's update; kl_approx: KL of the
        # policy to the rollout's during the update, mean over its steps; clip: share of tokens whose ratio
        # was clipped
        print(f"batch {i:3d}  reward {h['reward']:.3f}  exact {h['exact']:.2f}  seq_kl {h['seq_kl']:.3f}  "
              f"beta {kl_transform.kl_controller.coeff.item():.4f}  kl_approx {h['kl_approx']:.4f}  "
              f"clip {h['clip']:.3f}")


trainer.register_op("pre_steps_log", log_reward)
trainer.register_op("post_optim_complete_log", log_losses)
trainer.register_op("post_steps_log", print_progress)

# ---------------------------------------------------------------- 7. train, and check that it learned
t0 = time.perf_counter()
trainer.train()  # runs BATCHES batches, then shuts the collector down
k = 5  # mean reward over the first and over the last k batches: PPO must have raised it
first, last = (sum(h["reward"] for h in hs) / k for hs in (history[:k], history[-k:]))
print(f"mean reward: first {k} batches {first:.3f} -> last {k} batches {last:.3f} "
      f"({len(history)} batches, {time.perf_counter() - t0:.0f}s)")
assert len(history) == BATCHES
assert last > first + 0.2, f"PPO did not improve the reward: {first:.3f} -> {last:.3f}"

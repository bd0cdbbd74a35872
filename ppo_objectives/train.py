"""Token-level PPO with a critic, end to end on TorchRL: ``python -m ppo_objectives.train``.

One iteration (MiniMind's PPO stage, on TorchRL components)::

    collector (Collector / MultiSyncCollector) drives TokenLMEnv with the actor
        -> per-token batch [N, T]                       one step = one token
    trajectories_to_llm_batch                           -> LLM layout [B, R] + mask
    critic (no grad)                                    -> state_value [B, R]   (V_old)
    KLPenaltyTransform (frozen reference)               -> ref_log_prob, reward -= beta * k1
    MaskedGAE (gamma=1, lambda=0.95, whitened)          -> advantage, value_target
    for epoch in ppo_epochs: for minibatch:             TokenPPOLoss -> backward
        clip grad norm 1.0, AdamW step (actor, critic)
        once kl_approx > early_stop_kl: undo the step that crossed it, stop (trust region)
        skip the step when the loss or a gradient norm is not finite
    collapse guard (ppo_objectives.monitor)             -> warn_* / collapse columns, warning lines
    KL controller update (fixed by default, --adaptive-kl for Ziegler et al.)

The default job teaches a ~0.1M-parameter TinyCausalLM to reverse 3 digits
(``"123<"`` -> ``"321."``, :class:`~ppo_objectives.envs.DigitTask`), from a
short supervised warm start that teaches only the *format* (three digits then
EOS, digits random), so what the reward measures -- the right digits -- is
learned by PPO alone. It runs on CPU in a few minutes.

Data-parallel (DDP): ``torchrun --nproc_per_node 2 -m ppo_objectives.train ...``
(gloo on CPU, nccl with ``--device cuda``, one GPU per process). The launcher is
detected from ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK``; every rank rolls out its
own ``--num-envs`` rows (seeded per rank), the actor and the critic are called
through ``DistributedDataParallel`` in the update, advantages are whitened over
the valid tokens of all ranks, every optimizer step divides by the global
valid-token count (``functional.loss_normalizer``), the approx-KL early stop and
the non-finite guard decide on global numbers (all ranks stop and skip together),
and the logged metrics are over all ranks. Only rank 0 writes metrics, plot and
checkpoint; the run ends by checking that the parameters are identical on every rank.

Sharded (FSDP2): ``torchrun ... -m ppo_objectives.train --fsdp`` shards the actor's and the
critic's models instead (``torch.distributed.fsdp.fully_shard`` on each transformer block, then
on the model and the value head; ``_plumbing.shard_fsdp``), for models whose optimizer state
does not fit one rank: each rank holds ``1/world`` of every parameter, gradient and AdamW
moment. Everything above holds unchanged: a forward all-gathers the parameters it needs, a
backward reduce-scatters the gradients averaged over the ranks (as DDP averages them, so the
global-token normaliser keeps its meaning), and the optimizer steps the shards; the trust
region's snapshot and backtracking, the gradient clipping (the norm over every rank's shards)
and the non-finite guard work on the shards. The rollout runs on the whole actor, gathered once
per iteration and kept gathered until the batch is made (``_plumbing.gathered_for_rollout``):
the env policy makes one or two forwards per env step depending on which rows reset, a number
that differs between ranks, so per-forward all-gathers would leave ranks waiting on each other.
That costs one full copy of the actor's parameters per rank during the rollout (no gradients, no
optimizer state). The frozen reference is copied before sharding and stays whole (it has no
optimizer state). Checkpoints hold full state dicts, gathered on rank 0
(``torch.distributed.checkpoint.state_dict``; the models' as without ``--fsdp``, the optimizers'
keyed by parameter name), and ``--resume`` loads them on every rank, keeping its shards;
resume with the same ``--fsdp``. ``--fsdp`` needs torchrun, a critic with its own trunk (no
``--shared-trunk``) and ``--workers 1``.

Logged metrics (one row per iteration in ``DIR/metrics.csv``; plot ``DIR/training.png``)
----------------------------------------------------------------------------------------

``iteration``
    PPO iteration (one rollout + its updates), counted from 1.
``reward``
    Mean task score of the responses finished in this rollout, before any KL
    penalty (DigitTask: fraction of the answer's digits + EOS at the right
    index, in [0, 1]). The number that has to go up.
``exact``
    Fraction of those responses that are exactly right (score 1).
``response_len``
    Mean number of generated tokens per response (EOS included).
``episodes``
    Finished responses in the batch (``B``); episodes cut by the batch end are dropped.
``kl_ref``
    Per-token KL of the sampling policy to the frozen reference (the warm-started
    model), k1 estimator ``log pi(a) - log pi_ref(a)`` averaged over response
    tokens (``KLPenaltyTransform.last_kl``); its mean is the KL in nats per token.
``seq_kl``
    The same k1 summed over each response, averaged over responses (``last_seq_kl``);
    what the adaptive controller tracks.
``kl_coeff``
    The in-reward KL coefficient ``beta`` after this iteration's controller update.
``loss_objective``
    Clipped PPO surrogate ``agg(max(-A r, -A clip(r, 1-eps, 1+eps)))``, mean over the
    minibatch steps taken (token-mean aggregation).
``loss_critic``
    ``critic_coeff * agg(0.5 max((V-G)^2, (clip(V, V_old +- c) - G)^2))``, mean over steps.
``loss_kl_ref``
    The in-loss reference KL term (``kl_coeff`` of the loss, MiniMind's k3); 0 when
    ``--kl-loss-coef 0`` (the default: the KL is in the reward instead).
``loss_entropy``
    ``-entropy_coeff * agg(H)``; 0 without an entropy bonus.
``entropy``
    Mean per-token entropy (nats) of the current policy on the response tokens.
``kl_approx``
    ``mean(0.5 (log pi_new - log pi_old)^2)`` over valid tokens (the k2 estimate of the
    KL to the behaviour policy), averaged over the steps taken; MiniMind's early-stop signal.
``kl_approx_max``
    Its largest value over the minibatch checks of this iteration (what ``--early-stop-kl``
    compares), including the check that made a step be undone.
``kl_token_max``
    The largest *per-token* ``0.5 (log pi_new - log pi_old)^2`` seen by those checks: what the
    mean hides. Large values are routine on tokens sampled with a small probability and pushed
    lower (little probability mass moves); a large value with a large ``kl_approx_max`` is a jump.
``clip_fraction``
    Fraction of valid tokens whose ratio is outside ``[1-eps, 1+eps]`` (mean over steps).
``max_ratio`` / ``ESS``
    Largest importance ratio; normalised effective sample size of the ratios (1 = on-policy).
``value_clip_fraction``
    Fraction of tokens where the clipped value branch is the active one.
``explained_variance``
    ``1 - Var(G - V) / Var(G)`` of the returns by the critic (1 = perfect, <= 0 = useless).
``updates`` / ``early_stopped``
    Optimizer steps kept this iteration, and 1 when the approx-KL early stop fired.
``rolled_back`` / ``step_fraction``
    1 when the step that took ``kl_approx`` past ``--early-stop-kl`` was pulled back, and the
    fraction of that step kept: 0.5, 0.25 or 0.125 (backtracking until the policy is inside the
    limit), 0 when it was undone (parameters and AdamW state restored), 1 when no step crossed.
    ``--no-rollback`` keeps the crossing step whole, as MiniMind does.
``skipped_steps``
    Minibatch steps skipped by the non-finite guard this iteration: the summed loss
    (on any rank) or a pre-clip gradient norm was NaN/inf, so no optimizer stepped and
    the parameters and AdamW moments are untouched (each skip is also logged to stderr).
``grad_norm``
    Mean pre-clip gradient norm of the actor (clipped to ``--max-grad-norm``).
``rollout_s`` / ``reference_s`` / ``update_s`` / ``tokens_per_s``
    Wall time of the rollout (the collector), of scoring it (``V_old`` when the critic has its own
    trunk, the reference log-probs, GAE) and of the PPO updates; generated tokens per rollout second.
``warn_min_len`` / ``warn_zero_reward`` / ``warn_entropy`` / ``warn_kl_spike``
    1 when :class:`~ppo_objectives.monitor.CollapseGuard` flags this iteration: responses at
    their shortest (``response_len <= 1.5``, EOS first), ``reward < 0.05``, ``entropy < 0.05``
    while ``exact < 0.5`` (deterministic without solving the task), ``kl_approx_max > 1.0``
    (one step jumped four times past the trust region; pulled back when ``rolled_back``).
    Each event is also a ``WARNING ppo: iteration N: ...`` line on stderr and a ``warn=``
    field on the progress bar.
``warn_stall``
    1 while the run stalls: ``--stall-patience`` iterations without progress, neither in the
    reward's running mean nor in the held-out greedy accuracy (by 0.01), below a solved level
    (a running mean of ``reward`` or ``exact`` of 0.95); :class:`~ppo_objectives.monitor.CollapseGuard`.
    A warning, not a bad iteration: a stalled run is flat, not broken.
``collapse``
    1 while the run is collapsed: 5 or more bad iterations (``min_len``, ``zero_reward`` or
    ``entropy``) in a row. The plot shades flagged iterations orange and collapsed ones red,
    and a run that collapsed ends with a :class:`TrainingCollapseWarning`.
``eval_greedy`` / ``eval_sampled`` / ``eval_s`` (text tasks)
    Held-out mean reward (accuracy for a 0/1 reward) of greedy and sampled (T=1) completions of
    the policy after this iteration's update, and the evaluation's wall time; empty on iterations
    without an evaluation. Row ``0`` holds the pretrained model's, before any update.

Under ``torchrun`` the rollout numbers (``reward``, ``exact``, ``response_len``,
``seq_kl``) are over the responses of all ranks, ``episodes`` and ``tokens_per_s``
are totals, ``kl_approx`` is the token-weighted global value, and the other update
diagnostics are the mean of the ranks' values.

The plot ``DIR/training.png`` is redrawn at every checkpoint, one axis per signal
(:func:`ppo_objectives.monitor.plot_metrics`).

TorchRL loggers: ``--logger csv|tensorboard|wandb|mlflow`` (default ``none``: ``metrics.csv``
only) also sends every column of the row to a ``torchrl.record.loggers`` logger,
``log_scalar(name, value, step=iteration)``, under ``DIR/logs``: ``csv`` writes
``DIR/logs/NAME/scalars/<column>.csv`` (``step,value`` lines; ``NAME`` is the last part of
``DIR``), ``tensorboard`` event files in ``DIR/logs/NAME`` (``tensorboard --logdir DIR/logs``),
``wandb`` an offline run in ``DIR/logs/wandb`` (``WANDB_MODE=online`` logs live; ``wandb sync``
uploads an offline run), ``mlflow`` a local tracking store, ``DIR/logs/mlflow.db`` (SQLite;
artifacts in ``DIR/logs/mlartifacts``; ``mlflow ui --backend-store-uri sqlite:///DIR/logs/mlflow.db``).
``metrics.csv`` is written as without a logger. Only rank 0 logs. ``--resume`` continues at the
checkpoint's iteration: CSV rows and TensorBoard events logged after it are dropped, the W&B run
is continued under its id, MLflow starts a new run of the same experiment. The packages are in
the ``loggers`` extra (``pip install "ppo_objectives[loggers]"``; ``csv`` needs none); a missing
one is an ``ImportError`` naming it, raised before the run starts.

Pretrained checkpoints, mixed precision, activation checkpointing
------------------------------------------------------------------

``--model DIR`` trains a Hugging Face causal LM saved in the local directory ``DIR``
(``config.json`` + weights as ``save_pretrained`` writes them, and its tokenizer when
there is one; ``python -m ppo_objectives.pretrained --arch llama --out DIR`` writes a tiny
Llama or Qwen2 one) instead of a ``TinyCausalLM`` preset (``--preset`` is then ignored).
The actor, the critic trunk and the frozen reference are each loaded from ``DIR`` with
``from_pretrained`` (:func:`ppo_objectives.pretrained.load_policy_model`; no network); the
warm start then trains the actor, and the critic trunk and the reference take its weights,
as the preset's copies do. Each network is the checkpoint behind the **task's tokens**
(:class:`~ppo_objectives.pretrained.TokenMappedLM`): the env's token ids are mapped to the
model's through the tokenizer (each task token string is one tokenizer token; the identity
without a tokenizer), and the logits are the LM head's rows of the task's tokens, so the
policy is the model's next-token distribution renormalised over the task's vocabulary. The
checkpoint's state dicts are those of these networks (the Hugging Face weights under
``model.hf_model.``); ``--resume`` needs the same ``--model``.

``--dtype bfloat16`` is mixed precision: the actor's and the critic's forwards run under
``torch.autocast(dtype=torch.bfloat16)`` (``autocast_dtype`` of the models, KV cache in
bf16), while the parameters, their gradients and the AdamW moments stay float32 (master
weights) and the log-softmax, the value head's output, GAE and every loss stay float32 as
in a float32 run. The frozen reference is converted to bf16 (``.to(torch.bfloat16)``) and runs
in it: it takes no gradient, so it needs no float32 master copy, and half its memory is
saved; its log-probabilities are still computed in float32 from its bf16 logits / hidden
states. ``float32`` (the default) runs every forward in float32, bit for bit as before.

``--grad-checkpointing`` (with ``--model``) turns on Hugging Face's activation
checkpointing of the decoder layers (``use_reentrant=False``): activations are recomputed in
the backward pass instead of stored, the gradients are the same. ``TinyCausalLM`` has no
checkpointing, so the flag without ``--model`` is an error.

A pretrained model on a text task
---------------------------------

``--model DIR --task chat-add1 | chat-add2`` (single- and two-digit addition asked as a chat
question, :func:`ppo_objectives.text_tasks.arithmetic_examples`) or ``--task jsonl --prompts
FILE.jsonl --reward FILE.py:function [--eval-prompts FILE.jsonl]`` (your prompts and reward,
:func:`~ppo_objectives.text_tasks.read_prompts_jsonl`, :func:`~ppo_objectives.text_tasks.load_reward`)
trains a pretrained Hugging Face checkpoint on a text task (:class:`~ppo_objectives.text_tasks.TextTask`):
prompts rendered with the tokenizer's chat template and left-padded, the policy the model's
next-token distribution over its **whole vocabulary** (log-probs from hidden states at
``V >= 4096``), the episode ending at the tokenizer's end-of-turn / EOS token or at
``--max-new-tokens``, the reward computed on the decoded completion. It is the same loop as
above: the same env, collector, ``KLPenaltyTransform``, ``MaskedGAE`` and ``TokenPPOLoss``.
Such a run takes the ``pretrained`` recipe (:data:`RECIPES`): every flag left unset takes its
value there (``--help`` shows both recipes' values). No warm start; a critic on the actor's trunk
(a value head on the pretrained model's final hidden states: one trunk forward serves both, and
the env policy writes ``V_old`` as it samples); a small learning rate; one pass over each
rollout in two minibatch steps. ``benchmarks/README.md`` ("A real pretrained language model")
has the measurements behind each value.

Held-out evaluation: at the start (row ``iteration = 0`` of ``metrics.csv``, its other columns
empty), every ``--eval-every`` iterations (or each ``--eval-minutes`` of training time) and at
the end, the held-out prompts (the task's held-out split; ``--eval-prompts`` for ``jsonl``) are
answered greedily and sampled at temperature 1 (``--eval-samples`` per prompt): columns
``eval_greedy`` / ``eval_sampled`` (the mean reward: the accuracy for a 0/1 reward) and
``eval_s``, shown on the progress bar and in the plot; a few prompt -> completion pairs of each
evaluation go to ``DIR/samples.txt``. ``--time-limit MINUTES`` ends the run after that much
training time, with a final evaluation, checkpoint and export.

Export: at every checkpoint and at the end the actor is saved to ``DIR/hf`` as a Hugging Face
directory (``save_pretrained``: config, safetensors, tokenizer and chat template), so
``AutoModelForCausalLM.from_pretrained(DIR/hf)`` and ``generate`` use the trained model (greedy
``generate`` gives the evaluated greedy accuracy; tested).

Checkpoints: ``DIR/checkpoint.pt`` (actor, critic, reference, both optimizers, KL
controller, collapse guard, RNG states of every rank, iteration; no learning-rate scheduler is
used), written atomically (temporary file +
``os.replace``) every ``--save-every`` iterations and at the end; ``--resume``
continues from it and appends to ``metrics.csv`` (dropping any rows logged after that
checkpoint by the interrupted run, which are logged again). Its keys: ``iteration``,
``config`` (the run's :class:`TrainConfig` as a dict), the state dicts ``actor_model``,
``critic_model`` (the same tensors as ``actor_model`` with a shared trunk), ``critic_head``,
``reference``, ``actor_opt``, ``critic_opt``, ``kl_controller``, ``collapse_guard``,
``evaluation`` (text tasks: the held-out sampling generator), and the RNG states. To reload the
trained actor of a text run, ``load_causal_lm(DIR_of_--model)`` then
``load_state_dict(torch.load("checkpoint.pt")["actor_model"])``, or simply
``from_pretrained(DIR/hf)``; to continue the run, the same command with ``--resume``.

Reading this file
-----------------

Top to bottom, like a single-file RL script: the configuration (every field a CLI
flag), the pieces the job builds (collector, warm start, frozen reference), the
algorithm (:func:`rollout_batch`, :func:`ppo_update`), and :func:`train`, whose
loop is rollout -> update -> log -> checkpoint. What the job needs around that --
DDP, checkpoints, RNG states, the metrics CSV and the TorchRL loggers, optimizer
snapshots -- is in the internal module ``ppo_objectives/_plumbing.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule

from ppo_objectives import _plumbing, _text_job, _validate
from ppo_objectives import functional as F
from ppo_objectives._plumbing import read_metrics  # public through this module
from ppo_objectives._text_job import EVAL_COLUMNS, TEXT_TASKS
from ppo_objectives.envs import DigitTask, TokenLMEnv, trajectories_to_llm_batch, warm_start
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.readouts import ActorCritic, frozen_reference, make_actor_critic
from ppo_objectives.monitor import FLAGS, CollapseGuard
from ppo_objectives.monitor import plot_metrics as _plot
from ppo_objectives.pretrained import load_causal_lm, load_policy_model
from ppo_objectives.text_tasks import TextTask
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform
from ppo_objectives.critic_free import GroupAdvantage, ReinforcePlusPlus
from ppo_objectives.value import MaskedGAE

__all__ = [
    "RECIPES", "RESUME_MAY_CHANGE", "TrainConfig", "TrainingCollapseWarning", "build_parser", "check_launch",
    "collect_batch", "main",
    "make_collector", "plot_metrics", "ppo_update", "read_metrics", "rollout_batch", "score_batch", "train",
]  # fmt: skip

METRICS = (
    "iteration", "reward", "exact", "response_len", "episodes", "kl_ref", "seq_kl", "kl_coeff",
    "loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy", "entropy", "kl_approx", "kl_approx_max",
    "kl_token_max", "clip_fraction", "max_ratio", "ESS", "value_clip_fraction", "explained_variance", "updates",
    "early_stopped", "rolled_back", "step_fraction", "skipped_steps", "grad_norm", "rollout_s", "reference_s",
    "update_s", "tokens_per_s",
    *(f"warn_{f}" for f in FLAGS), "collapse",
)  # fmt: skip


DTYPES = ("float32", "bfloat16")  # --dtype; bfloat16: autocast of the actor and critic, bf16 reference


# --------------------------------------------------------------------------- #
# Configuration (every field is a CLI flag; the help text is the documentation)
# --------------------------------------------------------------------------- #


def _f(default, help, **kw):
    from dataclasses import field

    return field(default=default, metadata={"help": help, **kw})


#: The defaults that depend on what is trained. ``toy``: a digit task (``--task reverse | copy | add``) on a
#: TinyCausalLM preset or a ``--model`` checkpoint, from a supervised warm start. ``pretrained``: a text task
#: (``--task chat-add1 | chat-add2 | jsonl``) on a pretrained ``--model`` with its tokenizer, no warm start.
#: A flag left unset (``None``) takes its recipe's value; ``benchmarks/README.md`` has the measurements behind
#: the ``pretrained`` values.
RECIPES: dict[str, dict] = {
    "toy": dict(iterations=300, num_envs=64, warmup_steps=150, lr=3e-4, critic_lr=1e-3, ppo_epochs=4, minibatches=4,
                kl_coef=0.02, save_every=25, threads=1, max_new_tokens=None, eval_every=0, critic_warmup=0,
                stall_patience=100, shared_trunk=False, whiten=True, lam=0.95),
    "pretrained": dict(iterations=30, num_envs=32, warmup_steps=0, lr=2e-5, critic_lr=1e-3, ppo_epochs=1,
                       minibatches=2, kl_coef=0.01, save_every=10, threads=0, max_new_tokens=16, eval_every=5,
                       critic_warmup=0, stall_patience=15, shared_trunk=True, whiten=False, lam=1.0),
}  # fmt: skip

#: The critic-free ``--advantage`` modes (:mod:`ppo_objectives.critic_free`).
ADVANTAGE_MODES = ("grpo", "dr_grpo", "rloo", "reinforce++")

#: What each critic-free method expects, for the flags left unset: GRPO (DeepSeekMath) a k3 KL in the loss at
#: 0.04 and per-sequence token means; Dr. GRPO no KL and a constant normaliser (no length or std bias); RLOO and
#: REINFORCE++ the KL in the reward (k1 per token, as the job's PPO), token means.
ADVANTAGE_DEFAULTS: dict[str, dict] = {
    "grpo": dict(kl_coef=0.0, kl_loss_coef=0.04, loss_agg_mode="seq-mean-token-mean"),
    "dr_grpo": dict(kl_coef=0.0, kl_loss_coef=0.0, loss_agg_mode="token-sum-norm"),
    "rloo": dict(kl_loss_coef=0.0, loss_agg_mode="token-mean"),
    "reinforce++": dict(kl_loss_coef=0.0, loss_agg_mode="token-mean"),
}

#: ``--task`` values: the digit tasks (toy recipe) and the text tasks (pretrained recipe).
DIGIT_TASKS = ("reverse", "copy", "add")
TASKS = (*DIGIT_TASKS, *TEXT_TASKS)


def _rf(name: str, help: str):
    toy, text = RECIPES["toy"][name], RECIPES["pretrained"][name]
    return _f(None, f"{help} [default: {toy} toy / {text} pretrained]", recipe=True)


@dataclass
class TrainConfig:
    iterations: int = _rf("iterations", "PPO iterations (rollout + updates)")
    seed: int = _f(0, "seed of torch, the env's prompts and the warm start")
    device: str = _f("cpu", "device of models and env", choices=("cpu", "cuda"))
    out: str = _f("runs/ppo_token_lm", "output directory: metrics.csv, training.png, checkpoint.pt")
    resume: bool = _f(False, "continue from OUT/checkpoint.pt with the same flags (--iterations may grow; logging and "
                             "progress flags may change); metrics are appended")
    allow_change: str = _f("", "with --resume: flags (comma-separated, e.g. lr,kl-coef) allowed to differ from the "
                               "checkpoint's on purpose")
    task: str = _f("reverse", "reverse / copy / add: the toy digit tasks; chat-add1 / chat-add2: single- and "
                              "two-digit addition as chat questions (needs --model with a tokenizer); jsonl: your "
                              "prompts (--prompts, --reward, --eval-prompts)", choices=TASKS)
    digits: int = _f(3, "digits per operand of the toy task")
    prompts: str = _f("", "--task jsonl: training prompts, one JSON object per line with 'prompt' (a string or "
                          "chat messages) and the reward's fields")
    reward: str = _f("", "--task jsonl: the reward, FILE.py:function called as function(completion, **fields)")
    eval_prompts: str = _f("", "--task jsonl: held-out prompts (same format as --prompts); none: no evaluation")
    max_new_tokens: int = _rf("max_new_tokens", "text tasks: response budget M (the toy task's is its answer length)")
    eval_every: int = _rf("eval_every", "text tasks: held-out greedy and sampled accuracy every N iterations (and at "
                                        "the start and the end; 0: start and end only)")
    eval_samples: int = _f(1, "text tasks: sampled completions per held-out prompt")
    eval_minutes: float = _f(0.0, "text tasks: evaluate whenever another this many minutes of training time (rollouts "
                                  "and updates) have passed, instead of every --eval-every iterations; 0 = off")
    preset: str = _f("nano", "TinyCausalLM size preset (ignored with --model)", choices=("pico", "nano", "micro"))
    model: str = _f("", "a local Hugging Face checkpoint directory (config.json + weights, tokenizer optional) to "
                        "train instead of a TinyCausalLM preset; the actor, critic trunk and reference are loaded "
                        "from it (toy tasks: behind the task's tokens)")
    token_map: str = _f("tokenizer", "toy tasks with --model: find the task's tokens with the checkpoint's tokenizer "
                                      "(a checkpoint without one is an error), or 'identity': task token i is model "
                                      "token i, on purpose", choices=("tokenizer", "identity"))
    dtype: str = _f("float32", "bfloat16: actor and critic forwards under autocast (float32 weights, AdamW state, "
                               "log-softmax and losses), reference in bf16", choices=DTYPES)
    grad_checkpointing: bool = _f(False, "activation checkpointing of the decoder layers (needs --model)")
    shared_trunk: bool = _rf("shared_trunk", "critic value head on the actor's trunk (one forward serves both, and "
                                             "the rollout writes V_old) instead of its own copy of the trunk")
    fsdp: bool = _f(False, "under torchrun: shard the actor's and the critic's models over the ranks with FSDP2 "
                           "(fully_shard per transformer block, then the model) instead of DDP, so parameters, "
                           "gradients and AdamW state are split across ranks; the reference stays whole")
    num_envs: int = _rf("num_envs", "parallel env rows N (responses per rollout ~ N; per rank under torchrun)")
    workers: int = _f(1, "collector processes: 1 = Collector in-process, >1 = MultiSyncCollector")
    warmup_steps: int = _rf("warmup_steps", "supervised warm-start steps teaching the toy answer format (random "
                                            "digits); text tasks have none")
    warmup_lr: float = _f(3e-3, "warm-start learning rate")
    lr: float = _rf("lr", "actor AdamW learning rate (toy: 1e-3 makes single steps cross the trust region far more "
                          "often; see benchmarks/README.md)")
    critic_lr: float = _rf("critic_lr", "critic AdamW learning rate")
    critic_warmup: int = _rf("critic_warmup", "iterations that train the critic only (the actor stays as it is) "
                                              "before the PPO updates start")
    ppo_epochs: int = _rf("ppo_epochs", "passes over each rollout")
    minibatches: int = _rf("minibatches", "minibatches per pass")
    clip_epsilon: float = _f(0.2, "PPO ratio clip")
    clip_value: float = _f(0.2, "value clip range around V_old")
    critic_coef: float = _f(0.5, "weight of the value loss")
    entropy_coef: float = _f(0.0, "entropy bonus weight")
    gamma: float = _f(1.0, "discount")
    lam: float = _rf("lam", "GAE lambda (of the critic's value targets, and of the advantages unless --policy-lam or "
                            "--length-alpha is given)")
    whiten: bool = _rf("whiten", "whiten the advantages over the valid tokens of the batch (MiniMind; --no-whiten: "
                                 "raw advantages, in the reward's scale)")
    policy_lam: float = _f(None, "decoupled GAE (VAPO): the advantages' own lambda; unset: --lam", type_=float)
    length_alpha: float = _f(None, "length-adaptive GAE (VAPO): the advantages' lambda per response, "
                                   "1 - 1 / (alpha * length); unset: off", type_=float)
    kl_coef: float = _rf("kl_coef", "in-reward KL coefficient beta (k1 to the reference, per token)")
    adaptive_kl: bool = _f(False, "adapt beta towards --kl-target (Ziegler et al. 2019)")
    kl_target: float = _f(1.0, "target per-sequence KL (nats) of the adaptive controller")
    kl_loss_coef: float = _f(None, "in-loss reference KL weight (MiniMind: 0.02, k3); 0 = off [default: 0, 0.04 with "
                                   "--advantage grpo]", type_=float)
    advantage: str = _f("gae", "gae: PPO with a critic (MaskedGAE); grpo / dr_grpo / rloo / reinforce++: critic-free "
                               "advantages (no critic is trained), each with its method's aggregation and KL",
                        choices=("gae", *ADVANTAGE_MODES))
    group_size: int = _f(0, "responses sampled per prompt, sharing a group id (GRPO, RLOO); 0: 4 with grpo / dr_grpo "
                            "/ rloo, 1 otherwise")
    loss_agg_mode: str = _f(None, "the loss's aggregation [default: token-mean; dr_grpo: token-sum-norm; grpo: "
                                  "seq-mean-token-mean]", type_=str)
    early_stop_kl: float = _f(0.25, "approx-KL trust region: the PPO epochs stop when kl_approx exceeds it, and "
                                    "the step that took it there is undone (MiniMind stops at 0.25); 0 = off")
    no_rollback: bool = _f(False, "keep the step that took kl_approx past --early-stop-kl (MiniMind's early stop) "
                                  "instead of undoing it")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    time_limit: float = _f(0.0, "stop after the iteration in which the training time (rollouts and updates; "
                                "evaluations and checkpoints excluded) passes this many minutes, with a final "
                                "evaluation and checkpoint; 0 = run --iterations")
    stall_patience: int = _rf("stall_patience", "iterations without progress in reward or held-out accuracy that "
                                                "the collapse guard flags as a stall")
    save_every: int = _rf("save_every", "iterations between checkpoints (text tasks: and the OUT/hf export)")
    no_plot: bool = _f(False, "do not write training.png")
    no_progress: bool = _f(False, "no progress bar")
    logger: str = _f("none", "also log every metric to a TorchRL logger under OUT/logs (offline; rank 0); the "
                             'packages: pip install "ppo_objectives[loggers]"',
                     choices=("none", *_plumbing.LOGGERS))
    threads: int = _rf("threads", "torch CPU threads for this run (0 = torch's default); one thread is fastest for "
                                  "tiny models, and far faster when other processes share the cores")

    @property
    def critic_free(self) -> bool:
        """An ``--advantage`` without a critic (GRPO, Dr. GRPO, RLOO, REINFORCE++)."""
        return self.advantage != "gae"

    @property
    def recipe(self) -> str:
        """``"pretrained"`` for the text tasks, ``"toy"`` for the digit tasks."""
        return "pretrained" if self.task in TEXT_TASKS else "toy"

    def __post_init__(self):
        for name, value in (*ADVANTAGE_DEFAULTS.get(self.advantage, {}).items(), *RECIPES[self.recipe].items(),
                            ("kl_loss_coef", 0.0), ("loss_agg_mode", "token-mean")):
            if getattr(self, name) is None:
                setattr(self, name, value)
        self._check_advantage()
        self._check_task()
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig dtype={self.dtype!r} must be one of {DTYPES} (bfloat16: mixed precision)")
        if self.grad_checkpointing and not self.model:
            raise ValueError(
                "--grad-checkpointing needs --model DIR: it is Hugging Face's activation checkpointing of the "
                "decoder layers, and TinyCausalLM (the --preset models) has none; drop the flag or give --model"
            )
        if self.logger not in ("none", *_plumbing.LOGGERS):
            raise ValueError(f"TrainConfig logger={self.logger!r} must be one of {('none', *_plumbing.LOGGERS)}")
        for name in ("iterations", "num_envs", "workers", "ppo_epochs", "minibatches", "save_every",
                     "warmup_steps", "threads", "eval_every", "eval_samples", "critic_warmup", "stall_patience"):
            low = 0 if name in ("iterations", "warmup_steps", "threads", "eval_every", "critic_warmup") else 1
            _validate.check_int(name, getattr(self, name), low=low, where="TrainConfig ")
        if not _validate.is_real(self.eval_minutes, low=0.0):
            raise ValueError(f"TrainConfig eval_minutes={self.eval_minutes!r} must be a number of minutes >= 0")
        if not _validate.is_real(self.time_limit, low=0.0):
            raise ValueError(f"TrainConfig time_limit={self.time_limit!r} must be a number of minutes >= 0 (0: no limit)")
        if not _validate.is_real(self.early_stop_kl, low=0.0):
            raise ValueError(f"TrainConfig early_stop_kl={self.early_stop_kl!r} must be a finite number >= 0 (0 turns "
                             "the trust region off)")
        if self.policy_lam is not None:
            _validate.check_unit_interval("policy_lam", self.policy_lam)
        if self.length_alpha is not None and not _validate.is_real(self.length_alpha, low=0.0, strict=True):
            raise ValueError(f"TrainConfig length_alpha={self.length_alpha!r} must be a finite number > 0")
        if self.policy_lam is not None and self.length_alpha is not None:
            raise ValueError("--policy-lam and --length-alpha both set the advantages' lambda; give one of them")
        for name in ("lr", "critic_lr", "warmup_lr", "clip_epsilon", "max_grad_norm"):
            value = getattr(self, name)
            if not _validate.is_real(value, low=0.0, strict=True):
                raise ValueError(f"TrainConfig {name}={value!r} must be a finite number > 0")

    def _check_advantage(self) -> None:
        """A critic-free ``--advantage`` takes no critic option; groups fill ``--num-envs``."""
        if not self.group_size:
            self.group_size = 4 if self.advantage in ("grpo", "dr_grpo", "rloo") else 1
        _validate.check_int("group_size", self.group_size, low=1, where="TrainConfig ")
        if self.num_envs is not None and self.num_envs % self.group_size:
            raise ValueError(f"--num-envs {self.num_envs} is not a multiple of --group-size {self.group_size}: each "
                             f"prompt goes to {self.group_size} rows")
        _validate.check_mode(self.loss_agg_mode)
        if self.critic_free:
            given = [f"--{n.replace('_', '-')}" for n in ("policy_lam", "length_alpha") if getattr(self, n) is not None]
            given += ["--critic-warmup"] if self.critic_warmup else []
            if given:
                raise ValueError(f"{', '.join(given)} configure the critic, but --advantage {self.advantage} has none "
                                 f"(its advantages come from the group's / batch's scores); drop them or use --advantage gae")

    def _check_task(self) -> None:
        """The task's flags: a digit task checks its own; a text task needs --model and its own flags."""
        jsonl_flags = {"--prompts": self.prompts, "--reward": self.reward, "--eval-prompts": self.eval_prompts}
        if self.task == "jsonl":
            missing = [f for f in ("--prompts", "--reward") if not jsonl_flags[f]]
            if missing:
                raise ValueError(f"--task jsonl needs {' and '.join(missing)}: the training prompts (JSONL) and the "
                                 f"reward FILE.py:function")
        elif any(jsonl_flags.values()):
            given = [f for f, v in jsonl_flags.items() if v]
            raise ValueError(f"{', '.join(given)} belong to --task jsonl (your own prompts), but --task is "
                             f"{self.task}; add --task jsonl or drop them")
        if self.recipe == "toy":
            task = DigitTask(self.task, self.digits)  # the task checks its own arguments
            if self.max_new_tokens is not None:
                raise ValueError(f"--max-new-tokens is for text tasks; the toy task {self.task} answers in "
                                 f"{task.answer_len} tokens")
            return
        if not self.model:
            raise ValueError(f"--task {self.task} is a text task: it needs --model DIR, a pretrained checkpoint with "
                             f"its tokenizer (python -m ppo_objectives.pretrained --gguf smollm2 --out DIR)")
        if self.warmup_steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps}: the warm start teaches the toy digit format and "
                             f"would overwrite what a pretrained model knows; text tasks have none (drop the flag)")
        if self.fsdp:
            raise ValueError("--fsdp with a text task is not supported: the Hugging Face export and the held-out "
                             "evaluation need the whole actor on one rank; use DDP (torchrun without --fsdp)")
        if self.workers > 1:
            raise ValueError("--workers > 1 with a text task: the tokenizer and the reward run in this process only; "
                             "use --workers 1 (or torchrun for data parallelism)")
        _validate.check_int("max_new_tokens", self.max_new_tokens, low=1, where="TrainConfig ")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ppo_objectives.train",
        description="Token-level PPO with a critic (TorchRL collector -> KLPenaltyTransform -> MaskedGAE -> "
        "TokenPPOLoss), on a toy digit task or on a pretrained Hugging Face model's text task (--model DIR --task "
        "chat-add1). Data-parallel: torchrun --nproc_per_node N -m ppo_objectives.train ... (gloo on CPU, nccl "
        "with --device cuda). Metrics are explained in the module docstring: python -c 'import "
        "ppo_objectives.train as t; help(t)'",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    groups = {name: p.add_argument_group(name, about) for name, about in _HELP_GROUPS.items()}
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        g = groups[next(name for name, members in _GROUP_MEMBERS.items() if f.name in members)]
        if f.type in ("bool", bool) and meta.get("recipe"):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=meta["help"])
        elif f.type in ("bool", bool):
            g.add_argument(flag, action="store_true", help=meta["help"])
        else:
            typ = meta.get("type_") or {"int": int, "float": float, "str": str}[
                f.type if isinstance(f.type, str) else f.type.__name__]
            default = argparse.SUPPRESS if meta.get("recipe") else f.default
            g.add_argument(flag, type=typ, default=default, help=meta["help"], choices=meta.get("choices"))
    return p


#: ``--help``'s groups, and the flags (TrainConfig fields) in each.
_HELP_GROUPS = {
    "run": "length, seed, device, resuming",
    "model": "what is trained: a TinyCausalLM preset or a checkpoint directory, precision",
    "task": "the toy digit tasks, the text tasks, your own prompts and reward, held-out evaluation",
    "PPO": "rollouts and the clipped update",
    "KL": "the reference KL (in the reward, in the loss)",
    "critic": "the value function and GAE",
    "output": "what is written and shown",
    "parallel": "collector workers, torchrun (DDP / FSDP2), threads",
}
_GROUP_MEMBERS = {
    "run": ("iterations", "seed", "device", "resume", "allow_change", "time_limit"),
    "model": ("preset", "model", "token_map", "dtype", "grad_checkpointing"),
    "task": ("task", "digits", "prompts", "reward", "eval_prompts", "max_new_tokens", "eval_every", "eval_samples",
             "eval_minutes", "warmup_steps", "warmup_lr"),
    "PPO": ("num_envs", "lr", "ppo_epochs", "minibatches", "clip_epsilon", "entropy_coef", "loss_agg_mode",
            "early_stop_kl",
            "no_rollback", "max_grad_norm"),
    "KL": ("kl_coef", "adaptive_kl", "kl_target", "kl_loss_coef"),
    "critic": ("advantage", "group_size", "shared_trunk", "critic_lr", "critic_warmup", "clip_value", "critic_coef",
               "gamma", "lam", "whiten", "policy_lam", "length_alpha"),
    "output": ("out", "save_every", "no_plot", "no_progress", "logger", "stall_patience"),
    "parallel": ("workers", "fsdp", "threads"),
}


# --------------------------------------------------------------------------- #
# The pieces: env and collector, warm start, frozen reference, PPO modules
# --------------------------------------------------------------------------- #


_RANK_SEED_STRIDE = 1_000_003  # rank r rolls out with seed + r * stride (torch sampling and env prompts)


def _make_tasks(cfg: TrainConfig) -> tuple:
    """``(task, held-out task or None)``: the toy ``DigitTask`` (no held-out set), or the text task of
    ``--task`` with the tokenizer of ``--model`` (:func:`ppo_objectives._text_job.build_text_tasks`)."""
    if cfg.recipe == "toy":
        return DigitTask(cfg.task, cfg.digits), None
    return _text_job.build_text_tasks(cfg)


def _make_env(task, num_envs: int, device: str, seed: int, *, vocab_size: int | None = None,
              group_size: int = 1) -> TokenLMEnv:
    """The env of ``task``; a text task's vocabulary is the model's (``vocab_size``), which may exceed its
    tokenizer's (padded embeddings), so that every token the policy can sample is a valid action. ``group_size``
    rows share each prompt drawn at a full reset (``--group-size``)."""
    vocab = vocab_size if isinstance(task, TextTask) else None
    return TokenLMEnv.from_task(task, num_envs=num_envs, device=device, seed=seed, vocab_size=vocab,
                                group_size=group_size)


class _EnvFactory:
    """Picklable env constructor for collector worker processes."""

    def __init__(self, task, num_envs, device, seed, group_size=1):
        self.args, self.group_size = (task, num_envs, device, seed), group_size

    def __call__(self):
        return _make_env(*self.args, group_size=self.group_size)


def make_collector(cfg: TrainConfig, task: DigitTask, policy, env: TokenLMEnv, *, rank: int = 0):
    """``Collector`` (TorchRL 0.14's SyncDataCollector) or ``MultiSyncCollector`` over ``workers`` processes.

    ``frames_per_batch = N * M`` with ``reset_at_each_iter=True``: every row starts a
    fresh prompt at the start of each batch, so each row finishes at least one response.
    """
    from torchrl.collectors import Collector, MultiSyncCollector

    M = env.max_new_tokens
    if cfg.workers <= 1:
        return Collector(
            env,
            policy,
            frames_per_batch=cfg.num_envs * M,
            total_frames=-1,
            reset_at_each_iter=True,
            auto_register_policy_transforms=False,
        )
    per_worker = max(1, cfg.num_envs // cfg.workers)
    seeds = [cfg.seed + _RANK_SEED_STRIDE * rank + 1000 * (i + 1) for i in range(cfg.workers)]
    if per_worker % cfg.group_size:
        raise ValueError(f"--num-envs {cfg.num_envs} over --workers {cfg.workers} gives {per_worker} rows per worker, "
                         f"not a multiple of --group-size {cfg.group_size}")
    factories = [_EnvFactory(task, per_worker, "cpu", seed, cfg.group_size) for seed in seeds]
    return MultiSyncCollector(
        factories,
        policy,
        frames_per_batch=per_worker * cfg.workers * M,
        total_frames=-1,
        reset_at_each_iter=True,
        auto_register_policy_transforms=False,
        cat_results="stack",
    )


def _policy_lm(cfg: TrainConfig, task, device) -> torch.nn.Module:
    """The actor's causal LM: the ``--preset`` TinyCausalLM; for a toy task the checkpoint ``--model DIR``
    behind the task's tokens (:func:`~ppo_objectives.pretrained.load_policy_model`); for a text task the
    checkpoint with its whole vocabulary (:func:`~ppo_objectives.pretrained.load_causal_lm`). Under
    ``--dtype bfloat16`` its forward runs under autocast (``autocast_dtype``; the weights stay float32)."""
    autocast = _AUTOCAST_DTYPE[cfg.dtype]
    if cfg.recipe == "pretrained":
        return load_causal_lm(cfg.model, autocast_dtype=autocast, grad_checkpointing=cfg.grad_checkpointing).to(device)
    if cfg.model:
        return load_policy_model(cfg.model, task, autocast_dtype=autocast, grad_checkpointing=cfg.grad_checkpointing,
                                 token_map=cfg.token_map).to(device)
    config = TinyLMConfig.preset(cfg.preset, vocab_size=task.vocab_size, block_size=task.prompt_len + task.answer_len)
    return TinyCausalLM(config, autocast_dtype=autocast).to(device)


def _loaded_copy(cfg: TrainConfig, task: DigitTask, lm: torch.nn.Module, device) -> torch.nn.Module | None:
    """``--model``: the checkpoint loaded again (as in :func:`_policy_lm`) holding ``lm``'s current (warm-started)
    weights, for the critic trunk and the reference; ``None`` without ``--model`` (they are copies of ``lm``)."""
    if not cfg.model:
        return None
    kw = dict(autocast_dtype=lm.autocast_dtype, grad_checkpointing=cfg.grad_checkpointing)
    copy_lm = (load_causal_lm(cfg.model, **kw) if cfg.recipe == "pretrained"
               else load_policy_model(cfg.model, task, token_map=cfg.token_map, **kw))
    copy_lm = copy_lm.to(device)
    copy_lm.load_state_dict(lm.state_dict())
    return copy_lm


def _check_resumed_model(ckpt: dict, cfg: TrainConfig, out: Path) -> None:
    """``--resume`` with another ``--model`` (or a preset run's checkpoint with ``--model``) is an error."""
    saved = ckpt.get("config", {}).get("model", "")
    if saved != cfg.model:
        raise ValueError(
            f"--resume: {out / 'checkpoint.pt'} was written by a run with --model {saved!r} but this run has --model "
            f"{cfg.model!r}: its networks are another model's; resume with the same --model (or a new --out)"
        )


_AUTOCAST_DTYPE = {"float32": None, "bfloat16": torch.bfloat16}  # --dtype -> autocast_dtype of actor and critic
_REFERENCE_DTYPE = {"float32": None, "bfloat16": torch.bfloat16}  # --dtype -> the frozen reference's weights


def _ppo_modules(cfg: TrainConfig, actor: TensorDictModule, critic: TensorDictModule, ref: TensorDictModule,
                 device: torch.device, process_group) -> tuple:
    """The TorchRL modules of the iteration: KL controller, ``KLPenaltyTransform``, ``MaskedGAE``,
    ``TokenPPOLoss`` (calling ``actor`` and ``critic``, DDP-wrapped under torchrun)."""
    controller = (
        AdaptiveKLController(cfg.kl_coef, target=cfg.kl_target, horizon=10_000)
        if cfg.adaptive_kl
        else FixedKLController(cfg.kl_coef)
    ).to(device)
    kl_transform = KLPenaltyTransform(ref, coeff=controller, estimator="k1")
    gae = _advantage_estimator(cfg, device, process_group)
    loss_module = TokenPPOLoss(
        actor,
        None if cfg.critic_free else critic,
        clip_epsilon=cfg.clip_epsilon,
        critic_coeff=cfg.critic_coef,
        clip_value=cfg.clip_value,
        kl_coeff=cfg.kl_loss_coef,
        entropy_coeff=cfg.entropy_coef,
        entropy_bonus=True,  # the actor writes entropies: log them even without a bonus
        loss_agg_mode=cfg.loss_agg_mode,
        early_stop_kl=cfg.early_stop_kl,
        functional=False,
        device=device,
    )
    loss_module.make_value_estimator(gae)
    return controller, kl_transform, gae, loss_module


#: Where a critic-free group estimator reads each response's return: the sum of its (KL-penalised) per-token
#: rewards, which is the task score when the in-reward KL coefficient is 0.
RETURN_KEY = "penalized_score"


def _advantage_estimator(cfg: TrainConfig, device: torch.device, process_group):
    """``--advantage``: ``MaskedGAE`` (whitened over the valid tokens of every rank's batch), or a critic-free one."""
    if cfg.advantage == "gae":
        return MaskedGAE(gamma=cfg.gamma, lmbda=cfg.lam, policy_lmbda=cfg.policy_lam, length_alpha=cfg.length_alpha,
                         average_gae=cfg.whiten, device=device, process_group=process_group)
    if cfg.advantage == "reinforce++":
        return ReinforcePlusPlus(gamma=cfg.gamma, whiten=cfg.whiten, device=device, process_group=process_group)
    group = GroupAdvantage(cfg.advantage, device=device)
    group.set_keys(score=RETURN_KEY)
    return group


# --------------------------------------------------------------------------- #
# The algorithm: rollout, then the PPO update with its trust region
# --------------------------------------------------------------------------- #


def rollout_batch(collector_iter, ac: ActorCritic, kl_transform: KLPenaltyTransform, gae: MaskedGAE, P: int,
                  M: int):
    """One collector batch -> the response-layout batch the loss trains on (advantages included).

    Under data parallelism ``gae`` whitens over the valid tokens of every rank
    (``MaskedGAE(..., average_gae=True, process_group=pg)``).
    """
    device = next(ac.actor_model.parameters()).device
    return score_batch(collect_batch(collector_iter, device, P, M), ac, kl_transform, gae)


def collect_batch(collector_iter, device: torch.device, P: int, M: int) -> TensorDictBase:
    """The first half of :func:`rollout_batch`: one collector batch ``[N, T]`` as the response layout ``[B]``,
    with the env's per-token reward copied where ``MaskedGAE`` reads it."""
    batch = next(collector_iter)  # [N, T] per-token steps
    llm = trajectories_to_llm_batch(batch.to(device), P, M)
    llm.set(("next", "reward"), llm.get("token_reward").clone())  # the env's per-token reward
    return llm


def score_batch(llm: TensorDictBase, ac: ActorCritic, kl_transform: KLPenaltyTransform,
                gae: MaskedGAE) -> TensorDictBase:
    """The second half of :func:`rollout_batch`: ``V_old`` (unless the env policy wrote it), the reference
    log-probs and the KL penalty, then GAE; returns ``llm`` with these entries."""
    with torch.no_grad():
        critic_free = getattr(gae, "critic_free", False)
        if "state_value" not in llm.keys() and not critic_free:  # a critic on the actor's trunk: the policy wrote it
            ac.critic(llm)  # V_old: "state_value" [B, R]
        kl_transform(llm)  # "ref_log_prob", "kl_penalty"; reward -= beta * k1 on every token
        if critic_free:  # a group estimator reads each response's (penalised) return
            llm.set(RETURN_KEY, F.masked_sum(llm.get(("next", "reward")), llm.get("mask"), dim=-1))
        gae(llm)  # "advantage" (whitened over valid tokens), "value_target" = raw advantage + V_old
    return llm


def _rollout_stats(llm: TensorDictBase, kl_transform: KLPenaltyTransform, pg) -> dict:
    """The rollout's metrics, over the responses of every rank (one all-reduce under torchrun)."""
    score, B = llm["score"], llm.batch_size[0]
    n_tok = llm["mask"].sum()
    if pg is None:
        return dict(
            reward=float(score.mean()), exact=float((score >= 1.0).float().mean()),
            response_len=int(n_tok) / max(B, 1), episodes=B, kl_ref=float(kl_transform.last_kl),
            seq_kl=float(kl_transform.last_seq_kl), seq_kl_t=kl_transform.last_seq_kl, tokens=int(n_tok),
        )  # fmt: skip
    v = torch.stack([
        score.sum(), (score >= 1.0).sum(), n_tok, torch.tensor(B, device=score.device),
        kl_transform.last_kl.to(score.device), kl_transform.last_seq_kl.to(score.device) * B,
    ]).to(torch.float64)  # fmt: skip
    total = _plumbing.all_reduce(v, pg).tolist()
    episodes = max(total[3], 1.0)
    seq_kl = total[5] / episodes
    return dict(
        reward=total[0] / episodes, exact=total[1] / episodes, response_len=total[2] / episodes,
        episodes=int(total[3]), kl_ref=total[4] / dist.get_world_size(pg), seq_kl=seq_kl,
        seq_kl_t=torch.tensor(seq_kl, dtype=torch.float32, device=kl_transform.last_seq_kl.device),
        tokens=int(total[2]),
    )  # fmt: skip


def ppo_update(llm: TensorDictBase, loss_module: TokenPPOLoss, ac: ActorCritic, optimizers, cfg: TrainConfig,
               generator: torch.Generator, *, process_group=None, critic_only: bool = False) -> dict[str, float]:
    """MiniMind's update: ``ppo_epochs`` x ``minibatches`` AdamW steps on the summed ``loss_*``,
    grad-norm clipped, with an approx-KL trust region that holds.

    Every minibatch's forward measures ``kl_approx`` (the k2 KL of the current policy to the
    rollout policy) before its step. Once it exceeds ``early_stop_kl`` the update ends, and
    (unless ``cfg.no_rollback``) the step that took it there is **pulled back**, as TRPO's
    backtracking line search does: the parameters are moved back to 1/2, 1/4, then 1/8 of
    that step, each measured on the same minibatch, and the first fraction inside the limit
    is kept; when none is, the step is undone (parameters and optimizer states as before
    it). So no kept step leaves the policy past the limit, and a policy standing at a cliff
    of the loss surface still moves. After the last step one more forward (no gradient)
    measures the final policy, so the last step is checked too. Without the rollback (MiniMind's early
    stop) the crossing step is kept: one AdamW step can move a token's log-probability by
    several nats (a policy that jumps to EOS-first answers), and the check only stops the
    steps after it.

    A step whose summed loss or pre-clip gradient norm is not finite is skipped (counted in
    ``skipped_steps``).

    With a ``process_group`` (``loss_module`` calling DDP-wrapped networks): each step divides by
    the valid-token count of all ranks, and the early stop, the rollback and the non-finite guard
    decide on all-reduced numbers, so every rank takes (and undoes) the same steps.

    ``critic_only`` (the ``--critic-warmup`` iterations): the same minibatch steps on ``loss_critic``
    alone, stepping the critic's optimizer only; the actor's parameters do not move (a shared
    trunk included), so there is no trust region to hold.
    """
    B = llm.batch_size[0]
    u = _TrustRegionUpdate(loss_module, ac, optimizers, cfg, process_group, critic_only=critic_only)
    # minibatches per epoch: the same on every rank, none empty on the rank with the most rows
    most_rows = _plumbing.all_reduce(torch.tensor(B, device=llm.device), process_group, dist.ReduceOp.MAX)
    n_minibatches = min(cfg.minibatches, int(most_rows))  # 0 for an empty batch: no step at all
    mb = None
    for epoch in range(cfg.ppo_epochs if n_minibatches else 0):
        perm = torch.randperm(B, generator=generator).to(llm.device)
        for j, idx in enumerate(torch.tensor_split(perm, n_minibatches)):
            mb = llm[idx]
            out = u.loss(mb)  # TokenPPOLoss: loss_objective, loss_critic, ..., kl_approx
            total, kl_now, nonfinite = u.measure(out, mb)  # over all ranks
            if cfg.early_stop_kl and kl_now > cfg.early_stop_kl:
                u.stop(mb)  # this minibatch's step is not taken, nor any later one; the crossing one is pulled back
                break
            if nonfinite:
                u.skip_non_finite_loss(out, total, epoch, j)
                continue
            grad_norm = u.backward(total, epoch, j)  # clipped; None when a norm is not finite (step skipped)
            if grad_norm is not None:
                u.step(out, grad_norm)
        if u.stopped:
            break
    if u.rollback and u.steps and not u.stopped:  # the policy after the last step: one more forward
        u.check_last_step(mb)
    return u.stats(llm.device)


_BACKTRACK = (0.5, 0.25, 0.125)  # fractions of a crossing step tried before it is undone (TRPO's backtracking)
_LOGGED = ("loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy", "entropy", "kl_approx", "clip_fraction",
           "max_ratio", "ESS", "value_clip_fraction", "explained_variance")  # fmt: skip


class _TrustRegionUpdate:
    """What one :func:`ppo_update` measures, steps, pulls back and counts (see its docstring).

    Every decision (stop, skip, pull back) is taken on numbers all-reduced over
    ``process_group``, so every rank takes the same steps.
    """

    def __init__(self, loss_module: TokenPPOLoss, ac: ActorCritic, optimizers, cfg: TrainConfig, process_group, *,
                 critic_only: bool = False):
        self.loss_module, self.cfg, self.pg, self.critic_only = loss_module, cfg, process_group, critic_only
        self.optimizers = optimizers[1:] if critic_only else optimizers  # (actor, critic): the critic's alone
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.actor_params, self.critic_params = ac.actor_parameters(), ac.critic_parameters()
        self.all_params = list({id(p): p for p in self.actor_params + self.critic_params}.values())
        self.clipped_critic_params = self.critic_params if not ac.shared_trunk else self.all_params
        self.rollback = bool(cfg.early_stop_kl) and not cfg.no_rollback and not critic_only
        self.sums: dict[str, float] = {}
        self.steps, self.grad_norm, self.skipped, self.stopped = 0, 0.0, 0, False  # steps kept, their summed norm
        self.kl_max, self.kl_token_max = 0.0, 0.0  # the largest kl_approx and per-token value measured
        self.snapshot = None  # parameters and optimizer states before the last step
        self.last: dict | None = None  # the last step's logged numbers
        self.first: dict | None = None  # the first finite forward's
        self.kept = 1.0  # fraction of the crossing step kept by the trust region (1: nothing crossed)

    def loss(self, mb: TensorDictBase) -> TensorDictBase:
        """The loss terms on minibatch ``mb``, divided by its valid-token count over all ranks."""
        norm = F.loss_normalizer(mb["mask"], self.loss_module.loss_agg_mode, process_group=self.pg)
        return self.loss_module(mb, normalizer=norm)

    def _measure(self, out: TensorDictBase, mb: TensorDictBase):
        """(summed loss, kl_approx, its largest per-token value, some rank's loss is not finite), over all ranks."""
        total = out["loss_critic"] if self.critic_only else sum(v for k, v in out.items() if k.startswith("loss_"))
        n = mb["mask"].sum().to(torch.float32)
        signal = torch.stack([out["kl_approx"].detach() * n, n, (~torch.isfinite(total.detach())).float()])
        signal = _plumbing.all_reduce(signal, self.pg).tolist()  # host sync: the decisions need numbers
        tok = _plumbing.all_reduce(out["kl_approx_token_max"].detach().float().clone(), self.pg, dist.ReduceOp.MAX)
        kl = signal[0] / max(signal[1], 1.0) if self.pg is not None else float(out["kl_approx"])
        return total, kl, float(tok), signal[2] > 0

    def measure(self, out: TensorDictBase, mb: TensorDictBase):
        """(summed loss, kl_approx, not finite) of a minibatch's forward; tracks the largest KLs and the first
        forward's diagnostics (the ones logged when no step is kept)."""
        total, kl, tok, nonfinite = self._measure(out, mb)
        self.kl_max, self.kl_token_max = max(self.kl_max, kl), max(self.kl_token_max, tok)
        if self.first is None and not nonfinite:
            self.first = _logged(out)
        return total, kl, nonfinite

    def measure_now(self, on: TensorDictBase) -> tuple[float, float]:
        """(kl_approx, its largest per-token value) of the current policy on minibatch ``on``, no gradient."""
        with torch.no_grad():
            _, kl, tok, _ = self._measure(self.loss(on), on)
        return kl, tok

    def skip_non_finite_loss(self, out: TensorDictBase, total: torch.Tensor, epoch: int, j: int) -> None:
        self.skipped += 1
        if not torch.isfinite(total.detach()):  # the rank(s) whose loss it is say so
            _plumbing.log_skip(self.rank, self.pg, f"non-finite loss {_loss_terms(out)}", epoch, j)

    def backward(self, total: torch.Tensor, epoch: int, j: int) -> torch.Tensor | None:
        """Gradients of ``total``, clipped; the actor's pre-clip norm, or ``None`` (gradients dropped, the
        step skipped) when a pre-clip norm is not finite on some rank."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        total.backward()
        if self.critic_only:  # a shared trunk's gradient from the value loss: not applied, not counted
            for p in self.actor_params:
                p.grad = None
        gn = _plumbing.clip_grad_norm_(self.actor_params, self.cfg.max_grad_norm)  # sharded gradients too
        gn_c = _plumbing.clip_grad_norm_(self.clipped_critic_params, self.cfg.max_grad_norm)
        bad = _plumbing.all_reduce((~torch.isfinite(torch.stack([gn, gn_c]))).any().float(), self.pg)
        if float(bad) > 0:  # clipping scaled by a NaN norm: the gradients are garbage, drop them
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            self.skipped += 1
            if self.rank == 0:  # the gradients are all-reduced: the same on every rank
                why = f"non-finite gradient norm (actor {float(gn)}, critic {float(gn_c)})"
                _plumbing.log_skip(self.rank, self.pg, why, epoch, j)
            return None
        return gn

    def step(self, out: TensorDictBase, grad_norm: torch.Tensor) -> None:
        """One optimizer step of every optimizer (snapshotted first when it may have to be undone)."""
        if self.rollback:
            self.snapshot = _plumbing.snapshot(self.all_params, self.optimizers, reuse=self.snapshot)
        for opt in self.optimizers:
            opt.step()
        self.steps += 1
        self.last = dict(grad_norm=float(grad_norm), sums=_logged(out))
        self.grad_norm += self.last["grad_norm"]
        for k, v in self.last["sums"].items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def stop(self, measured_on: TensorDictBase) -> None:
        """The trust region is crossed: no more steps, and the last one is pulled back (unless ``no_rollback``)."""
        self.stopped = True
        if self.rollback and self.snapshot is not None:
            self.kept = self.pull_back_last_step(measured_on)

    def check_last_step(self, mb: TensorDictBase) -> None:
        """Measure the policy after the last step (no later minibatch did) and stop if it is past the limit."""
        kl_now, kl_tok = self.measure_now(mb)
        self.kl_max, self.kl_token_max = max(self.kl_max, kl_now), max(self.kl_token_max, kl_tok)
        if kl_now > self.cfg.early_stop_kl:
            self.stop(mb)

    def pull_back_last_step(self, measured_on: TensorDictBase) -> float:
        """The last step crossed the limit: shorten it (1/2, 1/4, 1/8 of it, measured on
        ``measured_on``) until the policy is back inside, else undo it. Returns the fraction kept."""
        after = [p.detach().clone() for p in self.all_params]
        for frac in _BACKTRACK:
            with torch.no_grad():
                for p, a, b in zip(self.all_params, self.snapshot[0], after):
                    p.copy_(torch.lerp(a, b, frac))
            kl, tok = self.measure_now(measured_on)
            if kl <= self.cfg.early_stop_kl:
                self.kl_token_max = max(self.kl_token_max, tok)
                return frac  # AdamW keeps the moments of the gradient it saw
        _plumbing.restore(self.snapshot, self.all_params, self.optimizers)  # parameters and AdamW state as before
        self.steps, self.grad_norm = self.steps - 1, self.grad_norm - self.last["grad_norm"]
        for k, v in self.last["sums"].items():
            self.sums[k] -= v
        return 0.0

    def stats(self, device: torch.device) -> dict[str, float]:
        """The update's logged numbers: diagnostics averaged over the steps kept, counts, KL maxima."""
        sums = self.sums
        if not self.steps and self.first is not None:  # no step kept: the diagnostics of the unchanged policy
            sums = dict(self.first)
        keys = sorted(sums)
        if self.pg is not None and keys:  # the mean of the ranks' diagnostics (every rank took the same steps)
            world = dist.get_world_size(self.pg)
            reduced = _plumbing.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device),
                                           self.pg).tolist()
            sums = {k: v / world for k, v in zip(keys, reduced)}
        steps = max(self.steps, 1)
        stats = {k: v / steps for k, v in sums.items()}
        stats.update({k: math.nan for k in _LOGGED if k not in stats})  # e.g. no critic: no critic terms
        stats.update(updates=self.steps, early_stopped=int(self.stopped), rolled_back=int(self.kept < 1.0),
                     step_fraction=self.kept, skipped_steps=self.skipped, kl_approx_max=self.kl_max,
                     kl_token_max=self.kl_token_max, grad_norm=self.grad_norm / steps)
        return stats


def _logged(out: TensorDictBase) -> dict[str, float]:
    return {k: float(out[k].detach()) for k in _LOGGED if k in out.keys()}


def _loss_terms(out: TensorDictBase) -> dict[str, float]:
    return {k: float(v.detach()) for k, v in out.items() if k.startswith("loss_")}


# --------------------------------------------------------------------------- #
# The loop
# --------------------------------------------------------------------------- #


def train(cfg: TrainConfig) -> list[dict[str, float]]:
    """Run PPO as configured; returns the metrics rows of the iterations run now.

    Under ``torchrun`` (``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` set) every process runs this
    as one rank of a data-parallel job and gets the same rows (all-reduced over the ranks).
    """
    check_launch(cfg)
    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = _plumbing.init_distributed(cfg.device)
    try:
        return _train(cfg, d)
    finally:
        torch.set_num_threads(threads_before)
        _plumbing.close_distributed(d)  # _train has returned: its DDP wrappers are freed while the group is alive


#: The flags a ``--resume`` may change: they alter neither what the run computes nor its data (``--iterations``
#: only upward). Any other difference from the checkpoint's configuration is refused unless ``--allow-change`` names it.
RESUME_MAY_CHANGE = ("iterations", "resume", "out", "no_progress", "no_plot", "logger", "save_every", "threads",
                     "time_limit", "allow_change", "eval_every", "eval_minutes", "eval_samples")


def check_launch(cfg: TrainConfig) -> None:
    """Refuse, before any process group, model or file exists, what this run cannot honour.

    ``--device cuda`` without CUDA, a ``--logger`` whose package is missing, ``--fsdp`` or
    ``--shared-trunk`` where they cannot run, an ``--out`` that is a file, and for ``--resume``:
    no checkpoint in ``--out``, flags that differ from the checkpoint's (:data:`RESUME_MAY_CHANGE`
    lists those that may), or nothing left to run. ``python -m ppo_objectives.train`` turns each
    into an ``error:`` line (exit 2).
    """
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was given but torch.cuda.is_available() is False; use --device cpu")
    _plumbing.check_logger(cfg.logger)  # its package is missing: say so now, not after the warm start
    _plumbing.check_fsdp(cfg.fsdp, shared_trunk=cfg.shared_trunk, workers=cfg.workers)
    if cfg.shared_trunk and _plumbing.launched_world_size() > 1:
        raise ValueError(
            "--shared-trunk under torchrun: the actor and the critic would share parameters, and two "
            "DistributedDataParallel wrappers cannot own the same parameters; add --no-shared-trunk for "
            "data-parallel runs (the critic then has its own copy of the trunk)"
        )
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; give a directory (created if missing) for the run's outputs")
    if cfg.resume:
        _check_resume(cfg, out)


def _check_resume(cfg: TrainConfig, out: Path) -> None:
    """``--resume``: a checkpoint exists, its configuration is this run's but for :data:`RESUME_MAY_CHANGE` (and
    ``--allow-change``), and iterations are left to run."""
    saved = _plumbing.read_run_config(out)
    if saved is None:
        raise FileNotFoundError(
            f"--resume: no checkpoint in {out} ({out / 'checkpoint.pt'} does not exist); drop --resume to start a new "
            f"run there, or give the --out of the run to continue"
        )
    allowed = {a.strip().replace("-", "_") for a in cfg.allow_change.split(",") if a.strip()}
    unknown = sorted(allowed - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise ValueError(f"--allow-change {cfg.allow_change}: no such flag {unknown}; name flags as on the command "
                         f"line, e.g. --allow-change lr,kl-coef")
    config, iteration = saved["config"], int(saved["iteration"])
    changed = [f.name for f in fields(TrainConfig) if f.name in config and f.name not in RESUME_MAY_CHANGE
               and f.name not in allowed and config[f.name] != getattr(cfg, f.name)]
    if changed:
        shown = ", ".join(f"--{n.replace('_', '-')} {getattr(cfg, n)!r} (the checkpoint's: {config[n]!r})"
                          for n in changed)
        raise ValueError(
            f"--resume: this run's flags differ from those of the run in {out}: {shown}; they change what the run "
            f"computes, so the resumed run would not continue it. Give the checkpoint's values, start a new --out, or "
            f"change them on purpose with --allow-change {','.join(n.replace('_', '-') for n in changed)}"
        )
    if iteration >= cfg.iterations:
        raise ValueError(f"--resume: nothing left to run: the checkpoint in {out} is at iteration {iteration} and "
                         f"--iterations is {cfg.iterations}; raise --iterations to continue the run")


@dataclass
class _Run:
    """Everything one training run holds, built by :func:`_build` (identical on every rank)."""

    cfg: TrainConfig
    d: _plumbing.Dist
    out: Path
    device: torch.device
    task: object  # a DigitTask or a TextTask
    env: TokenLMEnv
    ac: ActorCritic
    ref: TensorDictModule
    ddp_wrappers: list
    controller: object
    kl_transform: KLPenaltyTransform
    gae: MaskedGAE
    loss_module: TokenPPOLoss
    optimizers: tuple
    guard: CollapseGuard
    stateful: dict
    gen: torch.Generator
    start_it: int = 0
    collector: object = None
    collector_iter: object = None
    evaluation: object = None  # text tasks: _text_job.HeldOutEvaluation
    next_eval_s: float = 0.0  # --eval-minutes: the training time of the next evaluation

    @property
    def P(self) -> int:
        return self.env.prompt_len

    @property
    def M(self) -> int:
        return self.env.max_new_tokens


def _build(cfg: TrainConfig, d: _plumbing.Dist) -> _Run:
    """Setup: seeds, task, env, networks, TorchRL modules, optimizers, the collector; ``--resume``."""
    pg, out = d.group, Path(cfg.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)  # the warm start's data, then the minibatch permutations
    device = torch.device(f"cuda:{d.local_rank}" if cfg.device == "cuda" and pg is not None else cfg.device)
    rank_seed = cfg.seed + _RANK_SEED_STRIDE * d.rank  # = seed on rank 0 / without torchrun
    task, held_out = _make_tasks(cfg)  # a DigitTask, or a TextTask and its held-out prompts
    lm = _policy_lm(cfg, task, device)  # a TinyCausalLM preset, or --model DIR (toy: behind the task's tokens)
    env = _make_env(task, cfg.num_envs, str(device), rank_seed, vocab_size=lm.vocab_size, group_size=cfg.group_size)
    ckpt = _plumbing.load_checkpoint(out / "checkpoint.pt", d, device) if cfg.resume else None
    if ckpt is None:
        warm_start(lm, task, cfg.warmup_steps, cfg.warmup_lr, gen, device)  # text tasks: 0 steps
    else:
        _check_resumed_model(ckpt, cfg, out)  # the checkpoint holds the networks built here
    ac, ref, actor, critic, ddp_wrappers = _networks(cfg, d, task, lm, env.prompt_len, device)
    # --- TorchRL modules, optimizers, the collapse guard (ppo_objectives.monitor); --resume
    controller, kl_transform, gae, loss_module = _ppo_modules(cfg, actor, critic, ref, device, pg)
    optimizers = (torch.optim.AdamW(ac.actor_parameters(), lr=cfg.lr, weight_decay=0.0),
                  torch.optim.AdamW(ac.critic_parameters(), lr=cfg.critic_lr, weight_decay=0.0))
    guard = CollapseGuard(stall_patience=cfg.stall_patience)
    stateful = _stateful(ac, ref, optimizers, controller, guard)  # what a checkpoint holds, by name
    if cfg.fsdp:  # full state dicts, gathered on rank 0 and scattered back by --resume
        stateful = _plumbing.fsdp_stateful(stateful, ac)
    run = _Run(cfg, d, out, device, task, env, ac, ref, ddp_wrappers, controller, kl_transform, gae, loss_module,
               optimizers, guard, stateful, gen)
    if cfg.recipe == "pretrained":  # held-out accuracy; its sampling generator is checkpointed
        run.evaluation = stateful["evaluation"] = _text_job.HeldOutEvaluation(held_out, cfg, out, d.main)
        run.next_eval_s = 60.0 * cfg.eval_minutes
    run.start_it = _resume(ckpt, stateful, d, out, _columns(cfg)) if ckpt is not None else 0
    if ckpt is not None and d.main:
        print(f"resumed at iteration {run.start_it} of {cfg.iterations} from {out / 'checkpoint.pt'}", file=sys.stderr,
              flush=True)
    if ckpt is None and pg is not None:
        torch.manual_seed(rank_seed)  # after the identical build: each rank samples its own responses
    with _plumbing.gathered_for_rollout(ac.actor_model):  # TorchRL's collector runs the policy once as it is built
        run.collector = make_collector(cfg, task, ac.policy, env, rank=d.rank)
    run.collector_iter = iter(run.collector)
    if ckpt is not None:  # RNG states last: building the collector resets the env (draws prompts)
        _plumbing.restore_rng_states(ckpt, d.rank, gen, env._generator, device)
    return run


def _networks(cfg: TrainConfig, d: _plumbing.Dist, task, lm: torch.nn.Module, P: int, device) -> tuple:
    """``(ActorCritic, frozen reference, actor, critic, DDP wrappers)``: the loss calls ``actor`` and ``critic``,
    through DDP under torchrun (gradients all-reduced), or with ``--fsdp`` their models sharded in place."""
    critic_lm = None if cfg.shared_trunk else _loaded_copy(cfg, task, lm, device)  # None: a deepcopy of lm
    ac = make_actor_critic(lm, P, shared_trunk=cfg.shared_trunk, critic_model=critic_lm,
                           entropy_grad=cfg.entropy_coef > 0)
    ref_lm = _loaded_copy(cfg, task, ac.actor_model, device)  # --model: loaded again; else a copy of the actor
    ref = frozen_reference(ac.actor_model if ref_lm is None else ref_lm, P, dtype=_REFERENCE_DTYPE[cfg.dtype],
                           copy_model=ref_lm is None)  # made before any sharding: the reference stays whole
    if cfg.fsdp:
        actor, critic, ddp_wrappers = _plumbing.shard_fsdp(ac, d, device)
    elif d.group is not None:
        actor, critic, ddp_wrappers = _plumbing.wrap_ddp(ac, d, device)
    else:
        actor, critic, ddp_wrappers = ac.actor, ac.critic, []
    return ac, ref, actor, critic, ddp_wrappers


def _train(cfg: TrainConfig, d: _plumbing.Dist) -> list[dict[str, float]]:
    run = _build(cfg, d)
    # --- the loop: rollout -> update -> log -> checkpoint
    rows: list[dict[str, float]] = []
    bar, logger = _reporters(cfg, d, run.start_it, run.out)  # rank 0: progress bar (unless --no-progress), --logger
    try:
        if run.evaluation is not None and run.start_it == 0:  # the pretrained model before any update: row 0
            rows.append(_log_start(run.evaluation(run.ac.actor_model, 0, "start"), cfg, d, run.out, logger))
        train_s = 0.0  # rollouts and updates since this process started (--time-limit)
        for it in range(run.start_it, cfg.iterations):
            row = _iteration(run, it)
            train_s += row["rollout_s"] + row["reference_s"] + row["update_s"]
            last = it + 1 == cfg.iterations or _out_of_time(cfg, train_s, d.group, run.device)
            if run.evaluation is not None:  # held-out accuracy of the updated policy (text tasks)
                row.update(_evaluate_if_due(run, it + 1, last, train_s))
            # the collapse guard's warn_* / collapse columns and warning lines; metrics.csv, --logger, the bar
            step = row["rollout_s"] + row["reference_s"] + row["update_s"] if cfg.time_limit else 1
            rows.append(_log_iteration(row, run.guard, d, run.out, bar, logger, _columns(cfg), step))
            # checkpoint (and plot; text tasks: the Hugging Face export) every --save-every iterations and at the end
            if (it + 1) % cfg.save_every == 0 or last:
                _save(run, it + 1)
            if last:
                break
        ac = run.ac
        _plumbing.check_ranks_in_sync([ac.actor_model, ac.critic_model, ac.critic_head], d.group)
        if d.group is not None and d.main:
            print(f"parameters identical on all {d.world} ranks", file=sys.stderr, flush=True)
    finally:  # --- teardown
        _close_reporters(bar, logger)
        run.collector.shutdown()
        run.loss_module = None
        run.ddp_wrappers.clear()  # free the DDP reducers now, while the process group is alive
    _finish(cfg, d, run.guard, run.out)
    return rows


def _iteration(run: _Run, it: int) -> dict[str, float]:
    """One PPO iteration: rollout, scoring (V_old, reference, KL penalty, GAE), update, KL controller; its row."""
    cfg, pg = run.cfg, run.d.group
    # 1. rollout through the collector, then KL penalty and GAE on the LLM layout
    t0 = time.perf_counter()
    with _plumbing.gathered_for_rollout(run.ac.actor_model):  # --fsdp: the whole actor (else nothing)
        llm = collect_batch(run.collector_iter, run.device, run.P, run.M)
    t_ref = time.perf_counter()
    llm = score_batch(llm, run.ac, run.kl_transform, run.gae)  # V_old, reference log-probs, KL penalty, GAE
    t1 = time.perf_counter()
    # 2. PPO epochs x minibatches, approx-KL trust region, non-finite guard (critic only while
    #    it < --critic-warmup: the actor keeps the policy that made the rollouts)
    stats = ppo_update(llm, run.loss_module, run.ac, run.optimizers, cfg, run.gen, process_group=pg,
                       critic_only=it < cfg.critic_warmup)
    t2 = time.perf_counter()
    # 3. KL coefficient update (on the all-rank KL: beta stays identical on every rank); the
    #    collector's policy shares the weights (in-process) or receives them (worker processes)
    roll = _rollout_stats(llm, run.kl_transform, pg)
    coeff = run.controller.update(roll.pop("seq_kl_t"), n_steps=int(roll["episodes"]))
    n_tok = roll.pop("tokens")
    if cfg.workers > 1:
        run.collector.update_policy_weights_()
    _plumbing.release_host_memory()  # the rollout's and the update's freed host memory, back to the system
    return dict(iteration=it + 1, **roll, kl_coeff=float(coeff), rollout_s=t_ref - t0, reference_s=t1 - t_ref,
                update_s=t2 - t1, tokens_per_s=n_tok / max(t_ref - t0, 1e-9), **stats)


def _evaluate_if_due(run: _Run, iteration: int, last: bool, train_s: float) -> dict[str, float]:
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
    return bool(_plumbing.all_reduce(flag, pg, dist.ReduceOp.MAX))


def _save(run: _Run, iteration: int) -> None:
    """``checkpoint.pt`` and the plot; for a text task also the actor as a Hugging Face directory, ``OUT/hf``."""
    rng = _plumbing.rng_states(run.gen, run.env._generator, run.device)
    _checkpoint(iteration, run.cfg, run.d, run.stateful, rng, run.out)
    if run.d.main and run.cfg.recipe == "pretrained":
        _text_job.export_hf(run.ac.actor_model, run.task.tokenizer, run.out / "hf")


def plot_metrics(csv_path: Path, png_path: Path) -> None:
    """Plot ``metrics.csv`` into ``png_path`` (:func:`ppo_objectives.monitor.plot_metrics`)."""
    _plot(read_metrics(csv_path), png_path, title=f"PPO run {Path(csv_path).parent.name}")


def _stateful(ac: ActorCritic, ref: TensorDictModule, optimizers, controller, guard: CollapseGuard) -> dict:
    """The objects whose ``state_dict()`` a checkpoint holds, under their names in it (loaded in this order)."""
    return dict(actor_model=ac.actor_model, critic_model=ac.critic_model, critic_head=ac.critic_head,
                reference=ref.module.model, actor_opt=optimizers[0], critic_opt=optimizers[1],
                kl_controller=controller, collapse_guard=guard)


def _resume(ckpt: dict, stateful: dict, d: _plumbing.Dist, out: Path, columns: tuple) -> int:
    """``--resume``: every entry of ``stateful`` from ``ckpt``, and ``metrics.csv`` cut back to the
    checkpoint's iteration (the RNG states come later); returns that iteration."""
    start_it = _plumbing.restore_state(ckpt, stateful)
    if d.main:
        _plumbing.truncate_metrics(out / "metrics.csv", start_it, columns)
    return start_it


def _columns(cfg: TrainConfig) -> tuple[str, ...]:
    """The columns of ``metrics.csv``: :data:`METRICS`, plus the held-out evaluation's for text tasks."""
    return (*METRICS, *EVAL_COLUMNS) if cfg.recipe == "pretrained" else METRICS


def _log_start(evaluated: dict, cfg: TrainConfig, d: _plumbing.Dist, out: Path, logger) -> dict:
    """Row 0 of a text run: the held-out evaluation of the pretrained model, before any rollout (its other
    columns are nan, which the collapse guard and the plot skip)."""
    row = {**dict.fromkeys(_columns(cfg), math.nan), "iteration": 0, **evaluated}
    if d.main:
        _plumbing.append_metrics(out / "metrics.csv", row, _columns(cfg))
        _plumbing.log_row(logger, row, 0, _columns(cfg))
        print(f"held-out before training: greedy {row['eval_greedy']:.3f}, sampled {row['eval_sampled']:.3f}",
              file=sys.stderr, flush=True)
    return row


def _reporters(cfg: TrainConfig, d: _plumbing.Dist, start_it: int, out: Path) -> tuple:
    """Rank 0's progress bar (``None`` with ``--no-progress``) and ``--logger``'s TorchRL logger
    (``None`` without one; under ``out/logs``, named after ``out``, continuing after ``start_it``)."""
    if not d.main:
        return None, None
    logger = _plumbing.make_logger(cfg.logger, out, out.resolve().name, start_step=start_it)
    if cfg.no_progress:
        return None, logger
    from tqdm import tqdm

    if cfg.time_limit:  # the bar counts training seconds towards the limit
        return tqdm(total=round(60 * cfg.time_limit), desc="ppo (training s)", unit="s", dynamic_ncols=True), logger
    return tqdm(total=cfg.iterations, initial=start_it, desc="ppo", dynamic_ncols=True), logger


def _close_reporters(bar, logger) -> None:
    if bar is not None:
        bar.close()
    _plumbing.close_logger(logger)


def _log_iteration(row: dict, guard: CollapseGuard, d: _plumbing.Dist, out: Path, bar, logger=None,
                   columns: tuple = METRICS, bar_step: float = 1) -> dict:
    """Add the collapse guard's columns to ``row``; on rank 0 append it to ``metrics.csv``, send it to
    the ``--logger`` (step: the iteration) and print the guard's warnings; show it on the progress bar.
    Returns ``row``."""
    warnings_now = guard.update(row)
    if d.main:
        _plumbing.append_metrics(out / "metrics.csv", row, columns)
        _plumbing.log_row(logger, row, int(row["iteration"]), columns)
        for line in warnings_now:
            _plumbing.warn(line, bar)
    if bar is not None:
        flagged = "+".join(f for f in FLAGS if row[f"warn_{f}"])  # a collapse is always flagged
        warn = {"warn": "COLLAPSE" if row["collapse"] else flagged} if flagged else {}
        held_out = {k: f"{row[k]:.2f}" for k in ("eval_greedy", "eval_sampled") if not math.isnan(row.get(k, math.nan))}
        bar.set_postfix(reward=f"{row['reward']:.3f}", exact=f"{row['exact']:.2f}", kl=f"{row['kl_ref']:.4f}",
                        **held_out, **warn)
        bar.training_s = getattr(bar, "training_s", bar.n) + bar_step  # whole seconds (or iterations) on the bar
        bar.update(min(int(bar.training_s), bar.total) - bar.n)
    return row


def _checkpoint(iteration: int, cfg: TrainConfig, d: _plumbing.Dist, stateful: dict, rng: dict, out: Path) -> None:
    """Write ``checkpoint.pt`` (rank 0; a collective under torchrun) and redraw the plot: it follows the run."""
    state = _plumbing.checkpoint_state(iteration, asdict(cfg), d, stateful, rng)
    if d.main:
        _plumbing.save_checkpoint(out / "checkpoint.pt", state)
        _plumbing.write_run_config(out, iteration, asdict(cfg))  # what --resume compares its flags with
        if not cfg.no_plot:
            plot_metrics(out / "metrics.csv", out / "training.png")


def _finish(cfg: TrainConfig, d: _plumbing.Dist, guard: CollapseGuard, out: Path) -> None:
    """The final plot, and a :class:`TrainingCollapseWarning` (issued from :func:`train`) when the run collapsed."""
    csv_path = out / "metrics.csv"
    if d.main and not cfg.no_plot and csv_path.exists():
        plot_metrics(csv_path, out / "training.png")
    if d.main and guard.collapses:
        warnings.warn(f"the PPO run in {out} collapsed: {guard.summary()}; see the warn_* and collapse columns "
                      f"of {csv_path} and {out / 'training.png'}", TrainingCollapseWarning, stacklevel=3)


class TrainingCollapseWarning(RuntimeWarning):
    """Raised (as a warning) at the end of a run that went through a collapse (:class:`CollapseGuard`)."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # a configuration this run cannot honour is an error line, not a traceback
        cfg = TrainConfig(**vars(args))
        check_launch(cfg)
    except (ValueError, TypeError, ImportError, OSError, RuntimeError) as err:
        parser.error(str(err))
    t0 = time.perf_counter()
    rows = train(cfg)
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


if __name__ == "__main__":
    sys.exit(main())

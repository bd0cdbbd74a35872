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
``rollout_s`` / ``update_s`` / ``tokens_per_s``
    Wall time of the rollout and of the PPO updates; generated tokens per rollout second.
``warn_min_len`` / ``warn_zero_reward`` / ``warn_entropy`` / ``warn_kl_spike``
    1 when :class:`~ppo_objectives.monitor.CollapseGuard` flags this iteration: responses at
    their shortest (``response_len <= 1.5``, EOS first), ``reward < 0.05``, ``entropy < 0.05``
    while ``exact < 0.5`` (deterministic without solving the task), ``kl_approx_max > 1.0``
    (one step jumped four times past the trust region; pulled back when ``rolled_back``).
    Each event is also a ``WARNING ppo: iteration N: ...`` line on stderr and a ``warn=``
    field on the progress bar.
``collapse``
    1 while the run is collapsed: 5 or more bad iterations (``min_len``, ``zero_reward`` or
    ``entropy``) in a row. The plot shades flagged iterations orange and collapsed ones red,
    and a run that collapsed ends with a :class:`TrainingCollapseWarning`.

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

Checkpoints: ``DIR/checkpoint.pt`` (actor, critic, reference, both optimizers, KL
controller, collapse guard, RNG states of every rank, iteration; no learning-rate scheduler is
used), written atomically (temporary file +
``os.replace``) every ``--save-every`` iterations and at the end; ``--resume``
continues from it and appends to ``metrics.csv`` (dropping any rows logged after that
checkpoint by the interrupted run, which are logged again).

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
import copy
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

from ppo_objectives import _plumbing, _validate
from ppo_objectives import functional as F
from ppo_objectives._plumbing import read_metrics  # public through this module
from ppo_objectives.envs import DigitTask, TokenLMEnv, trajectories_to_llm_batch
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.models import ActorCritic, ResponseLogProbs, TinyCausalLM, TinyLMConfig, make_actor_critic
from ppo_objectives.monitor import FLAGS, CollapseGuard
from ppo_objectives.monitor import plot_metrics as _plot
from ppo_objectives.pretrained import load_policy_model
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform
from ppo_objectives.value import MaskedGAE

__all__ = [
    "TrainConfig", "TrainingCollapseWarning", "build_parser", "frozen_reference", "main", "make_collector",
    "plot_metrics", "ppo_update", "read_metrics", "rollout_batch", "train", "warm_start",
]  # fmt: skip

METRICS = (
    "iteration", "reward", "exact", "response_len", "episodes", "kl_ref", "seq_kl", "kl_coeff",
    "loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy", "entropy", "kl_approx", "kl_approx_max",
    "kl_token_max", "clip_fraction", "max_ratio", "ESS", "value_clip_fraction", "explained_variance", "updates",
    "early_stopped", "rolled_back", "step_fraction", "skipped_steps", "grad_norm", "rollout_s", "update_s", "tokens_per_s",
    *(f"warn_{f}" for f in FLAGS), "collapse",
)  # fmt: skip


DTYPES = ("float32", "bfloat16")  # --dtype; bfloat16: autocast of the actor and critic, bf16 reference


# --------------------------------------------------------------------------- #
# Configuration (every field is a CLI flag; the help text is the documentation)
# --------------------------------------------------------------------------- #


def _f(default, help, **kw):
    from dataclasses import field

    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    iterations: int = _f(300, "PPO iterations (rollout + updates)")
    seed: int = _f(0, "seed of torch, the env's prompts and the warm start")
    device: str = _f("cpu", "device of models and env", choices=("cpu", "cuda"))
    out: str = _f("runs/ppo_token_lm", "output directory: metrics.csv, training.png, checkpoint.pt")
    resume: bool = _f(False, "continue from OUT/checkpoint.pt (same flags); metrics are appended")
    task: str = _f("reverse", "toy task", choices=("reverse", "copy", "add"))
    digits: int = _f(3, "digits per operand of the task")
    preset: str = _f("nano", "TinyCausalLM size preset (ignored with --model)", choices=("pico", "nano", "micro"))
    model: str = _f("", "a local Hugging Face checkpoint directory (config.json + weights, tokenizer optional) to "
                        "train instead of a TinyCausalLM preset; the actor, critic trunk and reference are loaded "
                        "from it behind the task's tokens")
    dtype: str = _f("float32", "bfloat16: actor and critic forwards under autocast (float32 weights, AdamW state, "
                               "log-softmax and losses), reference in bf16", choices=DTYPES)
    grad_checkpointing: bool = _f(False, "activation checkpointing of the decoder layers (needs --model)")
    shared_trunk: bool = _f(False, "critic value head on the actor's trunk instead of its own copy")
    fsdp: bool = _f(False, "under torchrun: shard the actor's and the critic's models over the ranks with FSDP2 "
                           "(fully_shard per transformer block, then the model) instead of DDP, so parameters, "
                           "gradients and AdamW state are split across ranks; the reference stays whole")
    num_envs: int = _f(64, "parallel env rows N (responses per rollout ~ N; per rank under torchrun)")
    workers: int = _f(1, "collector processes: 1 = Collector in-process, >1 = MultiSyncCollector")
    warmup_steps: int = _f(150, "supervised warm-start steps teaching the answer format (random digits)")
    warmup_lr: float = _f(3e-3, "warm-start learning rate")
    lr: float = _f(3e-4, "actor AdamW learning rate (1e-3 makes single steps cross the trust region far more "
                         "often; see benchmarks/README.md)")
    critic_lr: float = _f(1e-3, "critic AdamW learning rate")
    ppo_epochs: int = _f(4, "passes over each rollout")
    minibatches: int = _f(4, "minibatches per pass")
    clip_epsilon: float = _f(0.2, "PPO ratio clip")
    clip_value: float = _f(0.2, "value clip range around V_old")
    critic_coef: float = _f(0.5, "weight of the value loss")
    entropy_coef: float = _f(0.0, "entropy bonus weight")
    gamma: float = _f(1.0, "discount")
    lam: float = _f(0.95, "GAE lambda")
    kl_coef: float = _f(0.02, "in-reward KL coefficient beta (k1 to the reference, per token)")
    adaptive_kl: bool = _f(False, "adapt beta towards --kl-target (Ziegler et al. 2019)")
    kl_target: float = _f(1.0, "target per-sequence KL (nats) of the adaptive controller")
    kl_loss_coef: float = _f(0.0, "in-loss reference KL weight (MiniMind: 0.02, k3); 0 = off")
    early_stop_kl: float = _f(0.25, "approx-KL trust region: the PPO epochs stop when kl_approx exceeds it, and "
                                    "the step that took it there is undone (MiniMind stops at 0.25); 0 = off")
    no_rollback: bool = _f(False, "keep the step that took kl_approx past --early-stop-kl (MiniMind's early stop) "
                                  "instead of undoing it")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    save_every: int = _f(25, "iterations between checkpoints")
    no_plot: bool = _f(False, "do not write training.png")
    no_progress: bool = _f(False, "no progress bar")
    logger: str = _f("none", "also log every metric to a TorchRL logger under OUT/logs (offline; rank 0); the "
                             'packages: pip install "ppo_objectives[loggers]"',
                     choices=("none", *_plumbing.LOGGERS))
    threads: int = _f(1, "torch CPU threads for this run (0 = torch's default); one thread is fastest for "
                         "tiny models, and far faster when other processes share the cores")

    def __post_init__(self):
        DigitTask(self.task, self.digits)  # the task checks its own arguments
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
                     "warmup_steps", "threads"):
            low = 0 if name in ("iterations", "warmup_steps", "threads") else 1
            _validate.check_int(name, getattr(self, name), low=low, where="TrainConfig ")
        if not _validate.is_real(self.early_stop_kl, low=0.0):
            raise ValueError(f"TrainConfig early_stop_kl={self.early_stop_kl!r} must be a finite number >= 0 (0 turns "
                             "the trust region off)")
        for name in ("lr", "critic_lr", "warmup_lr", "clip_epsilon", "max_grad_norm"):
            value = getattr(self, name)
            if not _validate.is_real(value, low=0.0, strict=True):
                raise ValueError(f"TrainConfig {name}={value!r} must be a finite number > 0")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ppo_objectives.train",
        description="Token-level PPO with a critic on a toy digit task (TorchRL collector -> "
        "KLPenaltyTransform -> MaskedGAE -> TokenPPOLoss). Data-parallel: torchrun --nproc_per_node N -m "
        "ppo_objectives.train ... (gloo on CPU, nccl with --device cuda). Metrics are explained in the module "
        "docstring: python -c 'import ppo_objectives.train as t; help(t)'",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", help=meta["help"])
        else:
            typ = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            p.add_argument(flag, type=typ, default=f.default, help=meta["help"], choices=meta.get("choices"))
    return p


# --------------------------------------------------------------------------- #
# The pieces: env and collector, warm start, frozen reference, PPO modules
# --------------------------------------------------------------------------- #


_RANK_SEED_STRIDE = 1_000_003  # rank r rolls out with seed + r * stride (torch sampling and env prompts)


def _make_env(task: DigitTask, num_envs: int, device: str, seed: int) -> TokenLMEnv:
    return TokenLMEnv.from_task(task, num_envs=num_envs, device=device, seed=seed)


class _EnvFactory:
    """Picklable env constructor for collector worker processes."""

    def __init__(self, task, num_envs, device, seed):
        self.args = (task, num_envs, device, seed)

    def __call__(self):
        return _make_env(*self.args)


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
    factories = [_EnvFactory(task, per_worker, "cpu", seed) for seed in seeds]
    return MultiSyncCollector(
        factories,
        policy,
        frames_per_batch=per_worker * cfg.workers * M,
        total_frames=-1,
        reset_at_each_iter=True,
        auto_register_policy_transforms=False,
        cat_results="stack",
    )


def _policy_lm(cfg: TrainConfig, task: DigitTask, block_size: int, device) -> torch.nn.Module:
    """The actor's causal LM: the ``--preset`` TinyCausalLM, or the checkpoint ``--model DIR`` behind the
    task's tokens (:func:`~ppo_objectives.pretrained.load_policy_model`); under ``--dtype bfloat16``
    its forward runs under autocast (``autocast_dtype``; the weights stay float32)."""
    autocast = _AUTOCAST_DTYPE[cfg.dtype]
    if cfg.model:
        return load_policy_model(cfg.model, task, autocast_dtype=autocast,
                                 grad_checkpointing=cfg.grad_checkpointing).to(device)
    config = TinyLMConfig.preset(cfg.preset, vocab_size=task.vocab_size, block_size=block_size)
    return TinyCausalLM(config, autocast_dtype=autocast).to(device)


def _loaded_copy(cfg: TrainConfig, task: DigitTask, lm: torch.nn.Module, device) -> torch.nn.Module | None:
    """``--model``: the checkpoint loaded again (as in :func:`_policy_lm`) holding ``lm``'s current (warm-started)
    weights, for the critic trunk and the reference; ``None`` without ``--model`` (they are copies of ``lm``)."""
    if not cfg.model:
        return None
    copy_lm = load_policy_model(cfg.model, task, autocast_dtype=lm.autocast_dtype,
                                grad_checkpointing=cfg.grad_checkpointing).to(device)
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


def warm_start(model: TinyCausalLM, task: DigitTask, steps: int, lr: float, generator: torch.Generator, device) -> float:
    """Supervised warm start on the answer *format*: prompt, then random digits of the answer's
    length, then EOS. Teaches "K digits and stop", not which digits. Returns the last loss."""
    if steps <= 0:
        return float("nan")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    P, K1 = task.prompt_len, task.answer_len
    head = ResponseLogProbs(model, P, return_entropy=False)
    loss = torch.zeros(())
    for _ in range(steps):
        prompts = task.sample_prompts(64, generator)  # [64, P], left-padded
        digits = torch.randint(10, (64, K1 - 1), generator=generator) + 2
        resp = torch.cat([digits, torch.full((64, 1), task.EOS)], 1)
        ids = torch.cat([prompts, resp], 1).to(device)
        mask = torch.cat([prompts != task.PAD, torch.ones_like(resp, dtype=torch.bool)], 1).to(device)
        loss = -head(ids, mask).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


def frozen_reference(actor_model: torch.nn.Module, prompt_len: int, *, dtype: torch.dtype | None = None,
                     copy_model: bool = True) -> TensorDictModule:
    """The frozen reference policy of the KL penalty: a copy of the actor's causal LM, in eval mode
    and without gradients, read out as per-token log-probabilities of the response.

    Args:
        actor_model: the actor's causal LM (``ActorCritic.actor_model``), copied as it is now
            (after the warm start): later optimizer steps of the actor do not move the copy.
        prompt_len: ``P``, the prompt width of the env (left-padded prompts).
        dtype: convert the reference's weights to it (``torch.bfloat16`` under ``--dtype bfloat16``)
            and run it in it, without autocast; ``None`` keeps the actor's dtype and autocast setting.
        copy_model: ``False`` uses ``actor_model`` itself (a network of its own, e.g. the
            checkpoint loaded again under ``--model``) instead of a ``copy.deepcopy``.

    Returns:
        A ``TensorDictModule`` reading ``input_ids`` and ``attention_mask`` (``[B, P + R]``) and
        writing ``log_prob`` (``[B, R]``): the reference
        :class:`~ppo_objectives.transforms.KLPenaltyTransform` takes. Its copy of the network is
        ``ref.module.model``.

    Example:
        >>> from tensordict import TensorDict
        >>> lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=8))
        >>> ref = frozen_reference(lm, prompt_len=3)
        >>> td = TensorDict(input_ids=torch.randint(10, (2, 7)), attention_mask=torch.ones(2, 7, dtype=torch.bool),
        ...                 batch_size=[2])
        >>> ref(td)["log_prob"].shape
        torch.Size([2, 4])
        >>> ref.module.model is lm, any(p.requires_grad for p in ref.parameters())
        (False, False)
    """
    ref = (copy.deepcopy(actor_model) if copy_model else actor_model).eval().requires_grad_(False)
    if dtype is not None:
        ref = ref.to(dtype)
        ref.autocast_dtype = None  # its weights are in dtype already
    return TensorDictModule(
        ResponseLogProbs(ref, prompt_len, return_entropy=False), ["input_ids", "attention_mask"], ["log_prob"]
    )


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
    # whitened over the valid tokens of the batch (of every rank's batch under torchrun)
    gae = MaskedGAE(gamma=cfg.gamma, lmbda=cfg.lam, average_gae=True, device=device, process_group=process_group)
    loss_module = TokenPPOLoss(
        actor,
        critic,
        clip_epsilon=cfg.clip_epsilon,
        critic_coeff=cfg.critic_coef,
        clip_value=cfg.clip_value,
        kl_coeff=cfg.kl_loss_coef,
        entropy_coeff=cfg.entropy_coef,
        entropy_bonus=True,  # the actor writes entropies: log them even without a bonus
        early_stop_kl=cfg.early_stop_kl,
        functional=False,
        device=device,
    )
    loss_module.make_value_estimator(gae)
    return controller, kl_transform, gae, loss_module


# --------------------------------------------------------------------------- #
# The algorithm: rollout, then the PPO update with its trust region
# --------------------------------------------------------------------------- #


def rollout_batch(collector_iter, ac: ActorCritic, kl_transform: KLPenaltyTransform, gae: MaskedGAE, P: int, M: int,
                  *, process_group=None):
    """One collector batch -> the response-layout batch the loss trains on (advantages included).

    Under data parallelism ``gae`` whitens over the valid tokens of every rank
    (``MaskedGAE(..., average_gae=True, process_group=pg)``); ``process_group`` here is
    no longer accepted.
    """
    if process_group is not None:
        raise TypeError(
            "rollout_batch(process_group=) is gone: build the estimator with "
            "MaskedGAE(..., average_gae=True, process_group=pg) to whiten over every rank's tokens"
        )
    batch = next(collector_iter)  # [N, T] per-token steps
    device = next(ac.actor_model.parameters()).device
    llm = trajectories_to_llm_batch(batch.to(device), P, M)
    llm.set(("next", "reward"), llm.get("token_reward").clone())  # the env's per-token reward
    with torch.no_grad():
        ac.critic(llm)  # V_old: "state_value" [B, R]
        kl_transform(llm)  # "ref_log_prob", "kl_penalty"; reward -= beta * k1 on every token
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
               generator: torch.Generator, *, process_group=None) -> dict[str, float]:
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
    """
    B = llm.batch_size[0]
    u = _TrustRegionUpdate(loss_module, ac, optimizers, cfg, process_group)
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

    def __init__(self, loss_module: TokenPPOLoss, ac: ActorCritic, optimizers, cfg: TrainConfig, process_group):
        self.loss_module, self.optimizers, self.cfg, self.pg = loss_module, optimizers, cfg, process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.actor_params, self.critic_params = ac.actor_parameters(), ac.critic_parameters()
        self.all_params = list({id(p): p for p in self.actor_params + self.critic_params}.values())
        self.clipped_critic_params = self.critic_params if not ac.shared_trunk else self.all_params
        self.rollback = bool(cfg.early_stop_kl) and not cfg.no_rollback
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
        total = sum(v for k, v in out.items() if k.startswith("loss_"))
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
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was given but torch.cuda.is_available() is False; use --device cpu")
    _plumbing.check_logger(cfg.logger)  # its package is missing: say so now, not after the warm start
    _plumbing.check_fsdp(cfg.fsdp, shared_trunk=cfg.shared_trunk, workers=cfg.workers)
    if cfg.shared_trunk and _plumbing.launched_world_size() > 1:
        raise ValueError(
            "--shared-trunk under torchrun: the actor and the critic would share parameters, and two "
            "DistributedDataParallel wrappers cannot own the same parameters; drop --shared-trunk for "
            "data-parallel runs (the critic then has its own copy of the trunk)"
        )
    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = _plumbing.init_distributed(cfg.device)
    try:
        return _train(cfg, d)
    finally:
        torch.set_num_threads(threads_before)
        _plumbing.close_distributed(d)  # _train has returned: its DDP wrappers are freed while the group is alive


def _train(cfg: TrainConfig, d: _plumbing.Dist) -> list[dict[str, float]]:
    # --- setup: seeds, task, env, networks (identical on every rank; DDP broadcasts rank 0's anyway)
    pg, out = d.group, Path(cfg.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)  # the warm start's data, then the minibatch permutations
    device = torch.device(f"cuda:{d.local_rank}" if cfg.device == "cuda" and pg is not None else cfg.device)
    rank_seed = cfg.seed + _RANK_SEED_STRIDE * d.rank  # = seed on rank 0 / without torchrun
    task = DigitTask(cfg.task, cfg.digits)
    env = _make_env(task, cfg.num_envs, str(device), rank_seed)
    P, M = env.prompt_len, env.max_new_tokens
    lm = _policy_lm(cfg, task, env.seq_len, device)  # a TinyCausalLM preset, or --model DIR behind the task's tokens
    ckpt = _plumbing.load_checkpoint(out / "checkpoint.pt", d, device) if cfg.resume else None
    if ckpt is None:
        warm_start(lm, task, cfg.warmup_steps, cfg.warmup_lr, gen, device)
    else:
        _check_resumed_model(ckpt, cfg, out)  # the checkpoint holds the networks built here
    critic_lm = None if cfg.shared_trunk else _loaded_copy(cfg, task, lm, device)  # None: a deepcopy of lm
    ac = make_actor_critic(lm, P, shared_trunk=cfg.shared_trunk, critic_model=critic_lm,
                           entropy_grad=cfg.entropy_coef > 0)
    ref_lm = _loaded_copy(cfg, task, ac.actor_model, device)  # --model: loaded again; else a copy of the actor
    ref = frozen_reference(ac.actor_model if ref_lm is None else ref_lm, P, dtype=_REFERENCE_DTYPE[cfg.dtype],
                           copy_model=ref_lm is None)  # made before any sharding: the reference stays whole
    # the loss calls the actor and the critic through DDP under torchrun (gradients all-reduced), or
    # with --fsdp their models sharded in place (parameters, gradients, AdamW state split over ranks)
    if cfg.fsdp:
        actor, critic, ddp_wrappers = _plumbing.shard_fsdp(ac, d, device)
    elif pg is not None:
        actor, critic, ddp_wrappers = _plumbing.wrap_ddp(ac, d, device)
    else:
        actor, critic, ddp_wrappers = ac.actor, ac.critic, []
    # --- TorchRL modules, optimizers, the collapse guard (ppo_objectives.monitor), the collector; --resume
    controller, kl_transform, gae, loss_module = _ppo_modules(cfg, actor, critic, ref, device, pg)
    optimizers = (torch.optim.AdamW(ac.actor_parameters(), lr=cfg.lr, weight_decay=0.0),
                  torch.optim.AdamW(ac.critic_parameters(), lr=cfg.critic_lr, weight_decay=0.0))
    guard = CollapseGuard()
    stateful = _stateful(ac, ref, optimizers, controller, guard)  # what a checkpoint holds, by name
    if cfg.fsdp:  # full state dicts, gathered on rank 0 and scattered back by --resume
        stateful = _plumbing.fsdp_stateful(stateful, ac)
    start_it = _resume(ckpt, stateful, d, out) if ckpt is not None else 0
    if ckpt is None and pg is not None:
        torch.manual_seed(rank_seed)  # after the identical build: each rank samples its own responses
    collector = make_collector(cfg, task, ac.policy, env, rank=d.rank)
    collector_iter = iter(collector)
    if ckpt is not None:  # RNG states last: building the collector resets the env (draws prompts)
        _plumbing.restore_rng_states(ckpt, d.rank, gen, env._generator, device)

    # --- the loop: rollout -> update -> log -> checkpoint
    rows: list[dict[str, float]] = []
    bar, logger = _reporters(cfg, d, start_it, out)  # rank 0: progress bar (unless --no-progress), --logger
    try:
        for it in range(start_it, cfg.iterations):
            # 1. rollout through the collector, then KL penalty and GAE on the LLM layout
            t0 = time.perf_counter()
            with _plumbing.gathered_for_rollout(ac.actor_model):  # --fsdp: the whole actor (else nothing)
                llm = rollout_batch(collector_iter, ac, kl_transform, gae, P, M)
            t1 = time.perf_counter()
            # 2. PPO epochs x minibatches, approx-KL trust region, non-finite guard
            stats = ppo_update(llm, loss_module, ac, optimizers, cfg, gen, process_group=pg)
            t2 = time.perf_counter()
            # 3. KL coefficient update (on the all-rank KL: beta stays identical on every rank); the
            #    collector's policy shares the weights (in-process) or receives them (worker processes)
            roll = _rollout_stats(llm, kl_transform, pg)
            coeff = controller.update(roll.pop("seq_kl_t"), n_steps=int(roll["episodes"]))
            n_tok = roll.pop("tokens")
            if cfg.workers > 1:
                collector.update_policy_weights_()
            # 4. log: the metrics row, the collapse guard's warn_* / collapse columns and warning lines
            row = dict(iteration=it + 1, **roll, kl_coeff=float(coeff), rollout_s=t1 - t0, update_s=t2 - t1,
                       tokens_per_s=n_tok / max(t1 - t0, 1e-9), **stats)
            rows.append(_log_iteration(row, guard, d, out, bar, logger))
            # 5. checkpoint (and plot) every --save-every iterations and at the end
            if (it + 1) % cfg.save_every == 0 or it + 1 == cfg.iterations:
                _checkpoint(it + 1, cfg, d, stateful, _plumbing.rng_states(gen, env._generator, device), out)
        _plumbing.check_ranks_in_sync([ac.actor_model, ac.critic_model, ac.critic_head], pg)
        if pg is not None and d.main:
            print(f"parameters identical on all {d.world} ranks", file=sys.stderr, flush=True)
    finally:  # --- teardown
        _close_reporters(bar, logger)
        collector.shutdown()
        del loss_module, actor, critic
        ddp_wrappers.clear()  # free the DDP reducers now, while the process group is alive
    _finish(cfg, d, guard, out)
    return rows


def plot_metrics(csv_path: Path, png_path: Path) -> None:
    """Plot ``metrics.csv`` into ``png_path`` (:func:`ppo_objectives.monitor.plot_metrics`)."""
    _plot(read_metrics(csv_path), png_path, title=f"PPO run {Path(csv_path).parent.name}")


def _stateful(ac: ActorCritic, ref: TensorDictModule, optimizers, controller, guard: CollapseGuard) -> dict:
    """The objects whose ``state_dict()`` a checkpoint holds, under their names in it (loaded in this order)."""
    return dict(actor_model=ac.actor_model, critic_model=ac.critic_model, critic_head=ac.critic_head,
                reference=ref.module.model, actor_opt=optimizers[0], critic_opt=optimizers[1],
                kl_controller=controller, collapse_guard=guard)


def _resume(ckpt: dict, stateful: dict, d: _plumbing.Dist, out: Path) -> int:
    """``--resume``: every entry of ``stateful`` from ``ckpt``, and ``metrics.csv`` cut back to the
    checkpoint's iteration (the RNG states come later); returns that iteration."""
    start_it = _plumbing.restore_state(ckpt, stateful)
    if d.main:
        _plumbing.truncate_metrics(out / "metrics.csv", start_it, METRICS)
    return start_it


def _reporters(cfg: TrainConfig, d: _plumbing.Dist, start_it: int, out: Path) -> tuple:
    """Rank 0's progress bar (``None`` with ``--no-progress``) and ``--logger``'s TorchRL logger
    (``None`` without one; under ``out/logs``, named after ``out``, continuing after ``start_it``)."""
    if not d.main:
        return None, None
    logger = _plumbing.make_logger(cfg.logger, out, out.resolve().name, start_step=start_it)
    if cfg.no_progress:
        return None, logger
    from tqdm import tqdm

    return tqdm(total=cfg.iterations, initial=start_it, desc="ppo", dynamic_ncols=True), logger


def _close_reporters(bar, logger) -> None:
    if bar is not None:
        bar.close()
    _plumbing.close_logger(logger)


def _log_iteration(row: dict, guard: CollapseGuard, d: _plumbing.Dist, out: Path, bar, logger=None) -> dict:
    """Add the collapse guard's columns to ``row``; on rank 0 append it to ``metrics.csv``, send it to
    the ``--logger`` (step: the iteration) and print the guard's warnings; show it on the progress bar.
    Returns ``row``."""
    warnings_now = guard.update(row)
    if d.main:
        _plumbing.append_metrics(out / "metrics.csv", row, METRICS)
        _plumbing.log_row(logger, row, int(row["iteration"]), METRICS)
        for line in warnings_now:
            _plumbing.warn(line, bar)
    if bar is not None:
        flagged = "+".join(f for f in FLAGS if row[f"warn_{f}"])  # a collapse is always flagged
        warn = {"warn": "COLLAPSE" if row["collapse"] else flagged} if flagged else {}
        bar.set_postfix(reward=f"{row['reward']:.3f}", exact=f"{row['exact']:.2f}", kl=f"{row['kl_ref']:.4f}", **warn)
        bar.update(1)
    return row


def _checkpoint(iteration: int, cfg: TrainConfig, d: _plumbing.Dist, stateful: dict, rng: dict, out: Path) -> None:
    """Write ``checkpoint.pt`` (rank 0; a collective under torchrun) and redraw the plot: it follows the run."""
    state = _plumbing.checkpoint_state(iteration, asdict(cfg), d, stateful, rng)
    if d.main:
        _plumbing.save_checkpoint(out / "checkpoint.pt", state)
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
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**vars(args))
    t0 = time.perf_counter()
    rows = train(cfg)
    if rows and int(os.environ.get("RANK", 0)) == 0:
        k = min(5, len(rows))
        first = sum(r["reward"] for r in rows[:k]) / k
        last = sum(r["reward"] for r in rows[-k:]) / k
        wall = time.perf_counter() - t0
        collapsed = sum(int(r["collapse"]) for r in rows)
        spikes = sum(int(r["warn_kl_spike"]) for r in rows)
        print(
            f"reward (mean of {k} iterations): start {first:.3f} -> end {last:.3f}; "
            f"exact-match at the end {rows[-1]['exact']:.2f}; {len(rows)} iterations in "
            f"{wall:.0f}s ({len(rows) / wall:.2f} it/s); collapsed iterations {collapsed}, KL spikes {spikes}; "
            f"metrics in {Path(cfg.out) / 'metrics.csv'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

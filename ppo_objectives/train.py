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

Logged metrics (one row per iteration in ``DIR/metrics.csv``; plot ``DIR/training.png``)
------------------------------------------------------------------------------------

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

Checkpoints: ``DIR/checkpoint.pt`` (actor, critic, reference, both optimizers, KL
controller, collapse guard, RNG states of every rank, iteration; no learning-rate scheduler is
used), written atomically (temporary file +
``os.replace``) every ``--save-every`` iterations and at the end; ``--resume``
continues from it and appends to ``metrics.csv`` (dropping any rows logged after that
checkpoint by the interrupted run, which are logged again).
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule

from ppo_objectives import functional as F
from ppo_objectives.envs import DigitTask, TokenLMEnv, trajectories_to_llm_batch
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.monitor import FLAGS, CollapseGuard
from ppo_objectives.monitor import plot_metrics as _plot
from ppo_objectives.models import (
    ActorCritic,
    ResponseLogProbs,
    TinyCausalLM,
    TinyLMConfig,
    make_actor_critic,
)
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform
from ppo_objectives.value import MaskedGAE

__all__ = ["TrainConfig", "TrainingCollapseWarning", "build_parser", "main", "ppo_update", "rollout_batch", "train"]

METRICS = (
    "iteration", "reward", "exact", "response_len", "episodes", "kl_ref", "seq_kl", "kl_coeff",
    "loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy", "entropy", "kl_approx", "kl_approx_max",
    "kl_token_max", "clip_fraction", "max_ratio", "ESS", "value_clip_fraction", "explained_variance", "updates",
    "early_stopped", "rolled_back", "step_fraction", "skipped_steps", "grad_norm", "rollout_s", "update_s", "tokens_per_s",
    *(f"warn_{f}" for f in FLAGS), "collapse",
)  # fmt: skip


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
    preset: str = _f("nano", "TinyCausalLM size preset", choices=("pico", "nano", "micro"))
    shared_trunk: bool = _f(False, "critic value head on the actor's trunk instead of its own copy")
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
    threads: int = _f(1, "torch CPU threads for this run (0 = torch's default); one thread is fastest for "
                         "tiny models, and far faster when other processes share the cores")

    def __post_init__(self):
        DigitTask(self.task, self.digits)  # the task checks its own arguments
        for name in ("iterations", "num_envs", "workers", "ppo_epochs", "minibatches", "save_every",
                     "warmup_steps", "threads"):
            value = getattr(self, name)
            low = 0 if name in ("iterations", "warmup_steps", "threads") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"TrainConfig {name}={value!r} must be an int >= {low}")
        kl = self.early_stop_kl
        if isinstance(kl, bool) or not isinstance(kl, (int, float)) or not (math.isfinite(kl) and kl >= 0):
            raise ValueError(f"TrainConfig early_stop_kl={kl!r} must be a finite number >= 0 (0 turns the trust "
                             "region off)")
        for name in ("lr", "critic_lr", "warmup_lr", "clip_epsilon", "max_grad_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
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
# Plumbing: torch.distributed (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK)
# --------------------------------------------------------------------------- #


@dataclass
class _Dist:
    """Where this process stands: rank / world size, and the process group (``None`` alone)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: object = None
    owns_group: bool = False  # we initialised it, so we destroy it

    @property
    def main(self) -> bool:
        return self.rank == 0


def _launched_world_size() -> int:
    """``WORLD_SIZE`` of a torchrun launch, 0 when not launched by torchrun (or a process group exists)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {missing} are not: start data-parallel runs with "
            "torchrun --nproc_per_node N -m ppo_objectives.train ..., or unset WORLD_SIZE for one process"
        )
    return int(os.environ["WORLD_SIZE"])


def _init_distributed(device: str) -> _Dist:
    """Join the torchrun job (gloo on CPU, nccl on CUDA); one process without a launcher."""
    if not _launched_world_size():
        return _Dist()
    owns = not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    if owns:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")  # env:// rendezvous of torchrun
    return _Dist(dist.get_rank(), dist.get_world_size(), local_rank, dist.group.WORLD, owns)


def _all_reduce(x: torch.Tensor, group, op=None) -> torch.Tensor:
    """In-place all-reduce (sum by default) over ``group``; the identity without one."""
    if group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return x


def _wrap_ddp(ac: ActorCritic, d: _Dist, device: torch.device) -> tuple[TensorDictModule, TensorDictModule, list]:
    """Actor and critic TensorDict modules whose networks are ``DistributedDataParallel``.

    The loss calls them (never ``.module``), so every backward all-reduces the gradients.
    Construction broadcasts rank 0's parameters, so every rank starts identical.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = dict(device_ids=[device.index] if device.type == "cuda" else None)  # the models have no buffers
    actor_ddp, critic_ddp = DDP(ac.actor.module, **kw), DDP(ac.critic.module, **kw)
    actor = TensorDictModule(actor_ddp, in_keys=ac.actor.in_keys, out_keys=ac.actor.out_keys)
    critic = TensorDictModule(critic_ddp, in_keys=ac.critic.in_keys, out_keys=ac.critic.out_keys)
    return actor, critic, [actor_ddp, critic_ddp]


def _param_checksums(modules) -> torch.Tensor:
    """Per parameter ``(sum, sum of squares, position-weighted sum)`` in float64 ([3 * n_params])."""
    rows = []
    for m in modules:
        for p in m.parameters():
            x = p.detach().double().flatten()
            w = torch.arange(1, x.numel() + 1, device=x.device, dtype=torch.float64) / x.numel()
            rows.append(torch.stack([x.sum(), (x * x).sum(), (x * w).sum()]))
    return torch.cat(rows)


def _check_ranks_in_sync(modules, group) -> None:
    """Raise when the parameters differ between ranks (their checksums are compared exactly)."""
    if group is None:
        return
    c = _param_checksums(modules)
    hi, lo = _all_reduce(c.clone(), group, dist.ReduceOp.MAX), -_all_reduce(-c, group, dist.ReduceOp.MAX)
    if not torch.equal(hi, lo):
        first = int((hi != lo).nonzero()[0]) // 3
        raise RuntimeError(
            f"the parameters differ between the {dist.get_world_size(group)} ranks (first at parameter #{first}): "
            "the gradients were not synchronised -- call the DDP-wrapped networks, never their .module"
        )


# --------------------------------------------------------------------------- #
# Plumbing: building the pieces
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


def _frozen_reference(actor_model, prompt_len: int) -> TensorDictModule:
    ref = copy.deepcopy(actor_model).eval().requires_grad_(False)
    return TensorDictModule(
        ResponseLogProbs(ref, prompt_len, return_entropy=False), ["input_ids", "attention_mask"], ["log_prob"]
    )


# --------------------------------------------------------------------------- #
# The algorithm
# --------------------------------------------------------------------------- #


def rollout_batch(collector_iter, ac: ActorCritic, kl_transform: KLPenaltyTransform, gae: MaskedGAE, P: int, M: int,
                  *, process_group=None):
    """One collector batch -> the LLM-layout batch the loss trains on (advantages included).

    With a ``process_group`` (``gae`` built with ``average_gae=False``) the advantages are
    whitened with the mean and variance of the valid tokens of every rank's batch.
    """
    batch = next(collector_iter)  # [N, T] per-token steps
    device = next(ac.actor_model.parameters()).device
    llm = trajectories_to_llm_batch(batch.to(device), P, M)
    llm.set(("next", "reward"), llm.get("token_reward").clone())  # the env's per-token reward
    with torch.no_grad():
        ac.critic(llm)  # V_old: "state_value" [B, R]
        kl_transform(llm)  # "ref_log_prob", "kl_penalty"; reward -= beta * k1 on every token
        gae(llm)  # "advantage" (whitened over valid tokens), "value_target" = raw advantage + V_old
        if process_group is not None:  # whiten over the valid tokens of all ranks
            llm.set("advantage", F.masked_whiten(llm["advantage"], llm["mask"], process_group=process_group))
    return llm


_BACKTRACK = (0.5, 0.25, 0.125)  # fractions of a crossing step tried before it is undone (TRPO's backtracking)
_LOGGED = ("loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy", "entropy", "kl_approx", "clip_fraction",
           "max_ratio", "ESS", "value_clip_fraction", "explained_variance")  # fmt: skip


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
    rank = dist.get_rank(process_group) if process_group is not None else 0
    # minibatches per epoch: the same on every rank, none empty on the rank with the most rows
    most_rows = _all_reduce(torch.tensor(B, device=llm.device), process_group, dist.ReduceOp.MAX)
    n_minibatches = min(cfg.minibatches, int(most_rows))  # 0 for an empty batch: no step at all
    actor_params, critic_params = ac.actor_parameters(), ac.critic_parameters()
    all_params = list({id(p): p for p in actor_params + critic_params}.values())
    rollback = bool(cfg.early_stop_kl) and not cfg.no_rollback
    sums: dict[str, float] = {}
    steps, kl_max, kl_token_max, stopped, grad_norm, skipped = 0, 0.0, 0.0, False, 0.0, 0
    snapshot, last, first = None, None, None  # state before the last step, its logged numbers, the first forward's
    kept = 1.0  # fraction of the crossing step kept by the trust region (1: nothing crossed)

    def measure(out, mb):
        """(kl_approx, its largest per-token value, some rank's loss is not finite), over all ranks."""
        total = sum(v for k, v in out.items() if k.startswith("loss_"))
        n = mb["mask"].sum().to(torch.float32)
        signal = torch.stack([out["kl_approx"].detach() * n, n, (~torch.isfinite(total.detach())).float()])
        signal = _all_reduce(signal, process_group).tolist()  # host sync: the decisions need numbers
        tok = _all_reduce(out["kl_approx_token_max"].detach().float().clone(), process_group, dist.ReduceOp.MAX)
        kl = signal[0] / max(signal[1], 1.0) if process_group is not None else float(out["kl_approx"])
        return total, kl, float(tok), signal[2] > 0

    def measure_now(on):
        """(kl_approx, its largest per-token value) of the current policy on minibatch ``on``, no gradient."""
        with torch.no_grad():
            norm = F.loss_normalizer(on["mask"], loss_module.loss_agg_mode, process_group=process_group)
            _, kl, tok, _ = measure(loss_module(on, normalizer=norm), on)
        return kl, tok

    def pull_back_last_step(measured_on):
        """The last step crossed the limit: shorten it (1/2, 1/4, 1/8 of it, measured on
        ``measured_on``) until the policy is back inside, else undo it. Returns the fraction kept."""
        nonlocal steps, grad_norm, kl_token_max
        after = [p.detach().clone() for p in all_params]
        for frac in _BACKTRACK:
            with torch.no_grad():
                for p, a, b in zip(all_params, snapshot[0], after):
                    p.copy_(torch.lerp(a, b, frac))
            kl, tok = measure_now(measured_on)
            if kl <= cfg.early_stop_kl:
                kl_token_max = max(kl_token_max, tok)
                return frac  # AdamW keeps the moments of the gradient it saw
        _restore(snapshot, all_params, optimizers)  # parameters and AdamW state as before the step
        steps, grad_norm = steps - 1, grad_norm - last["grad_norm"]
        for k, v in last["sums"].items():
            sums[k] -= v
        return 0.0

    mb = None
    for epoch in range(cfg.ppo_epochs if n_minibatches else 0):
        perm = torch.randperm(B, generator=generator).to(llm.device)
        for j, idx in enumerate(torch.tensor_split(perm, n_minibatches)):
            mb = llm[idx]
            norm = F.loss_normalizer(mb["mask"], loss_module.loss_agg_mode, process_group=process_group)
            out = loss_module(mb, normalizer=norm)
            total, kl_now, kl_tok, nonfinite = measure(out, mb)
            kl_max, kl_token_max = max(kl_max, kl_now), max(kl_token_max, kl_tok)
            if first is None and not nonfinite:
                first = {k: float(out[k].detach()) for k in _LOGGED if k in out.keys()}
            if cfg.early_stop_kl and kl_now > cfg.early_stop_kl:
                stopped = True  # this minibatch's step is not taken, nor any later one
                if rollback and snapshot is not None:  # ... and the step that crossed the limit is taken back
                    kept = pull_back_last_step(mb)
                break
            if nonfinite:
                skipped += 1
                if not torch.isfinite(total.detach()):  # the rank(s) whose loss it is say so
                    _log_skip(rank, process_group, f"non-finite loss {_loss_terms(out)}", epoch, j)
                continue
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            total.backward()
            gn = torch.nn.utils.clip_grad_norm_(actor_params, cfg.max_grad_norm)
            gn_c = torch.nn.utils.clip_grad_norm_(
                critic_params if not ac.shared_trunk else all_params, cfg.max_grad_norm
            )
            bad = _all_reduce((~torch.isfinite(torch.stack([gn, gn_c]))).any().float(), process_group)
            if float(bad) > 0:  # clipping scaled by a NaN norm: the gradients are garbage, drop them
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                skipped += 1
                if rank == 0:  # the gradients are all-reduced: the same on every rank
                    why = f"non-finite gradient norm (actor {float(gn)}, critic {float(gn_c)})"
                    _log_skip(rank, process_group, why, epoch, j)
                continue
            if rollback:
                snapshot = _snapshot(all_params, optimizers, reuse=snapshot)
            for opt in optimizers:
                opt.step()
            steps += 1
            last = dict(grad_norm=float(gn), sums={k: float(out[k].detach()) for k in _LOGGED if k in out.keys()})
            grad_norm += last["grad_norm"]
            for k, v in last["sums"].items():
                sums[k] = sums.get(k, 0.0) + v
        if stopped:
            break
    if rollback and steps and not stopped:  # the policy after the last step: one more forward
        kl_now, kl_tok = measure_now(mb)
        kl_max, kl_token_max = max(kl_max, kl_now), max(kl_token_max, kl_tok)
        if kl_now > cfg.early_stop_kl:
            stopped = True
            kept = pull_back_last_step(mb)
    if not steps and first is not None:  # no step kept: the diagnostics of the unchanged policy
        sums = dict(first)
    keys = sorted(sums)
    if process_group is not None and keys:  # the mean of the ranks' diagnostics (every rank took the same steps)
        world = dist.get_world_size(process_group)
        reduced = _all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=llm.device),
                              process_group).tolist()
        sums = {k: v / world for k, v in zip(keys, reduced)}
    stats = {k: v / max(steps, 1) for k, v in sums.items()}
    stats.update(updates=steps, early_stopped=int(stopped), rolled_back=int(kept < 1.0), step_fraction=kept,
                 skipped_steps=skipped,
                 kl_approx_max=kl_max, kl_token_max=kl_token_max, grad_norm=grad_norm / max(steps, 1))
    return stats


def _snapshot(params, optimizers, reuse=None) -> tuple[list[torch.Tensor], list[dict], list[torch.Tensor]]:
    """Copies of the parameters and of every optimizer's per-parameter state (AdamW's moments, step).

    ``reuse``: an earlier snapshot of the same tensors, whose buffers are overwritten in place
    (one ``_foreach_copy_`` instead of a fresh allocation per tensor) when its layout still fits.
    """
    live = [(i, p, k, v) for i, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]
            if p in opt.state for k, v in opt.state[p].items()]  # fmt: skip
    if reuse is not None and len(reuse[2]) == len(live):
        saved_params, states, flat = reuse
        torch._foreach_copy_(saved_params + flat, [p.detach() for p in params] + [v for *_, v in live])
        return reuse
    saved_params = [p.detach().clone() for p in params]
    states = [{} for _ in optimizers]
    flat = []
    for i, p, k, v in live:
        copy_v = v.clone()
        states[i].setdefault(p, {})[k] = copy_v
        flat.append(copy_v)
    return saved_params, states, flat


def _restore(snapshot, params, optimizers) -> None:
    """Put back what :func:`_snapshot` copied (in place: DDP and the optimizers keep their tensors)."""
    saved_params, states, _ = snapshot
    with torch.no_grad():
        for p, saved in zip(params, saved_params):
            p.copy_(saved)
    for opt, saved in zip(optimizers, states):
        for g in opt.param_groups:
            for p in g["params"]:
                if p in saved:
                    opt.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved[p].items()}
                else:  # the snapshot was taken before this parameter's first step
                    opt.state.pop(p, None)


def _loss_terms(out: TensorDictBase) -> dict[str, float]:
    return {k: float(v.detach()) for k, v in out.items() if k.startswith("loss_")}


def _log_skip(rank: int, process_group, why: str, epoch: int, minibatch: int) -> None:
    where = f" on rank {rank}" if process_group is not None else ""
    print(f"ppo_update: {why}{where} at epoch {epoch} minibatch {minibatch}: optimizer step skipped "
          "(on every rank; counted in skipped_steps)", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# Checkpoints, metrics, plot (plumbing)
# --------------------------------------------------------------------------- #


def _save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash leaves the previous checkpoint intact


def _append_metrics(path: Path, row: dict) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRICS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in METRICS})


def _truncate_metrics(path: Path, iteration: int) -> None:
    """Drop the rows after ``iteration`` (logged after the last checkpoint by a run that then
    died): the resumed run logs those iterations again. Atomic, like the checkpoint."""
    if not path.exists():
        return
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    keep = [r for r in rows if r.get("iteration") and float(r["iteration"]) <= iteration]
    if len(keep) == len(rows):
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRICS, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: r.get(k, "") or "" for k in METRICS} for r in keep)
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict[str, float]]:
    with Path(path).open() as f:
        return [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def plot_metrics(csv_path: Path, png_path: Path) -> None:
    """Plot ``metrics.csv`` into ``png_path`` (:func:`ppo_objectives.monitor.plot_metrics`)."""
    _plot(read_metrics(csv_path), png_path, title=f"PPO run {Path(csv_path).parent.name}")


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
    if cfg.shared_trunk and _launched_world_size() > 1:
        raise ValueError(
            "--shared-trunk under torchrun: the actor and the critic would share parameters, and two "
            "DistributedDataParallel wrappers cannot own the same parameters; drop --shared-trunk for "
            "data-parallel runs (the critic then has its own copy of the trunk)"
        )
    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = _init_distributed(cfg.device)
    try:
        return _train(cfg, d)
    finally:
        torch.set_num_threads(threads_before)
        if d.owns_group:
            # _train has returned, so its DDP wrappers are freed while the group is alive (a DDP
            # Reducer destroyed at interpreter exit, after the group, can deadlock with gloo)
            import gc

            gc.collect()
            dist.barrier()
            dist.destroy_process_group()


def _train(cfg: TrainConfig, d: _Dist) -> list[dict[str, float]]:
    pg = d.group
    out = Path(cfg.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    ckpt_path, csv_path = out / "checkpoint.pt", out / "metrics.csv"
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    device = torch.device(f"cuda:{d.local_rank}" if cfg.device == "cuda" and pg is not None else cfg.device)
    rank_seed = cfg.seed + _RANK_SEED_STRIDE * d.rank  # = seed on rank 0 / without torchrun

    # --- task, env, networks (identical on every rank; DDP broadcasts rank 0's anyway) ---
    task = DigitTask(cfg.task, cfg.digits)
    env = _make_env(task, cfg.num_envs, str(device), rank_seed)
    P, M = env.prompt_len, env.max_new_tokens
    lm = TinyCausalLM(TinyLMConfig.preset(cfg.preset, vocab_size=task.vocab_size, block_size=env.seq_len)).to(device)
    start_it = 0
    ckpt = torch.load(ckpt_path, map_location=device, weights_only=False) if cfg.resume and ckpt_path.exists() else None
    if cfg.resume and ckpt is None and d.main:
        print(f"--resume: no checkpoint at {ckpt_path}; starting fresh", file=sys.stderr)
    if ckpt is not None and ckpt.get("world_size", 1) != d.world:
        raise ValueError(
            f"--resume: {ckpt_path} was written by a run with {ckpt.get('world_size', 1)} process(es), this one has "
            f"{d.world}; resume with the same torchrun --nproc_per_node (each rank restores its own RNG states)"
        )
    if ckpt is None:
        warm_start(lm, task, cfg.warmup_steps, cfg.warmup_lr, gen, device)
    ac = make_actor_critic(lm, P, shared_trunk=cfg.shared_trunk, entropy_grad=cfg.entropy_coef > 0)
    # the loss calls the actor and the critic through DDP under torchrun (gradients all-reduced)
    actor, critic, ddp_wrappers = _wrap_ddp(ac, d, device) if pg is not None else (ac.actor, ac.critic, [])
    ref = _frozen_reference(ac.actor_model, P)

    # --- TorchRL components ---------------------------------------------------
    controller = (
        AdaptiveKLController(cfg.kl_coef, target=cfg.kl_target, horizon=10_000)
        if cfg.adaptive_kl
        else FixedKLController(cfg.kl_coef)
    ).to(device)
    kl_transform = KLPenaltyTransform(ref, coeff=controller, estimator="k1")
    guard = CollapseGuard()  # flags collapsing iterations (ppo_objectives.monitor)
    # one process: GAE whitens its batch; torchrun: rollout_batch whitens over all ranks' tokens
    gae = MaskedGAE(gamma=cfg.gamma, lmbda=cfg.lam, average_gae=pg is None, device=device)
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
    actor_opt = torch.optim.AdamW(ac.actor_parameters(), lr=cfg.lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(ac.critic_parameters(), lr=cfg.critic_lr, weight_decay=0.0)

    if ckpt is not None:  # --resume
        ac.actor_model.load_state_dict(ckpt["actor_model"])
        ac.critic_model.load_state_dict(ckpt["critic_model"])
        ac.critic_head.load_state_dict(ckpt["critic_head"])
        ref.module.model.load_state_dict(ckpt["reference"])
        actor_opt.load_state_dict(ckpt["actor_opt"])
        critic_opt.load_state_dict(ckpt["critic_opt"])
        controller.load_state_dict(ckpt["kl_controller"])
        if "collapse_guard" in ckpt:
            guard.load_state_dict(ckpt["collapse_guard"])
        start_it = int(ckpt["iteration"])
        if d.main:
            _truncate_metrics(csv_path, start_it)
    elif pg is not None:
        torch.manual_seed(rank_seed)  # after the identical build: each rank samples its own responses

    collector = make_collector(cfg, task, ac.policy, env, rank=d.rank)
    collector_iter = iter(collector)
    if ckpt is not None:  # RNG states last: building the collector resets the env (draws prompts)
        rng = ckpt["rank_rng"][d.rank] if "rank_rng" in ckpt else ckpt
        torch.set_rng_state(rng["torch_rng"])
        gen.set_state(rng["update_rng"])
        env._generator.set_state(rng["env_rng"])
        if rng.get("cuda_rng") is not None and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda_rng"], device)

    def rng_states():
        return dict(
            torch_rng=torch.get_rng_state(), update_rng=gen.get_state(), env_rng=env._generator.get_state(),
            cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        )  # fmt: skip

    def state(iteration):
        rank_rng = [rng_states()]
        if pg is not None:  # a collective: every rank calls state() at the same iterations
            rank_rng = [None] * d.world
            dist.all_gather_object(rank_rng, rng_states(), group=pg)
        return dict(
            iteration=iteration, config=asdict(cfg), world_size=d.world,
            actor_model=ac.actor_model.state_dict(), critic_model=ac.critic_model.state_dict(),
            critic_head=ac.critic_head.state_dict(), reference=ref.module.model.state_dict(),
            actor_opt=actor_opt.state_dict(), critic_opt=critic_opt.state_dict(),
            kl_controller=controller.state_dict(), collapse_guard=guard.state_dict(), **rank_rng[0],
            rank_rng=rank_rng,
        )  # fmt: skip

    rows: list[dict[str, float]] = []
    bar = None
    if not cfg.no_progress and d.main:
        from tqdm import tqdm

        bar = tqdm(total=cfg.iterations, initial=start_it, desc="ppo", dynamic_ncols=True)
    try:
        for it in range(start_it, cfg.iterations):
            # 1. rollout through the collector, then KL penalty and GAE on the LLM layout
            t0 = time.perf_counter()
            llm = rollout_batch(collector_iter, ac, kl_transform, gae, P, M, process_group=pg)
            t1 = time.perf_counter()
            # 2. PPO epochs x minibatches, approx-KL early stop, non-finite guard
            stats = ppo_update(llm, loss_module, ac, (actor_opt, critic_opt), cfg, gen, process_group=pg)
            t2 = time.perf_counter()
            # 3. KL coefficient update (on the all-rank KL: beta stays identical on every rank); the
            #    collector's policy shares the weights (in-process) or receives them (worker processes)
            roll = _rollout_stats(llm, kl_transform, pg)
            coeff = controller.update(roll.pop("seq_kl_t"), n_steps=int(roll["episodes"]))
            n_tok = roll.pop("tokens")
            if cfg.workers > 1:
                collector.update_policy_weights_()
            row = dict(
                iteration=it + 1,
                **roll,
                kl_coeff=float(coeff),
                rollout_s=t1 - t0,
                update_s=t2 - t1,
                tokens_per_s=n_tok / max(t1 - t0, 1e-9),
                **stats,
            )
            # 4. the collapse guard: warn_* / collapse columns, a warning line per event
            warnings_now = guard.update(row)
            rows.append(row)
            if d.main:
                _append_metrics(csv_path, row)
                for line in warnings_now:
                    _warn(line, bar)
            if bar is not None:
                flagged = "+".join(f for f in FLAGS if row[f"warn_{f}"])  # a collapse is always flagged
                warn = {"warn": "COLLAPSE" if row["collapse"] else flagged} if flagged else {}
                bar.set_postfix(reward=f"{row['reward']:.3f}", exact=f"{row['exact']:.2f}", kl=f"{row['kl_ref']:.4f}",
                                **warn)
                bar.update(1)
            if (it + 1) % cfg.save_every == 0 or it + 1 == cfg.iterations:
                st = state(it + 1)
                if d.main:
                    _save_checkpoint(ckpt_path, st)
                    if not cfg.no_plot:  # the plot follows the run, not only its end
                        plot_metrics(csv_path, out / "training.png")
        _check_ranks_in_sync([ac.actor_model, ac.critic_model, ac.critic_head], pg)
        if pg is not None and d.main:
            print(f"parameters identical on all {d.world} ranks", file=sys.stderr, flush=True)
    finally:
        if bar is not None:
            bar.close()
        collector.shutdown()
        del loss_module, actor, critic
        ddp_wrappers.clear()  # free the DDP reducers now, while the process group is alive
    if d.main and not cfg.no_plot and csv_path.exists():
        plot_metrics(csv_path, out / "training.png")
    if d.main and guard.collapses:
        import warnings

        warnings.warn(f"the PPO run in {out} collapsed: {guard.summary()}; see the warn_* and collapse columns "
                      f"of {csv_path} and {out / 'training.png'}", TrainingCollapseWarning, stacklevel=2)
    return rows


class TrainingCollapseWarning(RuntimeWarning):
    """Raised (as a warning) at the end of a run that went through a collapse (:class:`CollapseGuard`)."""


def _warn(line: str, bar) -> None:
    """A warning line on stderr that does not break the progress bar."""
    text = f"WARNING ppo: {line}"
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)


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
    total = _all_reduce(v, pg).tolist()
    episodes = max(total[3], 1.0)
    seq_kl = total[5] / episodes
    return dict(
        reward=total[0] / episodes, exact=total[1] / episodes, response_len=total[2] / episodes,
        episodes=int(total[3]), kl_ref=total[4] / dist.get_world_size(pg), seq_kl=seq_kl,
        seq_kl_t=torch.tensor(seq_kl, dtype=torch.float32, device=kl_transform.last_seq_kl.device),
        tokens=int(total[2]),
    )  # fmt: skip


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

"""Everything one run is built from: :func:`build` returns a :class:`Run`.

Tasks, the env and its TorchRL collector, the networks (a TinyCausalLM preset or a
``--model`` checkpoint, a value head, a frozen reference), DDP / FSDP2 wrappers,
the PPO modules (:class:`~ppo_objectives.transforms.KLPenaltyTransform`, the
advantage estimator, :class:`~ppo_objectives.loss.TokenPPOLoss`, the optimizers),
and, with ``--resume``, the state of the run read back from its checkpoint.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict.nn import TensorDictModule

from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.lora import AdaptersOff, add_lora
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.critic_trunk import freeze_critic_trunk
from ppo_objectives.llm.readouts import ActorCritic, frozen_reference, make_actor_critic
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.train import text_job
from ppo_objectives.train.checkpoints import load_checkpoint, remove_run_files, restore_rng_states, restore_state
from ppo_objectives.train.config import TrainConfig
from ppo_objectives.train.digit import DigitTask, warm_start
from ppo_objectives.train.distributed import Dist, fsdp_stateful, gathered_for_rollout, shard_fsdp, wrap_ddp
from ppo_objectives.train.loggers import columns, truncate_metrics
from ppo_objectives.train.monitor import CollapseGuard, CriticWarmup
from ppo_objectives.train.pretrained import load_causal_lm, load_policy_model
from ppo_objectives.train.ray_collector import make_ray_collector
from ppo_objectives.train.rollout import RETURN_KEY
from ppo_objectives.train.text import TextTask
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform
from ppo_objectives.value.critic_free import GroupAdvantage, ReinforcePlusPlus
from ppo_objectives.value.gae import MaskedGAE

# --------------------------------------------------------------------------- #
# The pieces: env and collector, warm start, frozen reference, PPO modules
# --------------------------------------------------------------------------- #


_RANK_SEED_STRIDE = 1_000_003  # rank r rolls out with seed + r * stride (torch sampling and env prompts)


def _make_tasks(cfg: TrainConfig) -> tuple:
    """``(task, held-out task or None)``: the toy ``DigitTask`` (no held-out set), or the text task of
    ``--task`` with the tokenizer of ``--model`` (:func:`ppo_objectives.train.text_job.build_text_tasks`)."""
    if cfg.recipe == "toy":
        return DigitTask(cfg.task, cfg.digits), None
    return text_job.build_text_tasks(cfg)


def _make_env(task, num_envs: int, device: str, seed: int, *, vocab_size: int | None = None,
              group_size: int = 1) -> TokenLMEnv:
    """The env of ``task``; a text task's vocabulary is the model's (``vocab_size``), which may exceed its
    tokenizer's (padded embeddings), so that every token the policy can sample is a valid action. ``group_size``
    rows share each prompt drawn at a full reset (``--group-size``)."""
    vocab = vocab_size if isinstance(task, TextTask) else None
    return TokenLMEnv.from_task(task, num_envs=num_envs, device=device, seed=seed, vocab_size=vocab,
                                group_size=group_size)


class _EnvFactory:
    """Picklable env constructor for collector workers (processes or Ray actors). In the worker it runs in, it
    also seeds torch's generator (the policy's sampling stream) and uses one thread, so that a worker's rollouts
    depend only on the seed and the weights it is sent: runs with workers are reproducible, and the same on
    worker processes and on Ray actors."""

    def __init__(self, task, num_envs, device, seed, group_size=1):
        self.args, self.group_size = (task, num_envs, device, seed), group_size
        self.parent = os.getpid()

    def __call__(self):
        if os.getpid() != self.parent:  # never reseed the learner's process
            torch.manual_seed(self.args[3])
            torch.set_num_threads(1)
        return _make_env(*self.args, group_size=self.group_size)


def make_collector(cfg: TrainConfig, task: DigitTask, policy, env: TokenLMEnv, *, rank: int = 0, world: int = 1):
    """The run's TorchRL collector: ``Collector`` in this process (``--workers 1``), or over ``--workers`` worker
    processes (``MultiSyncCollector``) or Ray actors (``--collector-backend ray``:
    :func:`~ppo_objectives.train.ray_collector.make_ray_collector`).

    ``frames_per_batch = N * env.max_steps`` (``M``, or fewer for a multi-turn task whose turns cannot fill ``M``:
    the environment's tokens take no step) with ``reset_at_each_iter=True``: every row starts a
    fresh prompt at the start of each batch, so each row finishes at least one response.
    Workers tag every frame with the ``"policy_version"`` of their weights, and have received the
    learner's weights once (version 1) when this returns.
    """
    from torchrl.collectors import Collector, MultiSyncCollector

    M = env.max_steps
    if not cfg.remote_rollouts:
        return Collector(
            env,
            policy,
            frames_per_batch=cfg.num_envs * M,
            total_frames=-1,
            reset_at_each_iter=True,
            auto_register_policy_transforms=False,
        )
    per_worker, factories = _worker_envs(cfg, task, rank)
    frames = per_worker * cfg.workers * M
    if cfg.collector_backend == "ray":
        return make_ray_collector(factories, policy, frames, address=cfg.ray_address, world=world)
    collector = MultiSyncCollector(
        factories,
        policy,
        frames_per_batch=frames,
        total_frames=-1,
        reset_at_each_iter=True,
        auto_register_policy_transforms=False,
        cat_results="stack",
        track_policy_version=True,
    )
    collector.update_policy_weights_()  # version 1, as on Ray
    return collector


def _worker_envs(cfg: TrainConfig, task: DigitTask, rank: int) -> tuple[int, list[_EnvFactory]]:
    """``(rows per worker, env factories)``: one factory per worker, each with ``--num-envs / --workers`` rows and
    its own prompt seed."""
    per_worker = max(1, cfg.num_envs // cfg.workers)
    if per_worker % cfg.group_size:
        raise ValueError(f"--num-envs {cfg.num_envs} over --workers {cfg.workers} gives {per_worker} rows per worker, "
                         f"not a multiple of --group-size {cfg.group_size}")
    seeds = [cfg.seed + _RANK_SEED_STRIDE * rank + 1000 * (i + 1) for i in range(cfg.workers)]
    return per_worker, [_EnvFactory(task, per_worker, "cpu", seed, cfg.group_size) for seed in seeds]


def _policy_lm(cfg: TrainConfig, task, device) -> torch.nn.Module:
    """The actor's causal LM: the ``--preset`` TinyCausalLM; for a toy task the checkpoint ``--model DIR``
    behind the task's tokens (:func:`~ppo_objectives.train.pretrained.load_policy_model`); for a text task the
    checkpoint with its whole vocabulary (:func:`~ppo_objectives.train.pretrained.load_causal_lm`). Under
    ``--dtype bfloat16`` its forward runs under autocast (``autocast_dtype``; the weights stay float32)."""
    autocast = _AUTOCAST_DTYPE[cfg.dtype]
    if cfg.recipe == "pretrained":
        lm = load_causal_lm(cfg.model, autocast_dtype=autocast, grad_checkpointing=cfg.grad_checkpointing)
        return (add_lora(lm, cfg.lora_rank) if cfg.lora_rank else lm).to(device)
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
    saved = ckpt["config"]["model"]
    if saved != cfg.model:
        raise ValueError(
            f"--resume: {out / 'checkpoint.pt'} was written by a run with --model {saved!r} but this run has --model "
            f"{cfg.model!r}: its networks are another model's; resume with the same --model (or a new --out)"
        )


_AUTOCAST_DTYPE = {"float32": None, "bfloat16": torch.bfloat16}  # --dtype -> autocast_dtype of actor and critic


_REFERENCE_DTYPE = {"float32": None, "bfloat16": torch.bfloat16}  # --reference-dtype -> the reference's weights


def _ppo_modules(cfg: TrainConfig, actor: TensorDictModule, critic: TensorDictModule, ref: TensorDictModule | None,
                 device: torch.device, process_group) -> tuple:
    """The TorchRL modules of the iteration: KL controller, ``KLPenaltyTransform`` (``None`` without a reference),
    ``MaskedGAE``, ``TokenPPOLoss`` (calling ``actor`` and ``critic``, DDP-wrapped under torchrun)."""
    controller = (
        AdaptiveKLController(cfg.kl_reward_coeff, target=cfg.kl_target, horizon=10_000)
        if cfg.adaptive_kl
        else FixedKLController(cfg.kl_reward_coeff)
    ).to(device)
    kl_transform = None if ref is None else KLPenaltyTransform(ref, coeff=controller, estimator="k1")
    gae = _advantage_estimator(cfg, device, process_group)
    loss_module = TokenPPOLoss(
        actor,
        None if cfg.critic_free else critic,
        clip_epsilon=cfg.clip_epsilon,
        critic_coeff=cfg.critic_coeff,
        clip_value=cfg.clip_value,
        kl_to_ref_coeff=cfg.kl_to_ref_coeff,
        entropy_coeff=cfg.entropy_coeff,
        entropy_bonus=True,  # the actor writes entropies: log them even without a bonus
        aggregation=cfg.aggregation,
        functional=False,
        device=device,
    )
    loss_module.make_value_estimator(gae)
    return controller, kl_transform, gae, loss_module



def _advantage_estimator(cfg: TrainConfig, device: torch.device, process_group):
    """``--advantage``: ``MaskedGAE`` (whitened over the valid tokens of every rank's batch), or a critic-free one."""
    if cfg.advantage == "gae":
        return MaskedGAE(gamma=cfg.gamma, lmbda=cfg.lmbda, policy_lmbda=cfg.policy_lmbda, length_alpha=cfg.length_alpha,
                         length_floor=cfg.length_floor,
                         average_gae=cfg.average_gae, holes=cfg.holes, level=cfg.gae_level, device=device,
                         process_group=process_group)
    if cfg.advantage == "reinforce++":
        return ReinforcePlusPlus(gamma=cfg.gamma, whiten=cfg.average_gae, device=device, process_group=process_group)
    group = GroupAdvantage(cfg.advantage, device=device)
    group.set_keys(score=RETURN_KEY)
    return group


@dataclass
class Run:
    """Everything one training run holds, built by :func:`build` (identical on every rank). A callback of
    :func:`~ppo_objectives.train.train` receives it as ``run``; reading is safe, changing is at the callback's risk.

    Attributes:
        cfg: the run's :class:`~ppo_objectives.train.TrainConfig`, its recipe defaults filled in.
        d: the process group: ``d.rank``, ``d.world``, ``d.main`` (rank 0), ``d.group`` (``None`` without torchrun).
        out: the output directory (``--out``) as a ``Path``: ``metrics.csv``, ``checkpoint.pt``, ``hf/``, ...
        device: the ``torch.device`` of the networks and the env.
        task: the training task: a :class:`~ppo_objectives.train.digit.DigitTask` or a
            :class:`~ppo_objectives.train.text.TextTask` (its ``tokenizer``, ``examples``, ``reward``).
        env: the :class:`~ppo_objectives.llm.env.TokenLMEnv` the collector steps (``env.env_turns_cut``, ...).
        ac: the :class:`~ppo_objectives.llm.readouts.ActorCritic`: ``ac.actor_model`` (the language model being
            trained), ``ac.actor`` / ``ac.critic`` (the TensorDict modules the loss calls), ``ac.policy`` (the
            env's policy), ``ac.critic_head``.
        ref: the frozen reference module of the KL terms; ``None`` when no KL term reads it.
        ddp_wrappers: the ``DistributedDataParallel`` wrappers under torchrun (empty otherwise).
        controller: the in-reward KL coefficient's controller (fixed, or adaptive with ``--adaptive-kl``).
        kl_transform: the :class:`~ppo_objectives.transforms.KLPenaltyTransform`; ``None`` without a reference.
        gae: the advantage estimator: :class:`~ppo_objectives.value.gae.MaskedGAE`, or with a critic-free
            ``--advantage`` a :class:`~ppo_objectives.value.critic_free.GroupAdvantage` /
            :class:`~ppo_objectives.value.critic_free.ReinforcePlusPlus`.
        loss_module: the :class:`~ppo_objectives.loss.TokenPPOLoss` of the update.
        optimizers: ``(actor AdamW, critic AdamW)``; a callback may change their learning rates.
        guard: the :class:`~ppo_objectives.train.monitor.CollapseGuard` that writes the ``warn_*`` columns.
        warmup: the :class:`~ppo_objectives.train.monitor.CriticWarmup`: which iterations train the critic alone.
        stateful: what ``checkpoint.pt`` holds, by name (``state_dict()`` of each).
        gen: the update's generator (minibatch permutations).
        start_it: the iteration this process started from (the checkpoint's with ``--resume``, else 0).
        collector: TorchRL's collector of the rollouts; ``collector_iter`` its iterator.
        evaluation: text tasks: the held-out evaluation (called as ``evaluation(model, iteration, what)``); else
            ``None``.
        next_eval_s: ``--eval-minutes``: the training time of the next evaluation.
        input_sha256: ``--task jsonl``: the input files' hashes as read (checkpointed; ``--resume`` checks them).
    """

    cfg: TrainConfig
    d: Dist
    out: Path
    device: torch.device
    task: object  # a DigitTask or a TextTask
    env: TokenLMEnv
    ac: ActorCritic
    ref: TensorDictModule | None  # None when no KL term needs it (TrainConfig.uses_reference)
    ddp_wrappers: list
    controller: object
    kl_transform: KLPenaltyTransform | None
    gae: MaskedGAE | GroupAdvantage | ReinforcePlusPlus
    loss_module: TokenPPOLoss
    optimizers: tuple
    guard: CollapseGuard
    warmup: CriticWarmup
    stateful: dict
    gen: torch.Generator
    start_it: int = 0
    collector: object = None
    collector_iter: object = None
    evaluation: object = None  # text tasks: text_job.HeldOutEvaluation
    next_eval_s: float = 0.0  # --eval-minutes: the training time of the next evaluation
    input_sha256: dict = field(default_factory=dict)  # --task jsonl: the input files' hashes, as read (checkpointed)

    @property
    def P(self) -> int:
        return self.env.prompt_len

    @property
    def M(self) -> int:
        return self.env.max_new_tokens

    def policy_version(self, it: int) -> int | None:
        """The version of the weights the rollout of iteration ``it`` must be sampled with: workers receive the
        learner's weights when built (1) and after every iteration since; ``None`` in-process (the collector's
        policy is the learner's)."""
        return 1 + it - self.start_it if self.cfg.remote_rollouts else None


def build(cfg: TrainConfig, d: Dist) -> Run:
    """Setup: seeds, task, env, networks, TorchRL modules, optimizers, the collector; ``--resume``."""
    pg, out = d.group, Path(cfg.out)
    if d.main:
        if cfg.overwrite:  # a new run where another one was: its files go, nothing of it is appended to
            remove_run_files(out)
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)  # the warm start's data, then the minibatch permutations
    device = torch.device(f"cuda:{d.local_rank}" if cfg.device == "cuda" and pg is not None else cfg.device)
    rank_seed = cfg.seed + _RANK_SEED_STRIDE * d.rank  # = seed on rank 0 / without torchrun
    task, held_out = _make_tasks(cfg)  # a DigitTask, or a TextTask and its held-out prompts
    input_sha256 = text_job.input_sha256(cfg)  # what --resume holds the files against
    lm = _policy_lm(cfg, task, device)  # a TinyCausalLM preset, or --model DIR (toy: behind the task's tokens)
    env = _make_env(task, cfg.num_envs, str(device), rank_seed, vocab_size=lm.vocab_size, group_size=cfg.group_size)
    ckpt = load_checkpoint(out / "checkpoint.pt", d, device) if cfg.resume else None
    if ckpt is None:
        warm_start(lm, task, cfg.warmup_steps, cfg.warmup_lr, gen, device)  # text tasks: 0 steps
    else:
        _check_resumed_model(ckpt, cfg, out)  # the checkpoint holds the networks built here
    ac, ref, actor, critic, ddp_wrappers = _networks(cfg, d, task, lm, env.prompt_len, device)
    # --- TorchRL modules, optimizers, the collapse guard (train/monitor.py); --resume
    controller, kl_transform, gae, loss_module = _ppo_modules(cfg, actor, critic, ref, device, pg)
    optimizers = (torch.optim.AdamW(ac.actor_parameters(), lr=cfg.lr, weight_decay=0.0),
                  torch.optim.AdamW(ac.critic_parameters(), lr=cfg.critic_lr, weight_decay=0.0))
    guard = CollapseGuard(stall_patience=cfg.stall_patience)
    warmup = CriticWarmup(cfg.critic_warmup, cfg.rare_reward_warmup, guard.reward_floor)
    stateful = _stateful(ac, ref, optimizers, controller, guard, warmup)  # what a checkpoint holds, by name
    if cfg.fsdp:  # full state dicts, gathered on rank 0 and scattered back by --resume
        stateful = fsdp_stateful(stateful, ac)
    run = Run(cfg, d, out, device, task, env, ac, ref, ddp_wrappers, controller, kl_transform, gae, loss_module,
               optimizers, guard, warmup, stateful, gen, input_sha256=input_sha256)
    if cfg.recipe == "pretrained":  # held-out accuracy; its sampling generator is checkpointed
        run.evaluation = stateful["evaluation"] = text_job.HeldOutEvaluation(held_out, cfg, out, d.main)
        run.next_eval_s = 60.0 * cfg.eval_minutes
    run.start_it = _resume(ckpt, stateful, d, out, columns(cfg)) if ckpt is not None else 0
    if ckpt is not None and d.main:
        print(f"resumed at iteration {run.start_it} of {cfg.iterations} from {out / 'checkpoint.pt'}", file=sys.stderr,
              flush=True)
    if ckpt is None and pg is not None:
        torch.manual_seed(rank_seed)  # after the identical build: each rank samples its own responses
    with gathered_for_rollout(ac.actor_model):  # TorchRL's collector runs the policy once as it is built
        run.collector = make_collector(cfg, task, ac.policy, env, rank=d.rank, world=d.world)
    run.collector_iter = iter(run.collector)
    if ckpt is not None:  # RNG states last: building the collector resets the env (draws prompts)
        restore_rng_states(ckpt, d.rank, gen, env._generator, device)
    return run


def _networks(cfg: TrainConfig, d: Dist, task, lm: torch.nn.Module, P: int, device) -> tuple:
    """``(ActorCritic, frozen reference, actor, critic, DDP wrappers)``: the loss calls ``actor`` and ``critic``,
    through DDP under torchrun (gradients all-reduced), or with ``--fsdp`` their models sharded in place."""
    critic_lm = None if cfg.shared_trunk else _loaded_copy(cfg, task, lm, device)  # None: a deepcopy of lm
    ac = make_actor_critic(lm, P, shared_trunk=cfg.shared_trunk, critic_model=critic_lm,
                           entropy_grad=cfg.entropy_coeff > 0, temperature=cfg.temperature)  # policy and actor at T
    if not ac.shared_trunk:
        freeze_critic_trunk(ac.critic_model, cfg.critic_train)  # --critic-train: what of its own trunk trains
    ref = _reference(cfg, task, ac, P, device)
    if cfg.fsdp:
        actor, critic, ddp_wrappers = shard_fsdp(ac, d, device)
    elif d.group is not None:
        actor, critic, ddp_wrappers = wrap_ddp(ac, d, device)
    else:
        actor, critic, ddp_wrappers = ac.actor, ac.critic, []
    return ac, ref, actor, critic, ddp_wrappers


def _reference(cfg: TrainConfig, task, ac: ActorCritic, P: int, device) -> TensorDictModule | None:
    """The frozen reference (the actor as it starts), or ``None`` when no KL term reads it. With ``--lora-rank`` it
    is the actor's own model with its adapters off: the base weights never move, so no copy is needed."""
    if not cfg.uses_reference:
        return None
    if cfg.lora_rank:
        return frozen_reference(AdaptersOff(ac.actor_model), P, copy_model=False, temperature=cfg.temperature)
    ref_lm = _loaded_copy(cfg, task, ac.actor_model, device)  # --model: loaded again; else a copy of the actor
    return frozen_reference(ac.actor_model if ref_lm is None else ref_lm, P, dtype=_REFERENCE_DTYPE[cfg.reference_dtype],
                            copy_model=ref_lm is None,  # made before any sharding: the reference stays whole
                            temperature=cfg.temperature)  # the KL penalty compares both at --temperature


def _stateful(ac: ActorCritic, ref: TensorDictModule | None, optimizers, controller, guard: CollapseGuard,
              warmup: CriticWarmup) -> dict:
    """The objects whose ``state_dict()`` a checkpoint holds, under their names in it (loaded in this order)."""
    reference = {} if ref is None else dict(reference=ref.module.model)
    return dict(actor_model=ac.actor_model, critic_model=ac.critic_model, critic_head=ac.critic_head,
                **reference, actor_opt=optimizers[0], critic_opt=optimizers[1],
                kl_controller=controller, collapse_guard=guard, critic_warmup=warmup)


def _resume(ckpt: dict, stateful: dict, d: Dist, out: Path, columns: tuple) -> int:
    """``--resume``: every entry of ``stateful`` from ``ckpt``, and ``metrics.csv`` cut back to the
    checkpoint's iteration (the RNG states come later); returns that iteration."""
    start_it = restore_state(ckpt, stateful)
    if d.main:
        truncate_metrics(out / "metrics.csv", start_it, columns)
    return start_it

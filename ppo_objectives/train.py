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
        stop all remaining steps once kl_approx > early_stop_kl
    KL controller update (fixed by default, --adaptive-kl for Ziegler et al.)

The default job teaches a ~0.1M-parameter TinyCausalLM to reverse 3 digits
(``"123<"`` -> ``"321."``, :class:`~ppo_objectives.envs.DigitTask`), from a
short supervised warm start that teaches only the *format* (three digits then
EOS, digits random), so what the reward measures -- the right digits -- is
learned by PPO alone. It runs on CPU in a few minutes.

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
    Its largest value over the minibatch steps (what ``--early-stop-kl`` compares).
``clip_fraction``
    Fraction of valid tokens whose ratio is outside ``[1-eps, 1+eps]`` (mean over steps).
``ratio_max`` / ``ess``
    Largest importance ratio; normalised effective sample size of the ratios (1 = on-policy).
``value_clip_fraction``
    Fraction of tokens where the clipped value branch is the active one.
``explained_variance``
    ``1 - Var(G - V) / Var(G)`` of the returns by the critic (1 = perfect, <= 0 = useless).
``updates`` / ``early_stopped``
    Optimizer steps taken this iteration, and 1 when the approx-KL early stop fired.
``grad_norm``
    Mean pre-clip gradient norm of the actor (clipped to ``--max-grad-norm``).
``rollout_s`` / ``update_s`` / ``tokens_per_s``
    Wall time of the rollout and of the PPO updates; generated tokens per rollout second.

Checkpoints: ``DIR/checkpoint.pt`` (actor, critic, reference, both optimizers, KL
controller, RNG states, iteration), written atomically (temporary file +
``os.replace``) every ``--save-every`` iterations and at the end; ``--resume``
continues from it and appends to ``metrics.csv``.
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
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule

from ppo_objectives.envs import DigitTask, TokenLMEnv, trajectories_to_llm_batch
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.models import (
    ActorCritic,
    ResponseLogProbs,
    TinyCausalLM,
    TinyLMConfig,
    make_actor_critic,
)
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform
from ppo_objectives.value import MaskedGAE

__all__ = ["TrainConfig", "build_parser", "main", "ppo_update", "rollout_batch", "train"]

METRICS = (
    "iteration", "reward", "exact", "response_len", "episodes", "kl_ref", "seq_kl", "kl_coeff",
    "loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy", "entropy", "kl_approx", "kl_approx_max",
    "clip_fraction", "ratio_max", "ess", "value_clip_fraction", "explained_variance", "updates",
    "early_stopped", "grad_norm", "rollout_s", "update_s", "tokens_per_s",
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
    num_envs: int = _f(64, "parallel env rows N (responses per rollout ~ N)")
    workers: int = _f(1, "collector processes: 1 = Collector in-process, >1 = MultiSyncCollector")
    warmup_steps: int = _f(150, "supervised warm-start steps teaching the answer format (random digits)")
    warmup_lr: float = _f(3e-3, "warm-start learning rate")
    lr: float = _f(1e-3, "actor AdamW learning rate")
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
    early_stop_kl: float = _f(0.25, "stop the PPO epochs when kl_approx exceeds it (MiniMind 0.25)")
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
        for name in ("lr", "critic_lr", "warmup_lr", "clip_epsilon", "max_grad_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"TrainConfig {name}={value!r} must be a finite number > 0")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ppo_objectives.train",
        description="Token-level PPO with a critic on a toy digit task (TorchRL collector -> "
        "KLPenaltyTransform -> MaskedGAE -> TokenPPOLoss). Metrics are explained in the module docstring: "
        "python -c 'import ppo_objectives.train as t; help(t)'",
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
# Plumbing: building the pieces
# --------------------------------------------------------------------------- #


def _make_env(task: DigitTask, num_envs: int, device: str, seed: int) -> TokenLMEnv:
    return TokenLMEnv.from_task(task, num_envs=num_envs, device=device, seed=seed)


class _EnvFactory:
    """Picklable env constructor for collector worker processes."""

    def __init__(self, task, num_envs, device, seed):
        self.args = (task, num_envs, device, seed)

    def __call__(self):
        return _make_env(*self.args)


def make_collector(cfg: TrainConfig, task: DigitTask, policy, env: TokenLMEnv):
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
    factories = [_EnvFactory(task, per_worker, "cpu", cfg.seed + 1000 * (i + 1)) for i in range(cfg.workers)]
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


def rollout_batch(collector_iter, ac: ActorCritic, kl_transform: KLPenaltyTransform, gae: MaskedGAE, P: int, M: int):
    """One collector batch -> the LLM-layout batch the loss trains on (advantages included)."""
    batch = next(collector_iter)  # [N, T] per-token steps
    device = next(ac.actor_model.parameters()).device
    llm = trajectories_to_llm_batch(batch.to(device), P, M)
    llm.set(("next", "reward"), llm.get("token_reward").clone())  # the env's per-token reward
    with torch.no_grad():
        ac.critic(llm)  # V_old: "state_value" [B, R]
        kl_transform(llm)  # "ref_log_prob", "kl_penalty"; reward -= beta * k1 on every token
        gae(llm)  # "advantage" (whitened over valid tokens), "value_target" = raw advantage + V_old
    return llm


def ppo_update(llm: TensorDictBase, loss_module: TokenPPOLoss, ac: ActorCritic, optimizers, cfg: TrainConfig,
               generator: torch.Generator) -> dict[str, float]:
    """MiniMind's update: ``ppo_epochs`` x ``minibatches`` AdamW steps on the summed ``loss_*``,
    grad-norm clipped; the first step whose ``kl_approx`` exceeds ``early_stop_kl`` is not applied
    and ends the update (no further optimizer steps this iteration)."""
    B = llm.batch_size[0]
    mb_size = max(1, math.ceil(B / cfg.minibatches))
    actor_params, critic_params = ac.actor_parameters(), ac.critic_parameters()
    all_params = list({id(p): p for p in actor_params + critic_params}.values())
    sums: dict[str, float] = {}
    steps, kl_max, stopped, grad_norm = 0, 0.0, False, 0.0
    for _epoch in range(cfg.ppo_epochs):
        perm = torch.randperm(B, generator=generator).to(llm.device)
        for start in range(0, B, mb_size):
            mb = llm[perm[start : start + mb_size]]
            out = loss_module(mb)
            kl_now = float(out["kl_approx"])  # host sync: the early-stop decision needs the number
            kl_max = max(kl_max, kl_now)
            if cfg.early_stop_kl and kl_now > cfg.early_stop_kl:
                stopped = True  # this minibatch's step is not taken, nor any later one
                break
            total = sum(v for k, v in out.items() if k.startswith("loss_"))
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            total.backward()
            gn = torch.nn.utils.clip_grad_norm_(actor_params, cfg.max_grad_norm)
            torch.nn.utils.clip_grad_norm_(critic_params if not ac.shared_trunk else all_params, cfg.max_grad_norm)
            for opt in optimizers:
                opt.step()
            steps += 1
            grad_norm += float(gn)
            for k in ("loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy", "entropy", "kl_approx",
                      "clip_fraction", "ratio_max", "ESS", "value_clip_fraction", "explained_variance"):
                if k in out.keys():
                    sums[k] = sums.get(k, 0.0) + float(out[k].detach())
        if stopped:
            break
    stats = {k.lower(): v / max(steps, 1) for k, v in sums.items()}
    stats.update(updates=steps, early_stopped=int(stopped), kl_approx_max=kl_max, grad_norm=grad_norm / max(steps, 1))
    return stats


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


def read_metrics(path: Path) -> list[dict[str, float]]:
    with Path(path).open() as f:
        return [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def plot_metrics(csv_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(csv_path)
    it = [r["iteration"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        ("reward", ["reward", "exact"]),
        ("KL", ["kl_ref", "kl_approx"]),
        ("losses", ["loss_objective", "loss_critic"]),
        ("policy / critic", ["entropy", "explained_variance", "clip_fraction"]),
    ]
    for ax, (title, keys) in zip(axes.flat, panels):
        for k in keys:
            ax.plot(it, [r.get(k, float("nan")) for r in rows], label=k)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, png_path)


# --------------------------------------------------------------------------- #
# The loop
# --------------------------------------------------------------------------- #


def train(cfg: TrainConfig) -> list[dict[str, float]]:
    """Run PPO as configured; returns the metrics rows of the iterations run now."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was given but torch.cuda.is_available() is False; use --device cpu")
    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg)
    finally:
        torch.set_num_threads(threads_before)


def _train(cfg: TrainConfig) -> list[dict[str, float]]:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path, csv_path = out / "checkpoint.pt", out / "metrics.csv"
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    device = torch.device(cfg.device)

    # --- task, env, networks -------------------------------------------------
    task = DigitTask(cfg.task, cfg.digits)
    env = _make_env(task, cfg.num_envs, cfg.device, cfg.seed)
    P, M = env.prompt_len, env.max_new_tokens
    lm = TinyCausalLM(TinyLMConfig.preset(cfg.preset, vocab_size=task.vocab_size, block_size=env.seq_len)).to(device)
    start_it = 0
    ckpt = torch.load(ckpt_path, map_location=device, weights_only=False) if cfg.resume and ckpt_path.exists() else None
    if cfg.resume and ckpt is None:
        print(f"--resume: no checkpoint at {ckpt_path}; starting fresh", file=sys.stderr)
    if ckpt is None:
        warm_start(lm, task, cfg.warmup_steps, cfg.warmup_lr, gen, device)
    ac = make_actor_critic(lm, P, shared_trunk=cfg.shared_trunk, entropy_grad=cfg.entropy_coef > 0)
    ref = _frozen_reference(ac.actor_model, P)

    # --- TorchRL components ---------------------------------------------------
    controller = (
        AdaptiveKLController(cfg.kl_coef, target=cfg.kl_target, horizon=10_000)
        if cfg.adaptive_kl
        else FixedKLController(cfg.kl_coef)
    ).to(device)
    kl_transform = KLPenaltyTransform(ref, coeff=controller, estimator="k1")
    gae = MaskedGAE(gamma=cfg.gamma, lmbda=cfg.lam, average_gae=True, device=device)
    loss_module = TokenPPOLoss(
        ac.actor,
        ac.critic,
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
        start_it = int(ckpt["iteration"])

    collector = make_collector(cfg, task, ac.policy, env)
    collector_iter = iter(collector)
    if ckpt is not None:  # RNG states last: building the collector resets the env (draws prompts)
        torch.set_rng_state(ckpt["torch_rng"])
        gen.set_state(ckpt["update_rng"])
        env._generator.set_state(ckpt["env_rng"])

    def state(iteration):
        return dict(
            iteration=iteration, config=asdict(cfg),
            actor_model=ac.actor_model.state_dict(), critic_model=ac.critic_model.state_dict(),
            critic_head=ac.critic_head.state_dict(), reference=ref.module.model.state_dict(),
            actor_opt=actor_opt.state_dict(), critic_opt=critic_opt.state_dict(),
            kl_controller=controller.state_dict(), torch_rng=torch.get_rng_state(),
            update_rng=gen.get_state(), env_rng=env._generator.get_state(),
        )  # fmt: skip

    rows: list[dict[str, float]] = []
    bar = None
    if not cfg.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.iterations, initial=start_it, desc="ppo", dynamic_ncols=True)
    try:
        for it in range(start_it, cfg.iterations):
            # 1. rollout through the collector, then KL penalty and GAE on the LLM layout
            t0 = time.perf_counter()
            llm = rollout_batch(collector_iter, ac, kl_transform, gae, P, M)
            t1 = time.perf_counter()
            # 2. PPO epochs x minibatches, approx-KL early stop
            stats = ppo_update(llm, loss_module, ac, (actor_opt, critic_opt), cfg, gen)
            t2 = time.perf_counter()
            # 3. KL coefficient update; the collector's policy shares the weights (in-process) or
            #    receives them (worker processes)
            coeff = controller.update(kl_transform.last_seq_kl, n_steps=llm.batch_size[0])
            if cfg.workers > 1:
                collector.update_policy_weights_()
            n_tok = int(llm["mask"].sum())
            row = dict(
                iteration=it + 1,
                reward=float(llm["score"].mean()),
                exact=float((llm["score"] >= 1.0).float().mean()),
                response_len=n_tok / max(llm.batch_size[0], 1),
                episodes=llm.batch_size[0],
                kl_ref=float(kl_transform.last_kl),
                seq_kl=float(kl_transform.last_seq_kl),
                kl_coeff=float(coeff),
                rollout_s=t1 - t0,
                update_s=t2 - t1,
                tokens_per_s=n_tok / max(t1 - t0, 1e-9),
                **stats,
            )
            rows.append(row)
            _append_metrics(csv_path, row)
            if bar is not None:
                bar.set_postfix(reward=f"{row['reward']:.3f}", exact=f"{row['exact']:.2f}", kl=f"{row['kl_ref']:.4f}")
                bar.update(1)
            if (it + 1) % cfg.save_every == 0 or it + 1 == cfg.iterations:
                _save_checkpoint(ckpt_path, state(it + 1))
    finally:
        if bar is not None:
            bar.close()
        collector.shutdown()
    if not cfg.no_plot and csv_path.exists():
        plot_metrics(csv_path, out / "training.png")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**vars(args))
    t0 = time.perf_counter()
    rows = train(cfg)
    if rows:
        k = min(5, len(rows))
        first = sum(r["reward"] for r in rows[:k]) / k
        last = sum(r["reward"] for r in rows[-k:]) / k
        print(
            f"reward (mean of {k} iterations): start {first:.3f} -> end {last:.3f}; "
            f"exact-match at the end {rows[-1]['exact']:.2f}; {len(rows)} iterations in "
            f"{time.perf_counter() - t0:.0f}s; metrics in {Path(cfg.out) / 'metrics.csv'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

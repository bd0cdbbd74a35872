"""One PPO update: minibatch epochs of :class:`~ppo_objectives.loss.TokenPPOLoss` inside an approx-KL trust region.

:func:`ppo_update` runs ``ppo_epochs`` passes of ``minibatches`` optimizer steps
(gradient clipping, AdamW for the actor and the critic). Once the approx-KL
crosses ``early_stop_kl`` the step that crossed it is undone, a fraction of it is
tried (TRPO's backtracking), and the update stops; a step whose loss or gradient
norm is not finite is skipped. The trust region's undo is an optimizer snapshot
(``snapshot``, ``restore``): the parameters and AdamW's state before the step.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

from ppo_objectives import functional as F
from ppo_objectives.llm.readouts import ActorCritic
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.train.config import TrainConfig
from ppo_objectives.train.distributed import all_reduce, clip_grad_norm_


def ppo_update(llm: TensorDictBase, loss_module: TokenPPOLoss, ac: ActorCritic, optimizers, cfg: TrainConfig,
               generator: torch.Generator, *, process_group=None, critic_only: bool = False) -> dict[str, float]:
    """MiniMind's update: ``ppo_epochs`` x ``minibatches`` AdamW steps on the summed ``loss_*``,
    grad-norm clipped, with an approx-KL trust region that holds.

    Every minibatch's forward measures ``kl_approx`` (the k2 KL of the current policy to the
    rollout policy) before its step. Once it exceeds ``early_stop_kl`` the update ends, and
    (with ``cfg.rollback``) the step that took it there is **pulled back**, as TRPO's
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

    ``critic_only`` (the warm-up iterations, :class:`~ppo_objectives.train.monitor.CriticWarmup`): the same
    minibatch steps on ``loss_critic`` alone, stepping the critic's optimizer only; the actor's parameters do
    not move (a shared trunk included), so there is no trust region to hold.

    ``cfg.micro_batches`` ``M > 1`` (gradient accumulation): each minibatch's forward and backward run on
    ``M`` row slices in turn, their gradients summed into the minibatch's one step, so the step is the same
    (up to float rounding) with a slice's activations in memory instead of the minibatch's.

    ``cfg.critic_steps`` ``K > 1``: after the policy's passes, ``K - 1`` more passes of critic-only
    steps over the same batch (fresh minibatch orders), so the critic takes ``K`` steps for each of
    the policy's; ``critic_updates`` counts the critic's steps and ``loss_critic_after`` is the
    value loss of the last pass (the other numbers are the policy pass's).
    """
    n_minibatches = minibatch_count(llm.batch_size[0], cfg, llm.device, process_group)
    u = TrustRegionUpdate(loss_module, ac, optimizers, cfg, process_group, critic_only=critic_only)
    mb = _passes(u, llm, n_minibatches, generator)
    if u.rollback and u.steps and not u.stopped:  # the policy after the last step: one more forward
        u.check_last_step(mb)
    stats = u.stats(llm.device)
    critic_steps = u.steps
    for _ in range(cfg.critic_steps - 1 if n_minibatches else 0):  # --critic-steps: critic-only passes
        c = TrustRegionUpdate(loss_module, ac, optimizers, cfg, process_group, critic_only=True)
        _passes(c, llm, n_minibatches, generator)
        critic_steps += c.steps
        stats["loss_critic_after"] = c.stats(llm.device)["loss_critic"]
    stats["critic_updates"] = critic_steps if loss_module._has_critic else 0
    return stats


def _passes(u: TrustRegionUpdate, llm: TensorDictBase, n_minibatches: int, generator: torch.Generator):
    """``ppo_epochs`` passes of ``n_minibatches`` steps of ``u`` over ``llm``, until its trust region stops it;
    returns the last minibatch (``None`` when there was none)."""
    mb = None
    for epoch in range(u.cfg.ppo_epochs if n_minibatches else 0):
        perm = torch.randperm(llm.batch_size[0], generator=generator).to(llm.device)
        for j, idx in enumerate(torch.tensor_split(perm, n_minibatches)):
            mb = llm[idx]
            u.minibatch(mb, epoch, j)
            if u.stopped:  # this minibatch's step is not taken, nor any later one; the crossing one is pulled back
                return mb
    return mb


def minibatch_count(rows: int, cfg: TrainConfig, device: torch.device, process_group) -> int:
    """Minibatches per epoch: the same on every rank, none empty on the rank with the most rows (0 for an empty
    batch: no step at all)."""
    most_rows = all_reduce(torch.tensor(rows, device=device), process_group, dist.ReduceOp.MAX)
    return min(cfg.minibatches, int(most_rows))


_BACKTRACK = (0.5, 0.25, 0.125)  # fractions of a crossing step tried before it is undone (TRPO's backtracking)


_LOGGED = ("loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy", "entropy", "kl_approx", "clip_fraction",
           "max_ratio", "ESS", "value_clip_fraction", "explained_variance")  # fmt: skip


class TrustRegionUpdate:
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
        self.rollback = bool(cfg.early_stop_kl) and cfg.rollback and not critic_only
        self.sums: dict[str, float] = {}
        self.steps, self.grad_norm, self.skipped, self.stopped = 0, 0.0, 0, False  # steps kept, their summed norm
        self.kl_max, self.kl_token_max = 0.0, 0.0  # the largest kl_approx and per-token value measured
        self.snapshot = None  # parameters and optimizer states before the last step
        self.last: dict | None = None  # the last step's logged numbers
        self.first: dict | None = None  # the first finite forward's
        self.kept = 1.0  # fraction of the crossing step kept by the trust region (1: nothing crossed)

    def minibatch(self, mb: TensorDictBase, epoch: int, j: int) -> float:
        """One minibatch: the forward, the trust-region check (past ``early_stop_kl``: stop, and the crossing step
        is pulled back), the non-finite guards, the clipped step. Returns its ``kl_approx`` over all ranks.

        Under ``--micro-batches M`` the slices' gradients are summed first (:meth:`loss` with ``backward``), then
        the same decisions are taken on the whole minibatch's numbers; a minibatch that crosses the trust region
        or is not finite drops its summed gradients."""
        accumulated = self.cfg.micro_batches > 1
        if accumulated:
            self.zero_grad()
        out = self.loss(mb, backward=accumulated)  # TokenPPOLoss: loss_objective, loss_critic, ..., kl_approx
        total, kl_now, nonfinite = self.measure(out, mb)  # over all ranks
        if self.cfg.early_stop_kl and kl_now > self.cfg.early_stop_kl:
            self.zero_grad()
            self.stop(mb)
        elif nonfinite:
            self.zero_grad()
            self.skip_non_finite_loss(out, total, epoch, j)
        else:  # clipped; None when a norm is not finite (step skipped)
            grad_norm = self.clip(epoch, j) if accumulated else self.backward(total, epoch, j)
            if grad_norm is not None:
                self.step(out, grad_norm)
        return kl_now

    def loss(self, mb: TensorDictBase, *, backward: bool = False) -> TensorDictBase:
        """The loss terms on minibatch ``mb``, divided by its valid-token count over all ranks.

        Under ``--micro-batches M`` (``cfg.micro_batches > 1``): the forward runs on ``M`` row slices in turn,
        each divided by the whole minibatch's count, so that their terms and gradients add up to the
        minibatch's; with ``backward`` each slice's finite loss is backpropagated (gradients accumulate) before
        the next slice's forward, so only one slice's activations are held at a time. Returns the merged,
        detached terms (:func:`merge_micro_batches`)."""
        norm = F.loss_normalizer(mb["mask"], self.loss_module.aggregation, process_group=self.pg)
        if self.cfg.micro_batches == 1:
            return self.loss_module(mb, normalizer=norm)
        parts = []
        rows = torch.arange(mb.batch_size[0], device=mb.device)
        for idx in torch.tensor_split(rows, self.cfg.micro_batches):
            if not idx.numel():  # fewer rows than micro-batches
                continue
            part = mb[idx]
            out = self.loss_module(part, normalizer=norm)
            total = self.total(out)
            if backward and torch.isfinite(total.detach()):  # a non-finite slice: the whole step is skipped
                total.backward()
            parts.append((out.detach(), part["mask"].sum()))
        return merge_micro_batches(parts)

    def total(self, out: TensorDictBase) -> torch.Tensor:
        """What a step minimises: the summed ``loss_*`` terms (``loss_critic`` alone for a critic-only step)."""
        return out["loss_critic"] if self.critic_only else sum(v for k, v in out.items() if k.startswith("loss_"))

    def _measure(self, out: TensorDictBase, mb: TensorDictBase):
        """(summed loss, kl_approx, its largest per-token value, some rank's loss is not finite), over all ranks."""
        total = self.total(out)
        n = mb["mask"].sum().to(torch.float32)
        signal = torch.stack([out["kl_approx"].detach() * n, n, (~torch.isfinite(total.detach())).float()])
        signal = all_reduce(signal, self.pg).tolist()  # host sync: the decisions need numbers
        tok = all_reduce(out["kl_approx_token_max"].detach().float().clone(), self.pg, dist.ReduceOp.MAX)
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
            log_skip(self.rank, self.pg, f"non-finite loss {_loss_terms(out)}", epoch, j)

    def backward(self, total: torch.Tensor, epoch: int, j: int) -> torch.Tensor | None:
        """Gradients of ``total``, clipped (:meth:`clip`)."""
        self.zero_grad()
        total.backward()
        return self.clip(epoch, j)

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def clip(self, epoch: int, j: int) -> torch.Tensor | None:
        """Clip the gradients; the actor's pre-clip norm, or ``None`` (gradients dropped, the step skipped)
        when a pre-clip norm is not finite on some rank."""
        if self.critic_only:  # a shared trunk's gradient from the value loss: not applied, not counted
            for p in self.actor_params:
                p.grad = None
        gn = clip_grad_norm_(self.actor_params, self.cfg.max_grad_norm)  # sharded gradients too
        gn_c = clip_grad_norm_(self.clipped_critic_params, self.cfg.max_grad_norm)
        bad = all_reduce((~torch.isfinite(torch.stack([gn, gn_c]))).any().float(), self.pg)
        if float(bad) > 0:  # clipping scaled by a NaN norm: the gradients are garbage, drop them
            self.zero_grad()
            self.skipped += 1
            if self.rank == 0:  # the gradients are all-reduced: the same on every rank
                why = f"non-finite gradient norm (actor {float(gn)}, critic {float(gn_c)})"
                log_skip(self.rank, self.pg, why, epoch, j)
            return None
        return gn

    def step(self, out: TensorDictBase, grad_norm: torch.Tensor) -> None:
        """One optimizer step of every optimizer (snapshotted first when it may have to be undone)."""
        if self.rollback:
            self.snapshot = snapshot(self.all_params, self.optimizers, reuse=self.snapshot)
        for opt in self.optimizers:
            opt.step()
        self.steps += 1
        self.last = dict(grad_norm=float(grad_norm), sums=_logged(out))
        self.grad_norm += self.last["grad_norm"]
        for k, v in self.last["sums"].items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def stop(self, measured_on: TensorDictBase) -> None:
        """The trust region is crossed: no more steps, and the last one is pulled back (with ``rollback``)."""
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
        restore(self.snapshot, self.all_params, self.optimizers)  # parameters and AdamW state as before
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
            reduced = all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device),
                                           self.pg).tolist()
            sums = {k: v / world for k, v in zip(keys, reduced)}
        steps = max(self.steps, 1)
        stats = {k: v / steps for k, v in sums.items()}
        stats.update({k: math.nan for k in _LOGGED if k not in stats})  # e.g. no critic: no critic terms
        stats.update(updates=self.steps, early_stopped=int(self.stopped), rolled_back=int(self.kept < 1.0),
                     step_fraction=self.kept, skipped_steps=self.skipped, kl_approx_max=self.kl_max,
                     kl_token_max=self.kl_token_max, grad_norm=self.grad_norm / steps)
        return stats


def merge_micro_batches(parts: list[tuple[TensorDictBase, torch.Tensor]]) -> TensorDictBase:
    """One minibatch's loss output from its micro-batches' ``(terms, valid-token count)``, each slice's terms
    divided by the whole minibatch's normaliser: the ``loss_*`` terms and ``kl_ref`` are summed, the maxima
    (``max_ratio``, ``kl_approx_token_max``, ...) take the largest, and every other diagnostic (a mean over
    the slice's valid tokens) is weighted by the slice's valid tokens. So the masked means equal the
    minibatch's own; ``ESS`` and ``explained_variance``, which are not means over tokens, become the
    token-weighted means of the slices' values.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> a = TensorDict({"loss_objective": torch.tensor(0.5), "max_ratio": torch.tensor(1.2),
        ...                 "clip_fraction": torch.tensor(0.0)})
        >>> b = TensorDict({"loss_objective": torch.tensor(0.25), "max_ratio": torch.tensor(1.1),
        ...                 "clip_fraction": torch.tensor(0.3)})
        >>> m = merge_micro_batches([(a, torch.tensor(1)), (b, torch.tensor(2))])
        >>> [round(float(m[k]), 3) for k in ("loss_objective", "max_ratio", "clip_fraction")]
        [0.75, 1.2, 0.2]
    """
    weights = torch.stack([n for _, n in parts]).to(torch.float32)
    merged = {}
    for key in parts[0][0].keys():
        values = torch.stack([out[key].to(torch.float32) for out, _ in parts])
        if key.startswith("loss_") or key == "kl_ref":
            merged[key] = values.sum()
        elif "max" in key.split("_"):
            merged[key] = values.max()
        else:  # a slice without valid tokens has weight 0 (and may hold NaN)
            weighted = torch.where(weights > 0, values * weights, values.new_zeros(()))
            merged[key] = weighted.sum() / weights.sum().clamp_min(1.0)
    return TensorDict(merged)


def _logged(out: TensorDictBase) -> dict[str, float]:
    return {k: float(out[k].detach()) for k in _LOGGED if k in out.keys()}


def _loss_terms(out: TensorDictBase) -> dict[str, float]:
    return {k: float(v.detach()) for k, v in out.items() if k.startswith("loss_")}


# --------------------------------------------------------------------------- #
# Optimizer snapshots (the trust region's undo) and the non-finite guard's line
# --------------------------------------------------------------------------- #


def snapshot(params, optimizers, reuse=None) -> tuple[list[torch.Tensor], list[dict], list[torch.Tensor]]:
    """Copies of the parameters and of every optimizer's per-parameter state (AdamW's moments, step).
    FSDP-sharded tensors (``DTensor``) are copied shard by shard: each rank keeps a copy of its shards.

    ``reuse``: an earlier snapshot of the same tensors, whose buffers are overwritten in place
    (one ``_foreach_copy_`` instead of a fresh allocation per tensor) when its layout still fits.
    """
    live = [(i, p, k, v) for i, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]
            if p in opt.state for k, v in opt.state[p].items()]  # fmt: skip
    if reuse is not None and len(reuse[2]) == len(live):
        saved_params, states, flat = reuse
        sources = [p.detach() for p in params] + [v for *_, v in live]
        torch._foreach_copy_(_locals(saved_params + flat), _locals(sources))
        return reuse
    saved_params = [p.detach().clone() for p in params]
    states = [{} for _ in optimizers]
    flat = []
    for i, p, k, v in live:
        copy_v = v.clone()
        states[i].setdefault(p, {})[k] = copy_v
        flat.append(copy_v)
    return saved_params, states, flat


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor, or the local shard of a ``DTensor`` (FSDP's parameters and AdamW moments): in-place
    copies between tensors of the same sharding run on the shards."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def restore(snap, params, optimizers) -> None:
    """Put back what :func:`snapshot` copied (in place: DDP and the optimizers keep their tensors)."""
    saved_params, states, _ = snap
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


def log_skip(rank: int, process_group, why: str, epoch: int, minibatch: int) -> None:
    """The stderr line of a minibatch step skipped by the non-finite guard."""
    where = f" on rank {rank}" if process_group is not None else ""
    print(f"ppo_update: {why}{where} at epoch {epoch} minibatch {minibatch}: optimizer step skipped "
          "(on every rank; counted in skipped_steps)", file=sys.stderr, flush=True)

"""What the training job needs around the PPO iteration (internal).

:mod:`ppo_objectives.train` reads as the algorithm; this module holds the rest, so
that it can be read (and tested) on its own:

* **torch.distributed** -- where this process stands in a ``torchrun`` job
  (:class:`Dist`, :func:`init_distributed`, :func:`close_distributed`), the
  all-reduce that is the identity without a process group, the
  ``DistributedDataParallel`` wrappers of the actor and the critic, and the exact
  check that every rank ends with the same parameters;
* **FSDP2** (``--fsdp``) -- the actor's and the critic's models sharded with
  ``torch.distributed.fsdp.fully_shard`` (each transformer block, then the root), the
  whole actor gathered for the rollout, gradient clipping over sharded gradients, and
  checkpoint entries that gather (and scatter back) full model and optimizer state dicts;
* **checkpoints** -- the state of a run (networks, optimizers, KL controller,
  collapse guard, the RNG states of every rank), written atomically and read back
  for ``--resume``;
* **RNG state** capture and restore (torch, CUDA, the update generator, the env's
  prompt generator);
* **the metrics CSV** (``metrics.csv``: append a row, drop the rows an interrupted
  run logged after its last checkpoint, read it back);
* **TorchRL loggers** (``--logger``: a ``torchrl.record.loggers`` logger writing
  under ``OUT/logs``, offline, that receives every row of ``metrics.csv``);
* **optimizer snapshots** -- copies of the parameters and AdamW's state, put back
  in place when the trust region undoes a step;
* **host memory** -- the C heap's free pages handed back to the system once per iteration;
* **stderr lines** that do not break the progress bar.

It is internal: the names are plain so :mod:`ppo_objectives.train` can import them,
but they are not part of the public API (``read_metrics`` is, through
:mod:`ppo_objectives.train`). The layering is in ``docs/design.md``.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import ctypes.util
import functools
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from tensordict.nn import TensorDictModule

from ppo_objectives.readouts import ActorCritic

__all__ = [
    "Dist",
    "all_reduce",
    "append_metrics",
    "LOGGERS",
    "check_logger",
    "check_fsdp",
    "check_ranks_in_sync",
    "checkpoint_state",
    "clip_grad_norm_",
    "close_distributed",
    "close_logger",
    "fsdp_stateful",
    "gathered_for_rollout",
    "init_distributed",
    "launched_world_size",
    "load_checkpoint",
    "log_row",
    "log_skip",
    "make_logger",
    "param_checksums",
    "read_metrics",
    "release_host_memory",
    "restore",
    "restore_rng_states",
    "restore_state",
    "rng_states",
    "save_checkpoint",
    "shard_fsdp",
    "snapshot",
    "transformer_blocks",
    "truncate_metrics",
    "untied_lm_head",
    "warn",
    "wrap_ddp",
]


# --------------------------------------------------------------------------- #
# torch.distributed (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK)
# --------------------------------------------------------------------------- #


@dataclass
class Dist:
    """Where this process stands: rank / world size, and the process group (``None`` alone)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: object = None
    owns_group: bool = False  # we initialised it, so we destroy it

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched_world_size() -> int:
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


def init_distributed(device: str) -> Dist:
    """Join the torchrun job (gloo on CPU, nccl on CUDA); one process without a launcher."""
    if not launched_world_size():
        return Dist()
    owns = not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    if owns:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")  # env:// rendezvous of torchrun
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dist.group.WORLD, owns)


def close_distributed(d: Dist) -> None:
    """Destroy the process group :func:`init_distributed` created (nothing when it did not create one).

    Call it once the DDP wrappers are unreferenced: they are collected first, while the
    group is alive (a DDP Reducer destroyed at interpreter exit, after the group, can
    deadlock with gloo).
    """
    if d.owns_group:
        import gc

        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, group, op=None) -> torch.Tensor:
    """In-place all-reduce (sum by default) over ``group``; the identity without one."""
    if group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return x


def untied_lm_head(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds an LM head with a parameter of its own (not tied to another parameter, such
    as the input embedding): a critic trunk reads hidden states only, so such a head takes no gradient.

    The heads are the ``lm_head`` submodules of ``model`` and of every module in it (``TinyCausalLM``,
    a Hugging Face ``*ForCausalLM``, ``HFCausalLMAdapter``); a tied parameter is one that
    ``model.named_parameters(remove_duplicate=False)`` yields more than once.
    """
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    heads = {id(h): h for m in model.modules() if isinstance(h := getattr(m, "lm_head", None), torch.nn.Module)}
    return any(uses.get(id(p)) == 1 for h in heads.values() for p in h.parameters())


def wrap_ddp(ac: ActorCritic, d: Dist, device: torch.device) -> tuple[TensorDictModule, TensorDictModule, list]:
    """Actor and critic TensorDict modules whose networks are ``DistributedDataParallel``.

    The loss calls them (never ``.module``), so every backward all-reduces the gradients.
    Construction broadcasts rank 0's parameters, so every rank starts identical. The critic's
    wrapper finds unused parameters when its trunk's LM head is not tied to the input embeddings
    (:func:`untied_lm_head`; e.g. an untied Hugging Face checkpoint under ``--model``): that head
    takes no gradient. Otherwise every parameter is used and DDP skips that search.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = dict(device_ids=[device.index] if device.type == "cuda" else None)
    actor_ddp = DDP(ac.actor.module, **kw)
    critic_ddp = DDP(ac.critic.module, find_unused_parameters=untied_lm_head(ac.critic_model), **kw)
    actor = TensorDictModule(actor_ddp, in_keys=ac.actor.in_keys, out_keys=ac.actor.out_keys)
    critic = TensorDictModule(critic_ddp, in_keys=ac.critic.in_keys, out_keys=ac.critic.out_keys)
    return actor, critic, [actor_ddp, critic_ddp]


def param_checksums(modules: Iterable[torch.nn.Module]) -> torch.Tensor:
    """Per parameter ``(sum, sum of squares, position-weighted sum)`` in float64 ([3 * n_params]).

    A parameter sharded by FSDP (a ``DTensor``) is summed as the full tensor its shards make
    (``full_tensor()``, an all-gather: under FSDP every rank calls this together)."""
    from torch.distributed.tensor import DTensor

    rows = []
    for m in modules:
        for p in m.parameters():
            x = p.detach()
            x = (x.full_tensor() if isinstance(x, DTensor) else x).double().flatten()
            w = torch.arange(1, x.numel() + 1, device=x.device, dtype=torch.float64) / x.numel()
            rows.append(torch.stack([x.sum(), (x * x).sum(), (x * w).sum()]))
    return torch.cat(rows)


def check_ranks_in_sync(modules: Iterable[torch.nn.Module], group) -> None:
    """Raise when the parameters differ between ranks (their checksums are compared exactly).

    Under DDP every rank holds every parameter, and a rank that missed a gradient all-reduce drifts.
    Under FSDP each element of a sharded parameter lives on one rank only, so the gathered
    parameters are equal by construction; what can still drift is every unsharded parameter.
    """
    if group is None:
        return
    c = param_checksums(modules)
    hi, lo = all_reduce(c.clone(), group, dist.ReduceOp.MAX), -all_reduce(-c, group, dist.ReduceOp.MAX)
    if not torch.equal(hi, lo):
        first = int((hi != lo).nonzero()[0]) // 3
        raise RuntimeError(
            f"the parameters differ between the {dist.get_world_size(group)} ranks (first at parameter #{first}): "
            "the gradients were not synchronised -- call the DDP-wrapped networks, never their .module"
        )


# --------------------------------------------------------------------------- #
# FSDP2 (--fsdp): sharded actor and critic under torchrun
# --------------------------------------------------------------------------- #


def check_fsdp(fsdp: bool, *, shared_trunk: bool, workers: int) -> None:
    """Raise when ``--fsdp`` cannot run as configured (before any process group or model exists).

    ``--fsdp`` needs a ``torchrun`` launch (it shards over the job's ranks), a critic with its own
    trunk (a shared trunk would be sharded twice), and the in-process collector (worker processes
    would get a shard each, not the policy). Nothing to check without ``--fsdp``.

    Example:
        >>> check_fsdp(False, shared_trunk=True, workers=4)  # no --fsdp: nothing to check
        >>> check_fsdp(True, shared_trunk=True, workers=1)
        Traceback (most recent call last):
        ...
        ValueError: --fsdp --shared-trunk: ...
    """
    if not fsdp:
        return
    if shared_trunk:
        raise ValueError(
            "--fsdp --shared-trunk: the actor and the critic would share one trunk, and fully_shard would shard "
            "it once for each (its parameters would belong to two FSDP groups); drop --shared-trunk with --fsdp "
            "(the critic then has its own copy of the trunk, sharded as well)"
        )
    if workers > 1:
        raise ValueError(
            f"--fsdp --workers {workers}: collector worker processes would receive a shard of the actor each, "
            "not the policy; use --workers 1 with --fsdp (the rollout runs in-process on the gathered actor)"
        )
    if not launched_world_size():
        raise ValueError(
            "--fsdp shards the models over the ranks of a torchrun job, and this process was not launched by "
            "torchrun (WORLD_SIZE is not set): run torchrun --nproc_per_node N -m ppo_objectives.train --fsdp "
            "..., or drop --fsdp for a single process"
        )


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a causal LM: the elements of its largest ``nn.ModuleList`` (by parameter
    count) whose elements are all of one class; ``[]`` when it has none.

    Found generically: ``TinyCausalLM.blocks``, ``HFCausalLMAdapter.hf_model.model.layers`` (Llama, Qwen2).

    Example:
        >>> from ppo_objectives.models import TinyCausalLM, TinyLMConfig
        >>> lm = TinyCausalLM(TinyLMConfig.preset("nano", vocab_size=10, block_size=8))
        >>> blocks = transformer_blocks(lm)
        >>> len(blocks), all(b is lm.blocks[i] for i, b in enumerate(blocks))
        (2, True)
        >>> transformer_blocks(torch.nn.Linear(2, 2))
        []
    """
    best, most = [], 0
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1:
            n = sum(p.numel() for p in m.parameters())
            if n > most:
                best, most = list(m), n
    return best


def shard_fsdp(ac: ActorCritic, d: Dist, device: torch.device) -> tuple[TensorDictModule, TensorDictModule, list]:
    """Shard the actor's and the critic's networks over the ranks with FSDP2 (``fully_shard``), in place.

    Each transformer block (:func:`transformer_blocks`) is one FSDP group, then the model itself (the
    embeddings, the final norm, the LM head) and the critic's value head: every parameter, its gradient
    and its AdamW moments become a ``DTensor`` sharded on dim 0, each rank holding ``~1/world`` of it.
    A forward all-gathers a group's parameters just before it runs and frees them after it, the root
    groups too (FSDP's default keeps a root gathered until its backward): so between forwards
    ``model.parameters()`` are always the sharded parameters the optimizers hold, which the trust
    region's snapshots, the gradient clipping and a forward without backward rely on. A backward
    reduce-scatters the gradients, averaged over the ranks as ``DistributedDataParallel`` averages them, so
    ``functional.loss_normalizer(..., process_group=)`` keeps its meaning. Rank 0's parameters are
    broadcast first (every rank starts from the same model, as with DDP).

    Build the frozen reference and anything else that copies the actor *before* this call, and the
    optimizers after it (over the sharded parameters). The rollout runs inside
    :func:`gathered_for_rollout` (a rank makes as many actor forwards as its env rows need).

    Returns ``(actor, critic, [])`` like :func:`wrap_ddp`: ``ac.actor`` and ``ac.critic`` themselves
    (their networks are now the FSDP modules), and no wrappers to free.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if d.group is None:
        raise ValueError("shard_fsdp needs a torchrun process group (init_distributed found none); launch with "
                         "torchrun --nproc_per_node N, or call wrap_ddp / use the networks as they are")
    mesh = init_device_mesh(device.type, (d.world,))
    for model in (ac.actor_model, ac.critic_model, ac.critic_head):
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t, 0, group=d.group)
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)  # the root too (FSDP keeps it gathered)
    return ac.actor, ac.critic, []


def _fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_for_rollout(model: torch.nn.Module) -> Iterator[None]:
    """The whole of a sharded ``model`` on every rank while the block runs; nothing for an unsharded one.

    The env policy calls the actor once or twice per env step, depending on which rows reset
    (``NextTokenLogits``' prefill of stale rows, ``ppo_objectives/policy.py``), so the ranks make
    different numbers of forwards in a rollout: with sharded parameters each forward would all-gather,
    and the ranks would wait on each other's collectives. Inside this block every FSDP group of ``model``
    is all-gathered once (``FSDPModule.unshard``) and kept whole (``set_reshard_after_forward(False)``),
    so a forward runs no collective; at the end the parameters are sharded again and every group
    reshards after its forwards again (as :func:`shard_fsdp` set it).

    Memory: each rank holds one full copy of the actor's parameters during the rollout (no gradients,
    no optimizer state), freed when the block ends; the sharded training state is untouched. A
    persistent unsharded copy of the actor, refreshed every iteration, would cost that much at all times.
    """
    mods = _fsdp_modules(model)
    if not mods:
        yield
        return
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def clip_grad_norm_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)``, and the total norm as a plain 0-d tensor.

    With FSDP-sharded parameters the gradients are ``DTensor`` shards: torch computes the norm over every
    rank's shards and returns it as a replicated ``DTensor``; its local value (the same on every rank) is
    returned, so it can be all-reduced and read like the norm of unsharded gradients. Plain parameters
    go through torch's function unchanged.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> clip_grad_norm_([w], 1.0), w.grad
        (tensor(5.), tensor([0.6000, 0.8000]))
    """
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.to_local() if isinstance(norm, DTensor) else norm


class _FullStateDict:
    """A checkpoint entry of an FSDP-sharded model (``optimizer=None``) or of its optimizer: ``state_dict()``
    gathers the full state on rank 0 (CPU; ``{}`` on the other ranks), ``load_state_dict()`` takes a
    full state dict on every rank and keeps this rank's shards (the dict given is left as it is). Both are
    collectives."""

    def __init__(self, model: torch.nn.Module, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint import state_dict as dcp

        opts = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.optimizer is None:
            return dcp.get_model_state_dict(self.model, options=opts)
        return dcp.get_optimizer_state_dict(self.model, self.optimizer, options=opts)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint import state_dict as dcp

        opts = dcp.StateDictOptions(full_state_dict=True)
        if self.optimizer is None:  # a new dict: torch puts the shards into the one it is given
            dcp.set_model_state_dict(self.model, dict(state), options=opts)
            return
        if any(isinstance(k, int) for k in state.get("state", {})):
            raise ValueError(
                "--resume --fsdp: the checkpoint's optimizer state is keyed by parameter index, as a run "
                "without --fsdp writes it (--fsdp keys it by parameter name); resume with the flags the "
                "checkpoint was written with"
            )
        state = dict(state, state={k: dict(v) for k, v in state.get("state", {}).items()},
                     param_groups=[dict(g) for g in state.get("param_groups", [])])
        dcp.set_optimizer_state_dict(self.model, self.optimizer, state, options=opts)


def fsdp_stateful(stateful: Mapping[str, object], ac: ActorCritic) -> dict:
    """``stateful`` (checkpoint entries by name) with the sharded networks and their optimizers replaced by
    entries that gather full state dicts (:class:`_FullStateDict`): ``actor_model``, ``critic_model``,
    ``critic_head``, and ``actor_opt`` / ``critic_opt`` when present (the optimizers of the actor's and of
    the critic's parameters). The model entries hold the same keys and full tensors as a run without
    ``--fsdp``; the optimizer entries are keyed by parameter name
    (``torch.distributed.checkpoint.state_dict``), so a checkpoint resumes with the same ``--fsdp``."""
    out = dict(stateful)
    for name in ("actor_model", "critic_model", "critic_head"):
        out[name] = _FullStateDict(getattr(ac, name))
    if "actor_opt" in out:
        out["actor_opt"] = _FullStateDict(ac.actor_model, stateful["actor_opt"])
    if "critic_opt" in out:  # the critic's trunk and head: both under the critic's module
        out["critic_opt"] = _FullStateDict(ac.critic.module, stateful["critic_opt"])
    return out


# --------------------------------------------------------------------------- #
# RNG states
# --------------------------------------------------------------------------- #


def rng_states(generator: torch.Generator, env_generator: torch.Generator, device: torch.device) -> dict:
    """This process's RNG states: torch's, the update ``generator``'s, the env's prompts', CUDA's."""
    return dict(
        torch_rng=torch.get_rng_state(), update_rng=generator.get_state(), env_rng=env_generator.get_state(),
        cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    )  # fmt: skip


def restore_rng_states(ckpt: dict, rank: int, generator: torch.Generator, env_generator: torch.Generator,
                       device: torch.device) -> None:
    """Put back the RNG states of ``rank`` saved in ``ckpt`` (a checkpoint of one process has them at top level)."""
    rng = ckpt["rank_rng"][rank] if "rank_rng" in ckpt else ckpt
    torch.set_rng_state(rng["torch_rng"])
    generator.set_state(rng["update_rng"])
    env_generator.set_state(rng["env_rng"])
    if rng.get("cuda_rng") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda_rng"], device)


# --------------------------------------------------------------------------- #
# Checkpoints
# --------------------------------------------------------------------------- #

OPTIONAL_STATE = ("collapse_guard",)  # absent from checkpoints written before the collapse guard existed


def checkpoint_state(iteration: int, config: dict, d: Dist, stateful: Mapping[str, object], rng: dict) -> dict:
    """The checkpoint of a run after ``iteration``: ``config``, the world size, the ``state_dict()`` of
    every entry of ``stateful`` under its name, this rank's ``rng`` states and every rank's (``rank_rng``).

    Under ``torchrun`` this is a collective (the RNG states are gathered): every rank calls it
    at the same iterations.
    """
    rank_rng = [rng]
    if d.group is not None:
        rank_rng = [None] * d.world
        dist.all_gather_object(rank_rng, rng, group=d.group)
    return dict(
        iteration=iteration, config=config, world_size=d.world,
        **{name: obj.state_dict() for name, obj in stateful.items()}, **rank_rng[0], rank_rng=rank_rng,
    )  # fmt: skip


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash leaves the previous checkpoint intact


def write_run_config(out: Path, iteration: int, config: dict) -> None:
    """``out/run_config.json``: the checkpoint's iteration and configuration, beside it (read without loading
    the checkpoint's tensors), written atomically after the checkpoint."""
    tmp = out / "run_config.json.tmp"
    tmp.write_text(json.dumps({"iteration": iteration, "config": config}, indent=1))
    os.replace(tmp, out / "run_config.json")


def read_run_config(out: Path) -> dict | None:
    """``{"iteration", "config"}`` of the checkpoint in ``out`` (``None`` without a checkpoint); from
    ``run_config.json``, else from the checkpoint itself."""
    path = out / "checkpoint.pt"
    if not path.exists():
        return None
    meta = out / "run_config.json"
    if meta.exists():
        saved = json.loads(meta.read_text())
        if saved["iteration"] == torch.load(path, map_location="cpu", weights_only=False, mmap=True)["iteration"]:
            return saved
    ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return {"iteration": int(ckpt["iteration"]), "config": ckpt.get("config", {})}


def load_checkpoint(path: Path, d: Dist, device: torch.device) -> dict | None:
    """The checkpoint at ``path`` for ``--resume``, ``None`` (and a note on stderr) when there is none.

    Raises a ``ValueError`` when it was written by a job with another number of processes.
    """
    ckpt = torch.load(path, map_location=device, weights_only=False) if path.exists() else None
    if ckpt is None and d.main:
        print(f"--resume: no checkpoint at {path}; starting fresh", file=sys.stderr)
    if ckpt is not None and ckpt.get("world_size", 1) != d.world:
        raise ValueError(
            f"--resume: {path} was written by a run with {ckpt.get('world_size', 1)} process(es), this one has "
            f"{d.world}; resume with the same torchrun --nproc_per_node (each rank restores its own RNG states)"
        )
    return ckpt


def restore_state(ckpt: dict, stateful: Mapping[str, object]) -> int:
    """Load every entry of ``stateful`` from ``ckpt`` (in order); returns the checkpoint's iteration."""
    for name, obj in stateful.items():
        if name in ckpt or name not in OPTIONAL_STATE:
            obj.load_state_dict(ckpt[name])
    return int(ckpt["iteration"])


# --------------------------------------------------------------------------- #
# The metrics CSV
# --------------------------------------------------------------------------- #


def append_metrics(path: Path, row: dict, fieldnames: Sequence[str]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fieldnames, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in fieldnames})


def truncate_metrics(path: Path, iteration: int, fieldnames: Sequence[str]) -> None:
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
        w = csv.DictWriter(f, fieldnames=fieldnames, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: r.get(k, "") or "" for k in fieldnames} for r in keep)
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a ``metrics.csv``, every non-empty cell as a float."""
    with Path(path).open() as f:
        return [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


# --------------------------------------------------------------------------- #
# TorchRL loggers (--logger)
# --------------------------------------------------------------------------- #

LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
_LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # csv needs none
_WANDB_ID = "wandb_run_id"  # OUT/logs/wandb_run_id: the W&B run a --resume continues


def check_logger(kind: str | None) -> None:
    """Raise an ``ImportError`` naming the ``loggers`` extra when the package of ``kind`` is not installed
    (``None`` / ``"none"``: no logger, nothing to check)."""
    if kind in (None, "none"):
        return
    if kind not in LOGGERS:
        raise ValueError(f"logger={kind!r} is not one of {('none', *LOGGERS)}")
    package = _LOGGER_PACKAGES.get(kind)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ImportError(
            f"--logger {kind} needs the {package} package, which is not installed: "
            f'pip install "ppo_objectives[loggers]" (or pip install {package})'
        )


def make_logger(kind: str | None, out_dir: Path, exp_name: str, *, start_step: int = 0):
    """The ``torchrl.record.loggers`` logger of ``--logger kind``, writing under ``out_dir/logs``; ``None``
    for ``None`` / ``"none"``.

    ``csv``: ``logs/EXP/scalars/NAME.csv`` (``step,value`` lines, :class:`~torchrl.record.loggers.CSVLogger`);
    ``tensorboard``: event files in ``logs/EXP``; ``wandb``: an offline run in ``logs/wandb`` (unless
    ``WANDB_MODE`` says otherwise); ``mlflow``: a local tracking store, ``logs/mlflow.db`` (SQLite) with
    the artifacts in ``logs/mlartifacts`` (``file:``).

    ``start_step``: the iteration a ``--resume`` continues from. What the interrupted run logged after it
    is dropped, as from ``metrics.csv`` (CSV rows removed, TensorBoard events purged from that step on),
    and a W&B run continues under its id. An MLflow resume logs into a new run of the same experiment.
    """
    check_logger(kind)
    if kind in (None, "none"):
        return None
    from torchrl.record.loggers import MLFlowLogger, get_logger

    log_dir = Path(out_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if kind == "wandb":
        return _wandb_logger(log_dir, exp_name, start_step)
    if kind == "mlflow":  # MLflow >= 3.10 refuses file-system tracking stores: SQLite, artifacts as files
        return MLFlowLogger(exp_name, tracking_uri=f"sqlite:///{(log_dir / 'mlflow.db').resolve()}",
                            artifact_location=(log_dir / "mlartifacts").resolve().as_uri())
    if kind == "csv" and start_step:
        _truncate_scalar_files(log_dir / exp_name / "scalars", start_step)
    logger = get_logger(kind, str(log_dir), exp_name)
    if kind == "tensorboard" and start_step:
        _purge_tensorboard(logger.experiment, start_step + 1)
    return logger


def log_row(logger, row: Mapping[str, float], step: int, fieldnames: Sequence[str]) -> None:
    """``logger.log_scalar(name, row[name], step=step)`` for every field of ``row`` but ``iteration``
    (the step); nothing without a logger."""
    if logger is None:
        return
    for name in fieldnames:
        if name != "iteration" and name in row:
            logger.log_scalar(name, float(row[name]), step=step)


def close_logger(logger) -> None:
    """Flush and close ``logger`` (``None``: nothing); an MLflow run is ended (``Logger.close`` leaves it active)."""
    if logger is None:
        return
    from torchrl.record.loggers import MLFlowLogger

    logger.close()
    if isinstance(logger, MLFlowLogger):
        import mlflow

        mlflow.end_run()


def _wandb_logger(log_dir: Path, exp_name: str, start_step: int):
    from torchrl.record.loggers import WandbLogger

    id_file = log_dir / _WANDB_ID
    run_id = id_file.read_text().strip() if start_step and id_file.exists() else None
    logger = WandbLogger(exp_name, save_dir=str(log_dir), id=run_id, project="ppo_objectives",
                         mode=os.environ.get("WANDB_MODE", "offline"))
    id_file.write_text(str(logger.experiment.id))
    return logger


def _truncate_scalar_files(scalars_dir: Path, step: int) -> None:
    """Drop the ``step,value`` lines after ``step`` from the CSV logger's files (atomic, per file)."""
    for path in sorted(scalars_dir.glob("*.csv")) if scalars_dir.is_dir() else ():
        lines = path.read_text().splitlines(keepends=True)
        keep = [line for line in lines if line.strip() and float(line.split(",", 1)[0]) <= step]
        if len(keep) < len(lines):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text("".join(keep))
            os.replace(tmp, path)


def _purge_tensorboard(writer, step: int) -> None:
    """What ``SummaryWriter(purge_step=step)`` writes: TensorBoard hides the events at ``step`` and later
    of the earlier event files."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))


# --------------------------------------------------------------------------- #
# Optimizer snapshots (the trust region's undo)
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


# --------------------------------------------------------------------------- #
# Host memory
# --------------------------------------------------------------------------- #


@functools.cache
def _glibc_malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where the C library is not glibc (macOS, musl, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_host_memory() -> bool:
    """Hand the free pages of the C heap back to the system (glibc's ``malloc_trim(0)``); ``True`` when it ran.

    A CPU iteration frees tensors of new shapes every time (response lengths; a text task's
    ``[rows, tokens, 49152]`` logits), and glibc keeps the freed pages in its per-thread arenas
    instead of returning them. Untrimmed, a SmolLM2 run on ``chat-add2`` grew by about half a gigabyte
    per iteration until the kernel killed it at 24 GB after 35–36 iterations; trimmed once per
    iteration it stays under 8 GB. It changes no number a run computes. Where the C library is
    not glibc it does nothing and returns ``False``.
    """
    trim = _glibc_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


# --------------------------------------------------------------------------- #
# stderr
# --------------------------------------------------------------------------- #


def log_skip(rank: int, process_group, why: str, epoch: int, minibatch: int) -> None:
    """The stderr line of a minibatch step skipped by the non-finite guard."""
    where = f" on rank {rank}" if process_group is not None else ""
    print(f"ppo_update: {why}{where} at epoch {epoch} minibatch {minibatch}: optimizer step skipped "
          "(on every rank; counted in skipped_steps)", file=sys.stderr, flush=True)


def warn(line: str, bar) -> None:
    """A warning line on stderr that does not break the progress bar."""
    text = f"WARNING ppo: {line}"
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)

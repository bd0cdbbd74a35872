"""Where the job runs: ``torchrun`` ranks, DDP and FSDP2 wrappers, the host's memory (internal).

* **torch.distributed** -- where this process stands in a ``torchrun`` job
  (:class:`Dist`, :func:`init_distributed`, :func:`close_distributed`), the
  all-reduce that is the identity without a process group, the
  ``DistributedDataParallel`` wrappers of the actor and the critic, and the exact
  check that every rank ends with the same parameters;
* **FSDP2** (``--fsdp``) -- the actor's and the critic's models sharded with
  ``torch.distributed.fsdp.fully_shard`` (each transformer block, then the root), the
  whole actor gathered for the rollout, gradient clipping over sharded gradients, and
  checkpoint entries that gather (and scatter back) full model and optimizer state dicts;
* **host memory** -- the C heap's free pages handed back to the system once per iteration.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from tensordict.nn import TensorDictModule

from ppo_objectives.llm.readouts import ActorCritic

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
        >>> from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
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
    (``NextTokenLogits``' prefill of stale rows, ``ppo_objectives/llm/policy.py``), so the ranks make
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

"""What the training job needs around the PPO iteration (internal).

:mod:`ppo_objectives.train` reads as the algorithm; this module holds the rest, so
that it can be read (and tested) on its own:

* **torch.distributed** -- where this process stands in a ``torchrun`` job
  (:class:`Dist`, :func:`init_distributed`, :func:`close_distributed`), the
  all-reduce that is the identity without a process group, the
  ``DistributedDataParallel`` wrappers of the actor and the critic, and the exact
  check that every rank ends with the same parameters;
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
* **stderr lines** that do not break the progress bar.

It is internal: the names are plain so :mod:`ppo_objectives.train` can import them,
but they are not part of the public API (``read_metrics`` is, through
:mod:`ppo_objectives.train`). The layering is in ``docs/design.md``.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from tensordict.nn import TensorDictModule

from ppo_objectives.models import ActorCritic

__all__ = [
    "Dist",
    "all_reduce",
    "append_metrics",
    "LOGGERS",
    "check_logger",
    "check_ranks_in_sync",
    "checkpoint_state",
    "close_distributed",
    "close_logger",
    "init_distributed",
    "launched_world_size",
    "load_checkpoint",
    "log_row",
    "log_skip",
    "make_logger",
    "param_checksums",
    "read_metrics",
    "restore",
    "restore_rng_states",
    "restore_state",
    "rng_states",
    "save_checkpoint",
    "snapshot",
    "truncate_metrics",
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


def wrap_ddp(ac: ActorCritic, d: Dist, device: torch.device) -> tuple[TensorDictModule, TensorDictModule, list]:
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


def param_checksums(modules: Iterable[torch.nn.Module]) -> torch.Tensor:
    """Per parameter ``(sum, sum of squares, position-weighted sum)`` in float64 ([3 * n_params])."""
    rows = []
    for m in modules:
        for p in m.parameters():
            x = p.detach().double().flatten()
            w = torch.arange(1, x.numel() + 1, device=x.device, dtype=torch.float64) / x.numel()
            rows.append(torch.stack([x.sum(), (x * x).sum(), (x * w).sum()]))
    return torch.cat(rows)


def check_ranks_in_sync(modules: Iterable[torch.nn.Module], group) -> None:
    """Raise when the parameters differ between ranks (their checksums are compared exactly)."""
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

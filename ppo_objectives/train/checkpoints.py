"""The state of a run, saved and restored (internal).

* **checkpoints** -- the state of a run (networks, optimizers, KL controller,
  collapse guard, the RNG states of every rank), written atomically and read back
  for ``--resume``, with the run's configuration beside it;
* **RNG state** capture and restore (torch, CUDA, the update generator, the env's
  prompt generator).

The trust region's optimizer snapshots are the update's (:mod:`ppo_objectives.train.update`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from ppo_objectives.train.distributed import Dist

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

#: The key of a checkpoint's configuration that holds ``{flag: sha256}`` of the input files the run read (``--task
#: jsonl``: ``--prompts``, ``--reward``'s file, ``--eval-prompts``); ``--resume`` refuses a file whose content changed.
INPUT_SHA256 = "input_sha256"


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


#: What a run writes in its ``--out`` (files and folders): a new run refuses an ``--out`` holding any of them unless
#: it continues that run (``--resume``) or deletes them first (``--overwrite``, :func:`remove_run_files`).
RUN_FILES = ("checkpoint.pt", "run_config.json", "metrics.csv", "training.png", "samples.txt", "hf", "logs")


def run_files(out: Path) -> list[str]:
    """The entries of :data:`RUN_FILES` (and their ``.tmp`` files) that ``out`` holds, in that order."""
    out = Path(out)
    names = [n for name in RUN_FILES for n in (name, f"{name}.tmp")]
    return [n for n in names if out.is_dir() and (out / n).exists()]


def remove_run_files(out: Path) -> None:
    """Delete what a run wrote in ``out`` (:func:`run_files`); anything else there is left alone."""
    for name in run_files(out):
        path = Path(out) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


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
    return {"iteration": int(ckpt["iteration"]), "config": ckpt["config"]}


def load_checkpoint(path: Path, d: Dist, device: torch.device) -> dict | None:
    """The checkpoint at ``path`` for ``--resume``, ``None`` (and a note on stderr) when there is none.

    Raises a ``ValueError`` when it was written by a job with another number of processes.
    """
    ckpt = torch.load(path, map_location=device, weights_only=False) if path.exists() else None
    if ckpt is None and d.main:
        print(f"--resume: no checkpoint at {path}; starting fresh", file=sys.stderr)
    if ckpt is not None and ckpt["world_size"] != d.world:
        raise ValueError(
            f"--resume: {path} was written by a run with {ckpt['world_size']} process(es), this one has "
            f"{d.world}; resume with the same torchrun --nproc_per_node (each rank restores its own RNG states)"
        )
    return ckpt


def restore_state(ckpt: dict, stateful: Mapping[str, object]) -> int:
    """Load every entry of ``stateful`` from ``ckpt`` (in order); returns the checkpoint's iteration."""
    missing = [name for name in stateful if name not in ckpt]
    if missing:  # e.g. a KL term added to a run that had none: it saved no reference
        raise ValueError(f"--resume: the checkpoint holds no {missing}, which this run needs (a run without a KL term "
                         "builds and saves no reference); resume with the flags it was written with")
    for name, obj in stateful.items():
        obj.load_state_dict(ckpt[name])
    return int(ckpt["iteration"])

"""The launch checks: what a run cannot honour is refused before any work starts.

:func:`check_launch` (``python -m ppo_objectives.train`` calls it, and so does
:func:`~ppo_objectives.train.train`) checks a :class:`~ppo_objectives.train.config.TrainConfig`
against what its values need of the rest of the job and of the machine: the task's own
arguments, the packages (loggers, ray, the progress bar, the plot), torchrun, the output
directory, the input files, and for ``--resume`` the checkpoint's configuration and input
files. :class:`~ppo_objectives.train.config.TrainConfig` itself checks only its own values.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from ppo_objectives.train.checkpoints import INPUT_SHA256, read_run_config, run_files
from ppo_objectives.train.config import RESUME_MAY_CHANGE, TrainConfig
from ppo_objectives.train.digit import DigitTask
from ppo_objectives.train.distributed import check_fsdp, launched_world_size
from ppo_objectives.train.loggers import check_logger
from ppo_objectives.train.ray_collector import cluster_address, import_ray
from ppo_objectives.train.text_job import check_inputs, input_sha256


def _missing(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except ValueError:  # a module set to None in sys.modules
        return True


def _check_job_packages(cfg: TrainConfig) -> None:
    """The job's progress bar needs tqdm and its plot matplotlib (the ``train`` extra), ``--lora-rank`` peft (the
    ``lora`` extra): a missing one is named with the flag that runs without it."""
    needed = (("tqdm", not cfg.no_progress, "--no-progress", "the progress bar"),
              ("matplotlib", not cfg.no_plot, "--no-plot", "training.png"))
    if cfg.lora_rank and _missing("peft"):
        raise ImportError(f"--lora-rank {cfg.lora_rank} needs peft, which is not installed: pip install -e "
                          "\".[lora]\" (from the clone), or run without --lora-rank (full fine-tuning)")
    for module, used, flag, what in needed:
        if used and _missing(module):
            raise ImportError(f"{what} needs {module}, which is not installed: pip install -e \".[train]\" (from "
                              f"the clone), or run without it with {flag}")


def check_launch(cfg: TrainConfig) -> None:
    """Refuse, before any process group, model or file exists, what this run cannot honour.

    A toy task's arguments (``--digits``: :class:`~ppo_objectives.train.digit.DigitTask` checks its own),
    ``--device cuda`` without CUDA, a ``--logger`` whose package is missing, ``--fsdp`` or
    ``--shared-trunk`` where they cannot run, ``--collector-backend ray`` without ray (or under
    torchrun without ``--ray-address``), an ``--out`` that is (or lies under) a file, ``--allow-change``
    without ``--resume``, a ``--model`` or text-task input that cannot be read
    (:func:`~ppo_objectives.train.text_job.check_inputs`), a new run in an ``--out`` that holds another run's
    files (:data:`~ppo_objectives.train.checkpoints.RUN_FILES`) without ``--overwrite``, and for ``--resume``: no
    checkpoint in ``--out``, flags that differ from the checkpoint's (:data:`~ppo_objectives.train.RESUME_MAY_CHANGE` lists those that
    may), input files (``--prompts``, ``--reward``, ``--eval-prompts``) whose sha256 differs from the
    checkpoint's, or nothing left to run. ``python -m ppo_objectives.train`` turns each into an
    ``error:`` line (exit 2).
    """
    if cfg.recipe == "toy":
        DigitTask(cfg.task, cfg.digits)  # the task checks its own arguments
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was given but torch.cuda.is_available() is False; use --device cpu")
    check_logger(cfg.logger)  # its package is missing: say so now, not after the warm start
    _check_job_packages(cfg)
    check_fsdp(cfg.fsdp, shared_trunk=cfg.shared_trunk, workers=cfg.workers)
    if cfg.shared_trunk and launched_world_size() > 1:
        raise ValueError(
            "--shared-trunk under torchrun: the actor and the critic would share parameters, and two "
            "DistributedDataParallel wrappers cannot own the same parameters; add --no-shared-trunk for "
            "data-parallel runs (the critic then has its own copy of the trunk)"
        )
    if cfg.micro_batches > 1 and launched_world_size() > 1:
        raise ValueError(
            f"--micro-batches {cfg.micro_batches} under torchrun: each rank would all-reduce its gradients once "
            "per micro-batch and could run fewer of them than another rank; drop --micro-batches (or lower "
            "--num-envs per rank) for data-parallel runs"
        )
    if cfg.collector_backend == "ray":
        _check_ray_launch(cfg)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; give a directory (created if missing) for the run's outputs")
    above = next(p for p in out.absolute().parents if p.exists())  # where --out would be created
    if not above.is_dir():
        raise FileExistsError(f"--out {out}: {above} is a file, so the directory cannot be created there; give a "
                              f"directory path outside it")
    if cfg.allow_change and not cfg.resume:
        raise ValueError(f"--allow-change {cfg.allow_change} names flags a --resume may change, but this run does not "
                         f"resume; add --resume (with the --out of the run to continue) or drop --allow-change")
    check_inputs(cfg)  # --model, --prompts, --reward, --eval-prompts: readable before anything loads
    if cfg.resume:
        _check_resume(cfg, out)
    elif not cfg.overwrite:
        _check_new_run(out)


def _check_new_run(out: Path) -> None:
    """A new run (no ``--resume``, no ``--overwrite``) never writes over another run's files: an ``--out`` that holds
    any of them is refused. Under torchrun every rank checks before the process group forms, so before rank 0
    writes anything."""
    held = run_files(out)
    if not held:
        return
    saved = read_run_config(out)
    at = f", a checkpoint at iteration {saved['iteration']}" if saved is not None else ""
    raise FileExistsError(
        f"--out {out} already holds a run ({', '.join(held)}{at}); add --resume to continue it, --overwrite to delete "
        f"those files and start a new run there, or give another --out"
    )


def _check_ray_launch(cfg: TrainConfig) -> None:
    """``--collector-backend ray``: ray is installed; under torchrun all ranks join one cluster (``--ray-address``)."""
    import_ray()
    world = launched_world_size()
    if world > 1 and not cluster_address(cfg.ray_address):
        raise ValueError(
            f"--collector-backend ray under torchrun ({world} ranks) needs --ray-address: each rank would start a "
            "Ray instance of its own; start one cluster (ray start --head) and pass --ray-address auto (or HOST:6379)"
        )


def _check_resume(cfg: TrainConfig, out: Path) -> None:
    """``--resume``: a checkpoint exists, its configuration is this run's but for :data:`RESUME_MAY_CHANGE` (and
    ``--allow-change``), the input files it recorded (``--task jsonl``) have the same sha256, and iterations are
    left to run."""
    saved = read_run_config(out)
    if saved is None:
        held = run_files(out)  # a run that died before its first checkpoint
        overwrite = f" with --overwrite (it holds {', '.join(held)})" if held else ""
        raise FileNotFoundError(
            f"--resume: no checkpoint in {out} ({out / 'checkpoint.pt'} does not exist); drop --resume to start a new "
            f"run there{overwrite}, or give the --out of the run to continue"
        )
    allowed = {a.strip().replace("-", "_") for a in cfg.allow_change.split(",") if a.strip()}
    unknown = sorted(allowed - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise ValueError(f"--allow-change {cfg.allow_change}: no such flag {unknown}; name flags as on the command "
                         f"line, e.g. --allow-change lr,kl-reward-coeff")
    config = saved["config"]
    iteration = int(saved["iteration"])
    names = {f.name for f in fields(TrainConfig)} | {INPUT_SHA256}
    if set(config) != names:  # another version's configuration: what it computed cannot be compared with this one's
        differ = sorted(set(config) ^ names)
        raise ValueError(
            f"--resume: the checkpoint in {out} was written by another version of ppo_objectives (its configuration "
            f"differs from this version's in {differ}); this version cannot continue that run: start a new --out, or "
            f"resume with the version that wrote it"
        )
    changed = [f.name for f in fields(TrainConfig) if f.name not in RESUME_MAY_CHANGE
               and f.name not in allowed and config[f.name] != getattr(cfg, f.name)]
    if changed:
        shown = ", ".join(f"--{n.replace('_', '-')} {getattr(cfg, n)!r} (the checkpoint's: {config[n]!r})"
                          for n in changed)
        raise ValueError(
            f"--resume: this run's flags differ from those of the run in {out}: {shown}; they change what the run "
            f"computes, so the resumed run would not continue it. Give the checkpoint's values, start a new --out, or "
            f"change them on purpose with --allow-change {','.join(n.replace('_', '-') for n in changed)}"
        )
    saved_sha, sha = config[INPUT_SHA256], input_sha256(cfg)  # the input files' contents, as flags are
    edited = [n for n in saved_sha if n in sha and n not in allowed and saved_sha[n] != sha[n]]
    if edited:
        shown = ", ".join(f"--{n.replace('_', '-')} {getattr(cfg, n)} (sha256 {sha[n][:12]}..., the checkpoint's: "
                          f"{saved_sha[n][:12]}...)" for n in edited)
        raise ValueError(
            f"--resume: input files changed since the checkpoint in {out} was written: {shown}; the resumed run would "
            f"train or evaluate on other data than the run it continues. Restore the files, start a new --out, or "
            f"change them on purpose with --allow-change {','.join(n.replace('_', '-') for n in edited)}"
        )
    if iteration >= cfg.iterations:
        raise ValueError(f"--resume: nothing left to run: the checkpoint in {out} is at iteration {iteration} and "
                         f"--iterations is {cfg.iterations}; raise --iterations to continue the run")

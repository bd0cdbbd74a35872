"""Where the job's numbers go (internal; :func:`read_metrics` is public through :mod:`ppo_objectives.train`).

* **the metrics CSV** (``metrics.csv``: its columns, :data:`METRICS` and :func:`columns`;
  append a row, drop the rows an interrupted run logged after its last checkpoint, read it back);
* **TorchRL loggers** (``--logger``: a ``torchrl.record.loggers`` logger writing
  under ``OUT/logs``, offline, that receives every row of ``metrics.csv``);
* **stderr lines** that do not break the progress bar (warnings).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

from ppo_objectives.train.config import LOGGERS, TrainConfig
from ppo_objectives.train.monitor import FLAGS
from ppo_objectives.train.text_job import EVAL_COLUMNS, EVAL_TURN_COLUMNS

# --------------------------------------------------------------------------- #
# The metrics CSV
# --------------------------------------------------------------------------- #

#: The columns of ``metrics.csv``, in order (a text task adds the held-out evaluation's; see :func:`columns`).
METRICS = (
    "iteration", "reward", "exact", "response_len", "episodes", "kl_ref", "seq_kl", "kl_reward_coeff",
    "loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy", "entropy", "kl_approx", "kl_approx_max",
    "kl_token_max", "clip_fraction", "max_ratio", "ESS", "value_clip_fraction", "explained_variance", "updates",
    "critic_updates", "early_stopped", "rolled_back", "step_fraction", "skipped_steps", "grad_norm", "rollout_s", "reference_s",
    "update_s", "tokens_per_s",
    *(f"warn_{f}" for f in FLAGS), "collapse",
)  # fmt: skip


#: The columns a multi-turn task adds (``--task chat-calc``, ``--tool``): the rollout's turns and the held-out ones.
TURN_COLUMNS = ("turns", "turn_tokens", "env_turns_cut", *EVAL_TURN_COLUMNS)


#: The column ``--critic-steps`` above 1 adds: the value loss of the last critic-only pass.
CRITIC_STEP_COLUMNS = ("loss_critic_after",)


def columns(cfg: TrainConfig) -> tuple[str, ...]:
    """The columns of ``metrics.csv``: :data:`METRICS`, plus :data:`CRITIC_STEP_COLUMNS` with ``--critic-steps``
    above 1, plus the held-out evaluation's for text tasks, plus :data:`TURN_COLUMNS` for multi-turn tasks."""
    base = (*METRICS, *(CRITIC_STEP_COLUMNS if cfg.critic_steps > 1 else ()))
    if cfg.recipe != "pretrained":
        return base
    return (*base, *EVAL_COLUMNS, *(TURN_COLUMNS if cfg.multi_turn else ()))



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
            f'pip install -e ".[loggers]" (or pip install {package})'
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
# stderr
# --------------------------------------------------------------------------- #


def warn_line(line: str, bar) -> None:
    """A warning line on stderr that does not break the progress bar."""
    text = f"WARNING ppo: {line}"
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)

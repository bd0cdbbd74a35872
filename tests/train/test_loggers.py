"""``--logger``: the training job's metrics through ``torchrl.record.loggers`` (CSV, TensorBoard)."""

import importlib.util
import pathlib
import re
import shutil

import numpy as np
import pytest
from _flags import SMALL

from ppo_objectives import train as T
from ppo_objectives.train import loggers

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
needs_tensorboard = pytest.mark.skipif(
    not HAS_TENSORBOARD, reason='tensorboard is not installed (pip install -e ".[test]")'
)


def _run(out, iterations, *flags):
    T.main(["--iterations", str(iterations), "--out", str(out), *SMALL, "--no-plot", *flags])
    return T.read_metrics(out / "metrics.csv")


def _expected(rows):
    """What the logger should hold: ``{column: [(iteration, value), ...]}`` from ``metrics.csv``."""
    return {k: [(int(r["iteration"]), r[k]) for r in rows] for k in T.METRICS if k != "iteration"}


def _csv_scalars(out):
    scalars = out / "logs" / out.name / "scalars"
    logged = {}
    for path in scalars.glob("*.csv"):
        pairs = [line.split(",") for line in path.read_text().split()]
        logged[path.stem] = [(int(step), float(value)) for step, value in pairs]
    return logged


def _tensorboard_scalars(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "logs" / out.name))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _as_float32(expected):
    return {k: [(s, float(np.float32(v))) for s, v in pairs] for k, pairs in expected.items()}


def test_csv_logger_gets_every_metric_of_metrics_csv_at_its_iteration(tmp_path):
    out = tmp_path / "run"
    rows = _run(out, 2, "--logger", "csv")
    assert [r["iteration"] for r in rows] == [1.0, 2.0]
    assert set(rows[0]) == set(T.METRICS)  # metrics.csv keeps its columns
    assert _csv_scalars(out) == _expected(rows)  # every value exactly (float repr round-trips)


@needs_tensorboard
def test_tensorboard_logger_event_file_holds_the_scalars_of_metrics_csv(tmp_path):
    out = tmp_path / "run"
    rows = _run(out, 2, "--logger", "tensorboard")
    assert _tensorboard_scalars(out) == _as_float32(_expected(rows))  # TensorBoard stores float32


@pytest.mark.parametrize("kind", ["csv", pytest.param("tensorboard", marks=needs_tensorboard)])
def test_resume_logs_on_from_the_checkpoint_and_drops_what_was_logged_after_it(tmp_path, kind):
    out = tmp_path / "run"
    _run(out, 2, "--logger", kind)
    shutil.copy(out / "checkpoint.pt", tmp_path / "at_2.pt")
    _run(out, 3, "--logger", kind, "--resume")  # logs iteration 3, then "dies": the checkpoint goes back to 2
    shutil.copy(tmp_path / "at_2.pt", out / "checkpoint.pt")
    rows = _run(out, 4, "--logger", kind, "--resume")
    assert [r["iteration"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    expected = _expected(rows)
    if kind == "csv":
        assert _csv_scalars(out) == expected
    else:
        assert _tensorboard_scalars(out) == _as_float32(expected)  # iteration 3 once: the old one is purged


@pytest.mark.slow
def test_under_torchrun_rank_0_alone_logs(torchrun_jobs):
    out = torchrun_jobs["full"][0]  # 3 iterations on 2 ranks with --logger csv
    assert [p.name for p in (out / "logs").iterdir()] == [out.name]
    assert _csv_scalars(out) == _expected(T.read_metrics(out / "metrics.csv"))  # each step once, not per rank


def test_without_logger_only_metrics_csv_is_written(tmp_path):
    out = tmp_path / "run"
    _run(out, 1)
    assert not (out / "logs").exists()
    assert loggers.make_logger("none", out, "run") is None and loggers.make_logger(None, out, "run") is None


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_logger_package_is_a_clear_error_before_the_run_starts(tmp_path, monkeypatch, kind, cli_error):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == kind else find_spec(name, *a))
    out = tmp_path / "run"
    err = cli_error(["--iterations", "1", "--out", str(out), "--logger", kind, *SMALL, "--no-plot"])
    assert re.search(rf'--logger {kind} needs the {kind} package.*"\.\[loggers\]"', err)
    assert not out.exists()  # raised before anything ran


JOB_MANUAL = pathlib.Path(__file__).parents[2] / "docs" / "job.md"


def test_every_logged_metric_is_explained_in_the_job_manual():
    manual = JOB_MANUAL.read_text()
    explained = set(re.findall(r"^- ((?:`\w+`(?: / )?)+)", manual, flags=re.M))
    names = {n for line in explained for n in re.findall(r"`(\w+)`", line)}
    from ppo_objectives.train.loggers import TURN_COLUMNS
    from ppo_objectives.train.text_job import EVAL_COLUMNS

    logged = {*T.METRICS, *EVAL_COLUMNS, *TURN_COLUMNS}
    assert logged <= names, sorted(logged - names)


def test_logger_flag_is_documented_and_checked():
    assert "--logger" in T.build_parser().format_help() and "--logger" in JOB_MANUAL.read_text()
    with pytest.raises(ValueError, match="TrainConfig logger='bogus' must be one of"):
        T.TrainConfig(logger="bogus")
    with pytest.raises(SystemExit):
        T.build_parser().parse_args(["--logger", "bogus"])

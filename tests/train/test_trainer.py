"""The job's iteration as TorchRL's ``Trainer`` (``ppo_objectives.train.trainer``) gives the job's numbers.

On the same flags and seed, ``train_with_trainer`` and the job (``train``) write the same
``metrics.csv`` in every column but the timings: the same generator draws the same minibatch
permutations, the trust region stops and pulls back the same steps, the KL controller and the
collapse guard see the same rows.
"""

import csv

import pytest
from _flags import SMALL

from ppo_objectives.train.config import TrainConfig, build_parser
from ppo_objectives.train.loop import train
from ppo_objectives.train.trainer import train_with_trainer

TIMING = {"rollout_s", "reference_s", "update_s", "tokens_per_s"}


def _config(out, *flags) -> TrainConfig:
    return TrainConfig(**vars(build_parser().parse_args([*SMALL, "--no-plot", "--out", str(out), *flags])))


def _csv(out) -> list[dict]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _assert_same_metrics(job: list[dict], trainer: list[dict]) -> None:
    assert len(job) == len(trainer) > 0
    assert job[0].keys() == trainer[0].keys()
    different = [(row["iteration"], k) for row, other in zip(job, trainer) for k in row
                 if k not in TIMING and row[k] != other[k]]  # fmt: skip
    assert different == []


@pytest.mark.parametrize(
    "flags",
    [
        ["--iterations", "3"],
        # a large step size and a tight trust region: steps are stopped and pulled back
        ["--iterations", "8", "--lr", "1e-3", "--early-stop-kl", "0.02"],
    ],
    ids=["default", "trust-region-fires"],
)
def test_the_trainer_writes_the_jobs_metrics(tmp_path, flags):
    rows = train(_config(tmp_path / "job", *flags))
    trained = train_with_trainer(_config(tmp_path / "trainer", *flags))
    _assert_same_metrics(_csv(tmp_path / "job"), _csv(tmp_path / "trainer"))
    assert [r["iteration"] for r in trained] == [r["iteration"] for r in rows]
    if "--early-stop-kl" in flags:
        assert any(int(r["rolled_back"]) for r in _csv(tmp_path / "trainer")), "the case must fire the trust region"


def test_the_trainer_resumes_the_job_exactly(tmp_path):
    train(_config(tmp_path / "job", "--iterations", "4"))
    train_with_trainer(_config(tmp_path / "trainer", "--iterations", "2"))
    train_with_trainer(_config(tmp_path / "trainer", "--iterations", "4", "--resume"))
    _assert_same_metrics(_csv(tmp_path / "job"), _csv(tmp_path / "trainer"))


def test_the_trainer_refuses_fsdp(tmp_path):
    with pytest.raises(ValueError, match=r"train_with_trainer: --fsdp is not supported: gathering the sharded actor"):
        train_with_trainer(_config(tmp_path, "--iterations", "1", "--fsdp"))


def test_the_command_line_runs_the_trainer_with_loop_torchrl(tmp_path, capsys):
    from ppo_objectives.train import main

    assert main([*SMALL, "--no-plot", "--iterations", "2", "--out", str(tmp_path / "cli"), "--loop", "torchrl"]) == 0
    assert "reward (mean of 2 iterations)" in capsys.readouterr().out
    train(_config(tmp_path / "job", "--iterations", "2"))
    _assert_same_metrics(_csv(tmp_path / "job"), _csv(tmp_path / "cli"))

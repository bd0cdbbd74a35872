"""The job's --temperature: checked, threaded to the env policy, the actor read-out, the reference and the
sampled held-out evaluation; the first PPO step of a run at a temperature is exactly on-policy."""

from __future__ import annotations

import math

import pytest
from _flags import SHORT

from ppo_objectives import train as T
from ppo_objectives.train import text_job
from ppo_objectives.train.build import build
from ppo_objectives.train.distributed import Dist
from ppo_objectives.train.text import EvalResult


@pytest.mark.parametrize("value, match", [
    (0.0, r"TrainConfig temperature=0\.0 must be a finite number > 0 \(--temperature divides the logits"),
    (-0.5, r"temperature=-0\.5 must be a finite number > 0"),
    (math.nan, r"temperature=nan must be a finite number > 0"),
    (math.inf, r"temperature=inf must be a finite number > 0"),
])  # fmt: skip
def test_train_config_refuses_a_bad_temperature(value, match):
    with pytest.raises(ValueError, match=match):
        T.TrainConfig(temperature=value)


@pytest.mark.parametrize("flag", ["0", "-1", "nan", "inf"])
def test_bad_temperature_flag_is_an_error_line(cli_error, tmp_path, flag):
    err = cli_error(["--temperature", flag, "--out", str(tmp_path)])
    assert "must be a finite number > 0" in err and "greedy decoding is not a temperature" in err


def test_temperature_flag_is_in_the_ppo_group_with_default_one(capsys):
    with pytest.raises(SystemExit):
        T.main(["--help"])
    out = capsys.readouterr().out
    assert out.index("\nPPO:") < out.index("\n  --temperature TEMPERATURE") < out.index("\nKL:")
    assert T.TrainConfig().temperature == 1.0


def test_build_gives_the_temperature_to_the_policy_the_actor_and_the_reference(tmp_path):
    cfg = T.TrainConfig(preset="pico", num_envs=4, warmup_steps=0, temperature=0.7, out=str(tmp_path))
    run = build(cfg, Dist())
    try:
        assert run.ac.policy.module[0].module.temperature == 0.7  # NextTokenLogits: samples softmax(logits / T)
        assert run.ac.actor.module.temperature == 0.7  # ResponseLogProbs: the loss's log_prob
        assert run.ref.module.temperature == 0.7  # the reference of the KL penalty
    finally:
        run.collector.shutdown()


def test_first_update_of_a_run_at_a_temperature_is_on_policy(cli_error, tmp_path):
    # one epoch of one minibatch: the logged ratio is the first forward's, before any step
    out = str(tmp_path / "run")
    argv = [*SHORT, "--ppo-epochs", "1", "--minibatches", "1", "--temperature", "0.7", "--out", out]
    T.main(["--iterations", "1", *argv])
    row = T.read_metrics(tmp_path / "run" / "metrics.csv")[-1]
    assert row["max_ratio"] == 1.0 and row["clip_fraction"] == 0.0 and row["kl_approx"] == 0.0
    assert row["kl_ref"] == 0.0  # policy and reference are scored at one temperature
    err = cli_error(["--iterations", "2", "--resume", *argv, "--temperature", "1.0"])
    assert "--temperature 1.0 (the checkpoint's: 0.7)" in err


def test_sampled_held_out_evaluation_uses_the_run_temperature(monkeypatch, tmp_path):
    calls = []

    def fake_evaluate(model, task, **kw):
        calls.append(kw)
        return EvalResult(0.0, [""], [0.0])

    monkeypatch.setattr(text_job, "evaluate", fake_evaluate)
    cfg = T.TrainConfig(preset="pico", temperature=1.3)
    evaluation = text_job.HeldOutEvaluation(object(), cfg, tmp_path, main=False)
    evaluation(None, 0, "start")
    greedy, sampled = calls
    assert greedy["greedy"] is True and "temperature" not in greedy  # greedy decoding has no temperature
    assert sampled["greedy"] is False and sampled["temperature"] == 1.3

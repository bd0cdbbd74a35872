"""The job's command line refuses what it cannot honour: error lines (exit 2, no traceback), a guarded
--resume, a grouped --help."""

from __future__ import annotations

import math
import re

import pytest
from _flags import SHORT

from ppo_objectives import train as T
from ppo_objectives.train.checkpoints import read_run_config


@pytest.mark.parametrize("argv, match", [
    (["--fsdp"], "this process was not launched by torchrun"),
    (["--grad-checkpointing"], "--grad-checkpointing needs --model DIR"),
    (["--task", "chat-add1"], "--task chat-add1 is a text task: it needs --model DIR"),
    (["--lr", "-1"], "--lr -1.0 must be a finite number > 0"),
    (["--policy-lmbda", "0.9", "--length-alpha", "1"], "--policy-lmbda and --length-alpha both set"),
    (["--gamma", "1.5"], "--gamma 1.5 is outside [0, 1]"),
    (["--lmbda", "-0.1"], "--lmbda -0.1 is outside [0, 1]"),
])  # fmt: skip
def test_configuration_errors_are_error_lines(cli_error, tmp_path, argv, match):
    err = cli_error([*argv, "--out", str(tmp_path)])
    assert match in err


def test_out_pointing_at_a_file_names_out(cli_error, tmp_path):
    (tmp_path / "f").write_text("x")
    err = cli_error(["--out", str(tmp_path / "f")])
    assert "--out " in err and "is a file; give a directory" in err


def test_resume_refuses_a_missing_checkpoint_changed_flags_and_nothing_left(cli_error, tmp_path):
    out = str(tmp_path / "run")
    assert "no checkpoint in" in cli_error(["--out", out, "--resume", *SHORT])
    T.main(["--iterations", "2", "--out", out, *SHORT])
    err = cli_error(["--iterations", "4", "--out", out, "--resume", "--task", "copy", "--lr", "1e-3", *SHORT,
                     "--num-envs", "16"])
    assert "--task 'copy' (the checkpoint's: 'reverse')" in err and "--lr 0.001 (the checkpoint's: 0.0003)" in err
    assert "--num-envs 16" in err and "--allow-change task,num-envs,lr" in err
    assert "nothing left to run" in cli_error(["--iterations", "2", "--out", out, "--resume", *SHORT])
    assert "no such flag" in cli_error(["--iterations", "3", "--out", out, "--resume", "--allow-change", "speed",
                                             *SHORT])


def test_resume_with_safe_changes_says_where_it_resumed(capsys, tmp_path):
    out = str(tmp_path / "run")
    T.main(["--iterations", "2", "--out", out, *SHORT])
    capsys.readouterr()
    T.main(["--iterations", "3", "--out", out, "--resume", "--save-every", "5", "--threads", "1", *SHORT])
    assert "resumed at iteration 2 of 3" in capsys.readouterr().err
    rows = T.read_metrics(tmp_path / "run" / "metrics.csv")
    assert [r["iteration"] for r in rows] == [1.0, 2.0, 3.0]
    T.main(["--iterations", "4", "--out", out, "--resume", "--lr", "1e-4", "--allow-change", "lr", *SHORT])
    assert not math.isnan(T.read_metrics(tmp_path / "run" / "metrics.csv")[-1]["reward"])


def test_a_rerun_into_a_run_directory_is_refused_and_the_run_is_kept(cli_error, tmp_path):
    out = tmp_path / "run"
    T.main(["--iterations", "2", "--out", str(out), *SHORT])
    checkpoint, metrics = (out / "checkpoint.pt").read_bytes(), (out / "metrics.csv").read_text()
    err = cli_error(["--iterations", "2", "--out", str(out), *SHORT]).strip().splitlines()[-1]
    assert f"--out {out} already holds a run (checkpoint.pt, run_config.json, metrics.csv" in err
    assert "a checkpoint at iteration 2" in err and "add --resume to continue it, --overwrite to delete" in err
    assert (out / "checkpoint.pt").read_bytes() == checkpoint and (out / "metrics.csv").read_text() == metrics
    with pytest.raises(FileExistsError, match=r"already holds a run .*add --resume to continue it, --overwrite"):
        T.train(T.TrainConfig(iterations=2, out=str(out), preset="pico", num_envs=8, warmup_steps=3))
    assert (out / "checkpoint.pt").read_bytes() == checkpoint


def test_overwrite_starts_clean_and_leaves_other_files_alone(tmp_path):
    out = tmp_path / "run"
    T.main(["--iterations", "3", "--out", str(out), "--seed", "1", *SHORT])
    (out / "notes.txt").write_text("mine")
    (out / "metrics.csv.tmp").write_text("a half-written file of the old run")
    T.main(["--iterations", "2", "--out", str(out), "--overwrite", *SHORT])
    assert [r["iteration"] for r in T.read_metrics(out / "metrics.csv")] == [1.0, 2.0]  # nothing appended
    assert (out / "notes.txt").read_text() == "mine" and not (out / "metrics.csv.tmp").exists()
    assert read_run_config(out)["config"]["seed"] == 0  # the new run's checkpoint, not the old one's
    T.main(["--iterations", "3", "--out", str(out), "--resume", *SHORT])  # --resume still appends once per iteration
    assert [r["iteration"] for r in T.read_metrics(out / "metrics.csv")] == [1.0, 2.0, 3.0]


def test_resume_and_overwrite_together_and_a_resume_of_a_run_without_checkpoint(cli_error, tmp_path):
    out = tmp_path / "run"
    assert "--resume continues the run in --out and --overwrite deletes it" in cli_error(
        ["--out", str(out), "--resume", "--overwrite", *SHORT])
    out.mkdir()
    (out / "metrics.csv").write_text("iteration,reward\n1,0.5\n")  # a run that died before its first checkpoint
    err = cli_error(["--out", str(out), "--resume", *SHORT])
    assert "no checkpoint in" in err and "drop --resume to start a new run there with --overwrite (it holds metrics.csv)" in err
    assert "already holds a run (metrics.csv); add --resume" in cli_error(["--out", str(out), *SHORT])


def test_a_toml_config_sets_flags_and_the_command_line_wins(tmp_path):
    (tmp_path / "recipe.toml").write_text('iterations = 3\nseed = 3\nlr = 1e-3\nmax_grad_norm = 0.5\n'
                                          '"no-plot" = true\nnum-envs = 4\n')
    out = tmp_path / "run"
    T.main(["--config", str(tmp_path / "recipe.toml"), "--iterations", "1", "--out", str(out), *SHORT])
    config = read_run_config(out)["config"]
    assert (config["iterations"], config["seed"], config["lr"], config["max_grad_norm"]) == (1, 3, 1e-3, 0.5)
    assert config["no_plot"] is True and config["num_envs"] == 8  # SHORT's --num-envs 8 comes after the file's


def test_a_run_repeats_from_its_run_config_json(cli_error, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    T.main(["--iterations", "2", "--out", str(a), "--seed", "5", "--lr", "1e-3", *SHORT])
    assert "already holds a run" in cli_error(["--config", str(a / "run_config.json")])  # its --out: refused
    T.main(["--config", str(a / "run_config.json"), "--out", str(b)])
    first, again = T.read_metrics(a / "metrics.csv"), T.read_metrics(b / "metrics.csv")
    for key in ("iteration", "reward", "loss_objective", "loss_critic", "kl_ref", "entropy"):
        assert [r[key] for r in first] == [r[key] for r in again], key
    assert read_run_config(b)["config"] == {**read_run_config(a)["config"], "out": str(b)}


@pytest.mark.parametrize("text, name, match", [
    ("lrr = 1e-3\n", "r.toml", r"--config .*r.toml: unknown key 'lrr' \(did you mean lr\?\); the keys are the flags"),
    ("lr = \"fast\"\n", "r.toml", r"--config .*r.toml: lr = 'fast' must be a float \(--lr takes one\)"),
    ("iterations = 2.5\n", "r.toml", r"iterations = 2.5 must be an int"),
    ("no-plot = 1\n", "r.toml", r"no-plot = 1 must be a bool"),
    ("task = [\"copy\"]\n", "r.toml", r"task = \['copy'\] must be a str"),
    ("lr = \n", "r.toml", r"--config .*r.toml: not valid TOML"),
    ('{"lr": 1e-3}', "r.json", r"not a run's run_config.json \(no \"config\" object\)"),
    ("task = \"nonesuch\"\n", "r.toml", r"argument --task: invalid choice: 'nonesuch'"),
])  # fmt: skip
def test_a_bad_config_file_is_one_error_line_naming_the_file_and_the_key(cli_error, tmp_path, text, name, match):
    (tmp_path / name).write_text(text)
    line = cli_error(["--config", str(tmp_path / name), "--out", str(tmp_path / "run")]).strip().splitlines()[-1]
    assert re.search(match, line), line
    assert "no such file" in cli_error(["--config", str(tmp_path / "none.toml")])


def test_help_is_grouped(capsys):
    with pytest.raises(SystemExit):
        T.main(["--help"])
    out = capsys.readouterr().out
    positions = [out.index(f"\n{g}:") for g in ("run", "model", "task", "PPO", "KL", "critic", "output", "parallel")]
    assert positions == sorted(positions)
    assert out.index("\n  --kl-reward-coeff") > out.index("\nKL:") > out.index("\n  --clip-epsilon")


def test_the_recipe_file_of_the_job_page_is_a_valid_config(tmp_path):
    from pathlib import Path

    from ppo_objectives.train.config_file import config_flags

    page = (Path(__file__).resolve().parents[2] / "docs" / "job.md").read_text()
    recipe = re.search(r"```toml\n(.*?)```", page, re.DOTALL)[1]
    (tmp_path / "recipe.toml").write_text(recipe)
    flags = config_flags(str(tmp_path / "recipe.toml"))
    assert flags[:2] == ["--task", "jsonl"] and "--max-new-tokens" in flags and "--eval-prompts" in flags
    assert T.build_parser().parse_args(flags).max_new_tokens == 32

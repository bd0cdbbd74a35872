"""The job's command line refuses what it cannot honour: error lines (exit 2, no traceback), a guarded
--resume, a grouped --help."""

from __future__ import annotations

import math

import pytest
from _flags import SHORT

from ppo_objectives import train as T


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


def test_help_is_grouped(capsys):
    with pytest.raises(SystemExit):
        T.main(["--help"])
    out = capsys.readouterr().out
    positions = [out.index(f"\n{g}:") for g in ("run", "model", "task", "PPO", "KL", "critic", "output", "parallel")]
    assert positions == sorted(positions)
    assert out.index("\n  --kl-reward-coeff") > out.index("\nKL:") > out.index("\n  --clip-epsilon")

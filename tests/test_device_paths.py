"""The training job on a local checkpoint on CUDA (skipped without a GPU).

The CPU run of the same job (bf16 autocast, activation checkpointing) is
``tests/train/test_pretrained.py::test_the_job_in_bfloat16_keeps_float32_master_weights_and_a_bf16_reference``;
this one is marked ``cuda``, so ``pytest -m cuda`` selects it and ``benchmarks/gpu_check.sh`` runs it.
The kernels under it are device-parametrised where they are tested: the hidden-state log-probs in float32 and bf16
(``tests/llm/test_logprobs_hidden.py``) and the Hugging Face per-row KV cache
(``tests/llm/test_hf.py``).
"""

from __future__ import annotations

import pytest
import torch

from ppo_objectives import train as T
from ppo_objectives.train import pretrained as PT
from ppo_objectives.train.digit import DigitTask

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.cuda
def test_the_job_on_a_checkpoint_in_bfloat16_with_activation_checkpointing(tmp_path):
    device = torch.device("cuda")
    path = PT.write_tiny_checkpoint(tmp_path / "ckpt", "qwen2", task=DigitTask("reverse", 3), hidden_size=32,
                                    num_layers=1, num_heads=4, num_kv_heads=2)
    out = tmp_path / "run"
    T.main(["--model", str(path), "--device", device.type, "--dtype", "bfloat16", "--grad-checkpointing",
            "--iterations", "2", "--num-envs", "8", "--warmup-steps", "3", "--ppo-epochs", "1",
            "--minibatches", "2", "--no-plot", "--no-progress", "--out", str(out)])
    rows = T.read_metrics(out / "metrics.csv")
    assert len(rows) == 2 and rows[-1]["updates"] >= 1
    for key in ("reward", "loss_objective", "loss_critic", "kl_ref", "entropy"):
        assert all(torch.isfinite(torch.tensor(r[key])) for r in rows), key
    state = torch.load(out / "checkpoint.pt", weights_only=False, map_location="cpu")
    assert {v.dtype for v in state["actor_model"].values()} == {torch.float32}
    assert {v.dtype for v in state["reference"].values()} == {torch.bfloat16}

"""The torchrun jobs several test files of the training job read (each run once per session), with the flags of
``_flags.py``."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _flags import TORCHRUN_SMALL

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def torchrun():
    """``torchrun(out, iterations, *flags) -> (CompletedProcess, wall seconds)``: ``python -m ppo_objectives.train``
    on 2 gloo ranks with ``TORCHRUN_SMALL``; a non-zero exit fails the test with the job's stderr."""

    def run(out: Path, iterations: int, *extra: str):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), "-m", "ppo_objectives.train", "--iterations", str(iterations), "--out", str(out),
               *TORCHRUN_SMALL, *extra]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), MPLBACKEND="Agg")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc, time.perf_counter() - t0

    return run


@pytest.fixture(scope="session")
def torchrun_jobs(torchrun, tmp_path_factory) -> dict:
    """The DDP jobs of the default model, run once per session: ``{name: (out_dir, CompletedProcess, wall_s)}``.

    - ``full``: 3 iterations in one go, checkpoints at 2 and 3, ``--logger csv``;
    - ``two``: 2 iterations without a plot (a copy of ``split``'s output before its resume);
    - ``split``: the same 2 iterations, then ``--resume`` to 3 (a second torchrun).
    """
    tmp = tmp_path_factory.mktemp("torchrun")
    full, split, two = tmp / "full", tmp / "split", tmp / "two"
    jobs = {"full": (full, *torchrun(full, 3, "--save-every", "2", "--logger", "csv"))}
    jobs["two"] = (two, *torchrun(split, 2, "--no-plot"))
    shutil.copytree(split, two)
    jobs["split"] = (split, *torchrun(split, 3, "--no-plot", "--resume"))
    return jobs


@pytest.fixture(scope="session")
def tok():
    """The testing kit's tiny chat tokenizer (a byte-level BPE with a chat template)."""
    pytest.importorskip("transformers")
    from ppo_objectives.testing import tiny_chat_tokenizer

    return tiny_chat_tokenizer()


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A tiny random Llama with that tokenizer, saved as a checkpoint directory once per session."""
    pytest.importorskip("transformers")
    from ppo_objectives.testing import tiny_chat_checkpoint

    return tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))

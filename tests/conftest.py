"""Shared fixtures: the device list (CPU always, CUDA when available), a seed, the CLI's error lines, and the
torchrun jobs several test files read (each run once per session)."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: The torchrun jobs' flags (the pico preset, 16 rows per rank, no trust region: every step is taken).
TORCHRUN_SMALL = ["--preset", "pico", "--num-envs", "16", "--warmup-steps", "5", "--no-progress", "--early-stop-kl", "0"]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        # parametrised device="cuda" cases carry the cuda marker so `-m cuda` selects them
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cuda":
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(params=DEVICES)
def device(request):
    """Every available device: 'cpu', plus 'cuda' when a GPU is present."""
    return torch.device(request.param)


@pytest.fixture
def seed():
    """Seed torch's global RNG and return a seeded generator."""
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


@pytest.fixture
def cli_error(capsys):
    """``cli_error(argv)``: run the job's ``main(argv)``, expect an argparse ``error:`` line (exit 2, no
    traceback) and return what it printed on stderr."""
    from ppo_objectives import train as T

    def run(argv) -> str:
        with pytest.raises(SystemExit) as exc:
            T.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "error:" in err
        return err

    return run


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

"""Shared fixtures: the device list (CPU always, CUDA when available), a seed and the CLI's error lines (the
torchrun jobs of the training job's tests are in ``train/conftest.py``)."""

import pytest
import torch

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

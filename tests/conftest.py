"""Shared fixtures: the device list (CPU always, CUDA when available) and a seed."""

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

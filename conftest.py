"""Collection rules for the doctests run over the package (`--doctest-modules`)."""

import importlib.util

# the testing kit's fixtures (ppo_response_batch, ...), opt-in as for any project that uses them
pytest_plugins = ["ppo_objectives.testing.pytest_plugin"]

collect_ignore = []
if importlib.util.find_spec("triton") is None:
    # the Triton kernel module imports triton at the top; it is only used on CUDA machines that have it
    collect_ignore.append("ppo_objectives/_kernels/triton_gae.py")

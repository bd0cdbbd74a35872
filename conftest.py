"""Collection rules for the doctests run over the package (`--doctest-modules`)."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("triton") is None:
    # the Triton kernel module imports triton at the top; it is only used on CUDA machines that have it
    collect_ignore.append("ppo_objectives/_kernels/triton_gae.py")

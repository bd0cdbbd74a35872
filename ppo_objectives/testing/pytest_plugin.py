"""pytest fixtures of the testing kit, as a pytest plugin a project turns on.

The plugin is opt-in: a project's ``conftest.py`` names it,
``pytest_plugins = ["ppo_objectives.testing.pytest_plugin"]`` (or ``pytest -p
ppo_objectives.testing.pytest_plugin``), so the pytest sessions of other projects in the
same environment never import it (importing it imports the package: torch and torchrl).
Every fixture name starts with ``ppo_``; every batch is seeded, so a test sees the
same numbers on every run. The helpers behind them are in :mod:`ppo_objectives.testing`.

============================== ===============================================================
fixture                        value
============================== ===============================================================
``ppo_testing``                the module :mod:`ppo_objectives.testing` (its assertions and references)
``ppo_generator``              a CPU ``torch.Generator`` seeded with 0
``ppo_response_batch``         ``response_batch(seed=0, with_advantage=True)``: ``[4]`` rows, ``R = 6``
``ppo_full_sequence_batch``    ``full_sequence_batch(seed=0, with_ref_log_prob=True)``: ``[3, 10]``
``ppo_collector_batch``        ``collector_batch(seed=0)``: ``[3, 8]`` TorchRL rows with done flags
``ppo_tiny_actor_critic``      ``tiny_actor_critic()``: ``(actor, critic)`` for the response layout
``ppo_mask_kind``              each of ``MASK_KINDS`` but ``"all_valid"`` in turn (one test per kind)
``ppo_masked_response_batch``  ``response_batch(mask=ppo_mask_kind, seed=0, with_advantage=True)``
============================== ===============================================================

Example (a user's ``conftest.py`` holds the ``pytest_plugins`` line; their ``test_shaper.py``)::

    def test_my_shaper_ignores_padding(ppo_masked_response_batch, ppo_testing):
        ppo_testing.assert_mask_invariant(MyShaper(), ppo_masked_response_batch)
"""

from __future__ import annotations

import pytest

from ppo_objectives import testing


@pytest.fixture
def ppo_testing():
    """The module ``ppo_objectives.testing``: factories, references, tiny networks and assertions."""
    return testing


@pytest.fixture
def ppo_generator():
    """A CPU ``torch.Generator`` seeded with 0 (pass it as ``generator=`` to the factories)."""
    return testing.make_generator(seed=0)


@pytest.fixture
def ppo_response_batch():
    """A response-layout batch ``[4]`` (``R = 6``, ``P = 3``, right padding) with values, reference log-probs and advantages."""
    return testing.response_batch(seed=0, with_advantage=True)


@pytest.fixture
def ppo_full_sequence_batch():
    """A full-sequence-layout batch ``[3, 10]`` (holes, ``[B, T, 1]`` flags) with values and reference log-probs."""
    return testing.full_sequence_batch(seed=0, with_ref_log_prob=True)


@pytest.fixture
def ppo_collector_batch():
    """TorchRL collector rows ``[3, 8]`` with done / terminated / truncated flags and next values, no mask."""
    return testing.collector_batch(seed=0)


@pytest.fixture
def ppo_tiny_actor_critic():
    """``(actor, critic)``: deterministic bigram TensorDict modules reading the response layout."""
    return testing.tiny_actor_critic()


@pytest.fixture(params=[kind for kind in testing.MASK_KINDS if kind != "all_valid"])
def ppo_mask_kind(request):
    """Each mask kind of ``ppo_objectives.testing.MASK_KINDS`` that has masked positions (all but ``"all_valid"``)."""
    return request.param


@pytest.fixture
def ppo_masked_response_batch(ppo_mask_kind):
    """A response-layout batch ``[4]`` with the mask kind of ``ppo_mask_kind`` (one test per kind)."""
    return testing.response_batch(mask=ppo_mask_kind, seed=0, with_advantage=True)

"""The pytest plugin of the testing kit: its helpers as fixtures in every pytest session, no setup.

Installing the package installs the plugin: its ``pytest11`` entry point (``[project.entry-points.pytest11]``
of ``pyproject.toml``, name ``ppo_objectives``) makes pytest load it by itself, so the fixtures below are
found in any test file with nothing to import and nothing to add to a ``conftest.py``. ``pytest -p
no:ppo_objectives`` switches it off; where ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` is set, ``-p ppo_objectives``
switches it on. A ``conftest.py`` that lists it anyway names the entry point (``pytest_plugins =
["ppo_objectives"]``, a no-op once loaded); the module's own name would register it twice, which pytest refuses.

It lives beside the package rather than in it because pytest imports it in every session of the environment,
those that use none of it too, and importing anything under ``ppo_objectives`` imports the package face
(torch, TensorDict, TorchRL: seconds). This module imports pytest only; the kit (:mod:`ppo_objectives.testing`)
is imported by the first fixture a test asks for.

Every fixture name starts with ``ppo_``; every batch is seeded, so a test sees the same numbers on every run.

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

Example (a user's ``test_shaper.py``, no ``conftest.py``)::

    def test_my_shaper_ignores_padding(ppo_masked_response_batch, ppo_testing):
        ppo_testing.assert_mask_invariant(MyShaper(), ppo_masked_response_batch)
"""

import pytest


def _kit():
    """The module ``ppo_objectives.testing``, imported on first use (it imports torch and TensorDict)."""
    from ppo_objectives import testing

    return testing


def pytest_generate_tests(metafunc):
    # The kinds come from the kit, so they are read only for a test that asks for them (directly or through
    # ppo_masked_response_batch): a session without such a test never imports the kit.
    if "ppo_mask_kind" in metafunc.fixturenames:
        kinds = [kind for kind in _kit().MASK_KINDS if kind != "all_valid"]
        metafunc.parametrize("ppo_mask_kind", kinds, indirect=True)


@pytest.fixture
def ppo_testing():
    """The module ``ppo_objectives.testing``: factories, references, tiny networks and assertions."""
    return _kit()


@pytest.fixture
def ppo_generator():
    """A CPU ``torch.Generator`` seeded with 0 (pass it as ``generator=`` to the factories)."""
    return _kit().make_generator(seed=0)


@pytest.fixture
def ppo_response_batch():
    """A response-layout batch ``[4]`` (``R = 6``, ``P = 3``, right padding) with values, reference log-probs and advantages."""
    return _kit().response_batch(seed=0, with_advantage=True)


@pytest.fixture
def ppo_full_sequence_batch():
    """A full-sequence-layout batch ``[3, 10]`` (holes, ``[B, T, 1]`` flags) with values and reference log-probs."""
    return _kit().full_sequence_batch(seed=0, with_ref_log_prob=True)


@pytest.fixture
def ppo_collector_batch():
    """TorchRL collector rows ``[3, 8]`` with done / terminated / truncated flags and next values, no mask."""
    return _kit().collector_batch(seed=0)


@pytest.fixture
def ppo_tiny_actor_critic():
    """``(actor, critic)``: deterministic bigram TensorDict modules reading the response layout."""
    return _kit().tiny_actor_critic()


@pytest.fixture
def ppo_mask_kind(request):
    """Each mask kind of ``ppo_objectives.testing.MASK_KINDS`` that has masked positions (all but ``"all_valid"``)."""
    return request.param


@pytest.fixture
def ppo_masked_response_batch(ppo_mask_kind):
    """A response-layout batch ``[4]`` with the mask kind of ``ppo_mask_kind`` (one test per kind)."""
    return _kit().response_batch(mask=ppo_mask_kind, seed=0, with_advantage=True)

"""A testing kit for code built on the package: batch factories, loop references, tiny networks, assertions.

For people who compose the package's modules with their own (a reward shaper,
a custom loss, a new critic) and want to unit-test them without a language
model or a collector. Everything here is deterministic given a seed and small
enough to run in milliseconds.

- **Batch factories** for the layouts of ``ppo_objectives/llm/layouts.py``:
  :func:`response_batch` (what :func:`~ppo_objectives.llm.layouts.trajectories_to_llm_batch`
  produces, plus what the training job adds), :func:`full_sequence_batch`
  (what :class:`~ppo_objectives.llm.chat.LLMToTokenBatch` produces, plus the
  critic's values) and :func:`collector_batch` (TorchRL collector rows with
  done / terminated / truncated flags). :func:`make_mask` draws the masks:
  ``MASK_KINDS`` names them.
- **Reference implementations**, plain Python loops over floats that share no
  code with the package: :func:`reference_gae_response`,
  :func:`reference_gae_collector` (the semantics of
  :func:`~ppo_objectives.functional.masked_gae`, ``docs/design.md``
  "GAE semantics"), :func:`reference_gae_tensordict` (what
  :class:`~ppo_objectives.value.gae.MaskedGAE` writes), :func:`reference_ppo_policy_loss`,
  :func:`reference_kl` (the k1 / k2 / k3 estimators), :func:`reference_log_probs` (chosen tokens
  under their logits) and :func:`reference_response_log_probs` (the response tokens of a causal LM,
  as :func:`~ppo_objectives.functional.response_log_probs`).
- **Tiny networks**: :func:`tiny_actor_critic` returns a bigram actor (writes
  ``log_prob`` and ``entropy``) and critic (writes ``state_value``) as
  TensorDict modules that read either layout and train with
  :class:`~ppo_objectives.loss.TokenPPOLoss`.
- **A tiny chat model**: :func:`tiny_chat_tokenizer` (a byte-level BPE tokenizer with a
  chat template, trained in code) and :func:`tiny_chat_checkpoint` (a random Llama saved
  with it), to test text tasks and rewards offline as a real instruct model is used.
- **Assertions**: :func:`assert_mask_invariant` (garbage and NaN at masked
  positions of a module's per-token inputs change none of its valid outputs,
  and masked outputs stay 0) and :func:`assert_matches_reference` (a tolerance
  check whose message gives the largest absolute and relative errors and where).

The same helpers are pytest fixtures (``ppo_response_batch``,
``ppo_tiny_actor_critic``, ...) in every pytest session once the package is
installed, with nothing to import and nothing to add to a ``conftest.py``: the
package's ``pytest11`` entry point ``ppo_objectives`` loads the plugin
:mod:`ppo_objectives_pytest`, which imports this kit only when a test asks for a
fixture (``pytest -p no:ppo_objectives`` switches it off).

Example:
    >>> import torch
    >>> from ppo_objectives import MaskedGAE
    >>> from ppo_objectives.testing import (
    ...     assert_mask_invariant, assert_matches_reference, reference_gae_tensordict, response_batch)
    >>> td = response_batch(batch_size=4, response_len=5, mask="holes", seed=0)
    >>> gae = MaskedGAE(gamma=1.0, lmbda=0.95)
    >>> want = reference_gae_tensordict(td, gamma=1.0, lmbda=0.95)
    >>> assert_matches_reference(gae(td.clone())["advantage"], want[0], name="advantage")
    >>> report = assert_mask_invariant(gae, td)
    >>> report.outputs
    [('advantage',), ('value_target',)]
"""

from ppo_objectives.testing.asserts import MaskInvariantReport, assert_mask_invariant, assert_matches_reference
from ppo_objectives.testing.batches import (
    MASK_KINDS,
    collector_batch,
    full_sequence_batch,
    make_generator,
    make_mask,
    response_batch,
)
from ppo_objectives.testing.networks import (
    CHAT_TEMPLATE,
    TinyTokenCritic,
    TinyTokenPolicy,
    tiny_actor_critic,
    tiny_chat_checkpoint,
    tiny_chat_tokenizer,
)
from ppo_objectives.testing.references import (
    reference_gae_collector,
    reference_gae_response,
    reference_gae_tensordict,
    reference_kl,
    reference_log_probs,
    reference_ppo_policy_loss,
    reference_response_log_probs,
)

__all__ = [
    "CHAT_TEMPLATE",
    "MASK_KINDS",
    "MaskInvariantReport",
    "TinyTokenCritic",
    "TinyTokenPolicy",
    "assert_mask_invariant",
    "assert_matches_reference",
    "collector_batch",
    "full_sequence_batch",
    "make_generator",
    "make_mask",
    "reference_gae_collector",
    "reference_gae_response",
    "reference_gae_tensordict",
    "reference_kl",
    "reference_log_probs",
    "reference_ppo_policy_loss",
    "reference_response_log_probs",
    "response_batch",
    "tiny_actor_critic",
    "tiny_chat_checkpoint",
    "tiny_chat_tokenizer",
]

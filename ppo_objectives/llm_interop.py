"""Interop with TorchRL's LLM stack: ``ChatEnv`` / ``LLMCollector`` batches into token-level PPO.

TorchRL's LLM tooling (:class:`~torchrl.envs.llm.ChatEnv`,
:class:`~torchrl.collectors.llm.LLMCollector`,
:class:`~torchrl.modules.llm.TransformersWrapper`) makes **one environment step
per assistant turn**; each step holds ragged token tensors
(``("tokens", "prompt" | "response" | "full")``, ``("log_probs", "response")``,
...). Our components (:class:`~ppo_objectives.value.MaskedGAE`,
``TokenPPOLoss``, ``KLPenaltyTransform``) read **one row per dialog and one
column per token**: the full-sequence layout of :mod:`ppo_objectives.layouts`,
which states its keys, shapes and alignment. This module gathers the entry
points for that path:

- :class:`LLMToTokenBatch` (defined in :mod:`ppo_objectives.layouts`): a
  :class:`~torchrl.envs.transforms.Transform` (collector ``postproc`` or
  replay-buffer transform) from the turn-level batch to the full-sequence
  ``[B, T]`` layout.
- :func:`bootstrap_from_next_turn` (:mod:`ppo_objectives.layouts`): for the
  one-row-per-turn layout, the value of the next turn's prompt as each turn's
  bootstrap value.
- :class:`CausalLMCritic` (defined in :mod:`ppo_objectives.readouts`): a value
  head on a Hugging Face causal LM that scores every token of a row in one
  forward pass and writes ``state_value``.
- :class:`CausalLMTokenLogProbs` (:mod:`ppo_objectives.readouts`): the matching
  actor read-out, the log-prob of every token of a row under the LM (for
  ``TokenPPOLoss`` and for recomputing the sampling log-probs, see the note in
  :class:`LLMToTokenBatch`).

The two read-outs share their arithmetic with the response-layout read-outs
of :func:`~ppo_objectives.readouts.make_actor_critic`, and reach Hugging Face
models the way :class:`~ppo_objectives.models.HFCausalLMAdapter` does
(:func:`~ppo_objectives.models.hf_forward`).

``transformers`` is an optional extra (``pip install ppo_objectives[hf]``):
nothing here imports it; the two read-outs take an already built model.

Example:
    >>> import torch
    >>> from tensordict import TensorDict, lazy_stack
    >>> turn = TensorDict({("tokens", "prompt"): torch.tensor([5, 6]), ("tokens", "full"): torch.tensor([5, 6, 7]),
    ...                    ("next", "reward"): torch.tensor([1.0]), ("next", "done"): torch.tensor([True])})
    >>> LLMToTokenBatch()(lazy_stack([lazy_stack([turn])]))["mask"]
    tensor([[False, False,  True]])
"""

from __future__ import annotations

from ppo_objectives.layouts import LLMToTokenBatch, bootstrap_from_next_turn
from ppo_objectives.readouts import CausalLMCritic, CausalLMTokenLogProbs

__all__ = ["CausalLMCritic", "CausalLMTokenLogProbs", "LLMToTokenBatch", "bootstrap_from_next_turn"]

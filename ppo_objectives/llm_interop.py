"""The TorchRL LLM stack's entry points: an earlier import path, kept as a plain re-export of ``ppo_objectives.llm.layouts`` and ``ppo_objectives.llm.readouts``.

New code imports from there; ``docs/design.md`` lists the re-exports.
"""

from ppo_objectives.llm.layouts import LLMToTokenBatch, bootstrap_from_next_turn
from ppo_objectives.llm.readouts import CausalLMCritic, CausalLMTokenLogProbs

__all__ = ["CausalLMCritic", "CausalLMTokenLogProbs", "LLMToTokenBatch", "bootstrap_from_next_turn"]  # fmt: skip

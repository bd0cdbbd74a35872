"""The batch layouts and their converters: an earlier import path, kept as a plain re-export of ``ppo_objectives.llm.layouts``.

New code imports from there; ``docs/design.md`` lists the re-exports.
"""

from ppo_objectives.llm.layouts import LLMToTokenBatch, ToLLMBatch, bootstrap_from_next_turn, trajectories_to_llm_batch

__all__ = ["LLMToTokenBatch", "ToLLMBatch", "bootstrap_from_next_turn", "trajectories_to_llm_batch"]  # fmt: skip

"""The env policy on a causal LM: an earlier import path, kept as a plain re-export of ``ppo_objectives.llm.policy``.

New code imports from there; ``docs/design.md`` lists the re-exports.
"""

from ppo_objectives.llm.policy import NextTokenLogits, make_actor, sample_with_kv_cache

__all__ = ["NextTokenLogits", "make_actor", "sample_with_kv_cache"]  # fmt: skip

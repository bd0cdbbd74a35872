"""The per-token read-outs: an earlier import path, kept as a plain re-export of ``ppo_objectives.llm.readouts``.

New code imports from there; ``docs/design.md`` lists the re-exports.
"""

from ppo_objectives.llm.readouts import (
    FROM_HIDDEN_MIN_VOCAB,
    VALUE_HEAD_INITS,
    ActorCritic,
    CausalLMCritic,
    CausalLMTokenLogProbs,
    ResponseLogProbs,
    ResponseValues,
    SharedForward,
    frozen_reference,
    lm_head_parameters,
    make_actor_critic,
    read_log_probs,
    read_values,
    value_head,
)

__all__ = ["ActorCritic", "CausalLMCritic", "CausalLMTokenLogProbs", "FROM_HIDDEN_MIN_VOCAB", "ResponseLogProbs", "ResponseValues", "SharedForward", "VALUE_HEAD_INITS", "frozen_reference", "lm_head_parameters", "make_actor_critic", "read_log_probs", "read_values", "value_head"]  # fmt: skip

"""The language-model side: layouts, models, the env, the policy and the per-token read-outs.

- :mod:`~ppo_objectives.llm.layouts`: the two batch layouts and the converters into them.
- :mod:`~ppo_objectives.llm.models`: :class:`TinyCausalLM` (a KV cache, named presets);
  :mod:`~ppo_objectives.llm.hf`: :class:`HFCausalLMAdapter`, any Hugging Face causal LM behind
  the same interface.
- :mod:`~ppo_objectives.llm.policy`: the env policy with a per-row KV cache, ``sample_with_kv_cache``.
- :mod:`~ppo_objectives.llm.readouts`: per-token log-probs and values for both layouts, the
  actor-critic pair, the frozen reference.
- :mod:`~ppo_objectives.llm.env`: :class:`TokenLMEnv` (one step is one token) for any task that
  follows :class:`~ppo_objectives.llm.env.LMTask`.
"""

from ppo_objectives.llm.env import LMTask, TokenLMEnv
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.llm.layouts import LLMToTokenBatch, ToLLMBatch, bootstrap_from_next_turn, trajectories_to_llm_batch
from ppo_objectives.llm.models import PRESETS, TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import NextTokenLogits, make_actor, sample_with_kv_cache
from ppo_objectives.llm.readouts import (
    ActorCritic,
    CausalLMCritic,
    CausalLMTokenLogProbs,
    frozen_reference,
    make_actor_critic,
)

__all__ = [
    "PRESETS", "ActorCritic", "CausalLMCritic", "CausalLMTokenLogProbs", "HFCausalLMAdapter", "LLMToTokenBatch",
    "LMTask", "NextTokenLogits", "TinyCausalLM", "TinyLMConfig", "ToLLMBatch", "TokenLMEnv",
    "bootstrap_from_next_turn", "frozen_reference", "make_actor", "make_actor_critic", "sample_with_kv_cache",
    "trajectories_to_llm_batch",
]  # fmt: skip

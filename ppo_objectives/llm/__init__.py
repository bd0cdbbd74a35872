"""The language-model side: layouts, models, the env, the policy, the per-token read-outs, TorchRL's LLM stack.

- :mod:`~ppo_objectives.llm.layouts`: the response layout (``TokenLMEnv`` rollouts) and its converters.
- :mod:`~ppo_objectives.llm.models`: :class:`TinyCausalLM` (a KV cache, named presets);
  :mod:`~ppo_objectives.llm.hf`: :class:`HFCausalLMAdapter`, any Hugging Face causal LM behind
  the same interface; :mod:`~ppo_objectives.llm.token_map`: :class:`TokenMappedLM`, such a model
  behind a task's (smaller) vocabulary; :mod:`~ppo_objectives.llm.lora`: LoRA adapters on such a model
  (``peft``) and the reference they give for free.
- :mod:`~ppo_objectives.llm.policy`: the env policy with a per-row KV cache, ``sample_with_kv_cache``.
- :mod:`~ppo_objectives.llm.readouts`: per-token log-probs and values of the response layout, the
  actor-critic pair, the frozen reference.
- :mod:`~ppo_objectives.llm.env`: :class:`TokenLMEnv` (one step is one token) for any task that
  follows :class:`~ppo_objectives.llm.env.LMTask`.
- :mod:`~ppo_objectives.llm.chat`: TorchRL's LLM stack (``ChatEnv``, ``LLMCollector``): the
  full-sequence layout, :class:`LLMToTokenBatch` into it, its read-outs
  (:class:`CausalLMTokenLogProbs`, :class:`CausalLMCritic`) and :func:`bootstrap_from_next_turn`.
"""

from ppo_objectives.llm.chat import CausalLMCritic, CausalLMTokenLogProbs, LLMToTokenBatch, bootstrap_from_next_turn
from ppo_objectives.llm.env import LMTask, TokenLMEnv
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.llm.layouts import ToLLMBatch, trajectories_to_llm_batch
from ppo_objectives.llm.models import PRESETS, TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import NextTokenLogits, make_actor, sample_with_kv_cache
from ppo_objectives.llm.readouts import ActorCritic, frozen_reference, make_actor_critic
from ppo_objectives.llm.token_map import TokenMappedLM

__all__ = [
    "PRESETS", "ActorCritic", "CausalLMCritic", "CausalLMTokenLogProbs", "HFCausalLMAdapter", "LLMToTokenBatch",
    "LMTask", "NextTokenLogits", "TinyCausalLM", "TinyLMConfig", "ToLLMBatch", "TokenLMEnv", "TokenMappedLM",
    "bootstrap_from_next_turn", "frozen_reference", "make_actor", "make_actor_critic", "sample_with_kv_cache",
    "trajectories_to_llm_batch",
]  # fmt: skip

"""The causal LMs: an earlier import path, kept as a plain re-export of ``ppo_objectives.llm.models`` and ``ppo_objectives.llm.hf``.

New code imports from there; ``docs/design.md`` lists the re-exports.
"""

from ppo_objectives.llm.hf import HFCausalLMAdapter, hf_decoder, hf_forward
from ppo_objectives.llm.models import PRESETS, KVCache, LMOutput, TinyCausalLM, TinyLMConfig, position_ids_from_mask

__all__ = ["HFCausalLMAdapter", "KVCache", "LMOutput", "PRESETS", "TinyCausalLM", "TinyLMConfig", "hf_decoder", "hf_forward", "position_ids_from_mask"]  # fmt: skip

#: The names built on these models, one layer up: imported from here they raise an ``ImportError`` that
#: names their module.
BUILT_ON = {"NextTokenLogits": "llm.policy", "make_actor": "llm.policy", "sample_with_kv_cache": "llm.policy",
            "ActorCritic": "llm.readouts", "ResponseLogProbs": "llm.readouts", "ResponseValues": "llm.readouts",
            "make_actor_critic": "llm.readouts"}


def __getattr__(name: str):
    if name in BUILT_ON:
        raise ImportError(f"{name} is not in ppo_objectives.models: it is built on these models one layer up; "
                          f"use from ppo_objectives.{BUILT_ON[name]} import {name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

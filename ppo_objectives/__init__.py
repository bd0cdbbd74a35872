"""ppo_objectives: token-level PPO with a critic for language models, on TorchRL.

The face holds the card: the objectives (:class:`MaskedGAE` and the critic-free
estimators, :class:`TokenPPOLoss`, :class:`KLPenaltyTransform` and its KL
controllers) and the functional core. The language-model side is
:mod:`ppo_objectives.llm`, the training job :mod:`ppo_objectives.train`, the testing
kit :mod:`ppo_objectives.testing`; ``docs/design.md`` draws the tree.
"""

from ppo_objectives.functional import (
    adaptive_kl_coeff,
    aggregate_loss,
    approx_kl,
    clipped_value_loss,
    explained_variance,
    kl_estimate,
    kl_penalized_rewards,
    last_valid_index,
    loss_normalizer,
    masked_gae,
    masked_gae_reference,
    masked_kl_estimate,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    reference_kl_penalty,
    response_log_probs,
    response_logp_positions,
    rollout_correction_weights,
    value_checks,
)
from ppo_objectives.loss import MINIMIND_PPO_DEFAULTS, TokenPPOLoss
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform
from ppo_objectives.value import GroupAdvantage, MaskedGAE, ReinforcePlusPlus

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "GroupAdvantage",
    "KLPenaltyTransform",
    "MINIMIND_PPO_DEFAULTS",
    "MaskedGAE",
    "ReinforcePlusPlus",
    "TokenPPOLoss",
    "adaptive_kl_coeff",
    "aggregate_loss",
    "approx_kl",
    "clipped_value_loss",
    "explained_variance",
    "kl_estimate",
    "kl_penalized_rewards",
    "last_valid_index",
    "loss_normalizer",
    "masked_gae",
    "masked_gae_reference",
    "masked_kl_estimate",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "reference_kl_penalty",
    "response_log_probs",
    "response_logp_positions",
    "rollout_correction_weights",
    "value_checks",
]

__version__ = "0.1.0"

#: Names this face exported before it held only the objectives and the functional core, and their homes:
#: they still work from here, with a DeprecationWarning that names the home.
MOVED = {
    "CausalLMCritic": "ppo_objectives.llm",
    "CausalLMTokenLogProbs": "ppo_objectives.llm",
    "DigitTask": "ppo_objectives.train.digit",
    "HFCausalLMAdapter": "ppo_objectives.llm",
    "LLMToTokenBatch": "ppo_objectives.llm",
    "NextTokenLogits": "ppo_objectives.llm",
    "TinyCausalLM": "ppo_objectives.llm",
    "TinyLMConfig": "ppo_objectives.llm",
    "ToLLMBatch": "ppo_objectives.llm",
    "TokenLMEnv": "ppo_objectives.llm",
    "bootstrap_from_next_turn": "ppo_objectives.llm",
    "frozen_reference": "ppo_objectives.llm",
    "make_actor": "ppo_objectives.llm",
    "make_actor_critic": "ppo_objectives.llm",
    "sample_with_kv_cache": "ppo_objectives.llm",
    "trajectories_to_llm_batch": "ppo_objectives.llm",
    "warm_start": "ppo_objectives.train.digit",
}


def __getattr__(name: str):
    if name not in MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"ppo_objectives.{name} moved: use from {MOVED[name]} import {name}", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(MOVED[name]), name)

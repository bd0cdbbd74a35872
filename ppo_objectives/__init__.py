"""ppo_objectives: token-level PPO with a critic for language models, on TorchRL."""

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
from ppo_objectives.critic_free import GroupAdvantage, ReinforcePlusPlus
from ppo_objectives.envs import DigitTask, TokenLMEnv, trajectories_to_llm_batch, warm_start
from ppo_objectives.layouts import ToLLMBatch
from ppo_objectives.llm_interop import CausalLMCritic, CausalLMTokenLogProbs, LLMToTokenBatch, bootstrap_from_next_turn
from ppo_objectives.loss import MINIMIND_PPO_DEFAULTS, TokenPPOLoss
from ppo_objectives.models import HFCausalLMAdapter, TinyCausalLM, TinyLMConfig
from ppo_objectives.policy import NextTokenLogits, make_actor, sample_with_kv_cache
from ppo_objectives.readouts import frozen_reference, make_actor_critic
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform
from ppo_objectives.value import MaskedGAE

__all__ = [
    "AdaptiveKLController",
    "CausalLMCritic",
    "CausalLMTokenLogProbs",
    "DigitTask",
    "FixedKLController",
    "GroupAdvantage",
    "HFCausalLMAdapter",
    "KLPenaltyTransform",
    "LLMToTokenBatch",
    "MINIMIND_PPO_DEFAULTS",
    "MaskedGAE",
    "NextTokenLogits",
    "ReinforcePlusPlus",
    "TinyCausalLM",
    "TinyLMConfig",
    "ToLLMBatch",
    "TokenLMEnv",
    "TokenPPOLoss",
    "adaptive_kl_coeff",
    "aggregate_loss",
    "approx_kl",
    "bootstrap_from_next_turn",
    "clipped_value_loss",
    "explained_variance",
    "frozen_reference",
    "kl_estimate",
    "kl_penalized_rewards",
    "last_valid_index",
    "loss_normalizer",
    "make_actor",
    "make_actor_critic",
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
    "sample_with_kv_cache",
    "trajectories_to_llm_batch",
    "value_checks",
    "warm_start",
]

__version__ = "0.1.0"

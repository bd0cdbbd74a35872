"""ppo_objectives: token-level PPO with a critic for language models, on TorchRL."""

from ppo_objectives.functional import (
    aggregate_loss,
    approx_kl,
    clipped_value_loss,
    explained_variance,
    kl_estimate,
    loss_normalizer,
    masked_gae,
    masked_gae_reference,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    reference_kl_penalty,
    response_log_probs,
    response_logp_positions,
    value_checks,
)
from ppo_objectives.envs import DigitTask, TokenLMEnv, trajectories_to_llm_batch
from ppo_objectives.llm_interop import CausalLMCritic, CausalLMTokenLogProbs, LLMToTokenBatch, bootstrap_from_next_turn
from ppo_objectives.loss import MINIMIND_PPO_DEFAULTS, TokenPPOLoss
from ppo_objectives.models import (
    HFCausalLMAdapter,
    NextTokenLogits,
    TinyCausalLM,
    TinyLMConfig,
    make_actor,
    make_actor_critic,
    sample_with_kv_cache,
)
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform
from ppo_objectives.value import MaskedGAE

__all__ = [
    "AdaptiveKLController",
    "CausalLMCritic",
    "CausalLMTokenLogProbs",
    "DigitTask",
    "FixedKLController",
    "HFCausalLMAdapter",
    "KLPenaltyTransform",
    "LLMToTokenBatch",
    "MINIMIND_PPO_DEFAULTS",
    "MaskedGAE",
    "NextTokenLogits",
    "TinyCausalLM",
    "TinyLMConfig",
    "TokenLMEnv",
    "TokenPPOLoss",
    "aggregate_loss",
    "bootstrap_from_next_turn",
    "approx_kl",
    "clipped_value_loss",
    "explained_variance",
    "kl_estimate",
    "loss_normalizer",
    "make_actor",
    "make_actor_critic",
    "masked_gae",
    "masked_gae_reference",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "reference_kl_penalty",
    "response_log_probs",
    "response_logp_positions",
    "sample_with_kv_cache",
    "trajectories_to_llm_batch",
    "value_checks",
]

__version__ = "0.1.0"

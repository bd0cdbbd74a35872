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

__version__ = "0.2.0"

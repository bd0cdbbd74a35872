"""Advantage estimators as TorchRL value estimators: masked GAE with a critic, and the critic-free ones.

- :mod:`ppo_objectives.value.gae`: :class:`MaskedGAE`, GAE over the valid tokens of each row
  (the arithmetic is :func:`ppo_objectives.functional.masked_gae`, its kernels ``ppo_objectives._kernels``).
- :mod:`ppo_objectives.value.critic_free`: :class:`GroupAdvantage` (GRPO, Dr. GRPO, RLOO) and
  :class:`ReinforcePlusPlus`, with their math as plain functions.
"""

from ppo_objectives.value.critic_free import (
    GROUP_KINDS,
    GroupAdvantage,
    ReinforcePlusPlus,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from ppo_objectives.value.gae import MaskedGAE

__all__ = [
    "GROUP_KINDS", "GroupAdvantage", "MaskedGAE", "ReinforcePlusPlus", "dr_grpo_advantages", "grpo_advantages",
    "reinforce_plus_plus_advantages", "rloo_advantages",
]  # fmt: skip

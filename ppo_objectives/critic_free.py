"""The critic-free advantage estimators: an earlier import path, kept as a plain re-export of ``ppo_objectives.value.critic_free``.

New code imports from there; ``docs/design.md`` lists the re-exports.
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

__all__ = ["GROUP_KINDS", "GroupAdvantage", "ReinforcePlusPlus", "dr_grpo_advantages", "grpo_advantages", "reinforce_plus_plus_advantages", "rloo_advantages"]  # fmt: skip

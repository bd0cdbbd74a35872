"""The env and the toy task: an earlier import path, kept as a plain re-export of ``ppo_objectives.llm.env`` and ``ppo_objectives.train.digit`` and ``ppo_objectives.llm.layouts``.

New code imports from there; ``docs/design.md`` lists the re-exports.
"""

from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.layouts import trajectories_to_llm_batch
from ppo_objectives.train.digit import DigitTask, warm_start

__all__ = ["DigitTask", "TokenLMEnv", "trajectories_to_llm_batch", "warm_start"]  # fmt: skip
